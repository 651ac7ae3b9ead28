"""Per-phase kernel summaries from torch.profiler, in the shape of Nsight Systems' kernel summary.

:func:`profile_phases` runs a step (see :mod:`profkit.timing`) under ``torch.profiler`` and returns,
for each phase (forward, backward, optimizer, ...), a table with the columns of ``nsys stats``'
"CUDA GPU Kernel Summary": Time (%), Total Time (ns), Instances, Avg, Med, Min, Max, StdDev, Name.

Attribution: each device kernel belongs to the phase whose ``record_function`` range encloses its
*launch* (the start of the CPU operator that launched it, found through the profiler's correlation
ids; the kernel's own start time when the launch is unknown). The backward pass launches kernels
from autograd's device threads, so ranges are matched by time, not by thread; phases of a
:class:`~profkit.timing.PhaseClock` synchronize at their end, so a phase's kernels also finish inside
it. Kernels outside every phase land in the table ``OUTSIDE``.

Without device kernels (a CPU-only run) the tables hold CPU operators instead, each with its *self*
time (less the operators it calls), so that nested operators are not counted twice.

Matrix multiplies are recognised by name with :data:`MATMUL_PATTERN`: cuBLAS/cuBLASLt kernels
(``gemm``, ``sgemm``, ``gemv``, ``nvjet_*``, ``*xmma*``, ``cublasLt::splitKreduce_kernel``),
``cutlass*`` tensor-op gemms, Triton templates
from torch.compile (``triton_tem_fused_mm``, ``..._addmm``, ``..._bmm``) and, on CPU, ``aten::mm``,
``aten::bmm``, ``aten::addmm``, ``aten::matmul``, ``aten::linear``. Fused attention kernels
(flash, mem-efficient, ``fmha``) and torch.compile's pointwise and reduction kernels
(``triton_poi_*``, ``triton_red_*``, ``triton_per_*``, even when named after an addmm) are not.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from profkit.timing import PhaseClock, Step, run_steps
from profkit.traces import timed_events

OUTSIDE = "outside phases"
DEFAULT_PHASES = ("forward", "backward", "optimizer")
MATMUL_PATTERN = re.compile(
    r"gemm|gemv|nvjet|xmma|cublas|splitKreduce|cutlass.*(?:tensorop|gemm)"
    r"|(?:^|[^a-z])(?:mm|bmm|addmm|baddbmm|matmul|linear)(?:[^a-z]|$)"
    r"|triton_tem_fused_.*mm",
    re.IGNORECASE,
)
# Fused attention, and torch.compile's pointwise/reduction kernels, which are named after the ops they
# came from (a bias add split off an addmm is "triton_poi_fused_addmm_0").
_NOT_MATMUL = re.compile(r"fmha|flash|attention|attn|triton_(?:poi|red|per)_", re.IGNORECASE)
COLUMNS = ("Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)",
           "StdDev (ns)", "Name")

EventKind = Literal["range", "kernel", "op"]


def is_matmul(name: str) -> bool:
    """Whether a kernel or operator name is a matrix multiply (see :data:`MATMUL_PATTERN`)."""
    return bool(MATMUL_PATTERN.search(name)) and not _NOT_MATMUL.search(name)


@dataclass(frozen=True)
class TraceEvent:
    """One profiler event, reduced to what the summaries need (times in ns on one clock).

    kind: "range" (a record_function annotation), "kernel" (a device kernel), "op" (a CPU operator).
    launch_ns: for kernels, when the CPU launched it (None if unknown).
    """

    name: str
    kind: EventKind
    start_ns: int
    duration_ns: int
    thread: int = 0
    launch_ns: int | None = None

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


@dataclass(frozen=True)
class KernelStat:
    name: str
    durations_ns: tuple[int, ...]

    @property
    def total_ns(self) -> int:
        return sum(self.durations_ns)

    def row(self, phase_total_ns: int) -> dict[str, Any]:
        """This kernel's row with the columns of :data:`COLUMNS`."""
        d = self.durations_ns
        return {
            "Time (%)": round(100.0 * self.total_ns / phase_total_ns, 1) if phase_total_ns else 0.0,
            "Total Time (ns)": self.total_ns,
            "Instances": len(d),
            "Avg (ns)": round(statistics.fmean(d), 1),
            "Med (ns)": round(float(statistics.median(d)), 1),
            "Min (ns)": min(d),
            "Max (ns)": max(d),
            "StdDev (ns)": round(statistics.stdev(d), 1) if len(d) > 1 else 0.0,
            "Name": self.name,
        }


@dataclass(frozen=True)
class KernelTable:
    """The kernels of one phase, largest total time first."""

    phase: str
    kernels: tuple[KernelStat, ...]

    @property
    def total_ns(self) -> int:
        return sum(k.total_ns for k in self.kernels)

    @property
    def matmul_ns(self) -> int:
        return sum(k.total_ns for k in self.kernels if is_matmul(k.name))

    @property
    def matmul_fraction(self) -> float:
        """Share of this phase's kernel time spent in matrix multiplies (NaN with no kernels)."""
        return self.matmul_ns / self.total_ns if self.total_ns else math.nan

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Rows with the columns of :data:`COLUMNS` (the ``limit`` largest, or all)."""
        return [k.row(self.total_ns) for k in self.kernels[:limit]]

    def format(self, limit: int | None = 20, name_width: int = 80) -> str:
        """Plain-text table like ``nsys stats``' output."""
        cells = [[str(row[c]) for c in COLUMNS[:-1]] + [str(row["Name"])[:name_width]]
                 for row in self.rows(limit)]
        widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(COLUMNS)]

        def line(values: Sequence[str]) -> str:
            # numbers right-aligned, the name (last) left as it is
            return "  ".join([*(v.rjust(w) for v, w in zip(values[:-1], widths, strict=False)), values[-1]])

        return "\n".join([line(COLUMNS), line(["-" * w for w in widths]), *map(line, cells)])


@dataclass
class KernelReport:
    """Per-phase kernel tables of one profiled run.

    source: "cuda kernels" or "cpu ops" (no device kernels were recorded).
    steps: how many measured steps the totals cover.
    """

    tables: dict[str, KernelTable]
    source: str
    steps: int = 1
    phases: tuple[str, ...] = field(default=DEFAULT_PHASES)

    def summary(self) -> list[dict[str, Any]]:
        """One row per phase: total time, kernel instances, matrix-multiply share."""
        rows = []
        for phase, table in self.tables.items():
            rows.append({
                "phase": phase,
                "total ms per step": table.total_ns / 1e6 / self.steps,
                "instances per step": sum(len(k.durations_ns) for k in table.kernels) / self.steps,
                "distinct kernels": len(table.kernels),
                "matmul %": 100.0 * table.matmul_fraction,
                "other %": 100.0 * (1.0 - table.matmul_fraction),
            })
        return rows


def _phase_ranges(events: Sequence[TraceEvent], phases: Sequence[str]) -> list[TraceEvent]:
    wanted = set(phases)
    return sorted((e for e in events if e.kind == "range" and e.name in wanted), key=lambda e: e.start_ns)


def _exclusive_ops(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """CPU operators with their *self* time: their duration less that of the operators they call.

    Operators nest on a thread, so each one's parent is the innermost earlier one still open.
    """
    by_thread: dict[int, list[TraceEvent]] = defaultdict(list)
    for event in events:
        if event.kind == "op":
            by_thread[event.thread].append(event)
    exclusive = []
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e.start_ns, -e.duration_ns))
        children_ns = [0] * len(ops)
        open_ops: list[int] = []
        for i, op in enumerate(ops):
            while open_ops and ops[open_ops[-1]].end_ns <= op.start_ns:
                open_ops.pop()
            if open_ops:
                children_ns[open_ops[-1]] += op.duration_ns
            open_ops.append(i)
        exclusive += [replace(op, duration_ns=max(op.duration_ns - spent, 0))
                      for op, spent in zip(ops, children_ns, strict=True)]
    return exclusive


def summarize_kernels(events: Iterable[TraceEvent], phases: Sequence[str] = DEFAULT_PHASES,
                      steps: int = 1) -> KernelReport:
    """Group kernels (or, without any, leaf CPU operators) by phase into nsys-style tables.

    A kernel belongs to the innermost range named in ``phases`` that encloses its launch time.
    Tables come in the order of ``phases`` (those with work only), then :data:`OUTSIDE` if needed.
    """
    events = list(events)
    kernels = [e for e in events if e.kind == "kernel"]
    source = "cuda kernels" if kernels else "cpu ops"
    work = kernels or _exclusive_ops(events)
    ranges = _phase_ranges(events, phases)
    starts = [r.start_ns for r in ranges]
    durations: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for item in work:
        when = item.launch_ns if item.launch_ns is not None else item.start_ns
        phase = OUTSIDE
        # The innermost enclosing range is the latest-starting one that still contains `when`.
        for i in reversed(range(bisect.bisect_right(starts, when))):
            if ranges[i].end_ns > when:
                phase = ranges[i].name
                break
        durations[phase][item.name].append(item.duration_ns)
    order = [p for p in phases if p in durations] + ([OUTSIDE] if OUTSIDE in durations else [])
    tables = {}
    for phase in order:
        stats = [KernelStat(name, tuple(d)) for name, d in durations[phase].items()]
        stats.sort(key=lambda k: (-k.total_ns, k.name))
        tables[phase] = KernelTable(phase, tuple(stats))
    return KernelReport(tables=tables, source=source, steps=steps, phases=tuple(phases))


def trace_events(prof: torch.profiler.profile) -> list[TraceEvent]:
    """The events of a finished ``torch.profiler.profile`` as :class:`TraceEvent`s."""
    return events_from_kineto(prof.profiler.kineto_results.events())


def events_from_kineto(raw_events: Iterable[Any]) -> list[TraceEvent]:
    """Convert the profiler's raw Kineto events (``_KinetoEvent``) to :class:`TraceEvent`.

    A device kernel's ``linked_correlation_id`` names the CPU operator that launched it, whose
    start is taken as the launch time. Memory copies/sets and device-side copies of annotations
    are dropped, as in nsys' kernel summary.
    """
    cpu_side: list[tuple[Any, EventKind]] = []
    device_kernels = []
    for raw in raw_events:
        activity = _activity(raw)
        if raw.device_type() == torch.autograd.DeviceType.CPU:
            if activity == "user_annotation":
                cpu_side.append((raw, "range"))
            elif activity == "cpu_op":
                cpu_side.append((raw, "op"))
            # else: runtime calls (cudaLaunchKernel...), python functions, profiler overhead
        elif activity == "kernel":
            device_kernels.append(raw)
    # Only operators and annotations: runtime calls number their correlation ids separately.
    launched_by = {raw.correlation_id(): raw.start_ns() for raw, _ in cpu_side}
    events = [TraceEvent(raw.name(), kind, raw.start_ns(), raw.duration_ns(), raw.start_thread_id())
              for raw, kind in cpu_side]
    events += [TraceEvent(raw.name(), "kernel", raw.start_ns(), raw.duration_ns(),
                          launch_ns=launched_by.get(raw.linked_correlation_id()))
               for raw in device_kernels]
    return events


def events_from_chrome(document: dict[str, Any]) -> list[TraceEvent]:
    """:class:`TraceEvent`s from a Chrome trace (``export_chrome_trace``, or :func:`profkit.trace`'s file).

    Ranges are the ``user_annotation`` events, operators the ``cpu_op`` ones, kernels the ``kernel``
    ones, each launched by the operator with the same "External id". Times become integer ns.
    """
    def ns(value: Any) -> int:
        return round(float(value) * 1e3)

    complete = timed_events(document.get("traceEvents", []))
    kinds: dict[str, EventKind] = {"user_annotation": "range", "cpu_op": "op"}
    launched_by = {e["args"]["External id"]: ns(e["ts"]) for e in complete
                   if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    events = []
    for e in complete:
        category = e.get("cat")
        if category in kinds:
            thread = e.get("tid") if isinstance(e.get("tid"), int) else 0
            events.append(TraceEvent(str(e["name"]), kinds[category], ns(e["ts"]), ns(e["dur"]), thread))
        elif category == "kernel":
            launch = launched_by.get(e.get("args", {}).get("External id"))
            events.append(TraceEvent(str(e["name"]), "kernel", ns(e["ts"]), ns(e["dur"]), launch_ns=launch))
    return events


def _activity(raw: Any) -> str:
    """Kineto's activity type of an event; older torch lacks activity_type(), so infer it."""
    if hasattr(raw, "activity_type"):
        return str(raw.activity_type())
    if raw.is_user_annotation():
        on_cpu = raw.device_type() == torch.autograd.DeviceType.CPU
        return "user_annotation" if on_cpu else "gpu_user_annotation"
    if raw.device_type() == torch.autograd.DeviceType.CPU:
        return "cuda_runtime" if raw.name().startswith("cu") else "cpu_op"
    return "gpu_memcpy" if raw.name().startswith(("Memcpy", "Memset")) else "kernel"


def profile_phases(step: Step, warmup: int = 2, steps: int = 1, phases: Sequence[str] = DEFAULT_PHASES,
                   device: torch.device | str | None = None) -> KernelReport:
    """Run ``step`` ``warmup`` times, then ``steps`` times under torch.profiler; summarize per phase.

    ``step`` has the signature used by :func:`profkit.timing.time_phases`; its phases must be named in
    ``phases`` to get their own tables. CUDA activity is recorded when CUDA is available.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    clock = PhaseClock(device)
    profiler = torch.profiler.profile(activities=activities)
    run_steps(step, warmup, steps, clock, measuring=profiler)
    return summarize_kernels(trace_events(profiler), phases, steps)
