"""Fully sharded data parallel: memory per rank and step time of DDP and FSDP, ours and torch's.

Trains the reference LM with AdamW on N ranks, each on its own batch, four ways, each with float32
compute and with bf16 compute, each on a freshly built model:
  torch-ddp        torch.nn.parallel.DistributedDataParallel (bf16: autocast)
  minddp-bucketed  minddp.BucketedDDP (bf16: autocast)
  torch-fsdp2      torch.distributed.fsdp.fully_shard on every block and the root
                   (bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32))
  minddp-fsdp      minddp.fully_shard, called exactly as torch's (the same code, the other import)

Memory per rank (the largest over the ranks), measured after a training step: the parameters,
gradients and optimizer state this rank holds (sizes of its local tensors: DTensor shards under
both FSDPs) and, on CUDA, the peak allocated during the step and other = peak - those three.
Beside it, the memory model: P parameters of 4 bytes held whole by DDP, 1/N of them (plus
padding) by FSDP, the same for gradients, 2x
that for AdamW's state; FSDP also holds the gathered units while they run (the root: embedding,
LM head, final norm, plus two blocks, the running one and the prefetched one, in the compute
dtype); activations (float32: benchmarks.checkpointing's model for naive attention; not
modelled for bf16).

Time per iteration (forward, backward, gradient synchronization, optimizer step), device
synchronized, mean over --iters, the slowest rank's. Communication per iteration, the part of it
no compute runs beside (exposed) and the overlap %, from --trace-steps more iterations traced on
every rank (benchmarks.overlap).

Runs on the GPUs (NCCL) when there is one per worker (small model), else on 2 CPU processes
(gloo, tiny model). Spawns its workers itself (minddp.launch), or runs under torchrun:
    torchrun --nproc-per-node 2 -m benchmarks.fsdp
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import minddp
from benchmarks.checkpointing import predicted_activation_bytes
from benchmarks.common import (
    add_device_arg,
    choose_device,
    console,
    device_name,
    free_device_memory,
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
from minddp import BucketedDDP
from minddp.launch import launch, tensor_device, under_torchrun
from profkit import PhaseClock, memory_breakdown, read_peak_memory, reset_peak_memory, run_steps
from profkit.timing import total_mean

TOUR_ARGS: list[str] = ["--warmup", "0", "--iters", "1", "--trace-steps", "1"]
MB = 1e6
STRATEGIES = ["torch-ddp", "minddp-bucketed", "torch-fsdp2", "minddp-fsdp"]
COMPUTE = {"fp32": None, "bf16": torch.bfloat16}
SHARDED = {"torch-fsdp2", "minddp-fsdp"}
TRACED = {"comm ms": "comm_ms", "exposed comm ms": "exposed_comm_ms", "overlap %": "overlap_pct"}


def wrap(strategy: str, model: TransformerLM, compute: torch.dtype | None, where: torch.device) -> nn.Module:
    if strategy == "torch-ddp":
        return DistributedDataParallel(model, device_ids=[where.index] if where.type == "cuda" else None)
    if strategy == "minddp-bucketed":
        return BucketedDDP(model)
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    lib: Any = minddp if strategy == "minddp-fsdp" else torch_fsdp  # the same names: only the import differs
    mesh = init_device_mesh(where.type, (dist.get_world_size(),))
    policy = lib.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    for block in model.blocks:
        lib.fully_shard(block, mesh=mesh, mp_policy=policy)
    lib.fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class Workload:
    """One strategy at one compute dtype: the wrapped model, AdamW and this rank's data stream."""

    def __init__(self, strategy: str, compute: str, cfg: ModelConfig, args: argparse.Namespace,
                 where: torch.device, rank: int) -> None:
        torch.manual_seed(args.seed)
        dtype = COMPUTE[compute]
        sharded = strategy in SHARDED
        # The sharded ones are built on the meta device and sharded there, then materialised shard by shard:
        # no rank ever holds the whole model, so it may be larger than one GPU (FSDP2's deferred init).
        with torch.device("meta") if sharded else where:
            model = TransformerLM(cfg, attention=args.attention)
        self.wrapped = wrap(strategy, model, dtype, where)
        if sharded:
            model.to_empty(device=where)
            model.init_weights()
        # DDP computes in bf16 under autocast; the FSDPs cast their gathered weights themselves.
        self.autocast = dtype is not None and not sharded
        self.optimizer = torch.optim.AdamW(self.wrapped.parameters(), lr=args.lr)
        self.cfg, self.args, self.where = cfg, args, where
        self.generator = torch.Generator(where).manual_seed(args.seed + rank)

    def forward_backward(self) -> None:
        tokens = random_batch(self.cfg, self.args.batch_size, self.args.context_length + 1, self.where,
                              self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        autocast = (torch.autocast(self.where.type, dtype=torch.bfloat16) if self.autocast
                    else contextlib.nullcontext())
        with autocast:
            logits = self.wrapped(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()

    def step(self, phase: Callable[[str], Any]) -> None:
        with phase("iteration"):
            self.forward_backward()
            self.optimizer.step()

    def held(self) -> dict[str, float]:
        held = memory_breakdown(model=self.wrapped, optimizer=self.optimizer).bytes
        return {name: held[name] for name in ("parameters", "gradients", "optimizer state")}


def measure(strategy: str, compute: str, cfg: ModelConfig, args: argparse.Namespace, where: torch.device,
            rank: int) -> dict[str, Any]:
    free_device_memory()
    work = Workload(strategy, compute, cfg, args, where, rank)
    clock = PhaseClock(where)
    run_steps(work.step, args.warmup, args.iters, clock)
    traced = args.trace_steps > 0
    comm = trace_comm(work.step, f"{strategy} {compute}", args.trace_steps, args.trace_dir) if traced else {}
    reset_peak_memory(where)
    work.forward_backward()
    work.optimizer.step()
    peak = read_peak_memory(where)
    record = {**work.held(), "peak": float(peak.allocated) if peak else math.nan,
              "iteration_s": total_mean(clock.timings()), "comm": comm}
    del work
    free_device_memory()
    return record


# --- the memory model ---------------------------------------------------------------------------

def memory_model(strategy: str, compute: str, cfg: ModelConfig, args: argparse.Namespace,
                 world_size: int) -> dict[str, float]:
    """Predicted bytes per rank: parameters, gradients, optimizer state, gathered units, activations."""
    with torch.device("meta"):
        model = TransformerLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = total - cfg.num_layers * block
    sharded = strategy in SHARDED
    held = 4 * total / world_size if sharded else 4 * total
    compute_bytes = 2 if COMPUTE[compute] is not None else 4
    gathered = compute_bytes * (root + 2 * block) if sharded else 0  # a copy even at one rank
    activations = (predicted_activation_bytes(cfg, "none", 2, args.batch_size, args.context_length)
                   if compute == "fp32" and args.attention == "naive" else math.nan)
    return {"parameters": held, "gradients": held, "optimizer state": 2 * held, "gathered": gathered,
            "activations": activations}


def tables(per_rank: list[dict[tuple[str, str], dict[str, Any]]], cfg: ModelConfig, args: argparse.Namespace,
           on_cuda: bool) -> pd.DataFrame:
    rows = []
    world_size = len(per_rank)
    for key in per_rank[0]:
        strategy, compute = key
        worst = {name: max(r[key][name] for r in per_rank)
                 for name in ("parameters", "gradients", "optimizer state", "peak", "iteration_s")}
        predicted = memory_model(strategy, compute, cfg, args, world_size)
        row = {"strategy": strategy, "compute": compute, "iteration_ms": 1e3 * worst["iteration_s"],
               "params_MB": worst["parameters"] / MB, "model_params_MB": predicted["parameters"] / MB,
               "grads_MB": worst["gradients"] / MB, "model_grads_MB": predicted["gradients"] / MB,
               "optimizer_MB": worst["optimizer state"] / MB,
               "model_optimizer_MB": predicted["optimizer state"] / MB,
               "model_gathered_MB": predicted["gathered"] / MB,
               "model_activations_MB": predicted["activations"] / MB}
        comm = per_rank[0][key].get("comm", {})
        row |= {column: comm.get(name, math.nan) for name, column in TRACED.items()}
        if on_cuda:
            held = worst["parameters"] + worst["gradients"] + worst["optimizer state"]
            row |= {"peak_MB": worst["peak"] / MB, "other_MB": (worst["peak"] - held) / MB}
        rows.append(row)
    return pd.DataFrame(rows).round(3)


# --- processes --------------------------------------------------------------------------------------

def measure_on_rank(args: argparse.Namespace) -> list[dict[tuple[str, str], dict[str, Any]]]:
    where = tensor_device(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args.size, args.context_length)
    records = {}
    cases = [(s, c) for s in args.strategies for c in args.compute]
    for i, (strategy, compute) in enumerate(cases, start=1):
        if rank == 0:
            console.print(f"[{i}/{len(cases)}] {strategy}, {compute} compute: {args.size} model, "
                          f"{world_size} x {where.type} ...")
        records[(strategy, compute)] = measure(strategy, compute, cfg, args, where, rank)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, records)
    return gathered


def main(argv: list[str] | None = None) -> None:
    parser = make_parser("fsdp", __doc__)
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="workers to spawn; default: every GPU, else 2 CPU processes "
                             "(under torchrun: its world size, leave this out)")
    add_device_arg(parser)
    parser.add_argument("--size", choices=list(MODEL_SIZES), default=None,
                        help="model size; default small on CUDA, tiny on CPU")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="sequences per rank; default 4 (CUDA), 2 (CPU)")
    parser.add_argument("--context-length", type=positive_int, default=None,
                        help="default 512 (CUDA), 32 (CPU)")
    parser.add_argument("--strategies", type=str_list(STRATEGIES), default=list(STRATEGIES),
                        help=f"comma-separated, among {', '.join(STRATEGIES)} (or 'all')")
    parser.add_argument("--compute", type=str_list(COMPUTE), default=list(COMPUTE),
                        help="compute dtypes: fp32, bf16 (or 'all')")
    parser.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed iterations per case")
    parser.add_argument("--iters", type=positive_int, default=5, help="timed iterations per case")
    parser.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--attention", choices=["naive", "sdpa"], default="naive",
                        help="attention function (the activation model covers naive)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model; each rank's data adds its rank")
    parser.add_argument("--trace-steps", type=nonnegative_int, default=2,
                        help="iterations traced per case for communication and overlap (0: none)")
    parser.add_argument("--trace-dir", type=str, default=None,
                        help="keep the traces here (for Perfetto); default: analysed and deleted")
    parser.add_argument("--timeout", type=positive_float, default=600,
                        help="seconds the run (and any collective) may take before it fails, not hangs")
    args = parse_args(parser, argv)
    workers = (int(os.environ["WORLD_SIZE"]) if under_torchrun()
               else (args.nproc or (torch.cuda.device_count() or 2)))  # fmt: skip
    on_cuda = choose_device(parser, args, workers)
    args.size = args.size or ("small" if on_cuda else "tiny")
    args.batch_size = args.batch_size or (4 if on_cuda else 2)
    args.context_length = args.context_length or (512 if on_cuda else 32)
    per_rank = launch(measure_on_rank, workers, args.backend, args=(args,), timeout_s=args.timeout)
    if per_rank is None:  # other ranks under torchrun
        return
    cfg = model_config(args.size, args.context_length)
    table = tables(per_rank, cfg, args, on_cuda)
    where = f"{len(per_rank)} x {device_name() if on_cuda else 'CPU process'}"
    setup = (f"{args.size} model, batch {args.batch_size} x {args.context_length} tokens per rank, AdamW, "
             f"{where}")
    keys = ["strategy", "compute"]
    measured = [c for c in table.columns if c not in keys and not c.startswith("model_")]
    print_table(table[keys + measured], f"FSDP against DDP: time and memory per rank (worst rank) — {setup}"
                + ("" if on_cuda else "\nCPU: tensor sizes only (no allocator statistics: no peak)"))
    print_table(table[keys + [c for c in table.columns if c.startswith("model_")]],
                "The memory model, per rank (MB): 4-byte masters, 1/N of them under FSDP; AdamW 2x; "
                "gathered = root + 2 blocks in the compute dtype")
    save_results(table, "fsdp", args, {"world_size": str(len(per_rank)), "model": args.size,
                                       "batch_size": str(args.batch_size),
                                       "context_length": str(args.context_length), "backend": args.backend})


if __name__ == "__main__":
    main()
