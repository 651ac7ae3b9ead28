"""Gradient buckets: the unit the wrappers communicate, and what a communication hook sees of one."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

# Each gradient view starts on a 128-byte boundary of its bucket so vectorized optimizer kernels stay fast.
_ALIGN_BYTES = 128


class GradBucket:
    """One bucket as a communication hook sees it: the methods of ``torch.distributed.GradBucket``.

    ``buffer()`` is the flat (1-D) tensor to reduce; ``gradients()`` are views of it shaped like
    ``parameters()``. A hook returns a ``torch.futures.Future`` whose value is the reduced flat
    tensor: the buffer itself, reduced in place, or a new tensor of as many elements and any
    floating dtype, which is copied back into the buffer.
    """

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[nn.Parameter], is_last: bool) -> None:
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._is_last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[nn.Parameter]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last


class Bucket:
    """Parameters reduced together, and the flat tensor that holds their gradients while they are reduced.

    A bucket of several parameters (or of one non-contiguous one) owns a flat buffer, allocated
    once, with a view of it per parameter. With ``gradient_as_bucket_view`` the views become the
    ``.grad`` (as in torch DDP): from then on autograd accumulates straight into the buffer and
    the average lands where the optimizer reads it. Without, gradients are copied in before and
    out after. A bucket of one contiguous parameter reduces that gradient in place: nothing to
    copy either way.
    """

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], indices: list[int],
                 gradient_as_bucket_view: bool) -> None:
        self.index, self.params, self.names, self.indices = index, params, names, indices
        self.as_view = gradient_as_bucket_view
        align = max(1, _ALIGN_BYTES // params[0].element_size())
        self.offsets = [0]
        for p in params[:-1]:
            self.offsets.append(self.offsets[-1] + math.ceil(p.numel() / align) * align)
        self.numel = self.offsets[-1] + params[-1].numel()
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if len(params) > 1 or not params[0].is_contiguous():
            self.buffer = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
            self.views = self.slices(self.buffer)
        self.remaining = len(params)  # gradients not yet arrived in this backward pass
        # The tensor being reduced now: the buffer, or the one parameter's gradient as it is.
        self.reduced: torch.Tensor | None = None
        self.pending: torch.futures.Future | torch.distributed.Work | None = None

    def slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (``numel`` elements) shaped like the parameters, at their offsets."""
        return [flat[o:o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params, strict=True)]

    def gather(self) -> torch.Tensor:
        """The tensor to reduce, holding every gradient (zeros where a parameter has none): the buffer, or
        the gradient of a bucket's one parameter (run once per bucket and step, so the second is quick)."""
        if self.buffer is None:
            grad = self.params[0].grad
            self.reduced = grad if grad is not None else torch.zeros_like(self.params[0])
            return self.reduced
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is view:  # autograd accumulated into the view (the same tensor object): nothing to do
                continue
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                # The first step, after zero_grad(set_to_none=True), or without gradient_as_bucket_view.
                view.copy_(grad)
                if self.as_view:
                    p.grad = view
        self.reduced = self.buffer
        return self.buffer

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's share of the tensor being reduced."""
        return self.views if self.buffer is not None else [self.reduced]

    def for_hook(self, reduced: torch.Tensor, is_last: bool) -> GradBucket:
        """This bucket as a communication hook sees it, with ``reduced`` (flattened) as its buffer."""
        return GradBucket(self.index, reduced.view(-1), self.grads() if reduced is self.reduced
                          else self.slices(reduced), self.params, is_last)

    def scatter(self, result: torch.Tensor, used: list[bool] | None) -> None:
        """Make the reduced ``result`` the gradients; a parameter without one gets it where ``used`` says so.

        ``used`` is indexed like the wrapper's parameters; ``None`` counts every parameter as used.
        """
        reduced = self.reduced
        if result is not reduced and (result.data_ptr() != reduced.data_ptr()
                                      or result.dtype != reduced.dtype):  # a hook's, not reduced in place
            if result.numel() != reduced.numel():
                raise ValueError(f"the communication hook returned {result.numel()} elements for bucket "
                                 f"{self.index} of {reduced.numel()} (parameters {', '.join(self.names)})")
            reduced.copy_(result.reshape(reduced.shape))
        for p, grad, index in zip(self.params, self.grads(), self.indices, strict=True):
            current = p.grad
            if current is grad:
                continue
            if current is None:
                if used is None or used[index]:
                    p.grad = grad if self.as_view or self.buffer is None else grad.clone()
            elif current.data_ptr() != grad.data_ptr():
                current.copy_(grad)
        self.reduced = self.pending = None


@dataclasses.dataclass
class _Filling:
    """The bucket of one device and dtype being filled, and how many of theirs were filled before it."""

    indices: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    closed: int = 0


def assign_buckets(tensors: Sequence[torch.Tensor], limits: Sequence[float]) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets by torch DDP's rule, in the order the buckets fill up.

    As ``torch.distributed._compute_bucket_assignment_by_size``: tensors of one device and dtype
    join that device and dtype's open bucket in order, and a bucket closes as soon as it holds at
    least its limit, so every bucket but the last of a device and dtype reaches the limit (a tensor
    larger than it ends its bucket). The n-th bucket of a device and dtype has limit ``limits[n]``,
    and the last limit serves for the rest: torch DDP's ``[1 MiB, bucket_cap_mb]`` makes the first
    bucket small. A limit of 0 gives one tensor per bucket, ``math.inf`` one bucket per device and
    dtype. Closed buckets come in the order they closed, then the open ones.
    """
    closed: list[list[int]] = []
    filling: dict[tuple[torch.device, torch.dtype], _Filling] = {}
    for i, t in enumerate(tensors):
        bucket = filling.setdefault((t.device, t.dtype), _Filling())
        bucket.indices.append(i)
        bucket.nbytes += t.numel() * t.element_size()
        if bucket.nbytes >= limits[min(bucket.closed, len(limits) - 1)]:
            closed.append(bucket.indices)
            bucket.indices, bucket.nbytes, bucket.closed = [], 0, bucket.closed + 1
    return closed + [bucket.indices for bucket in filling.values() if bucket.indices]


def assign_buckets_in_order(tensors: Sequence[torch.Tensor], order: Sequence[int],
                            limits: Sequence[float]) -> list[list[int]]:
    """Indices of ``tensors`` bucketed by :func:`assign_buckets`'s rule, taking the tensors in ``order``
    (every index once): reverse parameter order at construction, the order backward produced the
    gradients once it has run (torch DDP's rebuilt buckets)."""
    return [[order[i] for i in bucket] for bucket in assign_buckets([tensors[i] for i in order], limits)]
