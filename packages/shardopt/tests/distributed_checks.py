"""Checks of ShardedOptimizer that need several processes, and their launcher (used by test_distributed.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 distributed_checks.py RESULTS_DIR [nccl]

Every rank runs the checks of its world size in order and records each outcome in
RESULTS_DIR/rank<r>.json as it goes. Starting processes costs seconds, so one launch runs them all.
The first failure ends the process with an error, and torchrun then stops the other ranks.
Every rank computes the same gradients (same data, same model), so no DDP wrapper is needed.
With ``nccl`` each rank's tensors live on its GPU; the default is gloo on the CPU.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import shardopt.optimizer
from shardopt import ShardedOptimizer, StateOnRank

DEVICE = torch.device("cpu")  # main() sets each rank's GPU under NCCL
OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict]] = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (torch.optim.RMSprop, {"lr": 1e-3, "centered": True, "momentum": 0.5}),
    (torch.optim.Adagrad, {"lr": 1e-2}),  # builds its state in __init__, not lazily in step
    *([(torch.optim.Adafactor, {"lr": 1e-2})] if hasattr(torch.optim, "Adafactor") else []),  # torch >= 2.5
]


class ParamBag(nn.Module):
    """Parameters of chosen sizes and dtypes, and a loss that gives each one a different gradient."""

    def __init__(self, sizes: list[int], seed: int = 0, dtypes: list[torch.dtype] | None = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        dtypes = dtypes or [torch.float32] * len(sizes)
        values = [torch.randn(n, generator=generator, dtype=d) for n, d in zip(sizes, dtypes, strict=True)]
        self.weights = nn.ParameterList(nn.Parameter(v.to(DEVICE)) for v in values)

    def loss(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + step)
        total = torch.zeros((), dtype=torch.float64, device=DEVICE)
        for w in self.weights:
            target = torch.randn(w.shape, generator=generator, dtype=w.dtype).to(DEVICE)
            total = total + (w.tanh() - target).square().sum().double()
        return total


def train(model: ParamBag, optimizer: torch.optim.Optimizer, steps: range,
          reference: tuple[ParamBag, torch.optim.Optimizer] | None = None) -> None:
    """Train `steps`; with a reference (model, optimizer) alongside, demand equal parameters every step."""
    for step in steps:
        pairs = [(model, optimizer)] + ([reference] if reference else [])
        for m, o in pairs:
            o.zero_grad()
            m.loss(step).backward()
            o.step()
        if reference:
            assert_equal_params(model, reference[0], f"after step {step}")


def assert_equal_params(model: nn.Module, reference: nn.Module, when: str) -> None:
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters(), strict=True)):
        assert torch.equal(p, q), f"parameter {i} differs from the unsharded optimizer's {when}: " \
                                  f"max abs diff {(p - q).abs().max().item():.3g}"


def assert_equal_state_dicts(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"], (got["param_groups"], expected["param_groups"])
    assert sorted(got["state"]) == sorted(expected["state"]), (list(got["state"]), list(expected["state"]))
    for index, state in expected["state"].items():
        assert state.keys() == got["state"][index].keys()
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                # consolidate_state_dict returns CPU copies; compare values, not devices.
                got_value = got["state"][index][key]
                assert torch.equal(value.cpu(), got_value.cpu()), f"state[{index}][{key!r}] differs"
            else:
                assert value == got["state"][index][key]


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


# --- checks ------------------------------------------------------------------------------------------

def check_every_optimizer_matches_unsharded(_: Path) -> None:
    rank, world_size = world()
    for optimizer_cls, kwargs in OPTIMIZERS:
        model = ParamBag([40, 7, 33, 5, 64, 1, 12])
        reference = copy.deepcopy(model)
        optimizer = ShardedOptimizer(model.parameters(), optimizer_cls, **kwargs)
        train(model, optimizer, range(4), (reference, optimizer_cls(reference.parameters(), **kwargs)))
        owners = optimizer.param_owners
        assert sorted(set(owners)) == list(range(world_size)), f"{optimizer_cls.__name__}: owners {owners}"
        mine = {p for p, owner in zip(model.parameters(), owners, strict=True) if owner == rank}
        assert set(optimizer.state) == mine, f"{optimizer_cls.__name__}: rank {rank} holds state of others"


def check_param_groups_and_lr_scheduler(_: Path) -> None:
    model = ParamBag([30, 3, 20, 9, 16])
    reference = copy.deepcopy(model)

    def groups(m: ParamBag) -> list[dict]:
        w = list(m.weights)
        return [{"params": w[:2]}, {"params": w[2:4], "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.9)},
                {"params": w[4:], "lr": 1e-3}]

    optimizer = ShardedOptimizer(groups(model), torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
    reference_optimizer = torch.optim.AdamW(groups(reference), lr=1e-2, weight_decay=0.05)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in reference_optimizer.param_groups]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in (optimizer, reference_optimizer)]
    for step in range(5):
        train(model, optimizer, range(step, step + 1), (reference, reference_optimizer))
        for scheduler in schedulers:
            scheduler.step()
    assert optimizer.param_groups[1]["lr"] == reference_optimizer.param_groups[1]["lr"] < 3e-2


def check_add_param_group_moves_state_with_its_parameter(_: Path) -> None:
    # Sizes chosen so the big newcomer pushes earlier parameters (with state) onto other ranks.
    model = ParamBag([80, 72, 64, 56, 160])
    reference = copy.deepcopy(model)
    first, later = list(model.weights)[:4], list(model.weights)[4:]
    optimizer = ShardedOptimizer(first, torch.optim.AdamW, lr=1e-2)
    reference_optimizer = torch.optim.AdamW(list(reference.weights)[:4], lr=1e-2)
    train(model, optimizer, range(2), (reference, reference_optimizer))
    before = optimizer.param_owners
    optimizer.add_param_group({"params": later, "lr": 5e-2})
    reference_optimizer.add_param_group({"params": list(reference.weights)[4:], "lr": 5e-2})
    after = optimizer.param_owners
    assert any(b != a for b, a in zip(before, after[:4], strict=True)), f"nothing moved: {before} -> {after}"
    assert optimizer.param_groups[1]["lr"] == 5e-2 and "betas" in optimizer.param_groups[1]
    train(model, optimizer, range(2, 5), (reference, reference_optimizer))
    full = optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        assert_equal_state_dicts(full, reference_optimizer.state_dict())


def check_zero_idiom_state_dict_and_resume(tmp: Path) -> None:
    """consolidate_state_dict(to=r), then state_dict() on rank r: the full state, until the next step."""
    rank, world_size = world()
    model = ParamBag([24, 5, 40, 3, 17, 8])
    reference = copy.deepcopy(model)
    groups = lambda m: [{"params": list(m.weights)[:3]}, {"params": list(m.weights)[3:], "lr": 2e-2}]  # noqa: E731
    optimizer = ShardedOptimizer(groups(model), torch.optim.AdamW, lr=1e-2)
    reference_optimizer = torch.optim.AdamW(groups(reference), lr=1e-2)
    train(model, optimizer, range(3), (reference, reference_optimizer))

    shard = optimizer.sharded_state_dict()
    owners = optimizer.param_owners
    for index, owner in enumerate(owners):
        entry = shard["state"][index]
        if owner == rank:
            assert entry.keys() == reference_optimizer.state_dict()["state"][index].keys()
        else:
            assert entry == StateOnRank(owner), f"parameter {index} of rank {owner}: {entry!r}"
    assert_is_shard(optimizer.state_dict(), world_size)  # nothing consolidated yet
    expected = reference_optimizer.state_dict()
    for to in range(world_size):
        assert optimizer.consolidate_state_dict(to=to) == (optimizer.state_dict() if rank == to else None)
        if rank == to:
            assert_equal_state_dicts(optimizer.state_dict(), expected)
            full_state = optimizer.state_dict()["state"]
            assert all(t.device.type == "cpu" for s in full_state.values() for t in s.values())
        else:
            assert_is_shard(optimizer.state_dict(), world_size)
    last = world_size - 1  # the target of the latest consolidation
    if rank == last:
        torch.save({"optimizer": optimizer.state_dict(), "model": model.state_dict()}, tmp / "full.pt")
    dist.barrier()

    # The full state loads into the unsharded class and into a fresh ShardedOptimizer, and each rank's
    # own shard loads back into the same layout; all three resume exactly.
    checkpoint = torch.load(tmp / "full.pt", weights_only=True, map_location="cpu")
    plain_model = ParamBag([24, 5, 40, 3, 17, 8], seed=1)
    plain_model.load_state_dict(checkpoint["model"])
    plain = torch.optim.AdamW(groups(plain_model), lr=1e-2)
    plain.load_state_dict(checkpoint["optimizer"])
    resumed = []
    for saved in (torch.load(tmp / "full.pt", weights_only=True, map_location="cpu")["optimizer"],
                  copy.deepcopy(shard)):
        m = ParamBag([24, 5, 40, 3, 17, 8], seed=2)
        m.load_state_dict(checkpoint["model"])
        o = ShardedOptimizer(groups(m), torch.optim.AdamW, lr=0.5)  # lr comes back from the checkpoint
        o.load_state_dict(saved)
        assert o.param_groups[1]["lr"] == 2e-2
        resumed.append((m, o))
    train(model, optimizer, range(3, 5), (reference, reference_optimizer))
    if rank == last:
        assert_is_shard(optimizer.state_dict(), world_size)  # step() ended the consolidated state
    loaded = ["torch.optim.AdamW", "ShardedOptimizer from the full dict", "ShardedOptimizer from its shard"]
    for how, (m, o) in zip(loaded, [(plain_model, plain), *resumed], strict=True):
        train(m, o, range(3, 5))
        assert_equal_params(m, reference, f"after resuming in {how}")


def check_a_shard_where_a_full_state_belongs_fails_on_every_rank(tmp: Path) -> None:
    """Rank 0 saves state_dict() without consolidating: that shard loads nowhere it is incomplete."""
    rank, world_size = world()
    model = ParamBag([24, 5, 40, 3, 17, 8])
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, optimizer, range(2))
    # Without consolidate_state_dict, state_dict() is this rank's shard: torch.save refuses it...
    save_state_dict = lambda: torch.save(optimizer.state_dict(), tmp / f"rank{rank}.pt")  # noqa: E731
    expect_error(save_state_dict, RuntimeError, "state_dict")
    optimizer.consolidate_state_dict(to=0)
    if rank != 0:  # ...and so it does where another rank holds the consolidated state.
        expect_error(save_state_dict, RuntimeError, "state_dict")
    # A shard saved on purpose (sharded_state_dict) does not load where it lacks a rank's state.
    if rank == 0:
        torch.save(optimizer.sharded_state_dict(), tmp / "rank0.pt")
    dist.barrier()
    with torch.serialization.safe_globals([StateOnRank]):
        rank0_shard = torch.load(tmp / "rank0.pt", weights_only=True)
    # Rank 0 holds what it owns, but the other ranks do not: every rank raises, none loads alone.
    expect_error(lambda: optimizer.load_state_dict(rank0_shard), ValueError, "state_dict")
    resharded = ShardedOptimizer(list(model.parameters())[::-1], torch.optim.AdamW, lr=1e-2)
    expect_error(lambda: resharded.load_state_dict(copy.deepcopy(rank0_shard)), ValueError, "state_dict")
    # torch.load with its default weights_only=True refuses the shard's StateOnRank entries, so it does
    # not load into the unsharded optimizer as if the parameters of other ranks had no state.
    try:
        torch.load(tmp / "rank0.pt")
    except pickle.UnpicklingError as error:
        assert "StateOnRank" in str(error), error
    else:
        raise AssertionError("torch.load read a shard without being told that StateOnRank is safe")
    # Every rank's own shard still loads back where it came from.
    before = [dict(s) for s in optimizer.local_optimizer.state.values()]
    optimizer.load_state_dict(optimizer.sharded_state_dict())
    after = list(optimizer.local_optimizer.state.values())
    assert all(torch.equal(b["exp_avg"], a["exp_avg"]) for b, a in zip(before, after, strict=True))


def check_zero_redundancy_optimizer_loads_the_same_state(tmp: Path) -> None:
    """torch's ZeroRedundancyOptimizer and ShardedOptimizer: same full state, each loads the other's."""
    rank, _ = world()
    sizes = [30, 6, 44, 2, 21]
    reference = ParamBag(sizes)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    models = {kind: ParamBag(sizes) for kind in ("sharded", "zero")}
    hyperparameters = {"lr": 1e-2, "weight_decay": 0.1}
    optimizers = {
        "sharded": ShardedOptimizer(models["sharded"].parameters(), torch.optim.AdamW, **hyperparameters),
        "zero": ZeroRedundancyOptimizer(models["zero"].parameters(), optimizer_class=torch.optim.AdamW,
                                        **hyperparameters),
    }
    train(reference, reference_optimizer, range(3))
    for kind in optimizers:
        train(models[kind], optimizers[kind], range(3))
        assert_equal_params(models[kind], reference, f"after training with {kind}")
        optimizers[kind].consolidate_state_dict(to=0)
        if rank == 0:
            saved = optimizers[kind].state_dict()
            assert_equal_state_dicts(saved, reference_optimizer.state_dict())
            torch.save(saved, tmp / f"{kind}.pt")
    dist.barrier()
    train(reference, reference_optimizer, range(3, 5))
    for saved_by, loader in [("zero", "sharded"), ("sharded", "zero")]:
        optimizers[loader].load_state_dict(torch.load(tmp / f"{saved_by}.pt", weights_only=True))
        train(models[loader], optimizers[loader], range(3, 5))
        assert_equal_params(models[loader], reference, f"after {loader} resumed from {saved_by}'s state")


def assert_is_shard(state_dict: dict, world_size: int) -> None:
    """A shard has a StateOnRank for each parameter of another rank (with several ranks, there is one)."""
    elsewhere = [s for s in state_dict["state"].values() if isinstance(s, StateOnRank)]
    assert (len(elsewhere) > 0) == (world_size > 1), state_dict["state"]


def check_edge_layouts(_: Path) -> None:
    """Fewer parameters than ranks, two dtypes (two flat buffers), a closure, zero_grad of every gradient."""
    _, world_size = world()
    two_dtypes = [torch.float32, torch.float64] * 2
    for sizes, dtypes in [([9] * (world_size - 1), None), ([20, 6, 31, 4], two_dtypes)]:
        model = ParamBag(sizes, dtypes=dtypes)
        reference = copy.deepcopy(model)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
        train(model, optimizer, range(3), (reference, torch.optim.Adam(reference.parameters(), lr=1e-2)))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model.loss(7)
        loss.backward()
        return loss

    expected = model.loss(7).detach()
    assert torch.equal(optimizer.step(closure).detach(), expected), "step(closure) returns the closure's loss"
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def check_overlapped_param_gather_matches_unsharded(_: Path) -> None:
    """overlap_with=model: step() leaves the all-gathers in flight, each forward waits for its buckets."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)], nn.Linear(8, 3))
    layers = layers.to(DEVICE)
    # Both under DDP: its gradient mean (g + g + g) / 3 may round differently from g itself.
    model, reference = DistributedDataParallel(layers), DistributedDataParallel(copy.deepcopy(layers))
    bucket_bytes, shardopt.optimizer.OVERLAP_BUCKET_BYTES = shardopt.optimizer.OVERLAP_BUCKET_BYTES, 256
    try:  # small buckets, so that the parameters travel in several all-gathers
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, overlap_with=model, lr=1e-2)
    finally:
        shardopt.optimizer.OVERLAP_BUCKET_BYTES = bucket_bytes
    assert len(optimizer._flat_buffers) > 1, "this check needs several buckets"
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    all_gather = shardopt.optimizer.all_gather_single
    shardopt.optimizer.all_gather_single = DeferredAllGather
    try:
        for step in range(4):
            inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(step)).to(DEVICE)
            losses = []
            for m, o in ((model, optimizer), (reference, reference_optimizer)):
                o.zero_grad()
                loss = m(inputs).square().mean()
                loss.backward()
                o.step()
                losses.append(loss.detach())
            assert torch.equal(*losses), f"step {step}: the forward did not see the gathered parameters"
        optimizer.finish_param_gather()
    finally:
        shardopt.optimizer.all_gather_single = all_gather
    assert_equal_params(model, reference, "after overlapped steps")
    outsider = nn.Parameter(torch.zeros(3, device=DEVICE))
    expect_error(lambda: ShardedOptimizer([outsider], torch.optim.SGD, overlap_with=model, lr=0.1),
                 ValueError, "overlap_with")
    expect_error(lambda: optimizer.add_param_group({"params": [outsider]}), ValueError, "param_group")


class DeferredAllGather:
    """An async all-gather whose result reaches ``output`` only when waited for.

    The gather itself is real; deferring the copy makes a missing wait show, where gloo's own async
    all-gather usually completes before anyone looks.
    """

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        assert async_op, "overlap_with launches its all-gathers asynchronously"
        self.output, self.result = output, torch.empty_like(output)
        dist.all_gather_into_tensor(self.result, input, group=group)

    def wait(self) -> None:
        self.output.copy_(self.result)


def check_bad_input_fails_on_every_rank(_: Path) -> None:
    rank, world_size = world()
    model = ParamBag([10, 20, 30])
    params = list(model.parameters()) + ([nn.Parameter(torch.zeros(3, device=DEVICE))] if rank == 0 else [])
    expect_error(lambda: ShardedOptimizer(params, torch.optim.SGD, lr=0.1), ValueError, "params")

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    expect_error(lambda: optimizer.consolidate_state_dict(to=world_size), ValueError, "to")
    expect_error(lambda: optimizer.add_param_group({"params": [torch.zeros(2, device="meta")]}),
                 ValueError, "param_group")
    model.loss(0).backward()
    model.weights[1].data = model.weights[1].data.clone()  # what model.to() does to each parameter
    expect_error(optimizer.step, RuntimeError, "params")


def check_reshard_between_two_and_three_ranks(tmp: Path) -> None:
    """Save on 2 ranks, resume on 3, and the other way round; both equal uninterrupted training."""
    rank, _ = world()
    pair = dist.new_group([0, 1])
    if rank == 2:
        expect_error(lambda: ShardedOptimizer([nn.Parameter(torch.zeros(2))], torch.optim.SGD, pair, lr=0.1),
                     ValueError, "process_group")
    sizes = [33, 4, 50, 12, 27, 2, 19]
    groups = lambda m: [{"params": list(m.weights)[:4]}, {"params": list(m.weights)[4:], "lr": 3e-2}]  # noqa: E731
    reference = ParamBag(sizes)
    reference_optimizer = torch.optim.AdamW(groups(reference), lr=1e-2)
    train(reference, reference_optimizer, range(6))
    for save_group, load_group, name in [(pair, None, "2to3"), (None, pair, "3to2")]:
        if save_group is None or rank < 2:
            model = ParamBag(sizes)
            optimizer = ShardedOptimizer(groups(model), torch.optim.AdamW, save_group, lr=1e-2)
            train(model, optimizer, range(3))
            optimizer.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save({"optimizer": optimizer.state_dict(), "model": model.state_dict()},
                           tmp / f"{name}.pt")
        dist.barrier()
        if load_group is None or rank < 2:
            checkpoint = torch.load(tmp / f"{name}.pt", weights_only=True, map_location="cpu")
            model = ParamBag(sizes, seed=3)
            model.load_state_dict(checkpoint["model"])
            optimizer = ShardedOptimizer(groups(model), torch.optim.AdamW, load_group, lr=1e-2)
            optimizer.load_state_dict(checkpoint["optimizer"])
            train(model, optimizer, range(3, 6))
            assert_equal_params(model, reference, f"after resharding {name}")


def check_distributed_checkpoint_between_world_sizes(tmp: Path) -> None:
    """get/set_optimizer_state_dict + dcp.save/load, default options: 2 -> 3 and 3 -> 1 ranks, exactly.

    Checkpoints also move from the unsharded AdamW to ShardedOptimizer and back.

    The 3-rank save also takes a ZeroRedundancyOptimizer-style checkpoint in the same iteration,
    which must not disturb DCP (rank 0 then gives DCP the full state, the others their shards).
    """
    rank, _ = world()
    pair, single = dist.new_group([0, 1]), dist.new_group([0])
    sizes = [33, 4, 50, 12, 27, 2, 19]
    groups = lambda m: [{"params": list(m.weights)[:4]}, {"params": list(m.weights)[4:], "lr": 3e-2}]  # noqa: E731
    reference = ParamBag(sizes)
    reference_optimizer = torch.optim.AdamW(groups(reference), lr=1e-2, weight_decay=0.1)
    train(reference, reference_optimizer, range(6))

    Group = dist.ProcessGroup | None

    def fresh(group: Group, sharded: bool = True) -> tuple[ParamBag, torch.optim.Optimizer]:
        model = ParamBag(sizes, seed=3)  # lr=0.5: the checkpoint brings back the right one
        if not sharded:
            return model, torch.optim.AdamW(groups(model), lr=0.5)
        return model, ShardedOptimizer(groups(model), torch.optim.AdamW, group, lr=0.5)

    def save(model: ParamBag, optimizer: torch.optim.Optimizer, path: Path, group: Group) -> None:
        state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=path, process_group=group)

    def load(model: ParamBag, optimizer: torch.optim.Optimizer, path: Path, group: Group) -> None:
        state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path, process_group=group)
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"])

    for save_group, load_group, name in [(pair, None, "2to3"), (None, single, "3to1")]:
        if save_group is None or rank < 2:
            model = ParamBag(sizes)
            optimizer = ShardedOptimizer(groups(model), torch.optim.AdamW, save_group, lr=1e-2,
                                         weight_decay=0.1)
            train(model, optimizer, range(3))
            if save_group is None:
                optimizer.consolidate_state_dict(to=0)
                if rank == 0:
                    torch.save({"optimizer": optimizer.state_dict(), "model": model.state_dict()},
                               tmp / "zero_idiom.pt")
            save(model, optimizer, tmp / name, save_group)
        dist.barrier()
        if load_group is None or rank == 0:
            model, optimizer = fresh(load_group)
            load(model, optimizer, tmp / name, load_group)
            train(model, optimizer, range(3, 6))
            assert_equal_params(model, reference, f"after moving {name} with torch.distributed.checkpoint")
        dist.barrier()
    # The unsharded optimizer's DCP checkpoint (every rank holds all the state) loads into the sharded one.
    model = ParamBag(sizes)
    optimizer = torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.1)
    train(model, optimizer, range(3))
    save(model, optimizer, tmp / "unsharded", None)
    model, optimizer = fresh(None)
    load(model, optimizer, tmp / "unsharded", None)
    train(model, optimizer, range(3, 6))
    assert_equal_params(model, reference, "after resuming AdamW's DCP checkpoint in ShardedOptimizer")
    if rank == 0:  # the sharded checkpoints load into the unsharded optimizer
        for name, path in [("dcp", tmp / "3to1"), ("zero_idiom", None)]:
            model, optimizer = fresh(single, sharded=False)
            if path is None:
                checkpoint = torch.load(tmp / "zero_idiom.pt", weights_only=True)
                model.load_state_dict(checkpoint["model"])
                optimizer.load_state_dict(checkpoint["optimizer"])
            else:
                load(model, optimizer, path, single)
            train(model, optimizer, range(3, 6))
            assert_equal_params(model, reference, f"after resuming the {name} checkpoint in AdamW")


class FrozenTrunk(nn.Module):
    """A frozen Linear(64, 64) under two small trainable layers: at 2 ranks, rank 0 owns only its weight."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(64, 64).requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 2))
        self.to(DEVICE)

    def loss(self, step: int) -> torch.Tensor:
        inputs = torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        return self.head(self.trunk(inputs)).square().mean()


def check_distributed_checkpoint_with_a_rank_of_frozen_parameters(tmp: Path) -> None:
    """get_optimizer_state_dict steps an optimizer whose ``state`` is empty: on every rank or on none.

    A rank that owns only frozen parameters holds no state, even after training; torch's
    _init_optim_state used to step there alone, and the save aborted (a hang on NCCL).
    """
    rank, world_size = world()
    model, reference = FrozenTrunk(), FrozenTrunk()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    mine = [p for p, owner in zip(model.parameters(), optimizer.param_owners, strict=True) if owner == rank]
    if rank == 0:
        assert mine and not any(p.requires_grad for p in mine), "rank 0 should own only frozen parameters"
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(model, optimizer, range(3), (reference, reference_optimizer))
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp / "checkpoint")
    # A fresh optimizer (no state anywhere, so every rank takes the initializing step) loads it back.
    resumed = FrozenTrunk(seed=1)
    resumed_optimizer = ShardedOptimizer(resumed.parameters(), torch.optim.AdamW, lr=0.5)
    state = {"model": resumed.state_dict(), "optimizer": get_optimizer_state_dict(resumed, resumed_optimizer)}
    dcp.load(state, checkpoint_id=tmp / "checkpoint")
    resumed.load_state_dict(state["model"])
    set_optimizer_state_dict(resumed, resumed_optimizer, optim_state_dict=state["optimizer"])
    assert resumed_optimizer.param_groups[0]["lr"] == 1e-2
    train(resumed, resumed_optimizer, range(3, 6), (reference, reference_optimizer))


def check_state_of_a_parameter_owned_elsewhere_names_its_owner(_: Path) -> None:
    rank, _ = world()
    model = ParamBag([10, 20, 30, 40])
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, optimizer, range(1))
    for index, (param, owner) in enumerate(zip(model.parameters(), optimizer.param_owners, strict=True)):
        if owner == rank:
            assert optimizer.state[param]["exp_avg"].shape == param.shape
            continue
        assert param not in optimizer.state and optimizer.state.get(param) is None
        try:
            optimizer.state[param]["exp_avg"]
        except KeyError as error:
            named = f"parameter {index} (shape {tuple(param.shape)}) is owned by rank {owner}"
            assert named in str(error), error
        else:
            raise AssertionError(f"state[{index}] of rank {owner}'s parameter read on rank {rank}")


def expect_error(fn: Callable[[], object], error: type[Exception], argument: str) -> None:
    try:
        fn()
    except error as caught:
        assert str(caught).startswith(f"{argument}:"), f"message does not name {argument!r}: {caught}"
    else:
        raise AssertionError(f"no {error.__name__} naming {argument!r}")


CHECKS: dict[str, tuple[Callable[[Path], None], tuple[int, ...]]] = {
    "every_optimizer_matches_unsharded": (check_every_optimizer_matches_unsharded, (2, 3)),
    "param_groups_and_lr_scheduler": (check_param_groups_and_lr_scheduler, (2, 3)),
    "add_param_group_moves_state": (check_add_param_group_moves_state_with_its_parameter, (2, 3)),
    "zero_idiom_state_dict_and_resume": (check_zero_idiom_state_dict_and_resume, (2, 3)),
    "shard_where_full_state_belongs": (check_a_shard_where_a_full_state_belongs_fails_on_every_rank, (2, 3)),
    "zero_redundancy_optimizer_interop": (check_zero_redundancy_optimizer_loads_the_same_state, (2, 3)),
    "edge_layouts": (check_edge_layouts, (2, 3)),
    "overlapped_param_gather": (check_overlapped_param_gather_matches_unsharded, (2, 3)),
    "bad_input_fails_on_every_rank": (check_bad_input_fails_on_every_rank, (2, 3)),
    "reshard_between_two_and_three_ranks": (check_reshard_between_two_and_three_ranks, (3,)),
    "distributed_checkpoint_between_world_sizes": (check_distributed_checkpoint_between_world_sizes, (3,)),
    "state_of_a_parameter_owned_elsewhere": (check_state_of_a_parameter_owned_elsewhere_names_its_owner,
                                             (2, 3)),
    "distributed_checkpoint_with_frozen_rank": (check_distributed_checkpoint_with_a_rank_of_frozen_parameters,
                                                (2,)),
}


def without_numpy(what: str) -> str | None:
    """Why a check of ``what`` (a part of torch that needs numpy) cannot run here, or None if it can."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return f"{what} needs numpy, which this environment lacks (shardopt does not need it)"
    return None


# Checks that this environment cannot run, and why (each skipped by the test that would run it).
UNAVAILABLE: dict[str, str | None] = {
    "zero_redundancy_optimizer_interop": without_numpy("ZeroRedundancyOptimizer.consolidate_state_dict"),
    "distributed_checkpoint_between_world_sizes": without_numpy("torch.distributed.checkpoint"),
    "distributed_checkpoint_with_frozen_rank": without_numpy("torch.distributed.checkpoint"),
}


def checks_for(world_size: int) -> list[str]:
    return [name for name, (_, sizes) in CHECKS.items() if world_size in sizes and not UNAVAILABLE.get(name)]


def launch(world_size: int, results_dir: Path, backend: str = "gloo",
           timeout_s: float = 1200) -> dict[str, str]:
    """Run this file on `world_size` processes; {check: 'ok' or why not}, over all ranks.

    The whole process group (torchrun and its workers) is killed after ``timeout_s``, a hang guard
    (the checks take under a minute on a busy 2-core machine), so a hang fails the tests instead of
    stalling them.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", __file__, str(results_dir), backend]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        log, _ = process.communicate(timeout=timeout_s)
        ending = f"torchrun exited with code {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
        ending = f"killed after {timeout_s:.0f} s"
    per_rank = [json.loads(path.read_text()) if path.exists() else {}
                for path in (results_dir / f"rank{r}.json" for r in range(world_size))]
    failed = [name for results in per_rank for name, outcome in results.items() if outcome != "ok"]
    outcomes = {}
    for name in checks_for(world_size):
        failures = [f"rank {r}:\n{results[name]}" for r, results in enumerate(per_rank)
                    if results.get(name, "ok") != "ok"]
        missing = [r for r, results in enumerate(per_rank) if name not in results]
        if failures:
            outcomes[name] = "\n".join(failures)
        elif missing and failed:
            outcomes[name] = f"not run on ranks {missing}: {failed[0]} failed first"
        elif missing:
            outcomes[name] = f"did not finish on ranks {missing} ({ending}); output:\n{log[-6000:]}"
        else:
            outcomes[name] = "ok"
    return outcomes


def main(results_dir: Path, backend: str) -> None:
    global DEVICE
    if backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=900))  # a deadlock guard
    rank, world_size = world()
    results: dict[str, str] = {}
    out = results_dir / f"rank{rank}.json"
    for name in checks_for(world_size):
        scratch = results_dir / name
        scratch.mkdir(exist_ok=True)
        try:
            CHECKS[name][0](scratch)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            out.write_text(json.dumps(results))
            sys.stdout.flush()
            os._exit(1)  # torchrun stops the other ranks, which may be waiting in a collective
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "gloo")
