"""Misuse gets a clear error, on every rank (so none is left waiting in a collective); subgroups work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import minddp
from minddp import STRATEGIES, BucketedDDP, NaiveDDP, OverlapDDP, make_ddp


def test_without_a_process_group_every_strategy_says_to_initialize_one():
    assert not dist.is_initialized()
    for cls in STRATEGIES.values():
        with pytest.raises(RuntimeError, match="init_process_group"):
            cls(nn.Linear(2, 2))


def test_a_device_the_backend_cannot_serve_is_named(single_rank_group):
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'weight' is on device meta.*cannot serve.*cpu \(gloo\)"):
        NaiveDDP(model)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "25", 1e308])  # 1e308 MiB: inf bytes
def test_bucket_size_must_be_a_non_negative_number(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        BucketedDDP(nn.Linear(2, 2), bucket_size_mb=bad)


def test_bucket_cap_mb_is_torchs_name_for_bucket_size_mb(single_rank_group):
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    half = BucketedDDP(model, bucket_size_mb=0.5).bucket_names
    assert len(half) == 2 and BucketedDDP(model, bucket_cap_mb=0.5).bucket_names == half
    assert BucketedDDP(model, bucket_cap_mb=None).bucket_names == BucketedDDP(model).bucket_names  # 25 MiB
    with pytest.raises(ValueError, match=r"bucket_size_mb \(1\) or its torch name bucket_cap_mb \(2\), not"):
        BucketedDDP(model, bucket_size_mb=1, bucket_cap_mb=2)
    with pytest.raises(ValueError, match="bucket_cap_mb must be"):
        BucketedDDP(model, bucket_cap_mb=-1)


def test_device_ids_with_a_cpu_module_are_refused_as_by_torch(single_rank_group):
    with pytest.raises(ValueError, match="device_ids"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    for cls in STRATEGIES.values():
        with pytest.raises(ValueError, match=r"device_ids and output_device only work with a module on one"):
            cls(nn.Linear(2, 2), device_ids=[0])
        with pytest.raises(ValueError, match="output_device"):
            cls(nn.Linear(2, 2), output_device=0)


def test_a_comm_hook_is_registered_once(single_rank_group):
    ddp = NaiveDDP(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="hook must be callable"):
        ddp.register_comm_hook(None, "allreduce")
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)


def returns_the_buffer(state: object, bucket: minddp.GradBucket) -> torch.Tensor:
    return bucket.buffer()  # the tensor itself, where a Future of it belongs


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_comm_hook_that_returns_no_future_is_named(single_rank_group, strategy):
    ddp = make_ddp(strategy, nn.Linear(2, 2))
    ddp.register_comm_hook(None, returns_the_buffer)
    with pytest.raises(TypeError, match=r"hook returns_the_buffer returned a Tensor for bucket 0; .*Future"):
        ddp(torch.ones(1, 2)).sum().backward()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_changing_dtype_or_device_after_wrapping_says_wrap_after_to(single_rank_group, strategy):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ddp = make_ddp(strategy, model)
    for convert in (ddp.double, ddp.half, lambda: ddp.to("meta"), lambda: ddp.to(torch.bfloat16)):
        with pytest.raises(RuntimeError, match=r"torch.float32 tensors on cpu into .* Wrap after \.to\(\)"):
            convert()
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # refused before anything changed
    ddp.to("cpu").float()  # what changes nothing is allowed
    ddp(torch.ones(3, 2)).sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # "import numpy" fails from here on, as in a venv without numpy
import torch
import torch.distributed as dist
from torch import nn
from minddp import STRATEGIES
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
for cls in STRATEGIES.values():
    ddp = cls(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ddp(torch.randn(3, 4)).sum().backward()
print("trained without numpy")
"""


def test_needs_no_numpy(tmp_path):
    source = str(Path(minddp.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", NO_NUMPY, f"file://{tmp_path / 'store'}"], env=env,
                          capture_output=True, text=True, timeout=900)  # hang guard; takes seconds
    assert done.returncode == 0 and "trained without numpy" in done.stdout, done.stderr


def test_make_ddp_names_the_strategies_it_knows(single_rank_group):
    with pytest.raises(ValueError, match="strategy='zero'.*naive, flat, overlap, bucketed"):
        make_ddp("zero", nn.Linear(2, 2))
    assert isinstance(make_ddp("bucketed", nn.Linear(2, 2), bucket_size_mb=1), BucketedDDP)


class FirstOnly(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self[0](x)


def error_of(build) -> str:
    try:
        build()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


def misuse_on_three_ranks(rank: int, world_size: int) -> dict[str, object]:
    last = world_size - 1
    seen: dict[str, object] = {}
    seen["shape"] = error_of(lambda: NaiveDDP(nn.Linear(4, 3 if rank == last else 2)))
    frozen = nn.Linear(4, 2)
    frozen.bias.requires_grad_(rank != last)
    seen["requires_grad"] = error_of(lambda: BucketedDDP(frozen))
    extra = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3 if rank == last else 2)])
    seen["extra"] = error_of(lambda: OverlapDDP(extra))
    with torch.device("meta" if rank == last else "cpu"):
        somewhere_else = nn.Linear(2, 2)
    seen["device"] = error_of(lambda: NaiveDDP(somewhere_else))

    for name in STRATEGIES:
        ddp = make_ddp(name, nn.Linear(2, 2))
        loss = ddp(torch.ones(1, 2)).sum()
        loss.backward(retain_graph=True)
        seen[f"twice/{name}"] = error_of(loss.backward)
        ddp(torch.ones(1, 2)).sum().backward()  # the next iteration works: the group stays usable

    # Wrapped differently on the last rank: caught at construction, on every rank.
    seen["strategy"] = error_of(lambda: make_ddp("flat" if rank == last else "naive", nn.Linear(2, 2)))
    seen["bucket_size"] = error_of(lambda: BucketedDDP(nn.Linear(2, 2), bucket_size_mb=1 + (rank == last)))
    seen["find_unused"] = error_of(lambda: NaiveDDP(nn.Linear(2, 2), find_unused_parameters=rank == last))

    # find_unused_parameters=False and a parameter without a gradient: torch DDP's error, on time.
    unused = NaiveDDP(FirstOnly(nn.Linear(2, 2), nn.Linear(2, 2)))
    seen["unused"] = error_of(lambda: unused(torch.ones(1, 2)).sum().backward())

    # A subgroup of the last two ranks: its rank 0 is global rank 1, which must be the source of the weights.
    group = dist.new_group([1, 2])
    torch.manual_seed(rank)
    model = nn.Linear(1, 1, bias=False)
    if rank == 0:
        seen["outsider"] = error_of(lambda: BucketedDDP(model, process_group=group))
    else:
        ddp = BucketedDDP(model, process_group=group)
        ddp(torch.full((1, 1), float(rank + 1))).sum().backward()  # grad = rank + 1
        ddp.finish_gradient_synchronization()
        seen["subgroup_grad"] = model.weight.grad.item()
        seen["subgroup_weight"] = model.weight.item()
    dist.barrier()
    return seen


@pytest.fixture(scope="module")
def misuse(ranks) -> list[dict[str, object]]:
    return ranks(misuse_on_three_ranks, 3)


@pytest.mark.parametrize("check, pattern", [
    ("shape", r"parameter 'weight' has shape \(2, 4\).*rank 0 but shape \(3, 4\).*on rank 2"),
    ("requires_grad", r"'bias'.*requires_grad=True on rank 0.*requires_grad=False on rank 2"),
    ("extra", r"only rank 2 has parameter '2.weight'"),
    ("device", r"rank 2: .*'weight' is on device meta"),
])
def test_a_model_that_differs_between_ranks_fails_on_every_rank(misuse, check, pattern):
    for seen in misuse:
        assert re.search(pattern, seen[check]), seen[check]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_second_backward_without_forward_is_refused(misuse, name):
    for seen in misuse:
        assert "second gradient" in seen[f"twice/{name}"] and "no_sync" in seen[f"twice/{name}"]


@pytest.mark.parametrize("check, pattern", [
    ("strategy", r"strategy: 'NaiveDDP' on rank 0 but 'FlatDDP' on rank 2"),
    ("bucket_size", r"bucket_size_mb: 1.0 on rank 0 but 2.0 on rank 2"),
    ("find_unused", r"find_unused_parameters: False on rank 0 but True on rank 2"),
])
def test_a_wrapper_that_differs_between_ranks_fails_on_every_rank(misuse, check, pattern):
    for seen in misuse:
        assert re.search(pattern, seen[check]), seen[check]


def test_a_parameter_without_gradient_needs_find_unused_parameters(misuse):
    for seen in misuse:
        pattern = r"2 parameter\(s\) got no gradient.*: 1.weight, 1.bias\..*find_unused_parameters=True"
        assert re.search(pattern, seen["unused"]), seen["unused"]


def test_process_group_averages_over_its_members_from_its_first_member(misuse):
    assert "not a member" in misuse[0]["outsider"]
    for seen in misuse[1:]:
        assert seen["subgroup_grad"] == pytest.approx((2 + 3) / 2)
    torch.manual_seed(1)  # global rank 1 built its model from seed 1
    expected = nn.Linear(1, 1, bias=False).weight.item()
    assert misuse[1]["subgroup_weight"] == misuse[2]["subgroup_weight"] == expected
