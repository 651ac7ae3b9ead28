"""Where distributed time goes, from one trace per rank: compute, communication, overlap, stragglers.

    report = profkit.analyze_comm(["trace_rank0.json.gz", "trace_rank1.json.gz"])
    print(report.format())            # per rank and in total, per step
    print(report.collective_rows())   # per collective: bytes, bus bandwidth, who waited for whom

Reads Chrome traces (:func:`profkit.trace` writes them; any torch.profiler ``export_chrome_trace``
file works). What counts as what:

- **Communication**: on CUDA, the NCCL kernels (``nccl*`` names, or kernels whose args carry
  "Collective name"); without device kernels, gloo's ``gloo:<collective>`` ranges, which run on
  gloo's own threads.
- **Compute**: on CUDA, every other kernel (memory copies and sets are neither). On CPU, the CPU
  operators of the threads that run no collective, less the operators that issue collectives
  (``c10d::*``, ``record_param_comms``) and those that enclose them (their other children count).
- **Exposed communication**: the time some collective runs and no compute does; **overlap** is the
  rest of the communication time as a share of it: 100 * (1 - exposed / communication).
- **Wait**: collectives are matched across ranks by their order within their process group (the
  k-th all-reduce of each rank is one collective). A rank's wait at a collective is the last
  rank's arrival (start) less its own, on the clock the traces share (one host; or hosts whose
  clocks agree). The rank that arrives last, weighted by how long it kept the others, is the
  **straggler**.
- **Bytes and bus bandwidth** follow nccl-tests: the message size S is the larger of the input and
  output (an all-gather's gathered tensor, a reduce-scatter's input), from record_param_comms' /
  the NCCL kernel's "In msg nelems", "Out msg nelems" and "dtype", or gloo's input shapes and
  types. algbw = S / t and busbw = algbw * factor, factor 2(n-1)/n for all-reduce, (n-1)/n for
  all-gather, reduce-scatter and all-to-all, 1 otherwise; t is the shortest duration among the
  ranks (the last to arrive does not wait), or the rank's own with one trace.

Times are per step: the totals divided by the steps recorded in the trace (``profkit.trace`` writes
them; 1 otherwise).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profkit.tables import format_table
from profkit.traces import load_trace, timed_events, trace_files

__all__ = [
    "Collective",
    "CollectiveCall",
    "CommReport",
    "RankComm",
    "RankTimeline",
    "analyze_comm",
    "bus_factor",
    "read_timeline",
]

Interval = tuple[float, float]

_DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "int": 4,
    "int32": 4,
    "long": 8,
    "int64": 8,
    "short": 2,
    "int16": 2,
    "char": 1,
    "int8": 1,
    "signed char": 1,
    "byte": 1,
    "uint8": 1,
    "unsigned char": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complexfloat": 8,
    "complexdouble": 16,
}
_ISSUE_OPS = re.compile(r"^(?:c10d::|record_param_comms|nccl:|gloo:)")
_NCCL_KERNEL = re.compile(r"^nccl", re.IGNORECASE)
_STEP_RANGE = re.compile(r"^step \d+$")


def canonical_collective(name: str) -> str:
    """'all_reduce', 'all_gather', 'reduce_scatter', ... from gloo, record_param_comms or kernel names."""
    key = re.sub(r"[^a-z]", "", name.lower().removeprefix("gloo:").removeprefix("nccl:"))
    key = key.removeprefix("nccldevkernel").removeprefix("ncclkernel")
    for token, canonical in (
        ("allreduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("reducescatter", "reduce_scatter"),
        ("alltoall", "all_to_all"),
        ("broadcast", "broadcast"),
        ("barrier", "barrier"),
        ("sendrecv", "send_recv"),
        ("reduce", "reduce"),
        ("gather", "gather"),
        ("scatter", "scatter"),
        ("send", "send"),
        ("recv", "recv"),
    ):
        if token in key:
            return canonical
    return name


def bus_factor(collective: str, group_size: int) -> float:
    """nccl-tests' busbw / algbw for ``collective`` among ``group_size`` ranks."""
    n = group_size
    if n < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a profiler dtype name ('Float', 'c10::BFloat16', 'float'); NaN if unknown."""
    return float(_DTYPE_BYTES.get(dtype.lower().removeprefix("c10::").strip(), math.nan))


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as one rank saw it; times in ns on the rank's trace clock."""

    name: str
    group: str
    start_ns: float
    end_ns: float
    nbytes: float
    group_size: int

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


@dataclass
class RankTimeline:
    """What :func:`analyze_comm` needs of one rank's trace."""

    rank: int
    steps: int
    device: str  # "cuda" (kernels) or "cpu" (operators)
    compute: list[Interval]
    collectives: list[CollectiveCall]
    step_ns: float = math.nan  # the recorded steps' "step i" ranges, summed


# --- reading a trace ---------------------------------------------------------------------------------


def _events(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    return timed_events(document.get("traceEvents", []))


def _interval(event: Mapping[str, Any], offset_ns: float) -> Interval:
    start = float(event["ts"]) * 1e3 + offset_ns
    return start, start + float(event["dur"]) * 1e3


def _nelems(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _call_from_args(
    name: str, args: Mapping[str, Any], interval: Interval, world_size: int
) -> CollectiveCall:
    """A collective from record_param_comms-style args (NCCL kernels carry the same)."""
    elements = max(_nelems(args.get("In msg nelems")), _nelems(args.get("Out msg nelems")))
    size = int(args.get("Group size") or world_size)
    return CollectiveCall(
        canonical_collective(str(args.get("Collective name", name))),
        str(args.get("Process Group Name", "default")),
        *interval,
        elements * dtype_bytes(str(args.get("dtype", ""))),
        size,
    )


def _call_from_shapes(
    name: str, args: Mapping[str, Any], interval: Interval, world_size: int
) -> CollectiveCall:
    """A collective from a gloo range's input shapes and types (its args have no message sizes)."""
    collective = canonical_collective(name)
    nbytes = 0.0
    for dims, dtype in zip(args.get("Input Dims", []), args.get("Input type", []), strict=False):
        shapes = dims if dims and isinstance(dims[0], list) else [dims]
        nbytes += sum(math.prod(shape) for shape in shapes) * dtype_bytes(str(dtype))
    if not args.get("Input Dims"):
        nbytes = math.nan
    if collective == "all_gather":
        nbytes *= world_size  # the gathered tensor, as nccl-tests counts it
    return CollectiveCall(collective, "default", *interval, nbytes, world_size)


def _rank_and_world(document: Mapping[str, Any], position: int) -> tuple[int, int, int]:
    meta = document.get("profkit", {})
    info = document.get("distributedInfo", {})
    rank = int(meta.get("rank", info.get("rank", position)))
    world = int(meta.get("world_size", info.get("world_size", 1)))
    return rank, world, int(meta.get("steps", 1))


def read_timeline(
    document: Mapping[str, Any] | str | Path, position: int = 0, offset_ns: float = 0.0
) -> RankTimeline:
    """One rank's compute intervals and collectives from a Chrome trace (document or path).

    ``position`` stands in for the rank when the trace does not name it; ``offset_ns`` is added to
    every time (to put several traces on one clock).
    """
    if not isinstance(document, Mapping):
        document = load_trace(document)
    rank, world, steps = _rank_and_world(document, position)
    events = _events(document)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        calls, compute = _cuda_parts(kernels, _comms_metadata(events), world, offset_ns)
        device = "cuda"
    else:
        calls, compute = _cpu_parts(events, world, offset_ns)
        device = "cpu"
    step_ns = sum(
        e["dur"] * 1e3
        for e in events
        if e.get("cat") == "user_annotation" and _STEP_RANGE.match(str(e.get("name", "")))
    )
    return RankTimeline(
        rank, steps, device, compute, sorted(calls, key=lambda c: c.start_ns), step_ns or math.nan
    )


def _is_comm_kernel(event: Mapping[str, Any]) -> bool:
    return "Collective name" in event.get("args", {}) or bool(_NCCL_KERNEL.match(str(event.get("name", ""))))


def _comms_metadata(events: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """record_param_comms' args by "External id", for NCCL kernels whose own args lack them."""
    return {
        e["args"]["External id"]: e["args"]
        for e in events
        if e.get("name") == "record_param_comms" and "External id" in e.get("args", {})
    }


def _cuda_parts(
    kernels: list[dict[str, Any]], metadata: dict[Any, dict[str, Any]], world: int, offset_ns: float
) -> tuple[list[CollectiveCall], list[Interval]]:
    calls, compute = [], []
    for kernel in kernels:
        interval = _interval(kernel, offset_ns)
        if _is_comm_kernel(kernel):
            args = kernel.get("args", {})
            args = {**metadata.get(args.get("External id"), {}), **args}
            calls.append(_call_from_args(str(kernel["name"]), args, interval, world))
        else:
            compute.append(interval)
    return calls, compute


def _cpu_parts(
    events: list[dict[str, Any]], world: int, offset_ns: float
) -> tuple[list[CollectiveCall], list[Interval]]:
    calls = []
    comm_threads = set()
    for event in events:
        name = str(event.get("name", ""))
        if name.startswith("gloo:"):
            calls.append(_call_from_shapes(name, event.get("args", {}), _interval(event, offset_ns), world))
            comm_threads.add((event.get("pid"), event.get("tid")))
    if not calls:  # no gloo ranges: take record_param_comms, which the issuing thread records
        for event in events:
            if (
                event.get("name") == "record_param_comms"
                and event.get("args", {}).get("Collective name") != "wait"
            ):
                calls.append(
                    _call_from_args("record_param_comms", event["args"], _interval(event, offset_ns), world)
                )
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("cat") == "cpu_op" and (event.get("pid"), event.get("tid")) not in comm_threads:
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    compute = []
    for ops in by_thread.values():
        compute += _compute_ops(ops, offset_ns)
    return calls, compute


def _compute_ops(ops: list[dict[str, Any]], offset_ns: float) -> list[Interval]:
    """The intervals of one thread's operators that neither issue a collective nor enclose one."""
    ops = sorted(ops, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    intervals = [_interval(op, offset_ns) for op in ops]
    issues = [bool(_ISSUE_OPS.match(str(op.get("name", "")))) for op in ops]
    excluded = list(issues)
    open_ops: list[int] = []
    for i, (start, _) in enumerate(intervals):
        while open_ops and intervals[open_ops[-1]][1] <= start:
            open_ops.pop()
        if issues[i]:
            for parent in open_ops:
                excluded[parent] = True
        open_ops.append(i)
    return [interval for interval, out in zip(intervals, excluded, strict=True) if not out]


# --- interval arithmetic -----------------------------------------------------------------------------


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[Interval]) -> float:
    return math.fsum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        overlap = min(a[i][1], b[j][1]) - max(a[i][0], b[j][0])
        if overlap > 0:
            total += overlap
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# --- the report --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective across the ranks (matched by its order in its process group)."""

    index: int  # its position among the group's collectives
    name: str
    group: str
    nbytes: float
    group_size: int
    calls: dict[int, CollectiveCall]  # by rank

    @property
    def arrivals_ns(self) -> dict[int, float]:
        return {rank: call.start_ns for rank, call in self.calls.items()}

    def waits_ns(self) -> dict[int, float]:
        """Per rank: the last arrival less its own."""
        last = max(self.arrivals_ns.values())
        return {rank: last - start for rank, start in self.arrivals_ns.items()}

    @property
    def last_rank(self) -> int:
        arrivals = self.arrivals_ns
        return max(arrivals, key=lambda rank: (arrivals[rank], rank))

    @property
    def transfer_ns(self) -> float:
        """The shortest duration among the ranks: the last to arrive does not wait."""
        return min(call.duration_ns for call in self.calls.values())

    @property
    def algbw(self) -> float:
        """Bytes per second: message size / transfer time (NaN when either is unknown)."""
        return self.nbytes / (self.transfer_ns * 1e-9) if self.transfer_ns > 0 else math.nan

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.name, self.group_size)


@dataclass(frozen=True)
class RankComm:
    """One rank's times per step (ms) and collectives."""

    rank: int
    device: str
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_ms: float
    wait_ms: float
    collectives: float  # per step
    bytes: float  # per step

    @property
    def overlap_pct(self) -> float:
        """Share of communication time hidden behind compute (NaN without communication)."""
        return 100.0 * (1.0 - self.exposed_ms / self.comm_ms) if self.comm_ms > 0 else math.nan

    def row(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "step ms": self.step_ms,
            "compute ms": self.compute_ms,
            "comm ms": self.comm_ms,
            "exposed comm ms": self.exposed_ms,
            "overlap %": self.overlap_pct,
            "wait ms": self.wait_ms,
            "collectives": self.collectives,
            "MB": self.bytes / 1e6,
        }


@dataclass
class CommReport:
    """Per-rank and total communication of a traced step; :meth:`format` prints it."""

    ranks: list[RankComm]
    collectives: list[Collective]
    steps: int
    caused_wait_ms: dict[int, float] = field(default_factory=dict)  # per rank, per step
    # per rank: collectives at the end of its trace with no partner on every rank (left out of waits)
    unmatched: dict[int, int] = field(default_factory=dict)

    @property
    def straggler(self) -> int | None:
        """The rank the others waited for longest (None with one rank or no waiting)."""
        if not self.caused_wait_ms or max(self.caused_wait_ms.values()) <= 0:
            return None
        return max(self.caused_wait_ms, key=lambda r: self.caused_wait_ms[r])

    def bus_bandwidth(self) -> float:
        """Bytes per second over all collectives: sum of bytes * bus factor / sum of transfer times."""
        moved = math.fsum(c.nbytes * bus_factor(c.name, c.group_size) for c in self.collectives)
        seconds = math.fsum(c.transfer_ns for c in self.collectives) * 1e-9
        return moved / seconds if seconds > 0 else math.nan

    def total(self) -> RankComm:
        """Sums over the ranks (step time: the slowest rank's); overlap from the sums."""

        def add(attribute: str) -> float:
            return math.fsum(getattr(r, attribute) for r in self.ranks)

        return RankComm(
            -1,
            self.ranks[0].device if self.ranks else "",
            max((r.step_ms for r in self.ranks), default=math.nan),
            add("compute_ms"),
            add("comm_ms"),
            add("exposed_ms"),
            add("wait_ms"),
            add("collectives"),
            add("bytes"),
        )

    def rows(self) -> list[dict[str, Any]]:
        """One row per rank, then the total ("all")."""
        rows = [r.row() for r in self.ranks]
        total = self.total().row()
        total["rank"] = "all"
        for row, rank in zip(rows, self.ranks, strict=True):
            row["kept others waiting ms"] = self.caused_wait_ms.get(rank.rank, 0.0)
        total["kept others waiting ms"] = math.fsum(self.caused_wait_ms.values())
        return [*rows, total]

    def collective_rows(self) -> list[dict[str, Any]]:
        """Collectives grouped by (group, name, size): calls per step, bandwidth, waits per rank."""
        groups: dict[tuple[str, str, float], list[Collective]] = defaultdict(list)
        for c in self.collectives:
            groups[(c.group, c.name, c.nbytes)].append(c)
        rows = []
        for (group, name, nbytes), members in groups.items():
            transfer = math.fsum(c.transfer_ns for c in members) / len(members)
            row: dict[str, Any] = {
                "group": group,
                "collective": name,
                "MB": nbytes / 1e6,
                "calls per step": len(members) / self.steps,
                "transfer ms": transfer / 1e6,
                "busbw GB/s": math.fsum(c.nbytes for c in members)
                / (transfer * len(members) * 1e-9)
                * bus_factor(name, members[0].group_size)
                / 1e9
                if transfer > 0
                else math.nan,
            }
            for rank in sorted(members[0].calls):
                row[f"wait ms r{rank}"] = math.fsum(c.waits_ns()[rank] for c in members) / 1e6 / self.steps
            lasts = [c.last_rank for c in members]
            row["last most often"] = max(set(lasts), key=lasts.count) if len(members[0].calls) > 1 else "-"
            rows.append(row)
        return rows

    def format(self, markdown: bool | None = None) -> str:
        """The per-rank table, a line naming the straggler, and the per-collective table."""
        steps = f"per step, mean of {self.steps} steps" if self.steps > 1 else "per step"
        device = self.ranks[0].device if self.ranks else ""
        parts = [format_table(self.rows(), markdown, title=f"Communication ({device}, {steps})")]
        straggler = self.straggler
        if straggler is not None:
            parts.append(
                f"Straggler: rank {straggler} (the others waited {self.caused_wait_ms[straggler]:.3g} ms "
                "per step for it to arrive)."
            )
        if self.unmatched:
            parts.append(
                "Unmatched: "
                + ", ".join(f"rank {r} has {n}" for r, n in sorted(self.unmatched.items()))
                + " collective(s) that not every rank's trace holds (in flight when tracing stopped, or "
                "traces of different steps); they count in communication time, not in the waits."
            )
        parts.append(format_table(self.collective_rows(), markdown, title="Collectives"))
        return "\n\n".join(parts)


def _align(timelines: Sequence[RankTimeline]) -> tuple[list[Collective], dict[int, int]]:
    """Match the k-th collective of each kind in each group across ranks, as far as every rank has one.

    By kind, not by position among all of a group's collectives: every rank issues them in the same
    order, but gloo runs asynchronous ones on a pool of threads, so a broadcast can start before an
    all-gather issued ahead of it on one rank and after it on another. Returns the matched collectives
    and, per rank, how many of its collectives had no partner on every rank (one in flight when the
    trace stopped, or traces of different steps).
    """
    per_rank: dict[int, dict[tuple[str, str], list[CollectiveCall]]] = {}
    for t in timelines:
        kinds: dict[tuple[str, str], list[CollectiveCall]] = defaultdict(list)
        for call in t.collectives:
            kinds[(call.group, call.name)].append(call)
        per_rank[t.rank] = kinds
    collectives = []
    unmatched: dict[int, int] = defaultdict(int)
    for group, name in sorted({key for kinds in per_rank.values() for key in kinds}):
        counts = {rank: len(kinds.get((group, name), [])) for rank, kinds in per_rank.items()}
        common = min(counts.values())
        for rank, count in counts.items():
            unmatched[rank] += count - common
        for k in range(common):
            calls = {rank: kinds[(group, name)][k] for rank, kinds in per_rank.items()}
            first = next(iter(calls.values()))
            nbytes = max(c.nbytes for c in calls.values())
            collectives.append(Collective(k, name, group, nbytes, first.group_size, calls))
    ordered = sorted(collectives, key=lambda c: min(call.start_ns for call in c.calls.values()))
    return ordered, {rank: n for rank, n in unmatched.items() if n}


def _clock_offsets(documents: Sequence[Mapping[str, Any]]) -> list[float]:
    """ns to add to each trace's times to put them on one clock (traces store times from a base)."""
    bases = [float(d.get("baseTimeNanoseconds", 0)) for d in documents]
    low = min(bases, default=0.0)
    return [b - low for b in bases]


def analyze_comm(traces: Sequence[str | Path | Mapping[str, Any]]) -> CommReport:
    """Compute, communication, exposed communication, overlap and waits per rank, from one trace per rank.

    ``traces`` are paths (a directory stands for its ``*.json*`` files) or loaded documents; with one
    trace the waits are zero and no straggler is named. Times are ms per step.
    """
    paths_or_docs: list[Any] = []
    for t in traces:
        paths_or_docs += trace_files([t]) if isinstance(t, (str, Path)) else [t]
    if not paths_or_docs:
        raise ValueError("traces is empty: give one trace per rank")
    documents = [d if isinstance(d, Mapping) else load_trace(d) for d in paths_or_docs]
    offsets = _clock_offsets(documents)
    timelines = [
        read_timeline(d, i, offset) for i, (d, offset) in enumerate(zip(documents, offsets, strict=True))
    ]
    ranks = [t.rank for t in timelines]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two traces claim the same rank: {ranks}")
    steps = timelines[0].steps
    collectives, unmatched = _align(timelines)
    waits: dict[int, float] = defaultdict(float)
    caused: dict[int, float] = defaultdict(float)
    for c in collectives:
        rank_waits = c.waits_ns()
        for rank, wait in rank_waits.items():
            waits[rank] += wait
        caused[c.last_rank] += max(rank_waits.values())
    results = [_rank_comm(t, waits[t.rank]) for t in sorted(timelines, key=lambda t: t.rank)]
    return CommReport(results, collectives, steps, {r: caused[r] / 1e6 / steps for r in ranks}, unmatched)


def _rank_comm(t: RankTimeline, wait_ns: float) -> RankComm:
    comm = merge((c.start_ns, c.end_ns) for c in t.collectives)
    compute = merge(t.compute)
    comm_ns = length(comm)
    exposed_ns = comm_ns - intersect(comm, compute)
    per_step = 1e6 * t.steps
    return RankComm(
        t.rank,
        t.device,
        t.step_ns / per_step,
        length(compute) / per_step,
        comm_ns / per_step,
        exposed_ns / per_step,
        wait_ns / per_step,
        len(t.collectives) / t.steps,
        math.fsum(c.nbytes for c in t.collectives) / t.steps,
    )
