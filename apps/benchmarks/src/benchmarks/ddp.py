"""Data-parallel training step time: minddp's four strategies and torch DDP against one GPU alone.

Trains the reference Transformer LM with AdamW on random tokens, data-parallel over ``--nproc``
ranks, each rank with the same per-GPU batch. Every configuration is a freshly built model
(same seed), warmed up, then timed step by step with the device synchronized after each step; a
step's time is the slowest rank's. Reported per configuration, mean and standard deviation:

- step: forward + backward + gradient synchronization + optimizer step.
- exposed comm: step time minus the single-GPU step time, i.e. the communication (and its
  bookkeeping) not hidden behind backward. It is measured the same way for every strategy,
  torch DDP included; its std combines both steps' (sqrt(s_step^2 + s_single^2)).
- finish wait: the time ``finish_gradient_synchronization()`` holds the stream (CUDA events
  around it; wall time on CPU): after backward, what is still in flight. Not defined for torch
  DDP, which waits inside backward.
- x single: step time / single-GPU step time.

The single-GPU reference ("single") runs the same model, batch and optimizer with no wrapper, on
every rank at once (so CPU runs share the cores the same way as the distributed ones).
``torch`` is ``torch.nn.parallel.DistributedDataParallel`` with its defaults (25 MiB buckets)
except ``broadcast_buffers=False``: the model's only buffers are constant RoPE tables, and the
minddp wrappers do not re-broadcast buffers either. ``--bucket-mb`` lists bucket sizes for
``bucketed`` (one row each).

Spawns one worker per GPU (or 2 CPU processes with gloo), or runs under torchrun unchanged:
    torchrun --nproc-per-node 2 -m benchmarks.ddp --strategy bucketed,torch
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
import statistics
import time
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    console,
    float_list,
    free_device_memory,
    make_parser,
    mark_noise,
    nonnegative_int,
    parse_args,
    positive_float,
    positive_int,
    print_table,
    save_results,
    str_list,
)
from benchmarks.model import MODEL_SIZES, TransformerLM, model_config, random_batch
from minddp import make_ddp
from minddp.launch import default_nproc, launch, tensor_device

TOUR_ARGS = ["--strategy", "all", "--size", "tiny", "--batch", "2", "--context", "32",
             "--warmup", "2", "--steps", "8"]  # enough steps on CPU for a spread to compare with
STRATEGIES = ["naive", "flat", "overlap", "bucketed", "torch"]
SINGLE = "single"


@dataclass(frozen=True)
class Setup:
    size: str
    attention: str
    precision: str
    batch: int
    context: int
    warmup: int
    steps: int
    runs: tuple[tuple[str, float | None], ...]  # (strategy, bucket MiB or None), in order


@dataclass
class StepTimes:
    step_ms: list[float]
    finish_ms: list[float]  # empty where the strategy has no finish_gradient_synchronization
    peak_gib: float
    buckets: float  # gradient all-reduces per step of the overlapped minddp strategies; NaN otherwise


class _Clock:
    """Step-phase timestamps: CUDA events on the current stream, wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def wrap(model: nn.Module, strategy: str, bucket_mb: float | None, device: torch.device) -> nn.Module:
    if strategy == SINGLE:
        return model
    if strategy == "torch":
        # Newer torch renamed broadcast_buffers; either way buffers are synced once, at construction.
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_buffer_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       **no_buffer_sync)
    return make_ddp(strategy, model, **({"bucket_size_mb": bucket_mb} if strategy == "bucketed" else {}))


def train_and_time(setup: Setup, strategy: str, bucket_mb: float | None, device: torch.device) -> StepTimes:
    """Build, wrap and train a fresh model; each rank's own step and finish times."""
    free_device_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cfg = model_config(setup.size, setup.context)
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg, attention=setup.attention)
    ddp = wrap(model, strategy, bucket_mb, device)
    finish = getattr(ddp, "finish_gradient_synchronization", None)
    buckets = len(ddp.bucket_names) if hasattr(ddp, "bucket_names") else math.nan
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device).manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if setup.precision == "bf16"
                else contextlib.nullcontext())
    clock = _Clock(device)
    step_ms: list[float] = []
    finish_ms: list[float] = []
    for step in range(setup.warmup + setup.steps):
        tokens = random_batch(cfg, setup.batch, setup.context, device, generator)
        targets = random_batch(cfg, setup.batch, setup.context, device, generator)
        start = clock.now()
        with autocast:
            logits = ddp(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        backward_done = clock.now()
        if finish is not None:
            finish()
        synced = clock.now()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = clock.now()
        clock.synchronize()
        if step >= setup.warmup:
            step_ms.append(clock.ms(start, end))
            if finish is not None:
                finish_ms.append(clock.ms(backward_done, synced))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    del ddp, model, optimizer, finish
    gc.collect()
    return StepTimes(step_ms, finish_ms, peak, buckets)


def slowest_rank(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the ranks (a step takes as long as its slowest rank)."""
    if not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def benchmark(setup: Setup, backend: str) -> list[dict[str, object]]:
    """Run on every rank: the single-GPU reference, then every configuration, all in the same order."""
    device = tensor_device(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = []
    single_mean = single_std = math.nan
    for strategy, bucket_mb in ((SINGLE, None), *setup.runs):
        times = train_and_time(setup, strategy, bucket_mb, device)
        step_ms = slowest_rank(times.step_ms, device)
        finish_ms = slowest_rank(times.finish_ms, device)
        peak = max(slowest_rank([times.peak_gib], device)) if device.type == "cuda" else math.nan
        step_mean, step_std = mean_std(step_ms)
        if strategy == SINGLE:
            single_mean, single_std = step_mean, step_std
        finish_mean, finish_std = mean_std(finish_ms)
        label = f"{strategy} {bucket_mb:g} MiB" if bucket_mb is not None else strategy
        rows.append({
            "strategy": strategy,
            "bucket MiB": bucket_mb if bucket_mb is not None else (25.0 if strategy == "torch" else math.nan),
            "ranks": 1 if strategy == SINGLE else world_size,
            "buckets": times.buckets,
            "step ms": step_mean, "step std": step_std,
            "exposed comm ms": step_mean - single_mean if strategy != SINGLE else 0.0,
            "exposed std": math.hypot(step_std, single_std) if strategy != SINGLE else 0.0,
            "finish wait ms": finish_mean, "finish std": finish_std,
            "x single": step_mean / single_mean,
            "peak GiB": peak,
        })
        if rank == 0:
            console.print(f"  {label:<22} {step_mean:9.2f} ms/step  ({step_mean / single_mean:.3f}x single)")
    return rows


def runs_from(strategies: list[str], bucket_mbs: list[float]) -> tuple[tuple[str, float | None], ...]:
    runs: list[tuple[str, float | None]] = []
    for strategy in strategies:
        if strategy == "bucketed":
            runs += [("bucketed", mb) for mb in bucket_mbs]
        else:
            runs.append((strategy, None))
    return tuple(runs)


def main(argv: list[str] | None = None) -> None:
    has_gpu = torch.cuda.is_available()
    parser = make_parser("ddp", __doc__)
    parser.add_argument("--strategy", type=str_list(STRATEGIES), default="all",
                        help=f"comma-separated among {', '.join(STRATEGIES)} (or 'all')")
    parser.add_argument("--bucket-mb", type=float_list, default="25",
                        help="bucket sizes (MiB) for 'bucketed', one row each: e.g. 1,10,100,1000")
    parser.add_argument("--size", choices=list(MODEL_SIZES), default="xl" if has_gpu else "tiny",
                        help="reference model size (xl on a GPU, tiny without)")
    parser.add_argument("--attention", choices=["naive", "sdpa", "flash"], default="naive",
                        help="attention implementation of the model")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16" if has_gpu else "fp32",
                        help="fp32, or bf16 autocast: parameters, gradients and their all-reduce stay fp32 "
                             "(bf16 on a GPU, fp32 without)")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per GPU (per rank)")
    parser.add_argument("--context", type=positive_int, default=256, help="tokens per sequence")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="nccl" if has_gpu else "gloo",
                        help="nccl: one GPU per rank; gloo: CPU processes (nccl on a GPU, gloo without)")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="ranks (default: every GPU for nccl, 2 for gloo; torchrun's under torchrun)")
    parser.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps per configuration")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per configuration")
    parser.add_argument("--timeout", type=positive_float, default=1800,
                        help="seconds before the workers are killed")
    args = parse_args(parser, argv)
    if args.batch < 1 or args.context < 1:
        parser.error("--batch and --context must be positive")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    nproc = args.nproc if args.nproc is not None else default_nproc(args.backend)
    if nproc < 1:
        parser.error(f"--nproc: need at least 1 rank, got {nproc}" +
                     (" (no GPU found: use --backend gloo)" if args.backend == "nccl" else ""))

    setup = Setup(args.size, args.attention, args.precision, args.batch, args.context, args.warmup,
                  args.steps, runs_from(args.strategy, args.bucket_mb))
    console.print(f"[bold]{args.size} model, {args.precision}, batch {args.batch}x{args.context} per rank, "
                  f"{nproc} {args.backend} ranks[/bold]")
    rows = launch(benchmark, nproc, args.backend, args=(setup, args.backend), timeout_s=args.timeout)
    if rows is None:  # a torchrun rank other than 0
        return
    df = pd.DataFrame(rows)
    print_table(mark_noise(df, "exposed comm ms", "exposed std", {"exposed comm ms": "~0", "x single": "~1"}),
                f"DDP step time, {args.size} {args.precision}, {args.batch}x{args.context} per rank, "
                f"{nproc} ranks ({args.backend})")
    save_results(df, "ddp", args, metadata={"ranks": str(nproc), "backend": args.backend,
                                            "model": args.size, "precision": args.precision,
                                            "per-rank batch": f"{args.batch}x{args.context}"})


if __name__ == "__main__":
    main()
