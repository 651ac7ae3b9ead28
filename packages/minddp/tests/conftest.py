"""Run test code on several gloo ranks (forked CPU processes, hard time limit) or on one in-process rank."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _single_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_rank(worker: Callable[..., Any], rank: int, world_size: int, port: int, timeout: float,
              results: multiprocessing.Queue, args: tuple) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork; one thread never needs it
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, True, worker(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(worker: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """``worker(rank, world_size, *args)`` on ``world_size`` forked processes in one gloo group.

    Returns each rank's result (keep it to plain Python values), in rank order. A worker's
    exception fails the call with that rank's traceback; past ``timeout`` seconds every worker
    is killed. Forking (not spawning) saves re-importing torch in every worker; nothing here
    touches CUDA. One rank runs in this process.
    """
    if dist.is_initialized():
        raise RuntimeError("run_on_ranks: a process group is initialized in the parent; destroy it first")
    if world_size == 1:
        with _single_rank_group():
            return [worker(0, 1, *args)]
    ctx = multiprocessing.get_context("fork")
    results: multiprocessing.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(worker, rank, world_size, port, timeout, results, args),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                rank, ok, payload = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if dead:
                    code = procs[dead[0]].exitcode
                    raise AssertionError(f"rank {dead[0]} died, exit code {code}") from None
                if time.monotonic() >= deadline:
                    missing = [r for r in range(world_size) if r not in done]
                    raise AssertionError(f"ranks {missing} still running after {timeout:.0f} s") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{payload}")
            done[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[rank] for rank in range(world_size)]


@pytest.fixture(scope="session")
def ranks() -> Callable[..., list[Any]]:
    """:func:`run_on_ranks` as a fixture (under --import-mode=importlib tests cannot import conftest)."""
    return run_on_ranks


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo default group in this process, destroyed afterwards."""
    with _single_rank_group():
        yield
