"""Communication, exposed communication and overlap of a training step, from per-rank traces.

The experiments time their steps as before, then trace a few more with :func:`profkit.trace` on
every rank; rank 0 reads all ranks' traces (gathered over the process group, so ranks need no
shared disk) with :func:`profkit.analyze_comm`. What is reported is measured on the timeline:
the time a collective runs while no compute does (exposed), never a difference of two step times,
so it cannot come out negative.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

import profkit
from profkit.comm import CommReport
from profkit.timing import Step


def metrics(report: CommReport) -> dict[str, Any]:
    """compute, comm, exposed comm and wait ms per step (mean over the ranks), overlap % (from the ranks'
    sums), bus bandwidth (GB/s) and the straggler."""
    ranks = len(report.ranks)
    total = report.total()
    return {
        "compute ms": total.compute_ms / ranks,
        "comm ms": total.comm_ms / ranks,
        "exposed comm ms": total.exposed_ms / ranks,
        "overlap %": total.overlap_pct,
        "wait ms": total.wait_ms / ranks,
        "busbw GB/s": report.bus_bandwidth() / 1e9,
        "straggler": "-" if report.straggler is None else f"rank {report.straggler}",
    }


def trace_comm(step: Step, label: str, steps: int, trace_dir: str | Path | None = None) -> dict[str, Any]:
    """Trace ``steps`` calls of ``step(phase)`` on every rank and return :func:`metrics` on every rank.

    Traces are kept in ``trace_dir`` (as ``<label>_rank<r>.json.gz``, to open in Perfetto) when given.
    ``step`` must leave no asynchronous collective in flight when it returns (see :func:`profkit.trace`).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    name = re.sub(r"[^A-Za-z0-9.]+", "_", label).strip("_")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(trace_dir) if trace_dir is not None else Path(scratch)
        path = profkit.trace(step, path=folder / f"{name}_rank{{rank}}.json.gz", warmup=0, steps=steps)
        document = profkit.load_trace(path)
    if world == 1:
        return metrics(profkit.analyze_comm([document]))
    documents: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(document, documents, dst=0)
    result = [metrics(profkit.analyze_comm(documents)) if documents is not None else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]

