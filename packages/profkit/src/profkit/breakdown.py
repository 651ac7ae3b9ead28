"""What the peak memory is made of: parameters, gradients, optimizer state, activations, other.

    with profkit.record_memory_history("step.pickle"):
        train_step()                                   # leave the gradients in place for the pointers
    print(profkit.memory_breakdown("step.pickle", model=model, optimizer=optimizer).format())

From a snapshot, the blocks live at the peak of the active memory timeline (the one
:func:`profkit.render_memory_timeline` draws) are sorted, first by address, then by the stack that
allocated them:

1. **parameters**, **gradients**, **optimizer state**: the block holds the storage of one of
   ``model``'s parameters, of their ``.grad``, or of a tensor in ``optimizer.state``, matched by
   ``untyped_storage().data_ptr()`` (so views into a flat buffer, such as DDP's gradient buckets,
   count with their buffer). Pointers are those of the tensors when the breakdown is made: gradients
   set to None since, or state of an optimizer built afresh, are not matched this way.
2. **optimizer state** also: blocks allocated by an optimizer's ``_init_group`` (where torch's
   optimizers create their state lazily, on their first step).
3. **activations**: blocks allocated under a ``forward`` frame (a module's forward) still live at the
   peak, which is what autograd saved for the backward pass (and the forward's live outputs).
4. **gradients** also: blocks allocated by the backward pass (under a ``backward`` frame, or with no
   Python frames, which is what autograd's device threads record): parameter gradients not matched
   by pointer and activation gradients alive at the peak.
5. **other**: everything else (inputs, temporaries outside these, communication buffers, blocks
   allocated before recording that no pointer matched).

Without a snapshot (on a CPU, where there is no allocator history) the breakdown is the sizes of
the model's parameters and gradients and the optimizer's state, each distinct storage counted once;
activations and other are unknown (NaN), and so is the peak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from profkit.memory import BEFORE_RECORDING, Allocation, load_snapshot, read_trace
from profkit.tables import format_table

__all__ = ["CATEGORIES", "MemoryBreakdown", "memory_breakdown"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "other")


@dataclass
class MemoryBreakdown:
    """Bytes per category (:data:`CATEGORIES`) at the peak; ``source`` says how they were found."""

    bytes: dict[str, float]
    peak_bytes: float
    source: str  # "snapshot" or "tensor sizes"
    blocks: dict[str, int] = field(default_factory=dict)  # live blocks per category (snapshot only)

    def rows(self) -> list[dict[str, Any]]:
        """One row per category: MB, share of the peak, blocks; then the total."""
        rows = []
        for category in CATEGORIES:
            size = self.bytes.get(category, math.nan)
            rows.append({"category": category, "MB": size / 1e6,
                         "% of peak": 100 * size / self.peak_bytes if self.peak_bytes > 0 else math.nan,
                         "blocks": self.blocks.get(category, "-")})
        known = math.fsum(v for v in self.bytes.values() if not math.isnan(v))
        total = self.peak_bytes if not math.isnan(self.peak_bytes) else known
        rows.append({"category": "peak" if self.source == "snapshot" else "total (known)", "MB": total / 1e6,
                     "% of peak": 100.0 if self.peak_bytes > 0 else math.nan,
                     "blocks": sum(self.blocks.values()) if self.blocks else "-"})
        return rows

    def format(self, markdown: bool | None = None) -> str:
        title = ("Memory at the peak, by category (snapshot)" if self.source == "snapshot"
                 else "Memory by category (tensor sizes, held now)")
        return format_table(self.rows(), markdown, title=title)


def _storages(tensors: Iterable[Any]) -> Iterator[torch.Tensor]:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
            yield local


def _pointers(tensors: Iterable[Any]) -> dict[int, int]:
    """Storage address -> storage bytes of the distinct storages among ``tensors``."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _storages(tensors)}


def _tensor_groups(model: nn.Module | None,
                   optimizer: torch.optim.Optimizer | None) -> dict[str, dict[int, int]]:
    params = list(model.parameters()) if model is not None else []
    state = [v for s in optimizer.state.values() for v in s.values()] if optimizer is not None else []
    return {"parameters": _pointers(params), "gradients": _pointers(p.grad for p in params),
            "optimizer state": _pointers(state)}


def _names(frames: Iterable[dict[str, Any]]) -> list[str]:
    return [str(f.get("name", "")) for f in frames if str(f.get("filename", "")).endswith(".py")]


def category_of_stack(block: Allocation) -> str:
    """The category a block's allocating stack suggests (rules 2-5 of the module's docstring)."""
    if block.label == BEFORE_RECORDING:
        return "other"
    names = _names(block.frames)
    if "_init_group" in names:
        return "optimizer state"
    if not names or "backward" in names:  # no Python frames: autograd's device threads
        return "gradients"
    if "forward" in names:
        return "activations"
    return "other"


def _live_at_peak(allocations: list[Allocation], events: int) -> tuple[list[Allocation], float]:
    delta = np.zeros(events + 2)
    for a in allocations:
        delta[a.start] += a.size
        delta[a.end] -= a.size
    total = np.cumsum(delta[:-1])
    peak = int(total.argmax()) if total.size else 0
    return [a for a in allocations if a.start <= peak < a.end], float(total.max()) if total.size else 0.0


def memory_breakdown(snapshot: dict[str, Any] | str | Path | None = None, model: nn.Module | None = None,
                     optimizer: torch.optim.Optimizer | None = None,
                     device: int | None = None) -> MemoryBreakdown:
    """The peak memory by category, from a snapshot (dict or pickle path) or, without one, tensor sizes.

    ``model`` and ``optimizer`` (for a wrapper that shards the state, the optimizer that holds this
    rank's: ``ZeroRedundancyOptimizer.optim``) sort blocks by pointer; ``device`` picks the snapshot's
    device (default: the one with the most events). See the module docstring for the rules.
    """
    groups = _tensor_groups(model, optimizer)
    if snapshot is None:
        if model is None and optimizer is None:
            raise ValueError("memory_breakdown needs a snapshot, or a model and/or optimizer to measure")
        sizes: dict[str, float] = {name: float(sum(ptrs.values())) for name, ptrs in groups.items()}
        return MemoryBreakdown(sizes | {"activations": math.nan, "other": math.nan}, math.nan, "tensor sizes")
    if not isinstance(snapshot, dict):
        snapshot = load_snapshot(snapshot)
    trace = read_trace(snapshot, device)
    live, peak = _live_at_peak(trace.allocations, trace.events)
    owner = {ptr: name for name in ("parameters", "optimizer state", "gradients") for ptr in groups[name]}
    sizes = dict.fromkeys(CATEGORIES, 0.0)
    blocks = dict.fromkeys(CATEGORIES, 0)
    for block in live:
        category = owner.get(block.address) or category_of_stack(block)
        sizes[category] += block.size
        blocks[category] += 1
    return MemoryBreakdown(sizes, peak, "snapshot", blocks)
