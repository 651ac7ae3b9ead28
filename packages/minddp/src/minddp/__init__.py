"""Small, readable data-parallel wrappers over torch.distributed, each a drop-in for torch's
DistributedDataParallel.

Four strategies for averaging gradients: naive, flat, overlapped and bucketed all-reduce;
and ``fully_shard`` (torch FSDP2's API), which shards parameters, gradients and optimizer state
(ZeRO stage 3), with the assignment's ``FSDP`` wrapper over it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from minddp.after_backward import FlatDDP, NaiveDDP
from minddp.base import DataParallel
from minddp.buckets import GradBucket
from minddp.fsdp import FSDP
from minddp.fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from minddp.fsdp_memory import memory_report
from minddp.fully_shard import FSDPModule, UnshardHandle, fully_shard
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


__all__ = ["FSDP", "STRATEGIES", "BucketedDDP", "CPUOffloadPolicy", "DataParallel", "FSDPModule", "FlatDDP",
           "GradBucket", "MixedPrecisionPolicy", "NaiveDDP", "OffloadPolicy", "OverlapDDP", "UnshardHandle",
           "fully_shard", "make_ddp", "memory_report", "__version__"]
