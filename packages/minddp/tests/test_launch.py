"""minddp.launch: every rank's result, a failing rank named with its traceback, no hang past the limit."""

from __future__ import annotations

import operator
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def last_rank_leaves(how: str) -> None:
    """The last rank raises (or exits) while the others wait for it in a collective, which then fails."""
    if dist.get_rank() == dist.get_world_size() - 1:
        if how == "raise":
            raise ValueError("the cause")
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize(("how", "cause"), [("raise", "ValueError: the cause"),
                                            ("exit", "exited with code 3 without a result")])
def test_the_rank_that_failed_first_is_named_with_the_others_it_took_down(how, cause):
    # the waiting ranks' errors ("Connection reset/closed by peer") can reach the launcher first
    with pytest.raises(WorkerError) as failure:
        spawn(last_rank_leaves, 3, (how,), timeout_s=HANG_GUARD_S, start_method="fork")
    assert failure.value.rank == 2 and cause in failure.value.worker_traceback
    assert sorted(failure.value.other_failures) == [0, 1]
    message = str(failure.value)
    assert message.startswith("rank 2 failed first:") and "then rank 0 failed:" in message


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


# A launcher as a command is one: a script that spawns two ranks that wait; each rank names itself by a file.
LAUNCHER = """
import os, sys, time
from pathlib import Path
from minddp import launch

def wait_forever(folder):
    Path(folder, str(os.getpid())).touch()
    time.sleep(3600)

if __name__ == "__main__":
    folder, start_method, fallback = sys.argv[1:]
    if fallback == "watch":  # as where there is no prctl: the thread watching the parent's pid
        launch._parent_death_signal = lambda: False
    launch.spawn(wait_forever, 2, (folder,), start_method=start_method, timeout_s=3600)
"""


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def poll(condition, limit_s: float, guards: str) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"hang guard ({limit_s:.0f} s): {guards}"
        time.sleep(0.2)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize(("start_method", "fallback"), [("spawn", "prctl"), ("fork", "watch")])
def test_workers_exit_when_their_launcher_is_killed(tmp_path, start_method, fallback):
    """SIGKILL leaves the launcher no chance to stop its workers; they must notice and exit by themselves."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path), start_method, fallback],
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    workers: list[int] = []
    try:
        def started() -> bool:
            workers[:] = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
            assert launcher.poll() is None, f"the launcher exited with {launcher.returncode}"
            return len(workers) == 2
        poll(started, 600, "two workers starting (importing torch, joining a gloo group)")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        poll(lambda: not any(alive(pid) for pid in workers), 120,
             f"workers {workers} exiting after their launcher was killed")
    finally:
        launcher.kill()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
