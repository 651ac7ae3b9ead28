"""Strategies that communicate after the backward pass: simple, and every byte of it exposed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from minddp.base import DataParallel


class NaiveDDP(DataParallel):
    """One all-reduce per parameter, all issued when backward has computed every gradient.

    Takes torch DDP's arguments (see :class:`~minddp.base.DataParallel`).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, *,
                 process_group: dist.ProcessGroup | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True) -> None:
        super().__init__(module, device_ids, output_device, process_group=process_group,
                         broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                         gradient_as_bucket_view=gradient_as_bucket_view,
                         max_bucket_bytes=0, first_bucket_bytes=None, overlap=False)


class FlatDDP(DataParallel):
    """All gradients in one flat buffer (per device and dtype), all-reduced once after backward.

    One call instead of one per parameter saves the per-call overhead, at the price of waiting
    for the whole backward pass before any byte moves (and, without ``gradient_as_bucket_view``,
    of a copy in and out). Takes torch DDP's arguments (see :class:`~minddp.base.DataParallel`).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, *,
                 process_group: dist.ProcessGroup | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True) -> None:
        super().__init__(module, device_ids, output_device, process_group=process_group,
                         broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                         gradient_as_bucket_view=gradient_as_bucket_view,
                         max_bucket_bytes=math.inf, first_bucket_bytes=None, overlap=False)
