"""What every data-parallel wrapper shares: checks, the initial broadcast, no_sync and averaging.

Every collective here is issued in the same order on every rank; anything that could make one
rank raise while another goes on to the next collective is first agreed on by all ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

# Backends whose all-reduce can average in place (ReduceOp.AVG); the others get a pre-scaled SUM.
_BACKENDS_WITH_AVG = {"nccl"}
_BROADCAST_CHUNK_BYTES = 256 * 2**20
T = TypeVar("T", bound=torch.Tensor)


class DataParallel(nn.Module):
    """Base class of the minddp wrappers: ``module`` replicated on every rank of ``process_group``.

    At construction it checks that every rank holds the same parameters and buffers (names,
    shapes, dtypes, ``requires_grad``) on devices the group's backend can serve, then copies
    rank 0's parameters and buffers to every rank. Subclasses decide when gradients are
    communicated; after :meth:`finish_gradient_synchronization` every ``.grad`` holds the
    average over the ranks.

    Args:
        module: the model; its forward is called unchanged.
        process_group: the group to average over (default: the default group).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__} needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up its environment)")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        if self.rank < 0:
            raise ValueError("process_group: this rank is not a member of the given process group")
        self.world_size = dist.get_world_size(self.process_group)
        self._backends = _backend_per_device_type(self.process_group)
        # parameters() yields a tied tensor once, so tied parameters are communicated once.
        self._named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named_params]
        self._sync_enabled = True
        self._check_same_model_on_every_rank()
        self._broadcast_from_rank0([*module.parameters(), *module.buffers()])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronized step averages the sum.

        Inside, :meth:`finish_gradient_synchronization` does nothing.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient all-reduces; afterwards every ``.grad`` is the average over the ranks.

        Call it after ``backward()`` and before ``optimizer.step()``. A parameter that got no gradient
        on some rank counts as a zero gradient there; one that got no gradient on any rank keeps
        ``grad=None``, as it would without data parallelism.
        """
        raise NotImplementedError

    # --- helpers for the strategies ----------------------------------------------------------

    def _all_reduce_mean(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """All-reduce ``tensor`` in place to the mean over the ranks (AVG where the backend has it)."""
        if self._backends.get(tensor.device.type) in _BACKENDS_WITH_AVG:
            op = dist.ReduceOp.AVG
        else:
            if self.world_size > 1:
                tensor.div_(self.world_size)
            op = dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=op, group=self.process_group, async_op=async_op)

    def _grads_or_zeros(self) -> list[torch.Tensor]:
        """Each parameter's gradient, or zeros (a new tensor) where it has none on this rank."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]

    def _set_grads_used_anywhere(self, averaged: Sequence[torch.Tensor]) -> None:
        """Make ``averaged`` the parameters' gradients, except where no rank had a gradient (those stay None).

        Its one all-reduce (gradient counts) comes after the gradients' own, on every rank.
        """
        for p, grad, used in zip(self._params, averaged, self._used_on_any_rank(), strict=True):
            if used and p.grad is not grad:
                p.grad = grad

    def _used_on_any_rank(self) -> list[bool]:
        """For each parameter, whether some rank holds a gradient for it now. One all-reduce on every rank.

        The counts are read back (a device synchronization) only on a rank that lacks a gradient
        itself: elsewhere every parameter has a gradient, so every one is used somewhere.
        """
        local = [p.grad is not None for p in self._params]
        if not self._params:
            return local
        device = self._params[0].device
        counts = torch.tensor(local, dtype=torch.int32, pin_memory=device.type == "cuda")
        counts = counts.to(device, non_blocking=True)
        dist.all_reduce(counts, group=self.process_group)
        if all(local):
            return local
        return (counts > 0).tolist()

    # --- construction ------------------------------------------------------------------------

    def _check_same_model_on_every_rank(self) -> None:
        """Raise the same error on every rank if any rank's model differs from rank 0's or sits on a
        device the backend cannot serve (one all_gather_object, so no rank is left waiting)."""
        problem = self._local_device_problem()
        signature = [(f"parameter {n!r}", tuple(p.shape), str(p.dtype), p.requires_grad)
                     for n, p in self.module.named_parameters()]
        signature += [(f"buffer {n!r}", tuple(b.shape), str(b.dtype), False)
                      for n, b in self.module.named_buffers()]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (problem, signature), group=self.process_group)
        for rank, (rank_problem, _) in enumerate(gathered):
            if rank_problem:
                raise ValueError(f"rank {rank}: {rank_problem}")
        reference = gathered[0][1]
        for rank, (_, rank_signature) in enumerate(gathered[1:], start=1):
            mismatch = _first_difference(reference, rank_signature, rank)
            if mismatch:
                raise ValueError(f"module: {mismatch}; every rank must build the same model")

    def _local_device_problem(self) -> str | None:
        tensors = [*self.module.named_parameters(), *self.module.named_buffers()]
        for name, tensor in tensors:
            if self._backends and tensor.device.type not in self._backends:
                served = ", ".join(f"{d} ({b})" for d, b in self._backends.items())
                return (f"module: {name!r} is on device {tensor.device}, which the process group's "
                        f"backend cannot serve (it serves {served}); move the module to a served device "
                        "(e.g. model.to(f'cuda:{local_rank}') for NCCL) before wrapping it")
        return None

    def _broadcast_from_rank0(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy rank 0's values into ``tensors``, small ones coalesced into flat broadcasts of <= 256 MiB."""
        source = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for group in group_by_size(list(tensors), _BROADCAST_CHUNK_BYTES):
                if len(group) == 1 and group[0].is_contiguous():
                    dist.broadcast(group[0], src=source, group=self.process_group)
                    continue
                flat = torch.cat([t.reshape(-1) for t in group])
                dist.broadcast(flat, src=source, group=self.process_group)
                for t, chunk in zip(group, flat.split([t.numel() for t in group]), strict=True):
                    t.copy_(chunk.view_as(t))


def group_by_size(tensors: Sequence[T], max_bytes: float,
                  first_max_bytes: float | None = None) -> list[list[T]]:
    """Consecutive runs of ``tensors`` of one device and dtype holding at most ``max_bytes`` each.

    A tensor larger than the limit forms a group of its own; ``max_bytes=0`` gives one group per
    tensor and ``math.inf`` one group per (device, dtype) run. ``first_max_bytes`` limits the
    first group instead, where given.
    """
    groups: list[list[T]] = []
    group_bytes = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        current = groups[-1] if groups else None
        limit = first_max_bytes if first_max_bytes is not None and len(groups) == 1 else max_bytes
        if (current is None or (t.device, t.dtype) != (current[0].device, current[0].dtype)
                or group_bytes + size > limit):
            groups.append([t])
            group_bytes = size
        else:
            current.append(t)
            group_bytes += size
    return groups


def _backend_per_device_type(group: dist.ProcessGroup) -> dict[str, str]:
    """{'cpu': 'gloo', 'cuda': 'gloo'} for gloo, {'cuda': 'nccl'} for NCCL, from the group's backend config.

    Empty where the config does not say (a third-party backend): then no device is refused here
    and the backend raises its own error.
    """
    items = (item.split(":", 1) for item in str(dist.get_backend_config(group)).split(",") if ":" in item)
    return {device.strip(): backend.strip() for device, backend in items}


def _first_difference(reference: Sequence[tuple], other: Sequence[tuple], rank: int) -> str | None:
    """The first entry of two model signatures (name, shape, dtype, requires_grad) that differs."""
    for ref, oth in zip(reference, other, strict=False):  # the lengths are compared below
        if ref[0] != oth[0]:
            return f"rank 0 has {ref[0]} where rank {rank} has {oth[0]}"
        if ref[1:] != oth[1:]:
            return (f"{ref[0]} has shape {ref[1]}, {ref[2]}, requires_grad={ref[3]} on rank 0 but "
                    f"shape {oth[1]}, {oth[2]}, requires_grad={oth[3]} on rank {rank}")
    if len(reference) != len(other):
        longer, owner = (reference, "rank 0") if len(reference) > len(other) else (other, f"rank {rank}")
        return f"only {owner} has {longer[min(len(reference), len(other))][0]}"
    return None
