"""FSDP's two collectives on flat buffers: all-gather of shards, and reduce-scatter of gradients to a mean.

Each has one flat form (``all_gather_single``/``reduce_scatter_single`` where torch has them, else
``all_gather_into_tensor``/``reduce_scatter_tensor``) and a fallback for backends that lack it (gloo
on some torch versions): an all-gather into a list of views, or an all-reduce whose result is
sliced. Whether the flat form works is found out once per group, by trying it on a tiny tensor,
on every rank in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Backends whose reductions average in place (ReduceOp.AVG); the others sum and divide afterwards.
_BACKENDS_WITH_AVG = {"nccl"}


class PendingReduce:
    """A reduce-scatter in flight; :meth:`wait` returns this rank's shard of the mean."""

    def __init__(self, work: dist.Work | None, source: torch.Tensor, result: torch.Tensor,
                 divide_by: int) -> None:
        self._work = work
        self._source = source  # the collective reads it until done
        self._result = result
        self._divide_by = divide_by

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        self._source = None
        return self._result.div_(self._divide_by) if self._divide_by > 1 else self._result


class FlatCollectives:
    """All-gather and mean-reduce-scatter of 1-D tensors whose length is a multiple of the group size."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self._average_in_place = _backend_for(group, device) in _BACKENDS_WITH_AVG
        self._flat_gather = self._works(self._try_flat_gather)
        self._flat_reduce = self._works(self._try_flat_reduce)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> dist.Work | None:
        """Fill ``full`` with every rank's ``shard``, in rank order."""
        if self._flat_gather:
            return _all_gather_flat(full, shard, group=self.group, async_op=async_op)
        return dist.all_gather(list(full.chunk(self.world_size)), shard, group=self.group, async_op=async_op)

    def reduce_scatter_mean(self, full: torch.Tensor) -> PendingReduce:
        """Start averaging ``full`` over the ranks; the pending result is this rank's 1/N slice of the mean.

        ``full`` must stay untouched until the result is waited for (the fallback writes into it).
        """
        if self.world_size == 1:
            return PendingReduce(None, full, full, 1)
        op = dist.ReduceOp.AVG if self._average_in_place else dist.ReduceOp.SUM
        divide_by = 1 if self._average_in_place else self.world_size
        if self._flat_reduce:
            shard = full.new_empty(full.numel() // self.world_size)
            work = _reduce_scatter_flat(shard, full, op=op, group=self.group, async_op=True)
            return PendingReduce(work, full, shard, divide_by)
        work = dist.all_reduce(full, op=op, group=self.group, async_op=True)
        return PendingReduce(work, full, full.chunk(self.world_size)[self.rank], divide_by)

    def all_reduce_mean(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` over the ranks, in place."""
        if self.world_size == 1:
            return
        op = dist.ReduceOp.AVG if self._average_in_place else dist.ReduceOp.SUM
        dist.all_reduce(tensor, op=op, group=self.group)
        if not self._average_in_place:
            tensor.div_(self.world_size)

    def _works(self, attempt: Callable[[], None]) -> bool:
        if self.world_size == 1:
            return True
        try:
            attempt()
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        return True

    def _try_flat_gather(self) -> None:
        probe = torch.zeros(self.world_size, device=self.device)
        _all_gather_flat(probe, probe[:1].clone(), group=self.group)

    def _try_flat_reduce(self) -> None:
        probe = torch.zeros(self.world_size, device=self.device)
        _reduce_scatter_flat(probe[:1].clone(), probe, group=self.group)


def _backend_for(group: dist.ProcessGroup, device: torch.device) -> str:
    """The backend serving ``device``'s tensors in ``group`` ('nccl', 'gloo', ...; '' if unknown)."""
    config = str(dist.get_backend_config(group))
    for item in config.split(","):
        device_type, _, backend = item.partition(":")
        if backend and device_type.strip() == device.type:
            return backend.strip()
    return config if ":" not in config else ""
