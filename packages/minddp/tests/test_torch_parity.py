"""Every strategy against torch's DistributedDataParallel, on the same data in the same process.

One forked run per world size (2 and 3 gloo ranks) trains every case twice, once wrapped by a
minddp strategy and once by torch DDP with the same arguments, from the same per-rank
initialization, and reports each rank's largest difference between the two final states
(parameters and buffers). With 2 ranks the arithmetic is the same, so the states must be equal;
with 3 the sum of three values may round differently between the two bucket layouts.

Cases: buffers broadcast at every forward (BatchNorm, a random buffer) or not; no_sync
accumulation; torch's communication hooks; unused parameters; uneven inputs under join();
recovery after an exception in forward and in backward on every rank.
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


def train_uneven(ddp: nn.Module, rank: int, world_size: int, divide: bool) -> None:
    """Rank r has 2 + r batches; join() lets the others go on without it."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with ddp.join(divide_by_initial_world_size=divide):
        for step in range(2 + rank):
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


def train_without_failures(ddp: nn.Module, rank: int, world_size: int) -> None:
    """What train_through_failures must amount to: the steps that did not fail."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in [0, 3, 4]:
        loss_of(ddp, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


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
    """Collectives issued by one training step, after the first, by strategy and find_unused_parameters."""
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


def test_no_collective_beyond_the_gradients_unless_find_unused_parameters(ranks):
    for counts in ranks(count_collectives, 2):
        for strategy in STRATEGIES:
            assert counts[f"{strategy}/False"] == 0, counts
            assert counts[f"{strategy}/True"] == 1, counts  # which parameters some rank used


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
