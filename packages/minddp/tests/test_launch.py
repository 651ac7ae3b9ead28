"""minddp.launch: every rank's result, a failing rank named with its traceback, no hang past the limit."""

from __future__ import annotations

import operator
import os
import time

import pytest
import torch
import torch.distributed as dist

from minddp.launch import WorkerError, free_port, launch, spawn

# A hang guard for the launches below, not a time limit: they finish in seconds even on a busy 2-core
# machine, while a launcher that loses a rank would wait forever.
HANG_GUARD_S = 900


def rank_sum(offset: int) -> tuple[int, int, float]:
    """This rank, the world size, and the all-reduced sum of (rank + offset) over every rank."""
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def test_every_rank_runs_in_one_group_and_returns_in_rank_order():
    assert spawn(rank_sum, 3, (10,), start_method="fork", timeout_s=HANG_GUARD_S) == [
        (0, 3, 33.0), (1, 3, 33.0), (2, 3, 33.0)]


def test_spawned_ranks_run_an_importable_function():
    # spawned processes import fn by name: a test module is not importable there, torch is
    assert spawn(dist.get_rank, 3, timeout_s=HANG_GUARD_S) == [0, 1, 2]


def test_launch_returns_rank_0s_result():
    assert launch(dist.get_world_size, 2, "gloo", timeout_s=HANG_GUARD_S) == 2


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(WorkerError) as failure:
        spawn(operator.truediv, 2, (1, 0), timeout_s=HANG_GUARD_S, start_method="fork")
    assert failure.value.rank in (0, 1)
    assert "ZeroDivisionError" in failure.value.worker_traceback


def test_a_rank_that_dies_without_a_result_is_named():
    with pytest.raises(WorkerError, match="exited with code 3 without a result"):
        spawn(os._exit, 2, (3,), timeout_s=HANG_GUARD_S, start_method="fork")


def test_workers_past_the_time_limit_are_killed():
    sleep_s = 600.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after timeout_s=3"):
        spawn(time.sleep, 2, (sleep_s,), timeout_s=3, start_method="fork")
    assert time.monotonic() - start < sleep_s  # killed, not waited for


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"nproc": 0}, "nproc must be at least 1, got 0"),
    ({"backend": "mpi"}, "backend='mpi' is not one of gloo, nccl"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch(rank_sum, **{"nproc": 2, "backend": "gloo", **kwargs}, args=(0,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_nccl_without_cuda_says_so():
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        spawn(rank_sum, 2, (0,), backend="nccl")


def test_under_torchrun_fn_runs_in_this_process(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    try:
        assert launch(rank_sum, None, "gloo", args=(5,)) == (0, 1, 5.0)
        assert dist.is_initialized()  # torchrun's group stays for the rest of the command
        with pytest.raises(ValueError, match="torchrun started WORLD_SIZE=1"):
            launch(rank_sum, 2, "gloo", args=(5,))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
