"""Strategies that communicate after the backward pass: simple, and every byte of it exposed."""

from __future__ import annotations

import math

from minddp.base import DataParallel


class NaiveDDP(DataParallel):
    """One all-reduce per parameter, all issued when backward has computed every gradient.

    Takes torch DDP's arguments (see :class:`~minddp.base.DataParallel`).
    """

    bucket_limits = (0,)


class FlatDDP(DataParallel):
    """All gradients in one flat buffer (per device and dtype), all-reduced once after backward.

    One call instead of one per parameter saves the per-call overhead, at the price of waiting
    for the whole backward pass before any byte moves (and, without ``gradient_as_bucket_view``,
    of a copy in and out). Takes torch DDP's arguments (see :class:`~minddp.base.DataParallel`).
    """

    bucket_limits = (math.inf,)
