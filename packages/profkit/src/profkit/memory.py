"""CUDA memory: snapshots of the allocator's history, peak reports, and an offline timeline renderer.

    with profkit.memory.record_memory_history("step.pickle"):
        train_step()                                       # snapshot written on exit, even on OOM
    profkit.memory.render_memory_timeline("step.pickle", "step.png")

The picture is the "Active Memory Timeline" of https://pytorch.org/memory_viz, drawn with matplotlib
and no browser: the x axis counts allocation and free events, each live allocation is a band
stacked on those allocated before it (a free lets everything above it drop), and the largest
allocations are coloured and labelled with the source line that made them.

Snapshot format (what ``torch.cuda.memory._dump_snapshot`` pickles, and what the renderer reads):
``{"segments": [{"device", "address", "total_size", "blocks": [{"address", "size", "state",
"frames"}, ...]}, ...], "device_traces": [[{"action", "addr", "size", "frames": [{"filename",
"line", "name"}, ...], ...}, ...] per device]}``. Actions used: ``alloc``, ``free_completed`` and
``oom``; a free of an address never allocated in the trace, and a block still allocated at the end
that the trace never allocated, are allocations made before recording began.
"""

from __future__ import annotations

import os
import pickle
import re
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

BEFORE_RECORDING = "allocated before recording"
# Allocations made by threads without Python code: in a training step, autograd's backward threads.
NO_PYTHON_FRAMES = "no Python frames (autograd backward)"
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_LIBRARY_FILE = re.compile(r"[/\\](?:site|dist)-packages[/\\]torch[/\\]")


# --- recording and peaks -----------------------------------------------------------------------------

@contextmanager
def record_memory_history(path: str | Path, max_entries: int = 1_000_000,
                          stacks: str = "python") -> Iterator[Path]:
    """Record every CUDA allocation and free inside the block; pickle the snapshot to ``path`` on exit.

    The snapshot is written even if the block raises (an out-of-memory error is the moment you want
    to see). ``stacks="python"`` records Python frames only; "all" adds C++ frames (much slower).
    ``max_entries`` bounds the trace (a ring buffer: the oldest events are dropped beyond it).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("record_memory_history needs CUDA: torch.cuda.is_available() is False")
    if max_entries < 1:
        raise ValueError(f"max_entries={max_entries} must be >= 1")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks,
                                             max_entries=max_entries)
    try:
        yield path
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


@dataclass(frozen=True)
class PeakMemory:
    """Bytes: peak allocated by tensors, peak reserved by the caching allocator, allocated now."""

    allocated: int
    reserved: int
    current: int

    def as_gib(self) -> dict[str, float]:
        return {"peak allocated (GiB)": self.allocated / 2**30, "peak reserved (GiB)": self.reserved / 2**30,
                "allocated after (GiB)": self.current / 2**30}


def _on_cuda(device: torch.device | str | None) -> bool:
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start a new peak window (no-op without CUDA or for a non-CUDA device)."""
    if _on_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def read_peak_memory(device: torch.device | str | None = None) -> PeakMemory | None:
    """Peaks since the last :func:`reset_peak_memory` (None without CUDA or for a non-CUDA device)."""
    if not _on_cuda(device):
        return None
    return PeakMemory(allocated=torch.cuda.max_memory_allocated(device),
                      reserved=torch.cuda.max_memory_reserved(device),
                      current=torch.cuda.memory_allocated(device))


# --- reading a snapshot ------------------------------------------------------------------------------

def load_snapshot(path: str | Path) -> dict[str, Any]:
    """A snapshot pickle, as :func:`record_memory_history` or ``torch.cuda.memory._dump_snapshot`` write."""
    with Path(path).open("rb") as f:
        snapshot = pickle.load(f)
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError(f"{path} is not a CUDA memory snapshot (no 'device_traces')")
    return snapshot


def frame_label(frames: Sequence[dict[str, Any]]) -> str:
    """'file.py:123 function' for the innermost frame of user code, and the library frame it called.

    Frames inside torch and the standard library are skipped to find the user's line; the innermost
    Python frame follows it after ' › ' when that one is library code, so the line of
    ``optimizer.step()`` reads differently for the optimizer's state and its temporaries. If every
    frame is library code the innermost Python frame is used, and without Python frames the innermost
    C++ one. No frames at all is what the threads of autograd's backward pass record:
    :data:`NO_PYTHON_FRAMES`.
    """
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    if not python:
        return _format_frame(frames[0]) if frames else NO_PYTHON_FRAMES
    user = next((f for f in python if not _is_library(str(f["filename"]))), None)
    if user is None or user is python[0]:
        return _format_frame(python[0])
    return f"{_format_frame(user)} › {_format_frame(python[0])}"


def _is_library(filename: str) -> bool:
    return filename.startswith((_TORCH_DIR, _STDLIB_DIR)) or bool(_LIBRARY_FILE.search(filename))


def _format_frame(frame: dict[str, Any]) -> str:
    filename = os.path.basename(str(frame.get("filename", "?")))
    return f"{filename}:{frame.get('line', '?')} {frame.get('name', '?')}"


@dataclass(frozen=True)
class Allocation:
    """A block live on positions [start, end) of the timeline (position t: after t events).

    ``address`` is the block's device address (-1 when a free without its allocation gave only the
    size), ``frames`` the stack that allocated it (empty when unknown).
    """

    size: int
    start: int
    end: int
    label: str
    address: int = -1
    frames: tuple[dict[str, Any], ...] = ()


@dataclass
class Trace:
    """The alloc/free history of one device, as allocations in stacking order."""

    allocations: list[Allocation]
    events: int
    oom_positions: list[int] = field(default_factory=list)


def _pick_device(snapshot: dict[str, Any], device: int | None) -> int:
    traces = snapshot["device_traces"]
    if device is not None:
        if not 0 <= device < len(traces):
            raise ValueError(f"device={device}: the snapshot has traces for devices 0..{len(traces) - 1}")
        return device
    counts = [len(t) for t in traces]
    if not counts or max(counts) == 0:
        raise ValueError("the snapshot has no trace events: record_memory_history must be active while "
                         "the work runs (and max_entries > 0)")
    return counts.index(max(counts))


def _blocks_at_end(snapshot: dict[str, Any], device: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(address, block) of the blocks allocated when the snapshot was taken."""
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        address = segment.get("address", 0)
        for block in segment.get("blocks", []):
            if block.get("state", "").startswith("active"):
                yield block.get("address", address), block
            address += block["size"]


def read_trace(snapshot: dict[str, Any], device: int | None = None) -> Trace:
    """The allocations of ``device`` (default: the one with the most events) in stacking order."""
    device = _pick_device(snapshot, device)
    events = [e for e in snapshot["device_traces"][device]
              if e["action"] in ("alloc", "free_completed", "oom")]
    timed = [e for e in events if e["action"] != "oom"]
    n = len(timed)
    allocations: list[Allocation] = []
    # address -> (start, size, label, frames) of the blocks allocated now
    live: dict[int, tuple[int, int, str, tuple[dict[str, Any], ...]]] = {}

    def close(addr: int, end: int) -> None:
        start, size, label, frames = live.pop(addr)
        allocations.append(Allocation(size, start, end, label, addr, frames))

    oom_positions = []
    position = 0
    for event in events:
        if event["action"] == "oom":
            oom_positions.append(position)
            continue
        position += 1
        addr, size = event["addr"], event["size"]
        if event["action"] == "alloc":
            if addr in live:  # its free fell out of a wrapped ring buffer: close it here
                close(addr, position)
            frames = tuple(event.get("frames", []))
            live[addr] = (position, size, frame_label(frames), frames)
        elif addr in live:
            close(addr, position)
        else:
            allocations.append(Allocation(size, 0, position, BEFORE_RECORDING, addr))
    live_addresses = set(live)
    for addr in list(live):
        close(addr, n + 1)
    for address, block in _blocks_at_end(snapshot, device):
        if address not in live_addresses:
            frames = tuple(block.get("frames", []))
            label = frame_label(frames) if frames else BEFORE_RECORDING
            allocations.append(Allocation(block["size"], 0, n + 1, label, address, frames))
    allocations.sort(key=lambda a: a.start)  # stable: equal starts keep their order
    return Trace(allocations, n, oom_positions)


# --- the timeline ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Band:
    """A region between two step curves: value i holds from ``x[i]`` to ``right[i]``.

    ``label`` is None for a run of unlabelled allocations.
    """

    x: np.ndarray
    right: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    label: str | None


@dataclass(frozen=True)
class LabelledSource:
    label: str
    largest: int
    count: int


@dataclass
class MemoryTimeline:
    """What the picture shows: stacked bands, total memory, the peak and the labelled sources."""

    x: np.ndarray
    total: np.ndarray
    bands: list[Band]
    sources: list[LabelledSource]
    events: int
    oom_positions: list[int]

    @property
    def peak_bytes(self) -> int:
        return int(self.total.max()) if self.total.size else 0

    @property
    def peak_position(self) -> int:
        return int(self.x[int(self.total.argmax())]) if self.total.size else 0


def _sample_positions(total: np.ndarray, max_points: int) -> np.ndarray:
    """At most ``max_points`` positions: all of them, or each bin's highest-memory one (peaks survive)."""
    if total.size <= max_points:
        return np.arange(total.size)
    edges = np.linspace(0, total.size, max_points + 1).astype(int)
    bins = zip(edges[:-1], edges[1:], strict=True)
    return np.array([lo + int(np.argmax(total[lo:hi])) for lo, hi in bins if hi > lo])


def build_timeline(trace: Trace, top: int = 8, max_points: int = 4000) -> MemoryTimeline:
    """Stack ``trace``'s allocations into bands; colour the ``top`` source lines of the largest ones.

    Allocations from one of the chosen source lines get a band each; runs of other allocations
    that sit next to each other in the stack share one unlabelled band.
    """
    if top < 0:
        raise ValueError(f"top={top} must be >= 0")
    if max_points < 2:
        raise ValueError(f"max_points={max_points} must be >= 2")
    positions = trace.events + 1
    delta = np.zeros(positions + 1, dtype=np.float64)
    for a in trace.allocations:
        delta[a.start] += a.size
        delta[a.end] -= a.size
    total_all = np.cumsum(delta[:-1])
    x = _sample_positions(total_all, max_points)

    by_label: dict[str, list[Allocation]] = {}
    for a in trace.allocations:
        by_label.setdefault(a.label, []).append(a)
    largest: dict[str, int] = {}
    for a in sorted(trace.allocations, key=lambda a: -a.size):
        if len(largest) == top:
            break
        largest.setdefault(a.label, a.size)
    sources = [LabelledSource(label, size, len(by_label[label])) for label, size in largest.items()]
    next_x = np.append(x[1:], x[-1] + 1)

    level = np.zeros(x.size)
    bands: list[Band] = []
    run_start: np.ndarray | None = None  # level below the current run of unlabelled allocations

    def close_run() -> None:
        nonlocal run_start
        if run_start is not None:
            visible = np.flatnonzero(level > run_start)
            if visible.size:
                lo, hi = visible[0], visible[-1] + 1
                bands.append(Band(x[lo:hi], next_x[lo:hi], run_start[lo:hi], level[lo:hi].copy(), None))
            run_start = None

    for a in trace.allocations:
        lo, hi = np.searchsorted(x, a.start), np.searchsorted(x, a.end)
        if lo == hi:
            continue  # lives between two sampled positions
        if a.label in largest:
            close_run()
            lower = level[lo:hi].copy()
            level[lo:hi] += a.size
            bands.append(Band(x[lo:hi], next_x[lo:hi], lower, level[lo:hi].copy(), a.label))
        else:
            if run_start is None:
                run_start = level.copy()
            level[lo:hi] += a.size
    close_run()
    return MemoryTimeline(x=x, total=total_all[x], bands=bands, sources=sources, events=trace.events,
                          oom_positions=trace.oom_positions)


# --- drawing -----------------------------------------------------------------------------------------

def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            return scale, name
    return 1, "B"


def _shorten(label: str, width: int = 70) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _step_polygon(band: Band, scale: float) -> np.ndarray:
    """Vertices of a band whose values hold until the next sampled position."""
    xs = np.stack([band.x, band.right], axis=1).ravel()
    upper = np.repeat(band.upper, 2) / scale
    lower = np.repeat(band.lower, 2) / scale
    return np.concatenate([np.stack([xs, upper], 1), np.stack([xs[::-1], lower[::-1]], 1)])


def draw_timeline(timeline: MemoryTimeline, path: str | Path, title: str = "Active memory timeline",
                  dpi: int = 120) -> Path:
    """Write ``timeline`` as a PNG (matplotlib's Agg canvas: no display, no browser)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    scale, unit = _unit(max(timeline.peak_bytes, 1))
    palette = [
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
        "#393b79", "#ad494a", "#637939",
    ]
    colors = {s.label: palette[i % len(palette)] for i, s in enumerate(timeline.sources)}
    x_end = float(timeline.x[-1] + 1) if timeline.x.size else 1.0

    figure = Figure(figsize=(14, 7), dpi=dpi)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    polygons, facecolors = [], []
    for band in timeline.bands:
        polygons.append(_step_polygon(band, scale))
        facecolors.append(colors[band.label] if band.label is not None else "#c7c7c7")
    ax.add_collection(PolyCollection(polygons, facecolors=facecolors, edgecolors="white", linewidths=0.2))
    ax.set_xlim(0, x_end)
    ax.set_ylim(0, max(timeline.peak_bytes / scale * 1.08, 1e-9))
    peak = timeline.peak_bytes / scale
    ax.axhline(peak, color="black", linestyle="--", linewidth=0.8)
    ax.annotate(f"peak {peak:.2f} {unit}", (timeline.peak_position, peak), xytext=(4, 4),
                textcoords="offset points", fontsize=9)
    for position in timeline.oom_positions:
        ax.axvline(position, color="red", linewidth=1.2)
        ax.annotate("OOM", (position, peak), color="red", xytext=(4, -12), textcoords="offset points")
    ax.set_xlabel(f"allocation and free events ({timeline.events:,} in the trace)")
    ax.set_ylabel(f"active memory ({unit})")
    ax.set_title(title)
    handles = [Patch(facecolor=colors[s.label], label=f"{s.largest / scale:.3g} {unit}  {_shorten(s.label)}"
                     + (f"  (×{s.count})" if s.count > 1 else "")) for s in timeline.sources]
    handles.append(Patch(facecolor="#c7c7c7", label="other allocations"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title="largest allocation per source line", title_fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, bbox_inches="tight")
    return path


def render_memory_timeline(snapshot: dict[str, Any] | str | Path, path: str | Path, device: int | None = None,
                           top: int = 8, title: str | None = None, max_points: int = 4000) -> MemoryTimeline:
    """Snapshot (dict or pickle path) -> PNG of its active memory timeline; returns what was drawn."""
    if not isinstance(snapshot, dict):
        snapshot = load_snapshot(snapshot)
    timeline = build_timeline(read_trace(snapshot, device), top=top, max_points=max_points)
    draw_timeline(timeline, path, title or "Active memory timeline")
    return timeline
