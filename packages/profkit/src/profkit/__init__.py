"""Profiling toolkit for PyTorch training.

Timing, NVTX ranges, per-phase kernel summaries, traces for Perfetto, communication and overlap
from per-rank traces, and memory timelines and breakdowns.
"""

from profkit import breakdown, comm, kernels, memory, nsys, nvtx, traces
from profkit.breakdown import MemoryBreakdown, memory_breakdown
from profkit.comm import CommReport, analyze_comm
from profkit.kernels import (
    KernelReport,
    KernelTable,
    TraceEvent,
    is_matmul,
    profile_phases,
    summarize_kernels,
)
from profkit.memory import (
    PeakMemory,
    read_peak_memory,
    record_memory_history,
    render_memory_timeline,
    reset_peak_memory,
)
from profkit.nsys import NsysNotFoundError, nsys_command, run_nsys
from profkit.precision import autocast, autocast_dtype
from profkit.timing import PhaseClock, PhaseMarker, Timing, run_steps, synchronize, time_phases, time_steps
from profkit.traces import load_trace, trace, tracing

__version__ = "0.2.0"

__all__ = [
    "CommReport", "KernelReport", "KernelTable", "MemoryBreakdown", "NsysNotFoundError", "PeakMemory",
    "PhaseClock", "PhaseMarker", "Timing", "TraceEvent", "analyze_comm", "autocast", "autocast_dtype",
    "breakdown", "comm", "is_matmul", "kernels", "load_trace", "memory", "memory_breakdown", "nsys",
    "nsys_command", "nvtx", "profile_phases", "read_peak_memory", "record_memory_history",
    "render_memory_timeline", "reset_peak_memory", "run_nsys", "run_steps", "summarize_kernels",
    "synchronize", "time_phases", "time_steps", "trace", "traces", "tracing",
]
