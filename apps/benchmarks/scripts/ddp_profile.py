"""Where a DDP wrapper's step time goes: the bare model, BucketedDDP and torch DDP, at world size 1 (no
bytes moved) or over ``--nproc`` ranks (NCCL on GPUs, gloo on CPU processes).

Per configuration: the median step time (forward under bf16 autocast on a GPU, backward, AdamW,
``zero_grad(set_to_none=True)``, as in ``benchmarks.ddp``) and the host's time inside
``loss.backward()`` (it returns once the work is launched); the CPU time spent inside minddp's
post-accumulate-grad hooks and its end-of-backward callback (wall time on the thread that runs them,
the autograd device thread on a GPU); and, from ``torch.profiler`` over one more step, the device
time of NCCL kernels, of copies and fills, and of the rest (compute), and how long the device sat
idle within the step; of the NCCL time, how much ran while no other kernel did (exposed: what the
backward did not hide) and the share hidden behind other kernels; and how many host-device
synchronizations torch flags in one more step (compare with the bare model's count). An overhead
that shows up as idle time is host time (the launching thread fell behind, or waited for the
device); one that shows up as kernel time is device work; one that shows up as exposed NCCL time is
communication the backward did not hide. With ``--nproc`` above 1 the table is rank 0's, but for
the step time, the slowest rank's.

    export PYTHONPATH=packages/flashattn-triton/src:packages/minddp/src:packages/shardopt/src
    export PYTHONPATH=$PYTHONPATH:packages/profkit/src:apps/benchmarks/src
    python3 apps/benchmarks/scripts/ddp_profile.py --size xl            # single, bucketed, torch
    python3 apps/benchmarks/scripts/ddp_profile.py --size xl --configs single,naive,overlap,torch
    python3 apps/benchmarks/scripts/ddp_profile.py --size xl --nproc 2   # how much NCCL time is hidden
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import (
    ArgumentParser,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    save_results,
)
from benchmarks.ddp import wrap
from benchmarks.model import MODEL_SIZES, TransformerLM, model_config, random_batch
from minddp import reducer
from minddp.launch import spawn, tensor_device

CONFIGS = ["single", "naive", "flat", "overlap", "bucketed", "torch"]  # naive..bucketed: minddp's strategies


COLUMNS = ["step ms", "bwd host ms", "hooks ms", "hook us/call", "callback ms",
           "nccl ms", "nccl exposed ms", "nccl hidden %", "copy ms", "compute ms", "idle ms", "syncs"]


class HookClock:
    """Wall time spent inside the reducer's per-gradient hook and end-of-backward callback."""

    def __init__(self) -> None:
        self.seconds = {"hooks": 0.0, "callback": 0.0}
        self.calls = {"hooks": 0, "callback": 0}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Times the hooks of the wrappers built inside, and every reducer's callback."""
        originals = reducer._grad_ready_hook, reducer.Reducer.finish
        reducer._grad_ready_hook = lambda *args: self._timed("hooks", originals[0](*args))
        reducer.Reducer.finish = self._timed("callback", originals[1])
        try:
            yield
        finally:
            reducer._grad_ready_hook, reducer.Reducer.finish = originals

    def reset(self) -> None:
        for key in self.seconds:
            self.seconds[key], self.calls[key] = 0.0, 0

    def _timed(self, key: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            with torch.profiler.record_function(f"minddp.{key}"):
                result = function(*args)
            self.seconds[key] += time.perf_counter() - start
            self.calls[key] += 1
            return result
        return timed


Intervals = list[tuple[float, float]]


def device_times(prof: profile, step_ms: float) -> dict[str, float]:
    """Device time (ms) by kernel category over the profiled step, the time no kernel ran, and how much of
    the NCCL kernels' time no other kernel overlapped."""
    kinds = {"nccl ms": 0.0, "copy ms": 0.0, "compute ms": 0.0}
    nccl: Intervals = []
    other: Intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.time_range.elapsed_us() <= 0:
            continue
        name = event.name.lower()
        kind = ("nccl ms" if "nccl" in name or "onerank" in name else  # oneRankReduce: NCCL at one rank
                "copy ms" if any(k in name for k in ("memcpy", "memset", "copy", "fill")) else "compute ms")
        kinds[kind] += event.time_range.elapsed_us() / 1e3
        (nccl if kind == "nccl ms" else other).append((event.time_range.start, event.time_range.end))
    busy = merged(nccl + other)
    kinds["idle ms"] = step_ms - length(busy) / 1e3 if busy else float("nan")
    exposed = length(busy) - length(merged(other))  # when only NCCL ran
    kinds["nccl exposed ms"] = exposed / 1e3
    kinds["nccl hidden %"] = 100 * (1 - exposed / length(merged(nccl))) if nccl else float("nan")
    return kinds


def merged(intervals: Intervals) -> Intervals:
    """The union of ``intervals`` as disjoint sorted intervals."""
    union: Intervals = []
    for start, stop in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], stop))
        else:
            union.append((start, stop))
    return union


def length(union: Intervals) -> float:
    return sum(stop - start for start, stop in union)


def train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor) -> tuple[float, float]:
    """One training step as ``benchmarks.ddp`` runs it: its wall time in ms, the device synchronized,
    and how long the host spent inside ``loss.backward()`` (launching, not waiting for, the work)."""
    synchronize(tokens.device)
    start = time.perf_counter()
    with (torch.autocast("cuda", dtype=torch.bfloat16) if tokens.is_cuda else contextlib.nullcontext()):
        loss = F.cross_entropy(ddp(tokens).flatten(0, 1).float(), targets.flatten())
    backward_start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(tokens.device)
    return (time.perf_counter() - start) * 1e3, (backward_end - backward_start) * 1e3


def measure(config: str, args: argparse.Namespace, device: torch.device,
            clock: HookClock) -> dict[str, float]:
    """Step time and hook time over ``args.steps`` steps, then the device times of one profiled step."""
    cfg = model_config(args.size, args.context)
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    ddp = wrap(model, config, args.bucket_mb, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [tuple(random_batch(cfg, args.batch, args.context, device) for _ in range(2))
               for _ in range(args.warmup + args.steps + 1)]
    for tokens, targets in batches[:args.warmup]:
        train_step(ddp, optimizer, tokens, targets)
    clock.reset()
    times = [train_step(ddp, optimizer, tokens, targets) for tokens, targets in batches[args.warmup:-1]]
    row = {"step ms": statistics.median(step for step, _ in times),
           "bwd host ms": statistics.median(backward for _, backward in times),
           "hooks ms": clock.seconds["hooks"] * 1e3 / args.steps,
           "hook us/call": clock.seconds["hooks"] * 1e6 / max(1, clock.calls["hooks"]),
           "callback ms": clock.seconds["callback"] * 1e3 / args.steps}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled_ms, _ = train_step(ddp, optimizer, *batches[-1])
    if device.type == "cuda":
        row.update(device_times(prof, profiled_ms))
        row["syncs"] = float(synchronizing_calls(lambda: train_step(ddp, optimizer, *batches[-1])))
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        name = f"ddp_{config}_{args.size}_rank{dist.get_rank()}.json"
        prof.export_chrome_trace(os.path.join(args.trace, name))
    return row


def synchronizing_calls(step: Callable[[], Any]) -> int:
    """How many calls that block the host until the device catches up torch flags in ``step``
    (``torch.cuda.set_sync_debug_mode``: ``.item()``, ``.tolist()``, blocking copies and the like;
    waits inside NCCL or the driver are not seen)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_on_rank(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every configuration's row on this rank (run in a process group that :func:`minddp.launch.spawn` set
    up), the hooks timed."""
    device = tensor_device("nccl" if torch.cuda.is_available() else "gloo")
    clock = HookClock()
    rows = {}
    with clock.installed():
        for config in args.configs:
            rows[config] = measure(config, args, device, clock)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(MODEL_SIZES),
                        default="xl" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--configs", default="single,bucketed,torch",
                        help=f"comma-separated among {', '.join(CONFIGS)}")
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="ranks (one GPU each with NCCL, else CPU processes with gloo)")
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--context", type=positive_int, default=512)
    parser.add_argument("--bucket-mb", type=nonnegative_float, default=25.0)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--trace", default=None, help="a folder for each profiled step's Chrome trace")
    parser.add_argument("--timeout", type=positive_float, default=600,
                        help="seconds before the ranks are killed")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="also write the table as <results-dir>/<device>/ddp_profile.csv and .md")
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    if "single" not in args.configs or not set(args.configs) <= set(CONFIGS):
        parser.error(f"--configs: 'single' and any of {', '.join(CONFIGS[1:])}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc: at most the GPU count ({torch.cuda.device_count()}), got {args.nproc}")

    per_rank = spawn(profile_on_rank, args.nproc, (args,), backend=backend, timeout_s=args.timeout)
    rows = per_rank[0]
    for config, row in rows.items():  # a step takes as long as its slowest rank
        row["step ms"] = max(rank_rows[config]["step ms"] for rank_rows in per_rank)
    print(f"{args.size}, batch {args.batch}x{args.context} a rank, {backend} world size {args.nproc}, "
          f"{args.bucket_mb:g} MiB buckets; median of {args.steps} steps (the slowest rank's); the rest rank "
          "0's, device times from one profiled step")
    columns = [c for c in COLUMNS if c in rows["single"]] + ["overhead ms"]
    print(f"{'':10}" + "".join(f"{c:>16}" for c in columns))
    for config, row in rows.items():
        row["overhead ms"] = row["step ms"] - rows["single"]["step ms"]
        print(f"{config:10}" + "".join(f"{row[c]:16.2f}" for c in columns))
    if args.results_dir is not None:
        save_table(rows, columns, args, backend)


def save_table(rows: dict[str, dict[str, float]], columns: list[str], args: argparse.Namespace,
               backend: str) -> None:
    """The printed table as <results-dir>/<device>/ddp_profile.csv and .md, with the run's metadata."""
    table = pd.DataFrame([{"config": config, **{c: row[c] for c in columns}} for config, row in rows.items()])
    command = " ".join(["python3 apps/benchmarks/scripts/ddp_profile.py", *map(shlex.quote, sys.argv[1:])])
    where = argparse.Namespace(no_save=False, results_dir=args.results_dir, command=command)
    save_results(table, "ddp_profile", where,
                 {"ranks": str(args.nproc), "backend": backend, "model": args.size,
                  "per-rank batch": f"{args.batch}x{args.context}", "bucket MiB": f"{args.bucket_mb:g}"})


if __name__ == "__main__":
    main()
