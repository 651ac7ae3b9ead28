"""Strategies that communicate after the backward pass: simple, and every byte of it exposed."""

from __future__ import annotations

import math

import torch

from minddp.base import DataParallel, group_by_size


class NaiveDDP(DataParallel):
    """One blocking all-reduce per parameter, all issued in :meth:`finish_gradient_synchronization`."""

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_enabled:
            return
        grads = self._grads_or_zeros()
        for grad in grads:
            self._all_reduce_mean(grad)
        self._set_grads_used_anywhere(grads)


class FlatDDP(DataParallel):
    """All gradients copied into one flat tensor (per device and dtype) and all-reduced once.

    One call instead of one per parameter saves the per-call overhead, at the price of a copy in
    and out and of waiting for the whole backward pass before any byte moves.
    """

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_enabled:
            return
        grads = self._grads_or_zeros()
        for group in group_by_size(grads, math.inf):
            flat = torch.cat([g.reshape(-1) for g in group])
            self._all_reduce_mean(flat)
            for grad, chunk in zip(group, flat.split([g.numel() for g in group]), strict=True):
                grad.copy_(chunk.view_as(grad))
        self._set_grads_used_anywhere(grads)
