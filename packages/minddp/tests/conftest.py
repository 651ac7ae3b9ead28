"""Run test code on several gloo ranks (forked CPU processes, hard time limit) or on one in-process rank.

The processes come from :func:`minddp.launch.spawn`, the spawner the benchmarks use too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from minddp.launch import WorkerError, free_port, spawn


@contextlib.contextmanager
def _single_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _with_rank(worker: Callable[..., Any], *args: Any) -> Any:
    return worker(dist.get_rank(), dist.get_world_size(), *args)


# Forked ranks save re-importing torch in each. But where GPUs are visible, torch's autograd starts a thread
# a device at the first backward, after which a forked child's backward raises ("Unable to handle autograd's
# threading in combination with fork-based multiprocessing"); ranks are spawned there. device_count() asks
# NVML, so asking does not itself initialize CUDA.
_START_METHOD = "spawn" if torch.cuda.device_count() > 0 else "fork"


# A hang guard, not a time limit: a deadlocked collective waits forever, while every world these tests start
# finishes in well under a minute even on a busy 2-core machine.
HANG_GUARD_S = 900.0


def run_on_ranks(worker: Callable[..., Any], world_size: int, *args: Any,
                 timeout: float = HANG_GUARD_S) -> list[Any]:
    """``worker(rank, world_size, *args)`` on ``world_size`` CPU processes in one gloo group.

    Returns each rank's result (keep it to plain Python values), in rank order. A worker's
    exception fails the call (AssertionError) with that rank's traceback; past ``timeout``
    seconds (a hang guard) every worker is killed. ``worker`` must be a module-level function
    (spawned ranks import it). One rank runs in this process.
    """
    if dist.is_initialized():
        raise RuntimeError("run_on_ranks: a process group is initialized in the parent; destroy it first")
    if world_size == 1:
        with _single_rank_group():
            return [worker(0, 1, *args)]
    try:
        # One thread each: the parent's OpenMP pool does not survive fork, and tiny tests never need it.
        return spawn(_with_rank, world_size, (worker, *args), backend="gloo", timeout_s=timeout,
                     start_method=_START_METHOD, threads_per_rank=1)
    except (WorkerError, TimeoutError) as exc:
        raise AssertionError(str(exc)) from None


@pytest.fixture(scope="session")
def ranks() -> Callable[..., list[Any]]:
    """:func:`run_on_ranks` as a fixture (under --import-mode=importlib tests cannot import conftest)."""
    return run_on_ranks


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo default group in this process, destroyed afterwards."""
    with _single_rank_group():
        yield
