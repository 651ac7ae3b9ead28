"""Every strategy against torch's DistributedDataParallel, on the same data in the same process.

One forked run per world size (2 and 3 gloo ranks) trains every case twice, once wrapped by a
minddp strategy and once by torch DDP with the same arguments, from the same per-rank
initialization, and reports each rank's largest difference between the two final states
(parameters and buffers). With 2 ranks the arithmetic is the same, so the states must be equal;
with 3 the sum of three values may round differently between the two bucket layouts.

Cases: buffers broadcast at every forward (BatchNorm, a random buffer) or not; no_sync
accumulation; torch's communication hooks; unused parameters; uneven inputs under join();
recovery after an exception in forward and in backward on every rank.

Then, on 2 ranks: one rank raises in forward or backward, catches it and skips the step. Without
the round's agreement (see minddp.reducer), NaiveDDP averaged gradients of different iterations
from then on, silently, and the overlapping strategies aborted inside gloo ("Received data size
doesn't match expected size"). Now every rank raises once, and training then matches torch DDP
trained on the batches each rank actually stepped on.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from minddp import STRATEGIES, make_ddp

STEPS = 3
WORLD_SIZES = [2, 3]
# With 3 ranks, sums of three values may round differently: by about an ulp of the communicated dtype.
TOLERANCE_3_RANKS = {"hook-fp16": 1e-3, "hook-fp16-wrapper": 1e-3, "hook-bf16": 1e-2}


class Net(nn.Module):
    """BatchNorm statistics and a random buffer: what broadcast_buffers is about."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x)))) + self.shift


class Sometimes(nn.Module):
    """A branch only rank 0 uses in step 0, and no rank in the other steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h + self.branch(h) if self.use_branch else h)


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")


class Failing(nn.Module):
    """Raises in forward, or in backward after the output layer's gradients arrived, when told to.

    No BatchNorm: a forward that fails has updated its statistics, which no reference can replay.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("shift", torch.randn(3))
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.fail == "forward":
            raise RuntimeError("injected failure in forward")
        if self.fail == "backward":
            h = FailInBackward.apply(h)
        return self.out(h) + self.shift


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss_of(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(ddp(x), y)


def train_plain(ddp: nn.Module, rank: int, world_size: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        if isinstance(ddp.module, Sometimes):
            ddp.module.use_branch = step == 0 and rank == 0
        loss_of(ddp, *batch(step, rank)).backward()
        opt.step()  # no finish_gradient_synchronization(): backward returned with the averages
        opt.zero_grad()


def train_accumulating(ddp: nn.Module, rank: int, world_size: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        with ddp.no_sync():
            loss_of(ddp, *batch(step, rank, micro=0)).backward()
        loss_of(ddp, *batch(step, rank, micro=1)).backward()
        opt.step()
        opt.zero_grad()


def train_uneven(ddp: nn.Module, rank: int, world_size: int, divide: bool, fewest: int = 2) -> None:
    """Rank r has ``fewest`` + r batches; join() lets the others go on without it. With ``fewest=0``
    rank 0 joins before any backward, and takes part in the others' bucket rebuild from its shadow."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with ddp.join(divide_by_initial_world_size=divide):
        for step in range(fewest + rank):
            loss_of(ddp, *batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()


def train_through_failures(ddp: nn.Module, rank: int, world_size: int) -> None:
    """Step 1 fails in forward and step 2 in backward, on every rank; steps 0, 3 and 4 train."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step, fail in enumerate([None, "forward", "backward", None, None]):
        ddp.module.fail = fail
        try:
            loss_of(ddp, *batch(step, rank)).backward()
        except RuntimeError as exc:
            assert "injected failure" in str(exc), exc
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()


def train_on(ddp: nn.Module, rank: int, steps: list[int]) -> None:
    """The batches of ``steps`` only: what a run that skipped the others must amount to."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in steps:
        loss_of(ddp, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def train_without_failures(ddp: nn.Module, rank: int, world_size: int) -> None:
    """What train_through_failures must amount to: the steps that did not fail."""
    train_on(ddp, rank, [0, 3, 4])


def torch_ddp(model: nn.Module, **kwargs: Any) -> DistributedDataParallel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch >= 2.13 prefers forward_sync_buffers
        return DistributedDataParallel(model, **kwargs)


HOOKS = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
         "bf16": default_hooks.bf16_compress_hook,
         # set_buffer() and a result of another dtype than the bucket's:
         "fp16-wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)}


def bf16_hook_for_torch(state, bucket):  # no annotations: torch DDP checks them, and they are strings here
    """bf16_compress_hook under another name: torch DDP refuses that name without NCCL, gloo runs it."""
    return default_hooks.bf16_compress_hook(state, bucket)


def with_hook(wrap: Callable[..., nn.Module], hook: Callable) -> Callable[..., nn.Module]:
    def wrap_and_register(model: nn.Module, **kwargs: Any) -> nn.Module:
        ddp = wrap(model, **kwargs)
        is_torch = isinstance(ddp, DistributedDataParallel)
        ddp.register_comm_hook(None, bf16_hook_for_torch if is_torch and hook is HOOKS["bf16"] else hook)
        return ddp
    return wrap_and_register


# name -> (model, DDP keyword arguments, minddp's training, torch's training, comm hook or None)
CASES: dict[str, tuple[type[nn.Module], dict[str, Any], Callable, Callable, Callable | None]] = {
    "buffers": (Net, {}, train_plain, train_plain, None),
    "no-buffer-sync": (Net, {"broadcast_buffers": False}, train_plain, train_plain, None),
    "no_sync": (Net, {}, train_accumulating, train_accumulating, None),
    "find_unused": (Sometimes, {"find_unused_parameters": True}, train_plain, train_plain, None),
    "grads-copied": (Net, {"gradient_as_bucket_view": False}, train_plain, train_plain, None),
    **{f"hook-{name}": (Net, {}, train_plain, train_plain, hook) for name, hook in HOOKS.items()},
    **{f"join-divide-{divide}": (Net, {}, lambda d, r, w, divide=divide: train_uneven(d, r, w, divide),
                                 lambda d, r, w, divide=divide: train_uneven(d, r, w, divide), None)
       for divide in (True, False)},
    "join-from-none": (Net, {}, lambda d, r, w: train_uneven(d, r, w, True, fewest=0),
                       lambda d, r, w: train_uneven(d, r, w, True, fewest=0), None),
    "recovery": (Failing, {}, train_through_failures, train_without_failures, None),
}
NAMES = [f"{strategy}/{case}" for strategy, case in itertools.product(STRATEGIES, CASES)]


def trained_state(wrap: Callable[..., nn.Module], model_cls: type[nn.Module], kwargs: dict[str, Any],
                  train: Callable, hook: Callable | None, rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # every rank starts elsewhere: the wrapper broadcasts rank 0's state
    model = model_cls()
    ddp = with_hook(wrap, hook)(model, **kwargs) if hook is not None else wrap(model, **kwargs)
    train(ddp, rank, world_size)
    return {"state": model.state_dict(), "grad_is_none": [p.grad is None for p in model.parameters()]}


def compare_with_torch(rank: int, world_size: int) -> dict[str, float]:
    """Per case, the largest difference between minddp's and torch DDP's final states on this rank."""
    diffs = {}
    for strategy, (case, (model_cls, kwargs, train, torch_train, hook)) in itertools.product(
            STRATEGIES, CASES.items()):
        ours = trained_state(functools.partial(make_ddp, strategy), model_cls, kwargs, train, hook,
                             rank, world_size)
        theirs = trained_state(torch_ddp, model_cls, kwargs, torch_train, hook, rank, world_size)
        if ours["grad_is_none"] != theirs["grad_is_none"]:
            diffs[f"{strategy}/{case}"] = float("inf")
            continue
        diffs[f"{strategy}/{case}"] = max((t.double() - theirs["state"][k].double()).abs().max().item()
                                          for k, t in ours["state"].items())
    dist.barrier()
    return diffs


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def diffs(request: pytest.FixtureRequest, ranks) -> tuple[int, list[dict[str, float]]]:
    return request.param, ranks(compare_with_torch, request.param)


@pytest.mark.parametrize("name", NAMES)
def test_trains_like_torch_ddp(diffs, name):
    world_size, per_rank = diffs
    tolerance = 0.0 if world_size == 2 else TOLERANCE_3_RANKS.get(name.split("/")[1], 1e-5)
    for rank, rank_diffs in enumerate(per_rank):
        assert rank_diffs[name] <= tolerance, (
            f"{name} on rank {rank} of {world_size}: differs from torch DDP by {rank_diffs[name]}")


def count_collectives(rank: int, world_size: int) -> dict[str, int]:
    """Collectives issued by one training step, after the first, beyond the buckets' (by strategy and
    find_unused_parameters)."""
    counts = {}
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather")}

    def counting(name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for strategy, find_unused in itertools.product(STRATEGIES, (False, True)):
        ddp = make_ddp(strategy, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                       find_unused_parameters=find_unused)
        ddp(torch.ones(2, 4)).sum().backward()
        for name in originals:
            setattr(dist, name, counting(name))
        try:
            ddp(torch.ones(2, 4)).sum().backward()
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        counts[f"{strategy}/{find_unused}"] = len(calls) - len(ddp.bucket_names)
        calls.clear()
    return counts


def test_two_small_collectives_beyond_the_gradients_with_or_without_find_unused_parameters(ranks):
    # The round's open and close flags (which ranks began and completed the step); the close one also
    # carries which parameters some rank used, under find_unused_parameters.
    for counts in ranks(count_collectives, 2):
        for strategy in STRATEGIES:
            assert counts[f"{strategy}/False"] == counts[f"{strategy}/True"] == 2, counts


def early_termination(rank: int, world_size: int) -> list[str]:
    """Each wrapper's error under join(throw_on_early_termination=True), rank r having 2 + r batches."""
    errors = []
    for wrap in (functools.partial(make_ddp, "bucketed"), torch_ddp):
        ddp = wrap(Net())
        try:
            with ddp.join(throw_on_early_termination=True):
                for step in range(2 + rank):
                    loss_of(ddp, *batch(step, rank)).backward()
        except RuntimeError as exc:
            errors.append(str(exc))
        else:
            errors.append("no error")
    return errors


def test_throw_on_early_termination_raises_on_every_rank_as_torch_does(ranks):
    # 2 ranks only: torch DDP takes seconds to raise.
    for rank, (ours, theirs) in enumerate(ranks(early_termination, 2)):
        assert ours == theirs and "exhausted" in ours, f"rank {rank}: {ours!r} vs torch's {theirs!r}"


FAILING_RANK = 1
# (strategy, where the failing rank raises, find_unused_parameters, the step it fails at). Failing at step
# 0 skips the averaged backward whose gradient order the buckets are rebuilt in: no rank rebuilds then.
SKIP_CASES = [(s, where, False, 1) for s in STRATEGIES for where in ("backward", "forward")]
SKIP_CASES += [("bucketed", "backward", True, 1), ("bucketed", "backward", False, 0),
               ("naive", "forward", False, 0)]


def skip_case_name(strategy: str, where: str, find_unused: bool, failing_step: int) -> str:
    return f"{strategy}/{where}/find_unused={find_unused}" + ("/at step 0" if failing_step == 0 else "")


def train_skipping(ddp: nn.Module, rank: int, where: str, failing_step: int) -> tuple[list[int], list[str]]:
    """Batch ``failing_step`` fails on FAILING_RANK; every exception is caught and its step skipped, as a
    loop that tolerates a flaky batch does, until 3 steps are taken. Returns the batches stepped on and the
    errors."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    stepped, errors = [], []
    step = 0
    while len(stepped) < 3:
        ddp.module.fail = where if step == failing_step and rank == FAILING_RANK else None
        try:
            loss_of(ddp, *batch(step, rank)).backward()
        except RuntimeError as exc:
            errors.append(str(exc))
        else:
            opt.step()
            stepped.append(step)
        opt.zero_grad()
        step += 1
    return stepped, errors


def largest_difference(model: nn.Module, reference: nn.Module) -> float:
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


def skip_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for strategy, where, find_unused, failing_step in SKIP_CASES:
        options = {"find_unused_parameters": find_unused}
        wrap = functools.partial(make_ddp, strategy, **options)
        if strategy == "bucketed":  # a bucket per parameter: the output layer's go before the failure
            wrap = functools.partial(wrap, bucket_size_mb=0.0001)
        torch.manual_seed(rank)
        model = Failing()
        stepped, errors = train_skipping(wrap(model), rank, where, failing_step)
        torch.manual_seed(rank)
        reference = Failing()
        train_on(torch_ddp(reference, **options), rank, stepped)
        seen[skip_case_name(strategy, where, find_unused, failing_step)] = {
            "stepped": stepped, "errors": errors, "diff": largest_difference(model, reference)}

    # A forward under grad mode on every rank, without backward (an evaluation outside no_grad): no error.
    models = []
    for wrap in (functools.partial(make_ddp, "bucketed", bucket_size_mb=0.0001), torch_ddp):
        torch.manual_seed(rank)
        models.append(Failing())
        ddp = wrap(models[-1])
        ddp(batch(0, rank)[0])
        train_on(ddp, rank, [1, 2])
    seen["forward without backward everywhere"] = largest_difference(*models)
    return seen


@pytest.fixture(scope="module")
def skipped(ranks) -> list[dict[str, Any]]:
    return ranks(skip_on_one_rank, 2)


@pytest.mark.parametrize("name", [skip_case_name(*case) for case in SKIP_CASES])
def test_a_step_skipped_on_one_rank_raises_on_every_rank_then_trains_like_torch_ddp(skipped, name):
    healthy, failing = skipped[1 - FAILING_RANK][name], skipped[FAILING_RANK][name]
    failed = 0 if name.endswith("at step 0") else 1
    # The healthy rank raises at the end of the failed step's backward, and skips that batch.
    assert healthy["stepped"] == [s for s in range(4) if s != failed], healthy
    assert len(healthy["errors"]) == 1 and f"rank(s) {FAILING_RANK} skipped this step" in healthy["errors"][0]
    # The failing rank: its own exception, then ours at its next forward (batch 2, lost), then it trains.
    assert failing["stepped"] == [s for s in range(5) if s not in (failed, failed + 1)], failing
    own, ours = failing["errors"]
    assert "injected failure" in own
    assert f"rank {FAILING_RANK} skipped its last averaged step" in ours and "rank(s) 0 completed it" in ours
    for outcome in (healthy, failing):
        assert outcome["diff"] == 0.0, f"{name}: differs from torch DDP by {outcome['diff']}"


def test_a_forward_without_backward_on_every_rank_is_no_skip(skipped):
    for seen in skipped:
        assert seen["forward without backward everywhere"] == 0.0
