"""Strategies that hide communication behind the backward pass: all-reduces launched from gradient hooks.

A post-accumulate-grad hook counts each bucket's arrivals, and buckets are launched strictly in
bucket order, each as soon as it and every bucket before it are complete (see
:mod:`minddp.reducer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from minddp.base import DataParallel, bucket_limits


class OverlapDDP(DataParallel):
    """One asynchronous all-reduce per parameter, launched by its post-accumulate-grad hook.

    Communication overlaps the rest of backward; each call pays the per-call overhead, so many
    small parameters make it slow (see :class:`BucketedDDP`). Takes torch DDP's arguments (see
    :class:`~minddp.base.DataParallel`).
    """

    bucket_limits = (0,)
    overlap = True


class _DefaultBucketSize(float):
    """25.0, marked as not given by the caller (so that giving ``bucket_cap_mb`` as well is no conflict)."""


DEFAULT_BUCKET_MB = _DefaultBucketSize(25.0)


class BucketedDDP(DataParallel):
    """Gradients grouped in reverse parameter order into buckets of ``bucket_size_mb``, each
    all-reduced asynchronously as soon as its last gradient arrives.

    Buckets follow torch DDP's rule: a bucket closes once it holds at least ``bucket_size_mb``,
    so each reaches the size but the last (a parameter larger than the size ends its bucket).
    With the default size, the first bucket closes at 1 MiB, as in torch DDP, so communication
    starts with backward's first gradients rather than after a bucket's worth of them; a size
    the caller gives applies to the first bucket too (torch does the same). ``bucket_size_mb``
    is in MiB (2**20 bytes); torch's name for it, ``bucket_cap_mb``, is accepted too (``None``
    there means the default, 25, as in torch). ``bucket_size_mb=None`` puts every gradient in
    one bucket, ``0`` every parameter in its own. Takes torch DDP's other arguments (see
    :class:`~minddp.base.DataParallel`).
    """

    overlap = True

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, *,
                 bucket_size_mb: float | None = DEFAULT_BUCKET_MB, bucket_cap_mb: float | None = None,
                 process_group: dist.ProcessGroup | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True) -> None:
        if bucket_cap_mb is not None:
            if not isinstance(bucket_size_mb, _DefaultBucketSize):
                raise ValueError(f"give bucket_size_mb ({bucket_size_mb!r}) or its torch name bucket_cap_mb "
                                 f"({bucket_cap_mb!r}), not both")
            self.bucket_limits = bucket_limits(bucket_cap_mb, "bucket_cap_mb", default=False)
            bucket_size_mb = bucket_cap_mb
        else:
            self.bucket_limits = bucket_limits(bucket_size_mb, "bucket_size_mb",
                                               default=isinstance(bucket_size_mb, _DefaultBucketSize))
        self.bucket_size_mb = None if bucket_size_mb is None else float(bucket_size_mb)
        super().__init__(module, device_ids, output_device, process_group=process_group,
                         broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                         gradient_as_bucket_view=gradient_as_bucket_view)

    def _config(self) -> dict[str, object]:
        return {**super()._config(), "bucket_size_mb": self.bucket_size_mb}
