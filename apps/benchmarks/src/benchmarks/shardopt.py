"""Optimizer-state sharding: memory and step time of AdamW unsharded, shardopt.ShardedOptimizer and ZeRO.

Trains the reference LM data-parallel (gradients averaged by a DDP wrapper) with four optimizers
in one run, each on a freshly built model: plain ``torch.optim.AdamW`` (every rank holds all of
its state), ``shardopt.ShardedOptimizer`` over AdamW, the same with ``overlap_with=`` the DDP
model (the parameter all-gather of each step overlaps the next forward) and torch's
``ZeroRedundancyOptimizer`` over AdamW.

Memory, per rank (the largest over the ranks), at three moments: after init (model, DDP wrapper
and optimizer built), directly before and directly after the optimizer step of a training
iteration. Each is broken down into parameters, gradients and optimizer state (the sizes of the
live tensors on the device) and other = peak - those three (activations, DDP buckets,
communication buffers, temporaries). On CUDA the peak is the allocator's peak allocated bytes
(reset at the start of the iteration); on CPU there is no allocator record, so only the tensor
sizes are reported and the table says so.

Time per iteration (forward + backward + gradient all-reduce + optimizer step) and of the
optimizer step alone, each with the device synchronized, mean over the measured iterations,
the slowest rank's. Synchronizing after each phase waits for every collective, so it also hides
what overlapping gains: the back-to-back time runs the measured number of iterations with the
device synchronized only before the first and after the last, and divides. What the overlap hides
is read off traces: ``--trace-steps`` more iterations traced on every rank with ``profkit.trace``
give the communication per iteration, the part of it no compute runs beside (exposed) and the
overlap % (see ``benchmarks.overlap``).

Goal: optimizer-state bytes per rank <= unsharded / N + the state of one largest parameter, and
a step no slower than ZeroRedundancyOptimizer's in the same run.

Runs on 2 GPUs (NCCL) when there are 2 (XL model), else on 2 CPU processes (gloo, tiny model).
Spawns its workers itself (minddp.launch), or runs under torchrun:
    torchrun --nproc-per-node 2 -m benchmarks.shardopt
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    add_device_arg,
    choose_device,
    console,
    device_name,
    free_device_memory,
    held_bytes,
    make_parser,
    nonnegative_int,
    parse_args,
    positive_float,
    positive_int,
    print_table,
    save_results,
    str_list,
)
from benchmarks.model import MODEL_SIZES, ModelConfig, TransformerLM, model_config, random_batch
from benchmarks.overlap import trace_comm
from minddp import STRATEGIES, make_ddp
from minddp.launch import launch, tensor_device, under_torchrun
from profkit import PhaseClock, memory_breakdown, read_peak_memory, reset_peak_memory, run_steps, synchronize
from profkit.timing import total_mean
from shardopt import ShardedOptimizer

TOUR_ARGS: list[str] = ["--warmup", "1", "--iters", "2", "--trace-steps", "1"]
MB = 1e6
OPTIMIZERS: dict[str, str] = {
    "unsharded": "AdamW (unsharded)",
    "sharded": "ShardedOptimizer",
    "zero": "ZeroRedundancyOptimizer",
    "overlap": "ShardedOptimizer (overlap_with)",
}
ACCOUNTING = {True: "CUDA allocator: peak allocated; other = peak - parameters - gradients - optimizer state",
              False: "tensor sizes only: CPU has no allocator statistics, so no peak and no other"}
PHASES = ["after init", "before step", "after step"]
# benchmarks.overlap's columns in this experiment's time table
TRACED = {"comm ms": "comm_ms", "exposed comm ms": "exposed_comm_ms", "overlap %": "overlap_pct",
          "wait ms": "wait_ms"}
DDP_CHOICES = ["torch", *STRATEGIES]


def build_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``kind`` over ``model``'s parameters (``model``: the DDP wrapper)."""
    params = model.parameters()
    if kind == "unsharded":
        return torch.optim.AdamW(params, lr=lr)
    if kind == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, lr=lr)
    if kind == "overlap":
        return ShardedOptimizer(params, torch.optim.AdamW, overlap_with=model, lr=lr)
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeroRedundancyOptimizer keeps it in its inner one)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def state_bytes_per_param(optimizer: torch.optim.Optimizer, device: torch.device) -> list[int]:
    return [held_bytes(state.values(), device) for state in local_optimizer(optimizer).state.values()]


def breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """Parameters, gradients and optimizer state held now (profkit.memory_breakdown's tensor sizes), in
    bytes, and the peak allocated (CUDA only)."""
    held = memory_breakdown(model=model, optimizer=local_optimizer(optimizer)).bytes
    peak = read_peak_memory(device)
    return {"parameters": held["parameters"], "gradients": held["gradients"],
            "optimizer state": held["optimizer state"],
            "peak": float(peak.allocated) if peak else float("nan")}


class Workload:
    """One data-parallel training setup: the model, its DDP wrapper, an optimizer and a data stream."""

    def __init__(self, kind: str, cfg: ModelConfig, args: argparse.Namespace, device: torch.device,
                 rank: int) -> None:
        torch.manual_seed(args.seed)
        with device:
            self.model = TransformerLM(cfg, attention=args.attention)
        if args.ddp == "torch":
            self.wrapped: nn.Module = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)
        else:
            self.wrapped = make_ddp(args.ddp, self.model)
        self.optimizer = build_optimizer(kind, self.wrapped, args.lr)
        self.cfg, self.args, self.device = cfg, args, device
        self.generator = torch.Generator(device).manual_seed(args.seed + rank)

    def forward_backward(self) -> None:
        tokens = random_batch(self.cfg, self.args.batch_size, self.args.context_length + 1, self.device,
                              self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.wrapped(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()

    def step(self, phase: Callable[[str], Any]) -> None:
        with phase("forward+backward"):
            self.forward_backward()
        with phase("optimizer step"):
            self.optimizer.step()

    def step_then_forward_backward(self, phase: Callable[[str], Any]) -> None:
        """:meth:`step` turned around, for tracing: overlap_with's parameter all-gathers, which the optimizer
        step starts, run beside the forward that waits for them, and none is in flight when it returns."""
        with phase("optimizer step"):
            self.optimizer.step()
        with phase("forward+backward"):
            self.forward_backward()

    def back_to_back_s(self, iterations: int) -> float:
        """Seconds per iteration over ``iterations`` run without synchronizing between them."""
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(iterations):
            self.forward_backward()
            self.optimizer.step()
        synchronize(self.device)
        return (time.perf_counter() - start) / iterations


def measure(kind: str, cfg: ModelConfig, args: argparse.Namespace, device: torch.device,
            rank: int) -> dict[str, Any]:
    """Memory at the three moments and the times of one optimizer, on this rank."""
    free_device_memory()
    reset_peak_memory(device)
    work = Workload(kind, cfg, args, device, rank)
    memory = {"after init": breakdown(work.model, work.optimizer, device)}
    clock = PhaseClock(device)
    run_steps(work.step, args.warmup, args.iters, clock)
    back_to_back = work.back_to_back_s(args.iters)
    comm = {}
    if args.trace_steps > 0:
        work.forward_backward()  # the traced steps start with the optimizer step
        comm = trace_comm(work.step_then_forward_backward, OPTIMIZERS[kind], args.trace_steps, args.trace_dir)
    # One more iteration, untimed, with the peak window opened at its start.
    reset_peak_memory(device)
    work.forward_backward()
    memory["before step"] = breakdown(work.model, work.optimizer, device)
    work.optimizer.step()
    memory["after step"] = breakdown(work.model, work.optimizer, device)
    if isinstance(work.optimizer, ShardedOptimizer):
        work.optimizer.finish_param_gather()  # overlap_with leaves it for a next forward; there is none
    timings = clock.timings()
    record = {"memory": memory, "iteration_s": total_mean(timings), "back_to_back_s": back_to_back,
              "comm": comm, "step_s": timings["optimizer step"].mean,
              "largest_param_state": max(state_bytes_per_param(work.optimizer, device), default=0)}
    del work
    free_device_memory()
    return record


# --- tables ---------------------------------------------------------------------------------------

def tables(per_rank: list[dict[str, dict[str, Any]]], on_cuda: bool) -> dict[str, pd.DataFrame]:
    """Memory, time and goal tables from every rank's records (worst rank for each number).

    Without CUDA the memory table has no peak_MB and other_MB columns (see ACCOUNTING).
    """
    kinds = list(per_rank[0])
    memory_rows = []
    for kind in kinds:
        for phase in PHASES:
            worst = {key: max(r[kind]["memory"][phase][key] for r in per_rank)
                     for key in ("parameters", "gradients", "optimizer state", "peak")}
            row = {"optimizer": OPTIMIZERS[kind], "phase": phase,
                   "parameters_MB": worst["parameters"] / MB, "gradients_MB": worst["gradients"] / MB,
                   "optimizer_state_MB": worst["optimizer state"] / MB}
            if on_cuda:
                held = worst["parameters"] + worst["gradients"] + worst["optimizer state"]
                row |= {"other_MB": (worst["peak"] - held) / MB, "peak_MB": worst["peak"] / MB}
            memory_rows.append(row)
    time_rows = [{"optimizer": OPTIMIZERS[kind],
                  "iteration_ms": 1e3 * max(r[kind]["iteration_s"] for r in per_rank),
                  "optimizer_step_ms": 1e3 * max(r[kind]["step_s"] for r in per_rank),
                  "back_to_back_iteration_ms": 1e3 * max(r[kind]["back_to_back_s"] for r in per_rank),
                  "optimizer_state_MB": max(r[kind]["memory"]["after step"]["optimizer state"]
                                            for r in per_rank) / MB}
                 | {column: per_rank[0][kind].get("comm", {}).get(key, float("nan"))
                    for key, column in TRACED.items()}
                 for kind in kinds]
    frames = {"memory": pd.DataFrame(memory_rows), "time": pd.DataFrame(time_rows),
              "goal": goal_table(per_rank, len(per_rank))}
    return {name: df.round(3) for name, df in frames.items()}


def goal_table(per_rank: list[dict[str, dict[str, Any]]], world_size: int) -> pd.DataFrame:
    """The issue's goal, criterion by criterion: measured, limit, met (where the run has both sides)."""
    rows = []
    kinds = per_rank[0]
    if "sharded" in kinds and "unsharded" in kinds:
        state = max(r["sharded"]["memory"]["after step"]["optimizer state"] for r in per_rank)
        unsharded = per_rank[0]["unsharded"]["memory"]["after step"]["optimizer state"]
        limit = unsharded / world_size + per_rank[0]["unsharded"]["largest_param_state"]
        rows.append({"criterion": f"ShardedOptimizer state per rank <= unsharded/{world_size} "
                                  "+ one largest parameter's state (MB)",
                     "measured": state / MB, "limit": limit / MB, "met": bool(state <= limit)})
    if "sharded" in kinds and "zero" in kinds:
        step = max(r["sharded"]["step_s"] for r in per_rank)
        zero = max(r["zero"]["step_s"] for r in per_rank)
        rows.append({"criterion": "ShardedOptimizer step <= ZeroRedundancyOptimizer step (ms)",
                     "measured": 1e3 * step, "limit": 1e3 * zero, "met": bool(step <= zero)})
    return pd.DataFrame(rows, columns=["criterion", "measured", "limit", "met"])


# --- processes --------------------------------------------------------------------------------------

def measure_on_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every optimizer on this rank (inside launch's process group); every rank's records, in rank order."""
    device = tensor_device(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args.size, args.context_length)
    records = {}
    for i, kind in enumerate(args.optimizers, start=1):
        if rank == 0:
            console.print(f"[{i}/{len(args.optimizers)}] {OPTIMIZERS[kind]}: {args.size} model, "
                          f"{world_size} x {device.type}, {args.warmup} warm-up + {args.iters} timed "
                          "iterations ...")
        records[kind] = measure(kind, cfg, args, device, rank)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, records)
    return gathered


def report(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> None:
    on_cuda = args.backend == "nccl"
    world_size = len(per_rank)
    results = tables(per_rank, on_cuda)
    where = f"{world_size} x {device_name() if on_cuda else 'CPU process'}"
    setup = (f"{args.size} model, batch {args.batch_size} x {args.context_length} tokens per rank, "
             f"{args.ddp} DDP, {where}")
    print_table(results["memory"], f"Memory per rank, MB (worst rank) — {setup}\n{ACCOUNTING[on_cuda]}")
    print_table(results["time"], f"Time per iteration and per optimizer step, ms (slowest rank) — {setup}")
    goal = results["goal"].astype({"met": object})
    unjudged = goal["criterion"].str.endswith("(ms)") & (not on_cuda)  # step times: a GPU's to judge
    goal.loc[unjudged, "met"] = "not judged on CPU"
    print_table(goal, "Goal")
    for criterion, met in zip(goal["criterion"], goal["met"], strict=True):
        verdict = "met" if met is True else "NOT met" if met is False else "not judged: speed needs a GPU"
        console.print(f"{criterion}: {verdict}")
    metadata = {"world_size": str(world_size), "model": args.size, "batch_size": str(args.batch_size),
                "context_length": str(args.context_length), "ddp": args.ddp, "backend": args.backend,
                "memory_accounting": ACCOUNTING[on_cuda]}
    for name, df in results.items():
        if not df.empty:  # no goal without both sides of a criterion: the earlier goal file stays
            save_results(df, f"shardopt_{name}", args, metadata)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser("shardopt", __doc__)
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="workers to spawn; default 2 (under torchrun: its world size, leave this out)")
    add_device_arg(parser)
    parser.add_argument("--size", choices=list(MODEL_SIZES), default=None,
                        help="model size; default xl on CUDA, tiny on CPU")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="sequences per rank; default 4 (CUDA), 2 (CPU)")
    parser.add_argument("--context-length", type=positive_int, default=None,
                        help="default 256 (CUDA), 64 (CPU)")
    parser.add_argument("--optimizers", type=str_list(OPTIMIZERS), default=list(OPTIMIZERS),
                        help=f"comma-separated, among {', '.join(OPTIMIZERS)} (or 'all')")
    parser.add_argument("--ddp", choices=DDP_CHOICES, default="torch",
                        help="gradient averaging: torch's DistributedDataParallel or a minddp strategy")
    parser.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed iterations per optimizer")
    parser.add_argument("--iters", type=positive_int, default=5, help="timed iterations per optimizer")
    parser.add_argument("--lr", type=positive_float, default=1e-4,
                        help="AdamW learning rate (all three optimizers)")
    parser.add_argument("--attention", choices=["naive", "sdpa"], default="sdpa", help="attention function")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model; each rank's data adds its rank")
    parser.add_argument("--trace-steps", type=nonnegative_int, default=2,
                        help="iterations traced per optimizer for communication and overlap (0: none)")
    parser.add_argument("--trace-dir", type=str, default=None,
                        help="keep the traces here (for Perfetto); default: analysed and deleted")
    parser.add_argument("--timeout", type=positive_float, default=600,
                        help="seconds the run (and any collective) may take before it fails, not hangs")
    args = parse_args(parser, argv)
    workers = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (args.nproc or 2)
    on_cuda = choose_device(parser, args, workers)
    if args.warmup < 0 or args.iters < 1 or workers < 1:
        parser.error("--warmup must be >= 0, --iters >= 1 and --nproc >= 1")
    args.size = args.size or ("xl" if on_cuda else "tiny")
    args.batch_size = args.batch_size or (4 if on_cuda else 2)
    args.context_length = args.context_length or (256 if on_cuda else 64)
    per_rank = launch(measure_on_rank, workers, args.backend, args=(args,), timeout_s=args.timeout)
    if per_rank is not None:  # None on the other ranks under torchrun
        report(per_rank, args)


if __name__ == "__main__":
    main()
