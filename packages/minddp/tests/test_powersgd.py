"""torch's PowerSGD communication hook over several buckets, against torch DDP with the same hook and data.

PowerSGD issues its later all-reduces from its future's callbacks. gloo runs those on its own
threads when the previous all-reduce completes, so they raced with the next bucket's all-reduce,
in a different order on each rank: with several buckets both ranks stopped at the first
compressed step (``start_powerSGD_iter``) until the process-group timeout. torch DDP races the
same way on gloo, so its hook here waits for each bucket's future before returning, which is
what the wrappers now do themselves wherever a hook's future is not complete at launch.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from minddp import STRATEGIES, make_ddp

STEPS = 5
START_ITER = 2
# Each strategy's buckets, and torch DDP's bucket_cap_mb that gives the same ones: one per parameter, one
# bucket, or buckets of 104 bytes (mostly one parameter each, the biases two by two).
BUCKETS: dict[str, tuple[dict[str, Any], float]] = {
    "naive": ({}, 0), "overlap": ({}, 0), "flat": ({}, 25), "bucketed": ({"bucket_size_mb": 1e-4}, 1e-4)}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def powersgd_in_order(state: powersgd.PowerSGDState, bucket):  # no annotations: torch DDP checks them
    future = powersgd.powerSGD_hook(state, bucket)
    future.wait()  # see the module docstring: torch DDP on gloo would race otherwise
    return future


def train(wrap: Any, hook: Any, rank: int) -> list[list[float]]:
    torch.manual_seed(0)
    net = model()
    ddp = wrap(net)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=START_ITER)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in net.parameters()]


def powersgd_like_torch(rank: int, world_size: int) -> dict[str, Any]:
    results = {}
    for strategy, (kwargs, cap_mb) in BUCKETS.items():
        def torch_ddp(net: nn.Module, cap_mb: float = cap_mb) -> DistributedDataParallel:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return DistributedDataParallel(net, bucket_cap_mb=cap_mb)

        def ours(net: nn.Module, strategy: str = strategy, kwargs: dict = kwargs) -> nn.Module:
            ddp = make_ddp(strategy, net, **kwargs)
            results[f"{strategy}/buckets"] = len(ddp.bucket_names)
            return ddp

        results[strategy] = train(ours, powersgd.powerSGD_hook, rank)
        results[f"{strategy}/torch"] = train(torch_ddp, powersgd_in_order, rank)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def outcomes(ranks) -> list[dict[str, Any]]:
    return ranks(powersgd_like_torch, 2)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_powersgd_over_several_buckets_trains_like_torch_ddp(outcomes, strategy):
    for rank, seen in enumerate(outcomes):
        assert (seen[f"{strategy}/buckets"] > 1) == (strategy != "flat"), seen[f"{strategy}/buckets"]
        ours = torch.tensor([x for p in seen[strategy] for x in p])
        theirs = torch.tensor([x for p in seen[f"{strategy}/torch"] for x in p])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")
    assert outcomes[0][strategy] == outcomes[1][strategy], "the ranks' replicas differ"
