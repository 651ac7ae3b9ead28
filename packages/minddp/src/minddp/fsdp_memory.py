"""What one rank holds of a sharded model, from the sizes of its tensors (no allocator needed: CPU too)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def memory_report(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds: ``parameters``, ``gradients``, ``optimizer_state`` (the local parts of DTensors,
    whole plain tensors), ``padding`` (the flat shards' chunk padding), ``gathered`` (full parameters now
    all-gathered) and ``total``. Under ``fully_shard`` the first three are 1/N of the model's, vectors
    included."""
    from minddp.fully_shard import FSDPModule

    params = list(module.parameters())
    state: list[torch.Tensor] = []
    if optimizer is not None:
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    groups = [
        m._fsdp_state.group
        for m in module.modules()
        if isinstance(m, FSDPModule) and m._fsdp_state.group is not None
    ]
    report = {
        "parameters": _local_bytes(params),
        "gradients": _local_bytes(p.grad for p in params),
        "optimizer_state": _local_bytes(t for t in state if t.dim() > 0),
        "padding": sum(g.flat.nbytes for g in groups)
        - _local_bytes(i.param for g in groups for i in g.params),
        "gathered": sum(g.gathered_nbytes for g in groups),
    }
    report["total"] = sum(report.values())
    return report


def _local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            local = t._local_tensor if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total
