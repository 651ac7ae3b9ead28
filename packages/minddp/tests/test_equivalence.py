"""Every strategy, on 1, 2 and 3 gloo ranks, trains exactly like one process that sees the whole batch.

One forked run per world size trains every (strategy, model, variant) case and reports, per case,
the largest difference from the single-process reference and the final parameters; the tests
below check those reports. Models cover a frozen layer, tied weights, a branch no rank uses and
a branch only some ranks use in some steps (so ranks launch their hooks in different sets).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp import make_ddp
from minddp.buckets import assign_buckets

STEPS = 3
PER_RANK = 4
WORLD_SIZES = [1, 2, 3]


class FrozenLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.out = nn.Linear(8, 3)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        return self.out(torch.relu(self.frozen(torch.tanh(self.inp(x))))) + self.shift


class TiedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight  # one tensor, two names
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        return self.out(self.b(torch.tanh(self.a(x))))


class UnusedBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


class SometimesBranch(nn.Module):
    """The branch runs only where the caller asks: on some ranks, in some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


MODELS = {"frozen": FrozenLayer, "tied": TiedWeights, "unused": UnusedBranch, "sometimes": SometimesBranch}
UNUSED_SOMEWHERE = {"unused", "sometimes"}
# (name, strategy, kwargs); "two" is replaced by the bucket size that makes exactly two buckets.
STRATEGIES = [("naive", "naive", {}), ("flat", "flat", {}), ("overlap", "overlap", {}),
              ("bucketed-25MB", "bucketed", {}), ("bucketed-one", "bucketed", {"bucket_size_mb": None}),
              ("bucketed-two", "bucketed", {"bucket_size_mb": "two"}),
              ("bucketed-per-param", "bucketed", {"bucket_size_mb": 0})]
# plain: one backward per step; accumulate: a no_sync micro-batch, then a synced one;
# keep-grads: zero_grad(set_to_none=False), so gradients persist between steps.
VARIANTS = ["plain", "accumulate", "keep-grads"]
CASES = [f"{s}/{m}/{v}" for (s, _, _), m, v in itertools.product(STRATEGIES, MODELS, VARIANTS)]


def uses_branch(rank: int, world_size: int, step: int) -> bool:
    # step 0: rank 0 only; step 1: no rank; step 2: the last rank only.
    return (step == 0 and rank == 0) or (step == 2 and rank == world_size - 1)


def two_bucket_size_mb(model: nn.Module) -> float:
    """A bucket size that splits the trainable parameters (in reverse order) into exactly two buckets: the
    first closes when it holds all but the first parameter, which is left for the second."""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return sum(sizes[1:]) / 2**20


def batch(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    rows = world_size * PER_RANK
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def shard_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int,
               step: int) -> torch.Tensor:
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return nn.functional.mse_loss(model(x[rows], uses_branch(rank, world_size, step)), y[rows])


def train(model: nn.Module, world_size: int, variant: str, rank: int | None) -> None:
    """STEPS AdamW steps. rank=None: the reference, one process averaging every rank's shard loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    micro_batches = 2 if variant == "accumulate" else 1
    for step in range(STEPS):
        for micro in range(micro_batches):
            x, y = batch(step, micro, world_size)
            if rank is None:
                losses = [shard_loss(model, x, y, r, world_size, step) for r in range(world_size)]
                (sum(losses) / world_size).backward()
            elif micro < micro_batches - 1:
                with model.no_sync():
                    shard_loss(model, x, y, rank, world_size, step).backward()
            else:
                shard_loss(model, x, y, rank, world_size, step).backward()
        opt.step()  # right after backward: it returns with the gradients averaged
        opt.zero_grad(set_to_none=variant != "keep-grads")


def train_every_case(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    reports = {}
    for (name, strategy, kwargs), model_name, variant in itertools.product(STRATEGIES, MODELS, VARIANTS):
        torch.manual_seed(0)
        reference = MODELS[model_name]()
        torch.manual_seed(rank)  # each rank starts elsewhere: the wrapper must broadcast rank 0's state
        local = MODELS[model_name]()
        if kwargs.get("bucket_size_mb") == "two":
            kwargs = {"bucket_size_mb": two_bucket_size_mb(local)}
        # As with torch DDP, parameters that some rank leaves unused need find_unused_parameters=True.
        ddp = make_ddp(strategy, local, find_unused_parameters=model_name in UNUSED_SOMEWHERE, **kwargs)
        train(ddp, world_size, variant, rank)
        train(reference, world_size, variant, rank=None)
        ref_state = reference.state_dict()
        reports[f"{name}/{model_name}/{variant}"] = {
            "max_diff": max((t - ref_state[k]).abs().max().item() for k, t in local.state_dict().items()),
            # plain lists: tensors would cross processes through shared memory that dies with the worker
            "state": {k: t.tolist() for k, t in local.state_dict().items()},
            "buckets": getattr(ddp, "bucket_names", None),
            "trainable": [n for n, p in local.named_parameters() if p.requires_grad],
            "frozen_grads": [n for n, p in local.named_parameters()
                             if not p.requires_grad and p.grad is not None],
        }
    dist.barrier()
    return reports


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def reports(request: pytest.FixtureRequest, ranks) -> list[dict[str, dict[str, Any]]]:
    return ranks(train_every_case, request.param)


@pytest.mark.parametrize("case", CASES)
def test_matches_single_process_on_whole_batch(reports, case):
    assert reports[0][case]["max_diff"] < 1e-5, f"{case}: rank 0 drifted from the reference"
    assert reports[0][case]["frozen_grads"] == [], "frozen parameters must never get a gradient"


@pytest.mark.parametrize("case", CASES)
def test_every_rank_ends_bitwise_identical(reports, case):
    first = reports[0][case]["state"]
    for rank, report in enumerate(reports[1:], start=1):
        for key, values in report[case]["state"].items():
            assert values == first[key], f"{case}: {key} differs between rank 0 and rank {rank}"


HOOKED = [name for name, strategy, _ in STRATEGIES if strategy in ("overlap", "bucketed")]


@pytest.mark.parametrize("name", HOOKED)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_buckets_hold_each_trainable_parameter_once(reports, name, model_name):
    report = reports[0][f"{name}/{model_name}/plain"]
    in_buckets = [n for bucket in report["buckets"] for n in bucket]
    assert sorted(in_buckets) == sorted(report["trainable"])
    assert not any(n.startswith("frozen.") or n == "b.weight" for n in in_buckets)
    one_per_parameter = len(report["trainable"])
    expected_count = {"bucketed-one": 1, "bucketed-25MB": 1, "bucketed-two": 2}.get(name, one_per_parameter)
    assert len(report["buckets"]) == expected_count
    assert in_buckets[0] == report["trainable"][-1], "buckets must follow reverse parameter order"


@pytest.mark.parametrize("model_name", list(MODELS))
def test_two_bucket_size_is_exact(model_name):
    model = MODELS[model_name]()
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    assert len(assign_buckets(params, [int(two_bucket_size_mb(model) * 2**20)])) == 2
