"""Strategies that hide communication behind the backward pass: all-reduces launched from gradient hooks.

Gradients are grouped into buckets in reverse parameter order (roughly the order backward
produces them). A post-accumulate-grad hook counts each bucket's arrivals, and buckets are
launched strictly in bucket order, each as soon as it and every bucket before it are complete.
So every rank issues the same all-reduces in the same order even when autograd's order or the
set of used parameters differs between ranks; buckets still incomplete when backward ends (a
parameter got no gradient) are launched by ``finish_gradient_synchronization``, in bucket order.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.distributed as dist
from torch import nn

from minddp.base import DataParallel, group_by_size

MiB = 2**20
FIRST_BUCKET_MB = 1.0
# Each gradient view starts on a 128-byte boundary of its bucket so vectorized optimizer kernels stay fast.
_ALIGN_BYTES = 128


class _Bucket:
    """Parameters all-reduced together, and where this step stands.

    A bucket of several parameters owns a flat buffer and their ``.grad`` are views into it
    (as with torch DDP's ``gradient_as_bucket_view``): after the first step autograd
    accumulates straight into the buffer. A bucket of one contiguous parameter all-reduces
    that parameter's gradient itself: nothing to copy at all.
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], indices: list[int]) -> None:
        self.params, self.names, self.indices = params, names, indices
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if len(params) > 1 or not params[0].is_contiguous():
            self.buffer, self.views = _flat_buffer(params)
        self.waiting = set(range(len(params)))  # slots whose gradient has not arrived this step
        self.reduced: list[torch.Tensor] = []  # per parameter, the tensor being averaged this step
        self.work: dist.Work | None = None

    def gather_grads(self) -> torch.Tensor:
        """The tensor to all-reduce: gradients moved into the buffer, or the lone gradient (zeros if none)."""
        if self.buffer is None:
            p = self.params[0]
            self.reduced = [p.grad if p.grad is not None else torch.zeros_like(p)]
            return self.reduced[0]
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view.zero_()  # no gradient here: count it as zero, but leave .grad None until finish
            elif p.grad.data_ptr() != view.data_ptr():
                # The first step, or after zero_grad(set_to_none=True): one copy, then .grad is the view.
                view.copy_(p.grad)
                p.grad = view
        self.reduced = self.views
        return self.buffer

    def reset(self) -> None:
        self.waiting = set(range(len(self.params)))
        self.reduced = []
        self.work = None


def _flat_buffer(params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zeroed buffer holding every parameter's gradient, and each one's view of it, shaped like it."""
    align = max(1, _ALIGN_BYTES // params[0].element_size())
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end += math.ceil(p.numel() / align) * align
    buffer = torch.zeros(end, dtype=params[0].dtype, device=params[0].device)
    views = [buffer[offset:offset + p.numel()].view(p.shape)
             for offset, p in zip(offsets, params, strict=True)]
    return buffer, views


class _OverlappedDDP(DataParallel):
    """Buckets of at most ``max_bucket_bytes``, each all-reduced asynchronously once complete."""

    def __init__(self, module: nn.Module, max_bucket_bytes: float, first_bucket_bytes: float | None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(module, process_group)
        index = {id(p): i for i, p in enumerate(self._params)}
        names = [n for n, _ in self._named_params]
        groups = group_by_size(self._params[::-1], max_bucket_bytes, first_bucket_bytes)
        self._buckets = [_Bucket(group, [names[index[id(p)]] for p in group], [index[id(p)] for p in group])
                         for group in groups]
        self._next_to_launch = 0
        # The hooks hold the wrapper weakly, and go away with it: a dropped wrapper leaves no hooks behind.
        this = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, this, b, slot))
                   for b, bucket in enumerate(self._buckets) for slot, p in enumerate(bucket.params)]
        weakref.finalize(self, _remove_hooks, handles)

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        return [list(bucket.names) for bucket in self._buckets]

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_enabled:
            return
        for bucket in self._buckets[self._next_to_launch:]:
            self._launch(bucket)
        used = self._used_on_any_rank()
        for bucket in self._buckets:
            bucket.work.wait()
            for i, averaged in zip(bucket.indices, bucket.reduced, strict=True):
                if used[i] and self._params[i].grad is None:
                    self._params[i].grad = averaged
            bucket.reset()
        self._next_to_launch = 0

    def _on_grad_ready(self, bucket_index: int, slot: int) -> None:
        if not self._sync_enabled:
            return
        bucket = self._buckets[bucket_index]
        if slot not in bucket.waiting:
            raise RuntimeError(
                f"parameter {bucket.names[slot]!r} got a second gradient before "
                "finish_gradient_synchronization(); for several backward passes per step, "
                "run all but the last inside no_sync()")
        bucket.waiting.remove(slot)
        while self._next_to_launch < len(self._buckets) and not self._buckets[self._next_to_launch].waiting:
            self._launch(self._buckets[self._next_to_launch])

    def _launch(self, bucket: _Bucket) -> None:
        bucket.work = self._all_reduce_mean(bucket.gather_grads(), async_op=True)
        self._next_to_launch += 1


def _grad_ready(wrapper: weakref.ref[_OverlappedDDP], bucket_index: int, slot: int,
                _param: torch.Tensor) -> None:
    ddp = wrapper()
    if ddp is not None:
        ddp._on_grad_ready(bucket_index, slot)


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


class OverlapDDP(_OverlappedDDP):
    """One asynchronous all-reduce per parameter, launched by its post-accumulate-grad hook.

    Communication overlaps the rest of backward; each call pays the per-call overhead, so many
    small parameters make it slow (see :class:`BucketedDDP`).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(module, max_bucket_bytes=0, first_bucket_bytes=None, process_group=process_group)


class BucketedDDP(_OverlappedDDP):
    """Gradients grouped in reverse parameter order into buckets of at most ``bucket_size_mb``,
    each all-reduced asynchronously as soon as its last gradient arrives.

    A parameter larger than the bucket size gets a bucket of its own. As in torch DDP, the first
    bucket holds at most 1 MiB, so communication starts with backward's first gradients rather
    than after a bucket's worth of them. ``bucket_size_mb`` is in MiB (2**20 bytes, as torch
    DDP's ``bucket_cap_mb``); ``None`` puts every gradient in one bucket, ``0`` every parameter
    in its own.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0,
                 process_group: dist.ProcessGroup | None = None) -> None:
        if bucket_size_mb is not None and not (isinstance(bucket_size_mb, (int, float))
                                               and 0 <= bucket_size_mb < math.inf):
            raise ValueError(
                f"bucket_size_mb must be a non-negative number of MiB or None, got {bucket_size_mb!r}")
        if bucket_size_mb is None:
            super().__init__(module, math.inf, None, process_group)
        else:
            cap = bucket_size_mb * MiB
            super().__init__(module, cap, min(cap, FIRST_BUCKET_MB * MiB), process_group)
        self.bucket_size_mb = bucket_size_mb
