"""Profiling toolkit for PyTorch training: timing, NVTX ranges, per-phase kernel summaries and memory timelines."""

__version__ = "0.1.0"
