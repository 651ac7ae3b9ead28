"""Bucket mechanics on one rank: gradient views, no_sync, hooks that leave with their wrapper, and when
each strategy launches its all-reduces."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp import BucketedDDP, OverlapDDP, make_ddp


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def step(ddp: nn.Module, opt: torch.optim.Optimizer, set_to_none: bool) -> None:
    ddp(torch.randn(3, 4)).sum().backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)


def test_one_bucket_gradients_are_views_of_one_buffer(single_rank_group):
    ddp = BucketedDDP(mlp(), bucket_size_mb=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for set_to_none in (True, False, True):
        ddp(torch.randn(3, 4)).sum().backward()
        ddp.finish_gradient_synchronization()
        storages = {p.grad.untyped_storage().data_ptr() for p in ddp.parameters()}
        assert len(storages) == 1, f"after zero_grad(set_to_none={not set_to_none}) the views were lost"
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def test_finish_inside_no_sync_leaves_gradients_local(single_rank_group):
    ddp = BucketedDDP(mlp())
    with ddp.no_sync():
        ddp(torch.ones(1, 4)).sum().backward()
        local = [p.grad.clone() for p in ddp.parameters()]
        ddp.finish_gradient_synchronization()
    assert all(torch.equal(p.grad, g) for p, g in zip(ddp.parameters(), local, strict=True))
    ddp(torch.ones(1, 4)).sum().backward()  # the synced step that follows sees every gradient once
    ddp.finish_gradient_synchronization()
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(ddp.parameters(), local, strict=True))


def test_a_dropped_wrapper_leaves_no_hooks(single_rank_group):
    model = mlp()
    ddp = OverlapDDP(model)
    alive = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert alive() is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    again = BucketedDDP(model)  # wrapping the same module anew works as if it were the first time
    step(again, torch.optim.SGD(again.parameters(), lr=0.1), set_to_none=True)


def torch_ddp_buckets(model: nn.Module, limits: list[int]) -> list[list[str]]:
    """The buckets torch DDP builds for ``model``'s trainable parameters, by name, when backward produces
    their gradients in reverse order (its buckets after the first iteration)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size([p for _, p in named], limits, [],
                                                         list(range(len(named))))
    return [[named[i][0] for i in bucket] for bucket in buckets]


def mixed_sizes() -> nn.Module:
    # 1 MiB, 0.5 MiB and 2 MiB weights, small biases, a frozen layer, an fp16 layer between fp32 ones.
    return nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 256), nn.Linear(256, 512).half(),
                         nn.Linear(512, 1024), nn.Linear(1024, 8).requires_grad_(False), nn.Linear(8, 1024))


@pytest.mark.parametrize("size_mb", ["default", 0, 0.25, 0.5, 1, 1.5, 3, 25])
def test_buckets_are_torch_ddps(single_rank_group, size_mb):
    model = mixed_sizes()
    if size_mb == "default":  # torch's first bucket closes at 1 MiB, the others at 25 MiB
        ours = BucketedDDP(model).bucket_names
        assert ours == BucketedDDP(model, bucket_cap_mb=None).bucket_names
        theirs = torch_ddp_buckets(model, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20])
    else:  # a size given applies to every bucket
        ours = BucketedDDP(model, bucket_cap_mb=size_mb).bucket_names
        assert ours == BucketedDDP(model, bucket_size_mb=size_mb).bucket_names
        theirs = torch_ddp_buckets(model, [int(size_mb * 2**20)])
    # torch lists the buckets still open at the end in no fixed order between dtypes; we in order.
    assert sorted(ours) == sorted(theirs)
    assert ours[:-2] == theirs[:-2]


def test_a_bucket_closes_once_it_reaches_the_size(single_rank_group):
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # weights of exactly 1 MiB
    reverse = ["1.bias", "1.weight", "0.bias", "0.weight"]
    assert BucketedDDP(model).bucket_names == [reverse[:2], reverse[2:]]  # the first closes at 1 MiB
    assert BucketedDDP(model, bucket_size_mb=25).bucket_names == [reverse]
    assert BucketedDDP(model, bucket_size_mb=0.5).bucket_names == [reverse[:2], reverse[2:]]
    assert BucketedDDP(model, bucket_size_mb=None).bucket_names == [reverse]
    assert len(BucketedDDP(model, bucket_size_mb=0).bucket_names) == 4


class OutOfOrder(nn.Module):
    """Layers registered in another order than forward runs them: the last one registered runs first, so
    its gradient comes last, though reverse registration order would put it in the first bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 8)
        self.middle = nn.Linear(64, 64)
        self.embed = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.middle(torch.relu(self.embed(x)))))


def torch_ddp_rebuilt_buckets(model: nn.Module, size_mb: float) -> list[list[str]]:
    """The buckets torch DDP has rebuilt after the first iterations, in the order backward produced the
    gradients (from its logging data), by parameter name."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=size_mb)
    for _ in range(3):  # rebuilt at the second forward, logged at the third
        ddp(torch.randn(3, 16)).sum().backward()
    logged = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return [[names[int(i)] for i in bucket.split()] for bucket in logged.split(",")]


@pytest.mark.parametrize("size_mb", [0, 0.004, 0.02])
def test_buckets_are_rebuilt_in_the_order_backward_produced_the_gradients_as_torch_ddps(single_rank_group,
                                                                                       size_mb):
    torch.manual_seed(0)
    ddp = BucketedDDP(OutOfOrder(), bucket_size_mb=size_mb)
    registered = [n for n, _ in ddp.module.named_parameters()]
    assert sum(ddp.bucket_names, [])[::-1] == registered  # reverse registration order until backward ran
    ddp(torch.randn(3, 16)).sum().backward()
    assert ddp.bucket_names == torch_ddp_rebuilt_buckets(OutOfOrder(), size_mb)
    assert ddp.bucket_names[0][0].startswith("head.")


def test_a_parameter_registered_after_its_use_holds_back_no_bucket_once_rebuilt(single_rank_group,
                                                                                  monkeypatch):
    launched: list[torch.Tensor] = []  # gradient buckets only, not integer flags
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **kw: (
        tensor.is_floating_point() and launched.append(tensor)) or all_reduce(tensor, *a, **kw))
    model = OutOfOrder()
    ddp = BucketedDDP(model, bucket_size_mb=0)  # one parameter a bucket
    launched_before_embed: list[int] = []  # when the last gradient of backward is computed
    model.embed.weight.register_hook(lambda grad: launched_before_embed.append(len(launched)))
    for _ in range(2):
        launched.clear()
        ddp(torch.randn(3, 16)).sum().backward()
    # Reverse registration order puts embed's bias and weight first: only the bias's bucket could go before
    # backward reached the weight, its last gradient. Rebuilt, every bucket but the weight's goes before it.
    assert launched_before_embed == [1, len(ddp.bucket_names) - 1]


@pytest.mark.parametrize("strategy, during_backward", [("naive", False), ("flat", False), ("overlap", True),
                                                       ("bucketed", True)])
def test_overlapped_strategies_launch_during_backward_the_others_after(single_rank_group, monkeypatch,
                                                                      strategy, during_backward):
    launched: list[torch.Tensor] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **kw: launched.append(tensor) or
                        all_reduce(tensor, *a, **kw))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = make_ddp(strategy, model, **({"bucket_size_mb": 0} if strategy == "bucketed" else {}))
    seen_before_first_layer: list[int] = []
    model[0].weight.register_hook(lambda grad: seen_before_first_layer.append(len(launched)))
    ddp(torch.randn(3, 4)).sum().backward()
    assert (seen_before_first_layer[0] > 0) == during_backward
    # All of them by the time backward returns, and the round's open and close flags.
    assert len(launched) == len(ddp.bucket_names) + 2



@pytest.mark.parametrize("strategy", ["naive", "bucketed"])
def test_one_rank_sums_even_where_the_backend_averages(single_rank_group, monkeypatch, strategy):
    # On NCCL, which averages in the collective, a one-rank AVG still runs a scaling kernel over each
    # bucket; a SUM over one rank is the average already, and NCCL launches nothing for it.
    ops: list[dist.ReduceOp] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=dist.ReduceOp.SUM, **kw: ops.append(op) or
                        all_reduce(tensor, op=op, **kw))
    torch.manual_seed(0)
    reference, model = mlp(), mlp()
    model.load_state_dict(reference.state_dict())
    ddp = make_ddp(strategy, model)
    ddp._reducer.average_in_collective = True  # as on NCCL
    inputs = torch.randn(3, 4)
    ddp(inputs).sum().backward()
    reference(inputs).sum().backward()
    assert ops and all(op == dist.ReduceOp.SUM for op in ops)
    for theirs, ours in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
