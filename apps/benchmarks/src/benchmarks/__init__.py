"""Experiments for the CS336 systems assignment: run ``python -m benchmarks.<experiment> --help``."""

__version__ = "0.1.0"
