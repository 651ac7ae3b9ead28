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


def test_first_bucket_holds_at_most_one_mib_and_the_rest_fill_up(single_rank_group):
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # weights of exactly 1 MiB
    reverse = ["1.bias", "1.weight", "0.bias", "0.weight"]
    assert BucketedDDP(model, bucket_size_mb=25).bucket_names == [reverse[:1], reverse[1:]]
    assert BucketedDDP(model, bucket_size_mb=None).bucket_names == [reverse]
    assert len(BucketedDDP(model, bucket_size_mb=0.5).bucket_names) == 4


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
    assert len(launched) == len(ddp.bucket_names)  # all of them by the time backward returns



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
