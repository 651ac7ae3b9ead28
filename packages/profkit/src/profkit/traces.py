"""Traces to open in Perfetto (https://ui.perfetto.dev) or chrome://tracing, with profkit's phases on a track.

    path = profkit.trace(step, warmup=2, steps=3, path="step.json.gz")    # a step(phase) function

    with profkit.tracing("step.json.gz") as phase:                         # or any code
        with phase("forward"):
            loss = model(x).sum()

The file is torch.profiler's Chrome trace JSON (``export_chrome_trace``), gzipped, post-processed:
the ranges profkit opened (the phases, ``step i``, every :func:`profkit.nvtx.range` and the module
ranges of :func:`profkit.nvtx.annotate_modules`) move from the CPU thread that opened them to a
track of their own, "profkit ranges", at the top of that process. The CPU operators, CUDA kernels
and collectives (``gloo:all_reduce`` on gloo's threads, NCCL kernels on their stream) stay where the
profiler put them. A top-level ``"profkit"`` object records the version, the number of steps, the
rank and the world size, which :mod:`profkit.comm` reads.

Under ``torch.distributed`` each rank writes its own file: put ``{rank}`` in ``path``.
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from profkit import nvtx
from profkit.timing import PhaseMarker, Step, run_steps

__all__ = ["PROFKIT_TRACK", "load_trace", "render_trace", "trace", "tracing"]

PROFKIT_TRACK = "profkit ranges"
# Thread ids for profkit's tracks: far above real thread ids, below 2**31 for tools that read int32.
_TRACK_TID = 2**31 - 1024
_RANGE_CATEGORIES = ("user_annotation",)


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_path(path: str | Path) -> Path:
    """``path`` with ``{rank}`` filled in; an error when several ranks would write one file."""
    rank, world = _rank_and_world()
    text = str(path)
    if world > 1 and "{rank}" not in text:
        raise ValueError(
            f"path={text!r}: {world} ranks would all write this file; put '{{rank}}' in it, "
            "e.g. 'trace_rank{rank}.json.gz'"
        )
    return Path(text.replace("{rank}", str(rank)))


@contextmanager
def tracing(
    path: str | Path,
    steps: int = 1,
    activities: Sequence[torch.profiler.ProfilerActivity] | None = None,
    record_shapes: bool = True,
    with_stack: bool = False,
) -> Iterator[PhaseMarker]:
    """Profile the block with torch.profiler and write its trace, gzipped, to ``path`` on exit.

    Yields a ``phase`` function (``with phase("forward"): ...``) that marks ranges without timing or
    synchronizing. ``steps`` is how many training steps the block runs (recorded in the file, so that
    :mod:`profkit.comm` reports per step). ``activities`` default to CPU, plus CUDA when available;
    ``record_shapes`` keeps operator shapes (and the message sizes of gloo collectives).
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    path = resolve_path(path)
    profiler = torch.profiler.profile(
        activities=list(activities or _activities()), record_shapes=record_shapes, with_stack=with_stack
    )
    nvtx.traced_names.clear()
    with profiler:
        yield PhaseMarker()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the block's kernels end inside the trace
    write_trace(profiler, path, steps, set(nvtx.traced_names))


def trace(
    step: Step,
    *,
    path: str | Path,
    warmup: int = 2,
    steps: int = 1,
    activities: Sequence[torch.profiler.ProfilerActivity] | None = None,
    record_shapes: bool = True,
    with_stack: bool = False,
) -> Path:
    """Run ``step(phase)`` ``warmup`` times, then trace ``steps`` calls into ``path``; returns the path.

    ``step`` is the function :func:`profkit.time_phases` takes; here its phases only mark ranges
    (no device synchronization), so communication overlaps across them as it does untraced.
    Let no asynchronous collective run on when ``step`` returns (wait for it inside the step, or turn
    the step around so that it ends after the work that waits for it): torch's profiler can crash the
    process when a gloo collective that began inside the trace ends after the trace stops.
    """
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    resolved = resolve_path(path)
    run_steps(
        step,
        warmup,
        steps,
        PhaseMarker(),
        measuring=tracing(path, steps, activities, record_shapes, with_stack),
    )
    return resolved


def write_trace(profiler: torch.profiler.profile, path: Path, steps: int, names: set[str]) -> None:
    """Export ``profiler``'s Chrome trace, move the ranges named in ``names`` to their track, gzip it."""
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        with raw.open() as f:
            document = json.load(f)
    rank, world = _rank_and_world()
    document = move_ranges(document, names)
    document["profkit"] = {"version": _version(), "steps": steps, "rank": rank, "world_size": world}
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(document, f)


def _version() -> str:
    from profkit import __version__

    return __version__


def move_ranges(document: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Move the CPU ranges named in ``names`` to a "profkit ranges" track per thread that opened them."""
    events = document.get("traceEvents", [])
    tracks: dict[tuple[Any, Any], int] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in _RANGE_CATEGORIES and event.get("name") in names:
            key = (event.get("pid"), event.get("tid"))
            tid = tracks.setdefault(key, _TRACK_TID + len(tracks))
            event["args"] = {**event.get("args", {}), "thread": event.get("tid")}
            event["tid"] = tid
    for (pid, thread), tid in tracks.items():
        label = PROFKIT_TRACK if len(tracks) == 1 else f"{PROFKIT_TRACK} (thread {thread})"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": -1}}
        )
    return document


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace JSON document, gzipped or not."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    opener = gzip.open if _is_gzip(path) else open
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a Chrome trace: {exc}") from exc
    if isinstance(document, list):  # the JSON Array Format: events only
        document = {"traceEvents": document}
    if not isinstance(document, dict) or "traceEvents" not in document:
        raise ValueError(f"{path} is not a Chrome trace (no 'traceEvents')")
    return document


def _is_gzip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def trace_files(paths: Sequence[str | Path]) -> list[Path]:
    """Each path, or the ``*.json*`` files of a directory."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json*")) if p.is_dir() else [p]
    return files


# --- a picture of a trace ------------------------------------------------------------------------------

_COMM_NAME = re.compile(r"^(?:gloo:|nccl|c10d::|record_param_comms)", re.IGNORECASE)


@dataclass(frozen=True)
class _Slice:
    name: str
    start_us: float
    dur_us: float
    depth: int


def _track_names(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    processes = {
        e.get("pid"): str(e["args"].get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            process = processes.get(e.get("pid"), "")
            label = str(e["args"].get("name", e.get("tid")))
            names[(e.get("pid"), e.get("tid"))] = (
                label if label.startswith(PROFKIT_TRACK) or not process else f"{process}: {label}"
            )
    return names


def _nest(events: list[dict[str, Any]]) -> list[_Slice]:
    """Slices of one track with their nesting depth (0: outermost)."""
    ordered = sorted(events, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    open_ends: list[float] = []
    slices = []
    for e in ordered:
        start, dur = float(e["ts"]), float(e["dur"])
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        slices.append(_Slice(str(e["name"]), start, dur, len(open_ends)))
        open_ends.append(start + dur)
    return slices


def timed_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The complete events ("ph": "X") that carry a duration: ranges, operators, kernels, collectives."""
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _window(events: list[dict[str, Any]], names: dict[tuple[Any, Any], str]) -> tuple[float, float]:
    """The first "step i" range on profkit's track, else the whole trace (µs)."""
    steps = [
        e
        for e in events
        if e.get("ph") == "X"
        and str(e.get("name", "")).startswith("step ")
        and names.get((e.get("pid"), e.get("tid")), "").startswith(PROFKIT_TRACK)
    ]
    if steps:
        first = min(steps, key=lambda e: float(e["ts"]))
        return float(first["ts"]), float(first["ts"]) + float(first["dur"])
    timed = timed_events(events)
    return min(float(e["ts"]) for e in timed), max(float(e["ts"]) + float(e["dur"]) for e in timed)


def render_trace(
    trace: dict[str, Any] | str | Path,
    path: str | Path,
    window_us: tuple[float, float] | None = None,
    max_depth: int = 3,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Draw a trace's tracks (profkit's ranges, CPU threads, collectives, GPU streams) as a PNG.

    A stand-in for a Perfetto screenshot where no browser is at hand: one row of slices per track
    and nesting depth (up to ``max_depth``), collectives in red, over ``window_us`` (default: the
    first traced step, else the whole trace) in the trace's own microseconds.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    document = trace if isinstance(trace, dict) else load_trace(trace)
    events = document["traceEvents"]
    names = _track_names(events)
    lo, hi = window_us or _window(events, names)
    by_track: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if (
            e.get("ph") == "X"
            and "dur" in e
            and float(e["ts"]) < hi
            and float(e["ts"]) + float(e["dur"]) > lo
            and e.get("cat") in ("user_annotation", "cpu_op", "kernel", "gpu_memcpy", "gpu_memset")
        ):
            by_track.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    order = sorted(
        by_track,
        key=lambda k: (
            not names.get(k, "").startswith(PROFKIT_TRACK),
            any(e.get("cat") == "kernel" for e in by_track[k]),
            str(k),
        ),
    )
    rows: list[tuple[str, list[_Slice]]] = []
    for key in order:
        slices = _nest(by_track[key])
        for depth in range(min(max_depth, 1 + max(s.depth for s in slices))):
            label = names.get(key, f"{key[0]}/{key[1]}") if depth == 0 else ""
            rows.append((label, [s for s in slices if s.depth == depth]))
    figure = Figure(figsize=(14, 0.42 * len(rows) + 1.4), dpi=dpi)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    palette = [
        "#4e79a7",
        "#f28e2b",
        "#59a14f",
        "#b07aa1",
        "#edc948",
        "#76b7b2",
        "#ff9da7",
        "#9c755f",
        "#bab0ac",
    ]
    width = hi - lo
    for y, (_, slices) in enumerate(rows):
        spans = [(max(s.start_us, lo), min(s.start_us + s.dur_us, hi)) for s in slices]
        colors = [
            "#e15759" if _COMM_NAME.match(s.name) else palette[sum(map(ord, s.name)) % len(palette)]
            for s in slices
        ]
        ax.broken_barh(
            [((a - lo) / 1e3, (b - a) / 1e3) for a, b in spans],
            (y - 0.4, 0.8),
            facecolors=colors,
            edgecolor="white",
            linewidth=0.3,
        )
        for s, (start, end) in zip(slices, spans, strict=True):
            fits = int(190 * (end - start) / width)  # characters of 7-point text the slice can hold
            if fits >= 6:
                label = s.name if len(s.name) <= fits else s.name[: fits - 1] + "…"
                ax.text(
                    (start + end - 2 * lo) / 2e3, y, label, ha="center", va="center", fontsize=7, clip_on=True
                )
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, width / 1e3)
    ax.set_xlabel("ms from the window's start")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(title or "Trace tracks (red: collectives)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, bbox_inches="tight")
    return path
