"""Activation checkpointing: memory and step time of the reference LM under five recomputation policies.

Policies (benchmarks.model.CHECKPOINT_POLICIES, torch.utils.checkpoint non-reentrant): none;
every block; every k-th block (--every); segments of ceil(sqrt(L)) blocks; attention-only
(selective: the T^2 attention core is recomputed, nothing else).

For each policy and context length, one training step is forward + backward of the cross-entropy
loss (no optimizer: its state does not depend on the policy):
  activations_MB   memory held between forward and backward (allocated after the forward minus
                   before it): what the policy saves for the backward
  model_MB         the same predicted from the derivation in docs/checkpointing.md (naive attention)
  peak_MB          peak allocated during the step (parameters, gradients and recomputation included)
  step_ms          mean time of a step over --iters after --warmup, device synchronized
Then the largest context each policy can train at --size and --batch-size on this GPU (doubling
from the largest measured context, then bisection to --granularity tokens; an OOM is a no).

On a GPU (default: the small model, batch 4, contexts 512,1024,2048) memory comes from the CUDA
allocator. On CPU (tiny model, short contexts) there are no allocator statistics: only times and
the model's prediction are reported, and the search is skipped.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from benchmarks.common import (
    OOM,
    console,
    device,
    free_device_memory,
    int_list,
    is_oom,
    make_parser,
    nonnegative_int,
    parse_args,
    positive_int,
    print_table,
    save_results,
    str_list,
)
from benchmarks.model import (
    CHECKPOINT_POLICIES,
    MODEL_SIZES,
    ModelConfig,
    TransformerLM,
    checkpoint_segments,
    model_config,
    random_batch,
)
from profkit import time_steps

TOUR_ARGS: list[str] = ["--warmup", "0", "--iters", "1", "--contexts", "32"]
MB = 1e6
FLOAT = 4  # bytes: the reference model runs in float32


# --- the memory model (docs/checkpointing.md derives it) ------------------------------------------

def block_floats_per_token(cfg: ModelConfig, context: int, selective: bool) -> int:
    """Floats one block saves for the backward, per token, with naive attention.

    Two RMSNorms: input, normalized input, output, 1/rms (3d + 1 each); q and k after RoPE and a
    contiguous v (3d); the attention output re-laid out for the out projection (d); SwiGLU: w1 and
    w3 outputs, silu(w1 x), their product (4 d_ff); the softmax probabilities (H T), unless the
    attention core is recomputed.
    """
    per_token = 10 * cfg.d_model + 4 * cfg.d_ff + 2
    return per_token if selective else per_token + cfg.num_heads * context


def predicted_activation_bytes(cfg: ModelConfig, policy: str, every: int, batch: int, context: int) -> float:
    """Bytes held between forward and backward under ``policy`` (naive attention, float32)."""
    tokens = batch * context
    full_block = FLOAT * tokens * block_floats_per_token(cfg, context, selective=policy == "attention")
    if policy != "attention":
        full_block += context * context  # the causal mask (bool), one per block
    block_input = FLOAT * tokens * cfg.d_model
    held = 0
    for start, stop, recompute in checkpoint_segments(policy, cfg.num_layers, every):
        held += block_input if recompute else (stop - start) * full_block
    head = FLOAT * tokens * (3 * cfg.d_model + 1 + cfg.vocab_size)  # final RMSNorm, log-softmax
    return float(held + head)


# --- measurements -------------------------------------------------------------------------------

class Step:
    """Forward + backward of one batch on one model; memory readings on CUDA."""

    def __init__(self, model: TransformerLM, cfg: ModelConfig, batch: int, context: int,
                 where: torch.device) -> None:
        tokens = random_batch(cfg, batch, context + 1, where, torch.Generator(where).manual_seed(0))
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:].flatten()
        self.model, self.where = model, where

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(self.inputs).flatten(0, 1), self.targets).backward()

    def memory(self) -> dict[str, float]:
        """Activations held after the forward and the peak of a whole step, bytes (NaN without CUDA)."""
        if self.where.type != "cuda":
            return {"activations": math.nan, "peak": math.nan}
        self.model.zero_grad(set_to_none=True)
        free_device_memory()
        torch.cuda.reset_peak_memory_stats(self.where)
        before = torch.cuda.memory_allocated(self.where)
        loss = F.cross_entropy(self.model(self.inputs).flatten(0, 1), self.targets)
        activations = torch.cuda.memory_allocated(self.where) - before
        loss.backward()
        return {"activations": float(activations), "peak": float(torch.cuda.max_memory_allocated(self.where))}


def build(cfg: ModelConfig, policy: str, args: argparse.Namespace, where: torch.device) -> TransformerLM:
    torch.manual_seed(0)
    with where:
        return TransformerLM(cfg, attention=args.attention, checkpoint=policy, checkpoint_every=args.every)


def measure(model: TransformerLM, cfg: ModelConfig, policy: str, context: int, args: argparse.Namespace,
            where: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "context": context}
    try:
        step = Step(model, cfg, args.batch_size, context, where)
        memory = step.memory()
        timing = time_steps(step, warmup=args.warmup, steps=args.iters, device=where)
    except Exception as exc:
        if not is_oom(exc):
            raise
        free_device_memory()
        return row | {"activations_MB": OOM, "model_MB": OOM, "peak_MB": OOM, "step_ms": OOM}
    model_bytes = (predicted_activation_bytes(cfg, policy, args.every, args.batch_size, context)
                   if args.attention == "naive" else math.nan)
    free_device_memory()
    return row | {"activations_MB": memory["activations"] / MB, "model_MB": model_bytes / MB,
                  "peak_MB": memory["peak"] / MB, "step_ms": timing.mean_ms}


def fits(model: TransformerLM, cfg: ModelConfig, context: int, batch: int, where: torch.device) -> bool:
    """Whether one training step at ``context`` runs without running out of memory."""
    try:
        Step(model, cfg, batch, context, where)()
        return True
    except Exception as exc:
        if not is_oom(exc):
            raise
        return False
    finally:
        model.zero_grad(set_to_none=True)
        free_device_memory()


def largest_context(fits_at: Callable[[int], bool], start: int, limit: int, granularity: int) -> int:
    """The largest context up to ``limit`` that fits, to ``granularity`` tokens (0 if ``start`` does not).

    Doubles from ``start`` until a context fails, then bisects between the last success and it.
    """
    if not fits_at(start):
        return 0
    good, bad = start, None
    while bad is None and good < limit:
        trial = min(2 * good, limit)
        if fits_at(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > granularity:
        middle = (good + bad) // 2 // granularity * granularity
        if middle <= good:
            break
        good, bad = (middle, bad) if fits_at(middle) else (good, middle)
    return good


# --- tables ---------------------------------------------------------------------------------------

def add_slowdown(df: pd.DataFrame) -> pd.DataFrame:
    """step_ms relative to no checkpointing at the same context (NaN where either is OOM)."""
    times = pd.to_numeric(df["step_ms"], errors="coerce")
    baseline = times.where(df["policy"] == "none").groupby(df["context"]).transform("max")
    return df.assign(slowdown=(times / baseline).round(3))


def main(argv: list[str] | None = None) -> None:
    parser = make_parser("checkpointing", __doc__)
    parser.add_argument("--size", choices=list(MODEL_SIZES), default=None,
                        help="model size; default small on CUDA, tiny on CPU")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="default 4 (CUDA), 2 (CPU)")
    parser.add_argument("--contexts", type=int_list, default=None,
                        help="context lengths; default 512,1024,2048 (CUDA), 32,64 (CPU)")
    parser.add_argument("--policies", type=str_list(CHECKPOINT_POLICIES), default=list(CHECKPOINT_POLICIES),
                        help=f"comma-separated, among {', '.join(CHECKPOINT_POLICIES)} (or 'all')")
    parser.add_argument("--every", type=positive_int, default=2, help="k of the every-k policy")
    parser.add_argument("--attention", choices=["naive", "sdpa"], default="naive",
                        help="attention function (the memory model covers naive)")
    parser.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed steps per measurement")
    parser.add_argument("--iters", type=positive_int, default=3, help="timed steps per measurement")
    parser.add_argument("--search-limit", type=nonnegative_int, default=None,
                        help="largest context the search tries; default 32768 (CUDA); 0 skips the search")
    parser.add_argument("--granularity", type=positive_int, default=256,
                        help="the search's resolution, in tokens")
    args = parse_args(parser, argv)
    where = device()
    on_cuda = where.type == "cuda"
    args.size = args.size or ("small" if on_cuda else "tiny")
    args.batch_size = args.batch_size or (4 if on_cuda else 2)
    args.contexts = args.contexts or ([512, 1024, 2048] if on_cuda else [32, 64])
    args.search_limit = (32768 if on_cuda else 0) if args.search_limit is None else args.search_limit
    longest = max(max(args.contexts), args.search_limit)
    cfg = model_config(args.size, context_length=longest)
    setup = (f"{args.size} model ({cfg.num_layers} blocks), batch {args.batch_size}, "
             f"{args.attention} attention, float32, {where.type}")

    rows, largest = [], []
    for policy in args.policies:
        model = build(cfg, policy, args, where)
        measured = []
        for context in args.contexts:
            console.print(f"{policy}: context {context} ...")
            measured.append(measure(model, cfg, policy, context, args, where))
        rows += measured
        if on_cuda and args.search_limit:
            start = max((r["context"] for r in measured if r["step_ms"] != OOM), default=args.granularity)
            console.print(f"{policy}: searching for the largest context from {start} ...")
            found = largest_context(lambda c, m=model: fits(m, cfg, c, args.batch_size, where), start,
                                    args.search_limit, args.granularity)
            largest.append({"policy": policy, "largest_context": found, "search_limit": args.search_limit})
        del model
        free_device_memory()

    table = add_slowdown(pd.DataFrame(rows))
    print_table(table, f"Activation checkpointing — {setup}"
                + ("" if on_cuda else "\nCPU: no allocator statistics, memory columns are NaN"))
    metadata = {"model": args.size, "batch_size": str(args.batch_size), "attention": args.attention,
                "every": str(args.every)}
    save_results(table, "checkpointing", args, metadata)
    if largest:
        limits = pd.DataFrame(largest)
        print_table(limits, f"Largest context that trains — {setup}")
        save_results(limits, "checkpointing_max_context", args, metadata)


if __name__ == "__main__":
    main()
