"""minddp + shardopt: gradients averaged by a DDP wrapper, optimizer state sharded, on 2 gloo ranks.

For every minddp strategy, a small model trained with the wrapper and a ShardedOptimizer (each
rank on its half of every batch) must equal, bit for bit, the same wrapper with plain AdamW on
every rank, and match single-process training on the whole batch (up to the order in which the
gradient mean is summed). The consolidated optimizer state must match single-process AdamW's.

This file is also the worker: pytest runs it under torchrun (``python -m torch.distributed.run
--standalone --nproc-per-node 2 tests/test_shardopt_with_minddp.py RESULTS_DIR``).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minddp import STRATEGIES, make_ddp
from shardopt import ShardedOptimizer

WORLD_SIZE = 2
STEPS = 5
BATCH_PER_RANK = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(WORLD_SIZE * BATCH_PER_RANK, 8, generator=generator)
    return inputs, torch.randint(0, 4, (WORLD_SIZE * BATCH_PER_RANK,), generator=generator)


def train_both_ways(strategy: str) -> None:
    """DDP + ShardedOptimizer against DDP + AdamW (exactly) and single-process AdamW (closely)."""
    rank = dist.get_rank()
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    # A small bucket size gives the bucketed strategy several buckets.
    options = {"bucket_size_mb": 0.002} if strategy == "bucketed" else {}
    sharded = make_ddp(strategy, make_model(), **options)
    sharded_optimizer = ShardedOptimizer(sharded.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain = make_ddp(strategy, make_model(), **options)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    single = make_model()
    single_optimizer = torch.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        inputs, targets = batch(step)
        for ddp, optimizer in ((sharded, sharded_optimizer), (plain, plain_optimizer)):
            optimizer.zero_grad()
            F.cross_entropy(ddp(inputs[mine]), targets[mine]).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        single_optimizer.zero_grad()
        F.cross_entropy(single(inputs), targets).backward()
        single_optimizer.step()
        for i, (p, q, r) in enumerate(zip(sharded.parameters(), plain.parameters(), single.parameters(),
                                          strict=True)):
            where = f"step {step}, parameter {i}"
            assert torch.equal(p, q), f"{where}: sharded differs from DDP + AdamW"
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}, single: {m}")
    sharded_optimizer.consolidate_state_dict(to=0)  # ZeroRedundancyOptimizer's idiom
    if rank == 0:
        full, expected = sharded_optimizer.state_dict(), single_optimizer.state_dict()
        assert full["param_groups"] == expected["param_groups"]
        for index, state in expected["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(full["state"][index][key], value, rtol=1e-5, atol=1e-6)


def worker(results_dir: Path) -> None:
    from conftest import run_cases_on_this_rank

    run_cases_on_this_rank(results_dir, {s: functools.partial(train_both_ways, s) for s in STRATEGIES})


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, run_under_torchrun) -> dict[str, str]:
    """Run this file on 2 ranks under torchrun (killed whole after 150 s); {strategy: 'ok' or why not}."""
    results_dir = tmp_path_factory.mktemp("shardopt_with_minddp")
    return run_under_torchrun(__file__, results_dir, STRATEGIES, WORLD_SIZE)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_ddp_with_sharded_optimizer_matches_single_process(strategy, outcomes):
    assert outcomes[strategy] == "ok", outcomes[strategy]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
