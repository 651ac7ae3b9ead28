"""A rank that skips a step after an exception (caught) in forward or backward: every rank raises, once.

Without the round's agreement, NaiveDDP averaged gradients of different iterations from then on,
silently, and the overlapping strategies aborted inside gloo ("Received data size doesn't match
expected size"). Now the ranks that completed the step raise at the end of its backward, the one
that skipped at its next forward; after that, training goes on, and matches torch DDP trained on
the batches that each rank actually stepped on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from minddp import STRATEGIES, make_ddp

FAILING_RANK = 1
# (strategy, where the failing rank raises, find_unused_parameters)
CASES = [(s, where, False) for s in STRATEGIES for where in ("backward", "forward")]
CASES.append(("bucketed", "backward", True))


def case_name(strategy: str, where: str, find_unused: bool) -> str:
    return f"{strategy}/{where}/find_unused={find_unused}"


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")


class Failing(nn.Module):
    """Raises in forward, or in backward once the output layer's gradients have arrived, when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        if self.fail == "forward":
            raise RuntimeError("injected failure in forward")
        if self.fail == "backward":
            h = FailInBackward.apply(h)
        return self.out(h)


def batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * index + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train_skipping(ddp: nn.Module, rank: int, fail: str) -> tuple[list[int], list[str]]:
    """Batch 1 fails on FAILING_RANK; every exception is caught and its step skipped, as a loop that
    tolerates a flaky batch does. Returns the batches stepped on and the errors seen."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    stepped, errors = [], []
    index = 0
    while len(stepped) < 3:
        ddp.module.fail = fail if index == 1 and rank == FAILING_RANK else None
        try:
            nn.functional.mse_loss(ddp(*batch(index, rank)[:1]), batch(index, rank)[1]).backward()
        except RuntimeError as exc:
            errors.append(str(exc))
            opt.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
            stepped.append(index)
        index += 1
    return stepped, errors


def train_on(ddp: nn.Module, rank: int, batches: list[int]) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for index in batches:
        x, y = batch(index, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def torch_ddp(model: nn.Module, **kwargs: Any) -> DistributedDataParallel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(model, **kwargs)


def skip_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for strategy, fail, find_unused in CASES:
        name = case_name(strategy, fail, find_unused)
        options = {"find_unused_parameters": find_unused}
        wrap = functools.partial(make_ddp, strategy, **options)
        if strategy == "bucketed":  # one bucket per layer, some of them launched before the failure
            wrap = functools.partial(wrap, bucket_size_mb=0.0001)
        torch.manual_seed(rank)
        model = Failing()
        stepped, errors = train_skipping(wrap(model), rank, fail)
        torch.manual_seed(rank)
        reference = Failing()
        train_on(torch_ddp(reference, **options), rank, stepped)
        seen[name] = {"stepped": stepped, "errors": errors,
                      "diff": max((p - q).abs().max().item()
                                  for p, q in zip(model.parameters(), reference.parameters(), strict=True))}

    # A forward under grad mode on every rank, without backward (an evaluation outside no_grad): no error.
    models = []
    for wrap in (functools.partial(make_ddp, "bucketed", bucket_size_mb=0.0001), torch_ddp):
        torch.manual_seed(rank)
        models.append(Failing())
        ddp = wrap(models[-1])
        ddp(batch(0, rank)[0])
        train_on(ddp, rank, [1, 2])
    seen["forward without backward everywhere"] = max((p - q).abs().max().item() for p, q in zip(
        models[0].parameters(), models[1].parameters(), strict=True))
    return seen


@pytest.fixture(scope="module")
def outcomes(ranks) -> list[dict[str, Any]]:
    return ranks(skip_on_one_rank, 2, timeout=180)


@pytest.mark.parametrize("name", [case_name(*case) for case in CASES])
def test_every_rank_raises_once_then_trains_like_torch_ddp(outcomes, name):
    healthy, failing = outcomes[1 - FAILING_RANK][name], outcomes[FAILING_RANK][name]
    # The healthy rank raises at the end of the failed step's backward, and skips that batch.
    assert healthy["stepped"] == [0, 2, 3], healthy
    assert len(healthy["errors"]) == 1 and f"rank(s) {FAILING_RANK} skipped this step" in healthy["errors"][0]
    # The failing rank: its own exception, then ours at its next forward (batch 2, lost), then it trains.
    assert failing["stepped"] == [0, 3, 4], failing
    own, ours = failing["errors"]
    assert "injected failure" in own
    assert f"rank {FAILING_RANK} skipped its last averaged step" in ours and "rank(s) 0 completed it" in ours
    for outcome in (healthy, failing):
        assert outcome["diff"] == 0.0, f"{name}: differs from torch DDP by {outcome['diff']}"


def test_a_forward_without_backward_on_every_rank_is_no_skip(outcomes):
    for seen in outcomes:
        assert seen["forward without backward everywhere"] == 0.0
