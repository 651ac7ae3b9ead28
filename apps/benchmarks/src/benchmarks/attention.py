"""Naive attention, one head: forward and backward time and memory by head dim and length, eager vs compiled.

For every head dimension d and sequence length T: Q, K, V of shape (batch, T, d) that require
gradients; --warmup unmeasured passes, then --passes measured ones, each a timed forward and a
timed backward (the device synchronized after each), so --passes forward and --passes backward
timings. Memory in use before the backward is read between the two (CUDA only), counting from
before the inputs were made. The attention is the model's causal naive attention
(benchmarks.model.naive_attention: scores, mask + softmax, weighted sum), run eagerly and through
torch.compile side by side; a configuration that runs out of memory is an OOM cell, and one that
fails to compile says why.

Beside the measured memory is the memory the eager autograd graph should hold before backward
(see PREDICTED_FORMULA): the inputs, the output, the softmax output saved for backward, and the
boolean causal mask saved by masked_fill; the T x T scores themselves are freed once masked.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import pandas as pd
import torch
from rich.markup import escape

import profkit
from benchmarks.common import (
    OOM,
    as_cell,
    compile_backend,
    console,
    device,
    device_name,
    free_device_memory,
    int_list,
    is_oom,
    make_parser,
    nonnegative_int,
    or_oom,
    parse_args,
    positive_int,
    print_table,
    progress,
    save_results,
    str_list,
)
from benchmarks.model import naive_attention

VARIANTS = ("eager", "compiled")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PREDICTED_FORMULA = ("predicted bytes = s*(4*B*T*d  [Q, K, V, dO]  + B*T*d  [O]  "
                     "+ B*T*T  [softmax output saved for backward])  "
                     "+ T*T  [bool causal mask saved by masked_fill];  s = bytes per element")

_on_gpu = torch.cuda.is_available()
TOUR_ARGS: list[str] = (["--d", "64", "--T", "256,1024", "--passes", "20"] if _on_gpu else
                        ["--d", "16", "--T", "64,128", "--passes", "5", "--warmup", "1",
                         "--compile-backend", "aot_eager"])


def predicted_bytes(batch_size: int, seq_len: int, head_dim: int, element_size: int) -> int:
    """Memory the eager graph holds before backward (see PREDICTED_FORMULA)."""
    b, t, d = batch_size, seq_len, head_dim
    return element_size * (5 * b * t * d + b * t * t) + t * t


def allocated_bytes(dev: torch.device) -> int | None:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None


def measure(attend: Any, batch_size: int, seq_len: int, head_dim: int, dtype: torch.dtype, warmup: int,
            passes: int, dev: torch.device) -> dict[str, float | str]:
    """Mean forward and backward ms of ``attend`` and the memory in use before backward (MiB).

    The memory counts the inputs (Q, K, V and the output gradient) and what the forward added,
    as of the last pass: not what a first pass allocates for good (cuBLAS workspaces, say).
    """
    q, k, v = (torch.randn(batch_size, seq_len, head_dim, device=dev, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(batch_size, seq_len, head_dim, device=dev, dtype=dtype)
    input_bytes = sum(x.nbytes for x in (q, k, v, grad_out))
    in_use: list[int] = []

    def step(phase: profkit.timing.Phase) -> None:
        for x in (q, k, v):
            x.grad = None
        before = allocated_bytes(dev)
        with phase("forward"):
            out = attend(q, k, v)
        after = allocated_bytes(dev)
        if before is not None and after is not None:
            in_use.append(input_bytes + after - before)
        with phase("backward"):
            out.backward(grad_out)

    times = profkit.time_phases(step, warmup=warmup, steps=passes, device=dev)
    return {"fwd ms": times["forward"].mean_ms, "bwd ms": times["backward"].mean_ms,
            "mem MiB": in_use[-1] / 2**20 if in_use else ""}


def compiled_cell(args: argparse.Namespace, seq_len: int, head_dim: int, dev: torch.device) -> dict[str, Any]:
    """The compiled variant: a fresh compile per shape; OOM, or the reason compiling failed, as the cell."""
    # A fresh compile per shape: never the silent eager fallback that hitting the recompile limit gives.
    torch._dynamo.reset()
    attend = torch.compile(naive_attention, backend=args.compile_backend)
    try:
        return measure(attend, args.batch_size, seq_len, head_dim, DTYPES[args.dtype], args.warmup,
                       args.passes, dev)
    except Exception as exc:
        if is_oom(exc):
            free_device_memory()
            return {"fwd ms": OOM, "bwd ms": OOM, "mem MiB": OOM}
        message = str(exc).strip().splitlines()[0][:80] if str(exc).strip() else ""
        console.print(f"[yellow]d={head_dim} T={seq_len} compiled: {type(exc).__name__}: "
                      f"{escape(message)}[/yellow]")
        failed = f"compile failed ({type(exc).__name__})"
        return {"fwd ms": failed, "bwd ms": failed, "mem MiB": failed}
    finally:
        torch._dynamo.reset()


def eager_cell(args: argparse.Namespace, seq_len: int, head_dim: int, dev: torch.device) -> dict[str, Any]:
    result = or_oom(lambda: measure(naive_attention, args.batch_size, seq_len, head_dim, DTYPES[args.dtype],
                                    args.warmup, args.passes, dev))
    return result if result != OOM else {"fwd ms": OOM, "bwd ms": OOM, "mem MiB": OOM}


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("attention", __doc__)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="batch size (one head)")
    parser.add_argument("--d", type=int_list, default="16,32,64,128", help="head dimensions, comma-separated")
    parser.add_argument("--T", type=int_list, default="256,1024,4096,8192,16384" if _on_gpu else "64,128",
                        help="sequence lengths, comma-separated (default without a GPU: 64,128)")
    parser.add_argument("--passes", type=positive_int, default=100,
                        help="measured forward and backward passes")
    parser.add_argument("--warmup", type=nonnegative_int, default=5,
                        help="unmeasured passes first (torch.compile compiles in the first)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of Q, K, V")
    parser.add_argument("--tf32", action="store_true", help="let fp32 matmuls use TF32")
    parser.add_argument("--variants", type=str_list(VARIANTS), default="eager,compiled",
                        help="eager and/or compiled, comma-separated")
    parser.add_argument("--compile-backend", type=compile_backend, default="inductor",
                        help="torch.compile backend (aot_eager compiles fast on a CPU, for a quick check)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    for name, minimum in (("batch_size", 1), ("passes", 1), ("warmup", 0)):
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {minimum}")
    if "compiled" in args.variants and args.warmup < 1:
        parser.error("--variants compiled needs --warmup >= 1: the first pass compiles")
    for name in ("d", "T"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            parser.error(f"--{name}: give positive integers")
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    compiled_name = "compiled" if args.compile_backend == "inductor" else f"compiled ({args.compile_backend})"
    cells = {"eager": eager_cell, "compiled": compiled_cell}
    shapes = list(itertools.product(args.d, args.T))
    rows = []
    with progress() as bar:
        task = bar.add_task("attention", total=len(shapes) * len(args.variants))
        for head_dim, seq_len in shapes:
            row: dict[str, Any] = {"d": head_dim, "T": seq_len}
            for variant in args.variants:
                bar.update(task, description=f"d={head_dim} T={seq_len} {variant}")
                label = compiled_name if variant == "compiled" else variant
                for column, value in cells[variant](args, seq_len, head_dim, dev).items():
                    row[f"{column} {label}"] = value
                free_device_memory()
                bar.advance(task)
            row["predicted MiB"] = predicted_bytes(args.batch_size, seq_len, head_dim, element_size) / 2**20
            rows.append(row)
    df = pd.DataFrame(rows)
    order = ["d", "T"] + [c for measure_name in ("fwd ms", "bwd ms", "mem MiB") for c in df.columns
                          if c.startswith(measure_name)] + ["predicted MiB"]
    df = df[order].map(as_cell)
    title = (f"naive causal attention, batch {args.batch_size}, one head, {args.dtype}, "
             f"mean of {args.passes} passes on {device_name()}")
    print_table(df, title)
    console.print(f"memory before backward: {PREDICTED_FORMULA}"
                  + ("" if dev.type == "cuda" else " (measured memory needs CUDA: blank here)"), markup=False)
    save_results(df, "attention", args, {"dtype": args.dtype, "batch_size": str(args.batch_size),
                                         "passes": str(args.passes), "formula": PREDICTED_FORMULA})


if __name__ == "__main__":
    main()
