"""Data-parallel training step time: minddp's four strategies and torch DDP against one GPU alone.

Trains the reference Transformer LM with AdamW on random tokens, data-parallel over ``--nproc``
ranks, each rank with the same per-GPU batch. Every configuration is a freshly built model
(same seed), warmed up, then timed step by step with the device synchronized after each step; a
step's time is the slowest rank's. Reported per configuration:

- step: forward + backward (which returns with the gradients averaged) + optimizer step, mean and
  standard deviation; x single: step time / single-GPU step time; x torch: step time / torch DDP's
  at the same bucket size in the same run.
- From ``--trace-steps`` more steps traced with ``profkit.trace`` on every rank and read by
  ``profkit.analyze_comm`` (per step, mean over the ranks): compute (kernels, or CPU operators on
  CPU), comm (the collectives: NCCL kernels, or gloo's all-reduces on its threads), exposed comm
  (the time a collective runs while no compute does), overlap % (100 * (1 - exposed / comm)),
  wait (the time a rank's collectives wait for the last rank to arrive), bus bandwidth as
  nccl-tests counts it, and the straggler (the rank the others waited for). These are read off the
  timeline, not taken as differences of step times, so they cannot be negative. ``--trace-dir``
  keeps the traces (open them in https://ui.perfetto.dev).

The single-GPU reference ("single") runs the same model, batch and optimizer with no wrapper, on
every rank at once (so CPU runs share the cores the same way as the distributed ones). ``torch``
is ``torch.nn.parallel.DistributedDataParallel``, given the very arguments the minddp wrappers
get (``device_ids``, ``gradient_as_bucket_view=True``, ``broadcast_buffers=False``: the model's
only buffers are constant RoPE tables, and ``bucket_cap_mb``); ``--bucket-mb`` lists bucket sizes
for ``bucketed`` and ``torch`` (one row each).

Spawns one worker per GPU (``--nproc 1``: one GPU alone, NCCL with world size 1), or 2 CPU
processes with gloo, or runs under torchrun unchanged:
    python -m benchmarks.ddp --nproc 1 --strategy bucketed,torch --size xl --precision bf16
    torchrun --nproc-per-node 2 -m benchmarks.ddp --strategy bucketed,torch
With ``--nproc 1`` no byte moves: NCCL with one rank copies at most, so the comm is that copy.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    NOISE,
    console,
    float_list,
    free_device_memory,
    make_parser,
    nonnegative_int,
    parse_args,
    positive_float,
    positive_int,
    print_table,
    save_results,
    str_list,
    with_noise_marked,
    within_noise,
)
from benchmarks.model import MODEL_SIZES, TransformerLM, model_config, random_batch
from benchmarks.overlap import trace_comm
from minddp import make_ddp
from minddp.launch import default_nproc, launch, tensor_device
from profkit.timing import Phase

# enough steps on CPU for a spread to compare with
TOUR_ARGS = ["--strategy", "all", "--size", "tiny", "--batch", "2", "--context", "32",
             "--warmup", "2", "--steps", "8", "--trace-steps", "2"]
STRATEGIES = ["naive", "flat", "overlap", "bucketed", "torch"]
BUCKET_SIZED = ("bucketed", "torch")  # one row per --bucket-mb
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
    trace_steps: int = 2
    trace_dir: str | None = None


@dataclass
class StepTimes:
    step_ms: list[float]
    peak_gib: float
    buckets: float  # gradient all-reduces per step of the minddp strategies; NaN otherwise
    comm: dict[str, Any] = field(default_factory=dict)  # benchmarks.overlap.metrics, from traces


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
    """``model`` wrapped by ``strategy``: torch DDP and minddp get the same torch DDP arguments."""
    if strategy == SINGLE:
        return model
    kwargs: dict[str, object] = {"device_ids": [device.index] if device.type == "cuda" else None,
                                 "gradient_as_bucket_view": True, "broadcast_buffers": False}
    if strategy in BUCKET_SIZED:
        kwargs["bucket_cap_mb"] = bucket_mb
    if strategy == "torch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch >= 2.13 prefers forward_sync_buffers
            return DistributedDataParallel(model, **kwargs)
    return make_ddp(strategy, model, **kwargs)


def _unmarked(name: str) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def train_and_time(setup: Setup, strategy: str, bucket_mb: float | None, device: torch.device,
                   label: str) -> StepTimes:
    """Build, wrap and train a fresh model: each rank's own step times, then its traced steps."""
    free_device_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cfg = model_config(setup.size, setup.context)
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg, attention=setup.attention)
    ddp = wrap(model, strategy, bucket_mb, device)
    buckets = len(ddp.bucket_names) if hasattr(ddp, "bucket_names") else math.nan
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device).manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if setup.precision == "bf16"
                else contextlib.nullcontext())
    clock = _Clock(device)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return (random_batch(cfg, setup.batch, setup.context, device, generator),
                random_batch(cfg, setup.batch, setup.context, device, generator))

    def train_step(phase: Phase, data: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        tokens, targets = data if data is not None else batch()
        with phase("forward"), autocast:
            logits = ddp(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        with phase("backward"):
            loss.backward()  # returns with the gradients averaged
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step_ms: list[float] = []
    for step in range(setup.warmup + setup.steps):
        data = batch()  # made outside the timed span, as the step a user times gets its batch from a loader
        start = clock.now()
        train_step(_unmarked, data)
        end = clock.now()
        clock.synchronize()
        if step >= setup.warmup:
            step_ms.append(clock.ms(start, end))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    comm = trace_comm(train_step, label, setup.trace_steps, setup.trace_dir) if setup.trace_steps else {}
    return StepTimes(step_ms, peak, buckets, comm)


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
    single_mean = math.nan
    for strategy, bucket_mb in ((SINGLE, None), *setup.runs):
        label = f"{strategy} {bucket_mb:g} MiB" if bucket_mb is not None else strategy
        times = train_and_time(setup, strategy, bucket_mb, device, label)
        step_ms = slowest_rank(times.step_ms, device)
        peak = max(slowest_rank([times.peak_gib], device)) if device.type == "cuda" else math.nan
        step_mean, step_std = mean_std(step_ms)
        if strategy == SINGLE:
            single_mean = step_mean
        rows.append({
            "strategy": strategy,
            "bucket MiB": bucket_mb if bucket_mb is not None else math.nan,
            "ranks": 1 if strategy == SINGLE else world_size,
            "buckets": times.buckets,
            "step ms": step_mean, "step std": step_std, "step median ms": statistics.median(step_ms),
            "x single": step_mean / single_mean,
            **times.comm,
            "peak GiB": peak,
        })
        if rank == 0:
            console.print(f"  {label:<22} {step_mean:9.2f} ms/step  ("
                          + against_single(rows[-1], noise_against_single(rows)[-1], single_mean)
                          + comm_summary(times.comm) + ")")
    return with_torch_ratio(rows)


def noise_against_single(rows: list[dict[str, Any]]) -> list[bool]:
    """Per row, whether what it adds to one device's step ("single") is noise by the rule every table
    applies (:func:`within_noise`): the difference of the mean step times against the spread of that
    difference (sqrt(std^2 + std_single^2)); a row's ratio to one device is then not a finding. The
    single row is the reference, never noise."""
    single = next((r for r in rows if r["strategy"] == SINGLE), None)
    if single is None:
        return [False] * len(rows)
    return [row["strategy"] != SINGLE and within_noise(
        float(row["step ms"]) - float(single["step ms"]), math.hypot(float(row["step std"]),
                                                                     float(single["step std"])))
        for row in rows]


def noise_against_torch(rows: list[dict[str, Any]]) -> list[bool]:
    """Per row, whether its step time and torch DDP's (at the same bucket size, as "x torch" pairs them)
    differ by less than the spread of their difference: a signed comparison, so its size is tested."""
    torch_rows = [r for r in rows if r["strategy"] == "torch"]
    flags = []
    for row in rows:
        same_size = [r for r in torch_rows if r["bucket MiB"] == row["bucket MiB"]] or torch_rows
        flags.append(bool(same_size) and row["strategy"] not in (SINGLE, "torch") and within_noise(
            abs(float(row["step ms"]) - float(same_size[0]["step ms"])),
            math.hypot(float(row["step std"]), float(same_size[0]["step std"]))))
    return flags


def against_single(row: dict[str, Any], noise: bool, single_mean: float) -> str:
    """'1.472x single', or '~1x single (noise)' where ``noise``; 'the reference' for one device."""
    if row["strategy"] == SINGLE:
        return "the reference"
    return f"~1x single {NOISE}" if noise else f"{float(row['step ms']) / single_mean:.3f}x single"


def shown_with_noise(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The table as printed: ratios to one device or to torch DDP that are noise read '~1 (noise)'."""
    df = pd.DataFrame(rows)
    shown = with_noise_marked(df, noise_against_single(rows), ["x single"], {"x single": "~1"})
    marked = with_noise_marked(df, noise_against_torch(rows), ["x torch"], {"x torch": "~1"})
    if "x torch" in df:
        shown["x torch"] = marked["x torch"]
    return shown


def comm_summary(comm: dict[str, Any]) -> str:
    """', exposed comm 1.2 of 3.4 ms, overlap 65%' from the traced columns ('' when not traced)."""
    if not comm or not comm.get("comm ms"):
        return ""
    return (f", exposed comm {comm['exposed comm ms']:.3g} of {comm['comm ms']:.3g} ms, "
            f"overlap {comm['overlap %']:.0f}%")


def with_torch_ratio(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Add "x torch": each row's step time over torch DDP's, at the same bucket size where torch ran one."""
    torch_rows = [r for r in rows if r["strategy"] == "torch"]
    for row in rows:
        same_size = [r for r in torch_rows if r["bucket MiB"] == row["bucket MiB"]] or torch_rows
        row["x torch"] = (row["step ms"] / same_size[0]["step ms"]
                          if same_size and row["strategy"] != SINGLE else math.nan)
    return rows


def runs_from(strategies: list[str], bucket_mbs: list[float]) -> tuple[tuple[str, float | None], ...]:
    runs: list[tuple[str, float | None]] = []
    for strategy in strategies:
        if strategy in BUCKET_SIZED:
            runs += [(strategy, mb) for mb in bucket_mbs]
        else:
            runs.append((strategy, None))
    return tuple(runs)


def main(argv: list[str] | None = None) -> None:
    has_gpu = torch.cuda.is_available()
    parser = make_parser("ddp", __doc__)
    parser.add_argument("--strategy", type=str_list(STRATEGIES), default="all",
                        help=f"comma-separated among {', '.join(STRATEGIES)} (or 'all')")
    parser.add_argument("--bucket-mb", type=float_list, default="25",
                        help="bucket sizes (MiB) for 'bucketed' and 'torch', a row each: e.g. 1,10,100")
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
                        help="ranks (default: every GPU for nccl, 2 for gloo; torchrun's under torchrun); "
                             "1: one GPU alone, where the overhead is the wrappers' own host cost")
    parser.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps per configuration")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per configuration")
    parser.add_argument("--trace-steps", type=nonnegative_int, default=2,
                        help="steps traced per configuration after the timed ones, for communication, "
                             "exposed communication and overlap (0: no traces)")
    parser.add_argument("--trace-dir", type=str, default=None,
                        help="keep the traces here (<strategy>_rank<r>.json.gz, for Perfetto); default: "
                             "analysed and deleted")
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
                  args.steps, runs_from(args.strategy, args.bucket_mb), args.trace_steps, args.trace_dir)
    console.print(f"[bold]{args.size} model, {args.precision}, batch {args.batch}x{args.context} per rank, "
                  f"{nproc} {args.backend} ranks[/bold]")
    rows = launch(benchmark, nproc, args.backend, args=(setup, args.backend), timeout_s=args.timeout)
    if rows is None:  # a torchrun rank other than 0
        return
    df = pd.DataFrame(rows)
    print_table(shown_with_noise(rows), f"DDP step time and communication, {args.size} {args.precision}, "
                    f"{args.batch}x{args.context} per rank, {nproc} ranks ({args.backend})")
    save_results(df, "ddp", args, metadata={"ranks": str(nproc), "backend": args.backend,
                                            "model": args.size, "precision": args.precision,
                                            "per-rank batch": f"{args.batch}x{args.context}"})


if __name__ == "__main__":
    main()
