"""Small, readable data-parallel wrappers over torch.distributed, each a drop-in for torch's
DistributedDataParallel.

Four strategies for averaging gradients: naive, flat, overlapped and bucketed all-reduce;
and FSDP, which shards parameters, gradients and optimizer state (ZeRO stage 3).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from minddp.after_backward import FlatDDP, NaiveDDP
from minddp.base import DataParallel
from minddp.buckets import GradBucket
from minddp.fsdp import FSDP
from minddp.overlapped import BucketedDDP, OverlapDDP

__version__ = "0.2.0"

STRATEGIES: dict[str, type[DataParallel]] = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": BucketedDDP,
}


def make_ddp(strategy: str, module: nn.Module, **kwargs: Any) -> DataParallel:
    """Wrap ``module`` with the strategy named ``strategy`` (a key of :data:`STRATEGIES`).

    ``kwargs`` go to the wrapper: torch DDP's keyword arguments for all, ``bucket_size_mb`` (or
    ``bucket_cap_mb``) for ``"bucketed"``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy](module, **kwargs)


__all__ = ["FSDP", "STRATEGIES", "BucketedDDP", "DataParallel", "FlatDDP", "GradBucket", "NaiveDDP",
           "OverlapDDP",
           "make_ddp", "__version__"]
