"""Run a function on every rank of a process group: local processes spawned here, or under torchrun.

    from minddp.launch import launch, spawn

    def measure(sizes):                     # a module-level function: each rank runs it
        rank = torch.distributed.get_rank()  # inside an initialized default group
        ...
        return rows

    rows = launch(measure, nproc=2, backend="gloo", args=(sizes,))   # rank 0's result
    every = spawn(measure, 2, args=(sizes,))                         # every rank's, in rank order

:func:`spawn` starts ``nproc`` processes on this host that meet on a free localhost port; each
calls ``fn(*args)`` inside an initialized default group and sends back its result. A worker's
exception is raised here as :class:`WorkerError` naming its rank, with its traceback; a worker
that dies without a result, likewise; past ``timeout_s`` every worker is killed and
:class:`TimeoutError` names the ranks still running. Nothing is left behind to hang: workers also
end when the launching process dies, even by SIGKILL (the OOM killer, a scheduler), where no
cleanup of its own runs, so no orphan keeps a GPU.

:func:`launch` is the command-line form: under torchrun (``RANK`` and ``WORLD_SIZE`` set) it
runs ``fn`` in this process instead, in torchrun's group, so a command written with ``launch``
runs unchanged on one host or on many; there rank 0 gets the result and the other ranks ``None``.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import datetime
import faulthandler
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl")


class WorkerError(RuntimeError):
    """A worker raised or died: its ``rank`` and ``worker_traceback`` (or how it ended).

    When several ranks fail, ``rank`` is the one that failed first (the others often fail because it
    left their collectives: "Connection reset by peer"), and ``other_failures`` maps each other failed
    rank to its traceback or how it ended.
    """

    def __init__(self, rank: int, worker_traceback: str,
                 other_failures: dict[int, str] | None = None) -> None:
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.other_failures = dict(other_failures or {})
        message = f"rank {rank} failed" + (" first" if self.other_failures else "") + f":\n{worker_traceback}"
        for other, how in sorted(self.other_failures.items()):
            message += f"\nthen rank {other} failed:\n{how}"
        super().__init__(message)


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc(backend: str) -> int:
    """The world size a plain run gets: torchrun's, else every GPU for NCCL, else 2 CPU processes."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return torch.cuda.device_count() if backend == "nccl" else 2


def tensor_device(backend: str) -> torch.device:
    """Where a rank's tensors live for ``backend``: its GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_backend(backend: str, nproc: int | None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs; use backend='gloo' on CPU")
    if nproc is not None and nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if backend == "nccl" and nproc is not None and nproc > torch.cuda.device_count():
        raise ValueError(f"nproc={nproc} NCCL ranks need as many GPUs; "
                         f"this host has {torch.cuda.device_count()}")


def spawn(fn: Callable[..., T], nproc: int, args: Sequence[Any] = (), *, backend: Backend = "gloo",
          timeout_s: float = 1800.0, start_method: Literal["spawn", "fork"] = "spawn",
          threads_per_rank: int | None = None) -> list[T]:
    """``fn(*args)`` on ``nproc`` new local processes, one rank each of a ``backend`` group; every result.

    Returns each rank's result in rank order. ``fn`` and its results must pickle with
    ``start_method="spawn"`` (the default: CUDA cannot be used in forked children); ``"fork"``
    starts faster and takes any callable, for CPU work. NCCL gives each rank the GPU of its local
    rank. ``threads_per_rank`` sets torch's intra-op threads (default: the CPU cores shared out).
    ``timeout_s`` bounds the whole run and every collective in it.
    """
    _check_backend(backend, nproc)
    ctx = multiprocessing.get_context(start_method)
    results: multiprocessing.Queue = ctx.Queue()
    port = free_port()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    procs = [ctx.Process(target=_worker, name=f"rank{rank}",
                         args=(fn, tuple(args), rank, nproc, backend, port, timeout_s, threads, results,
                               os.getpid()))
             for rank in range(nproc)]
    for p in procs:
        p.start()
    finished: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    deadline = time.monotonic() + timeout_s
    succeeded = False
    try:
        while len(finished) + len(failures) < nproc:
            # After a first failure the others get a moment to report theirs, then are stopped.
            wait_until = deadline if not failures else min(
                deadline, min(f.at for f in failures.values()) + _FAILURE_REPORT_S)
            try:
                rank, error, result, failed_at = results.get(
                    timeout=max(0.01, min(1.0, wait_until - time.monotonic())))
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if rank not in finished and rank not in failures and p.exitcode is not None:
                        how = f"{_how_it_ended(p.exitcode)} without a result"
                        failures[rank] = _Failure(time.monotonic(), how, died=True)
                if time.monotonic() >= wait_until:
                    break
                continue
            if error is None:
                finished[rank] = result
            else:
                failures[rank] = _Failure(failed_at, error, died=False)
        if failures:
            first = min(failures, key=lambda r: failures[r].precedence())
            others = {r: f.how for r, f in failures.items() if r != first}
            others.update({r: "still running when stopped" for r in range(nproc)
                           if r not in finished and r not in failures})
            raise WorkerError(first, failures[first].how, others)
        if len(finished) < nproc:
            running = [r for r in range(nproc) if r not in finished]
            raise TimeoutError(f"ranks {running} still running after timeout_s={timeout_s:.0f} s; "
                               "killed them")
        succeeded = True
    finally:
        _stop(procs, grace_s=30.0 if succeeded else 0.0)
    return [finished[rank] for rank in range(nproc)]


def launch(fn: Callable[..., T], nproc: int | None, backend: Backend, args: Sequence[Any] = (),
           timeout_s: float = 1800.0) -> T | None:
    """``fn(*args)`` on ``nproc`` ranks of a ``backend`` group; rank 0's result (``None`` on other ranks).

    Without torchrun: :func:`spawn` (``nproc=None`` means :func:`default_nproc`). Under torchrun:
    ``fn`` runs in this process, in the default group (initialized here if need be, serving CPU
    tensors by gloo and CUDA tensors by NCCL), and ``nproc`` must be ``None`` or the world size.
    """
    if under_torchrun():
        return _run_in_torchrun(fn, nproc, backend, args, timeout_s)
    _check_backend(backend, nproc)
    return spawn(fn, default_nproc(backend) if nproc is None else nproc, args, backend=backend,
                 timeout_s=timeout_s)[0]


def _run_in_torchrun(fn: Callable[..., T], nproc: int | None, backend: str, args: Sequence[Any],
                     timeout_s: float) -> T | None:
    world_size = int(os.environ["WORLD_SIZE"])
    if nproc is not None and nproc != world_size:
        raise ValueError(f"nproc={nproc}, but torchrun started WORLD_SIZE={world_size} ranks; "
                         "leave nproc out under torchrun")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        # One default group for the whole run, serving CPU tensors by gloo and CUDA tensors by NCCL,
        # so one command can measure both backends.
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_destroy_default_group)
    served = str(dist.get_backend_config())
    if f":{backend}" not in served and served != backend:
        raise ValueError(f"backend={backend!r}, but the process group serves {served}")
    result = fn(*args)
    return result if dist.get_rank() == 0 else None


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PARENT_POLL_S = 1.0


def _parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when the thread that started it ends; whether that was possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, rank: int) -> None:
    """Exit once this process's parent is no longer parent_pid: it died, and the orphan was adopted."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    print(f"minddp.launch: rank {rank}: the launching process {parent_pid} is gone; exiting",
          file=sys.stderr, flush=True)
    os._exit(1)


def _exit_with_parent(parent_pid: int, rank: int) -> None:
    """End this worker when the launcher dies, however it dies: by the kernel's parent-death signal on Linux,
    else by a thread watching the parent's pid. A launcher already gone (before the signal was asked for)
    ends it here."""
    if _parent_death_signal():
        if os.getppid() != parent_pid:
            os._exit(1)
        return
    threading.Thread(target=_watch_parent, args=(parent_pid, rank), name="minddp-parent-watch",
                     daemon=True).start()


def _worker(fn: Callable[..., Any], args: Sequence[Any], rank: int, nproc: int, backend: str, port: int,
            timeout_s: float, threads: int, results: multiprocessing.Queue, parent_pid: int) -> None:
    _exit_with_parent(parent_pid, rank)
    faulthandler.enable()  # a crash prints every thread's Python stack to stderr, where the launcher shows it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.set_num_threads(threads)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, None, fn(*args), 0.0))
    except BaseException:
        results.put((rank, traceback.format_exc(), None, time.monotonic()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_FAILURE_REPORT_S = 10.0  # how long the other ranks get to report once one has failed


@dataclasses.dataclass(frozen=True)
class _Failure:
    at: float  # time.monotonic() (one clock for every process of a host) when it raised or was seen dead
    how: str  # its traceback, or how it ended
    died: bool  # ended without reporting: a crash or an exit, which the other ranks' errors then follow

    def precedence(self) -> tuple[bool, float]:
        """Sorts the failure that caused the others first: a death, else the earliest error."""
        return (not self.died, self.at)


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _stop(procs: list[Any], grace_s: float) -> None:
    """Give workers ``grace_s`` to exit, then terminate, then kill the rest (stuck in a collective)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


__all__ = ["BACKENDS", "WorkerError", "default_nproc", "free_port", "launch", "spawn", "tensor_device",
           "under_torchrun"]
