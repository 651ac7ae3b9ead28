"""End-to-end timing of the Transformer LM: forward, backward and optimizer per size, context and precision.

Each configuration builds the model (batch 4, vocab 10,000, AdamW in train mode) on the device, runs
--warmup unmeasured steps, then --steps measured ones, synchronizing the device after every phase.
Rows report each phase's mean and standard deviation, tokens/s, achieved TFLOP/s (matrix-multiply
FLOPs of the model, the backward counted as twice the forward, the optimizer as none) and MFU
against the device's dense peak for the precision (see PEAK_TFLOPS; blank for unknown devices).
A configuration that runs out of memory is an OOM row and the sweep goes on.

fp32 means IEEE float32 matrix multiplies (TF32 off) unless --tf32; bf16 means torch.autocast to
bfloat16 with float32 parameters and optimizer state. Forward runs with autograd on in every mode,
so its time is the forward of a training step.

Extras: --profile kernels adds per-phase kernel tables (torch.profiler, nsys "CUDA GPU Kernel
Summary" columns) and their matrix-multiply share; --nvtx annotates steps, phases, blocks and the
three parts of naive attention for Nsight Systems (python -m profkit.nsys -- python -m
benchmarks.e2e ... runs it under nsys); --memory FILE records the CUDA allocator's history of fresh
steps (model construction included) to FILE, draws FILE.png and writes the per-phase peak table.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

import profkit
from benchmarks.common import (
    OOM,
    as_cell,
    check_writable,
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
    results_name,
    save_results,
    str_list,
)
from benchmarks.model import (
    ATTENTION,
    MODEL_SIZES,
    ModelConfig,
    TransformerLM,
    count_parameters,
    forward_flops,
    model_config,
    random_batch,
)

MODES = ("forward", "forward-backward", "train")
PRECISIONS = ("fp32", "bf16")
BATCH_SIZE = 4
# Dense (no sparsity) peak TFLOP/s by a fragment of torch.cuda.get_device_name(); first match wins.
# Columns: bf16 tensor cores, fp32 without TF32, fp32 matmuls in TF32.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 NVL", {"bf16": 835.0, "fp32": 60.0, "tf32": 418.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0, "tf32": 378.0}),
    ("H100", {"bf16": 989.0, "fp32": 67.0, "tf32": 495.0}),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", {"bf16": 835.0, "fp32": 60.0, "tf32": 418.0}),
    ("H200", {"bf16": 989.0, "fp32": 67.0, "tf32": 495.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5, "tf32": 156.0}),
]
NAIVE_ATTENTION_PARTS = {
    "benchmarks.model.attention_scores": "attention scores",
    "benchmarks.model.attention_softmax": "attention softmax",
    "benchmarks.model.attention_weighted_sum": "attention weighted sum",
}
PHASE_COLUMNS = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}

_on_gpu = torch.cuda.is_available()
TOUR_ARGS: list[str] = (
    ["--size", "small", "--context", "256", "--warmup", "2", "--steps", "5", "--precision", "fp32,bf16"]
    if _on_gpu else
    ["--size", "tiny", "--context", "64", "--warmup", "1", "--steps", "3", "--profile", "kernels"]
)


def peak_tflops(name: str, precision: str, tf32: bool) -> float | None:
    """The device's dense peak for the precision, or None for a device not in PEAK_TFLOPS."""
    key = "tf32" if precision == "fp32" and tf32 else precision
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in name:
            return peaks[key]
    return None


def step_flops(cfg: ModelConfig, batch_size: int, mode: str) -> float:
    """Model FLOPs of one step: forward, plus a backward of twice the forward unless mode is forward."""
    forward = forward_flops(cfg, batch_size, cfg.context_length)
    return forward if mode == "forward" else 3 * forward


@dataclass(frozen=True)
class Config:
    size: str
    context: int
    precision: str
    attention: str

    @property
    def tag(self) -> str:
        return f"{self.size}_ctx{self.context}_{self.precision}_{self.attention}"


@dataclass
class Workload:
    """A model, its optimizer and one batch, with the step that profkit times or profiles."""

    cfg: ModelConfig
    model: torch.nn.Module
    step: Callable[[profkit.timing.Phase], None]


def build_workload(config: Config, args: argparse.Namespace, dev: torch.device) -> Workload:
    cfg = model_config(config.size, config.context, args.vocab_size)
    torch.manual_seed(args.seed)
    with dev:  # build on the device: initializing billions of parameters on the CPU takes minutes
        model = TransformerLM(cfg, attention=config.attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if args.mode == "train" else None
    run = torch.compile(model, backend=args.compile_backend) if args.compile else model
    tokens = random_batch(cfg, args.batch_size, config.context, dev)
    targets = random_batch(cfg, args.batch_size, config.context, dev)

    def step(phase: profkit.timing.Phase) -> None:
        model.zero_grad(set_to_none=True)  # outside the phases: not timed
        with phase("forward"), profkit.autocast(config.precision, dev.type):
            logits = run(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if args.mode == "forward":
            return
        with phase("backward"):
            loss.backward()
        if optimizer is not None:
            with phase("optimizer"):
                optimizer.step()

    return Workload(cfg, model, step)


@contextlib.contextmanager
def annotations(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """--nvtx: ranges around each block, its attention and feed-forward, and naive attention's parts."""
    if not enabled:
        yield
        return

    def coarse(name: str, _module: torch.nn.Module) -> bool:
        parts = name.split(".")
        return parts[0] != "blocks" or len(parts) == 2 or (len(parts) == 3 and parts[2] in ("attn", "ffn"))

    with profkit.nvtx.annotate_modules(model, coarse), \
            profkit.nvtx.annotate_functions(*NAIVE_ATTENTION_PARTS, names=NAIVE_ATTENTION_PARTS):
        yield


def set_matmul_precision(tf32: bool) -> None:
    """fp32 matmuls in IEEE float32, or TF32 with --tf32: set explicitly, never left to defaults."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def measure(config: Config, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """The row of one configuration (and its kernel report, under the key 'kernels', if asked)."""
    work = build_workload(config, args, dev)
    with annotations(work.model, args.nvtx):
        profkit.reset_peak_memory(dev)
        times = profkit.time_phases(work.step, warmup=args.warmup, steps=args.steps, device=dev)
        peak = profkit.read_peak_memory(dev)
    row: dict[str, Any] = {"params (M)": count_parameters(work.model) / 1e6}
    for phase, short in PHASE_COLUMNS.items():
        timing = times.get(phase)
        row[f"{short} ms"] = timing.mean_ms if timing else ""
        row[f"{short} std"] = timing.std_ms if timing else ""
    step_s = sum(t.mean for t in times.values())
    achieved = step_flops(work.cfg, args.batch_size, args.mode) / step_s / 1e12
    peak_compute = peak_tflops(device_name(), config.precision, args.tf32) if dev.type == "cuda" else None
    row.update({
        "step ms": step_s * 1e3,
        "tokens/s": args.batch_size * config.context / step_s,
        "TFLOP/s": achieved,
        "MFU %": 100 * achieved / peak_compute if peak_compute else "",
        "peak GiB": peak.allocated / 2**30 if peak else "",
    })
    if args.profile == "kernels":
        row["kernels"] = profkit.profile_phases(work.step, warmup=1, steps=args.profile_steps, device=dev)
    return row


def record_memory(config: Config, args: argparse.Namespace, dev: torch.device, path: Path) -> pd.DataFrame:
    """Record model construction and --memory-steps fresh steps; draw the timeline; per-phase peaks."""
    clock = profkit.PhaseClock(dev, track_memory=True)
    outcome = "ok"
    try:
        with profkit.record_memory_history(path):
            work = build_workload(config, args, dev)
            profkit.run_steps(work.step, warmup=0, steps=args.memory_steps, clock=clock)
    except Exception as exc:  # the snapshot of an OOM is the one worth drawing
        if not is_oom(exc):
            raise
        outcome = OOM
    work = None
    free_device_memory()
    png = path.with_suffix(".png")
    title = (f"{config.size}, context {config.context}, {config.precision}, {args.mode}: "
             f"model construction + {args.memory_steps} steps" + (" (OOM)" if outcome == OOM else ""))
    timeline = profkit.render_memory_timeline(path, png, title=title)
    console.print(f"[dim]wrote {path} and {png}: peak {timeline.peak_bytes / 2**30:.2f} GiB[/dim]")
    rows = [{"step": i, "phase": phase, **peak.as_gib()}
            for phase, peaks in clock.peaks.items() for i, peak in enumerate(peaks)]
    rows.sort(key=lambda r: r["step"])
    rows.append({"step": "all", "phase": "timeline peak (active)",
                 "peak allocated (GiB)": timeline.peak_bytes / 2**30, "peak reserved (GiB)": "",
                 "allocated after (GiB)": ""})
    return pd.DataFrame(rows)


def memory_path(template: Path, config: Config, several: bool) -> Path:
    """--memory FILE as given for one configuration; FILE with the configuration's tag for several."""
    return template.with_name(f"{template.stem}_{config.tag}{template.suffix}") if several else template


def kernel_tables(report: profkit.KernelReport, config: Config) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """All phases' kernel rows in one table (a Phase column first), and the per-phase summary rows."""
    rows = [{"Phase": phase, **row} for phase, table in report.tables.items() for row in table.rows()]
    summary = [{"size": config.size, "context": config.context, "precision": config.precision,
                "attention": config.attention, "source": report.source, **row} for row in report.summary()]
    return pd.DataFrame(rows), summary


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("e2e", __doc__)
    cpu_default = not _on_gpu
    parser.add_argument("--size", type=str_list(MODEL_SIZES), default="tiny" if cpu_default else "small",
                        help=f"model sizes, comma-separated or 'all' ({', '.join(MODEL_SIZES)}); "
                             "default: small on a GPU, tiny without")
    parser.add_argument("--context", type=int_list, default="64" if cpu_default else "128,256,512",
                        help="context lengths, comma-separated; default 128,256,512 on a GPU, 64 without")
    parser.add_argument("--mode", choices=MODES, default="train",
                        help="forward; forward-backward; train (forward, backward and an AdamW step)")
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="unmeasured steps before measuring")
    parser.add_argument("--steps", type=positive_int, default=10, help="measured steps")
    parser.add_argument("--precision", type=str_list(PRECISIONS), default="fp32",
                        help="fp32 and/or bf16 (autocast), comma-separated")
    parser.add_argument("--tf32", action="store_true",
                        help="let fp32 matmuls use TF32 (MFU then uses the TF32 peak)")
    parser.add_argument("--attention", type=str_list(ATTENTION), default="naive",
                        help=f"attention implementations, comma-separated ({', '.join(ATTENTION)})")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--compile-backend", type=compile_backend, default="inductor",
                        help="torch.compile backend")
    parser.add_argument("--batch-size", type=positive_int, default=BATCH_SIZE, help="sequences per step")
    parser.add_argument("--vocab-size", type=positive_int, default=10_000, help="vocabulary size")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and the random batch")
    parser.add_argument("--profile", choices=["kernels"], default=None,
                        help="kernels: per-phase kernel tables from torch.profiler, "
                             "saved as their own files")
    parser.add_argument("--profile-steps", type=positive_int, default=1,
                        help="steps profiled by --profile kernels")
    parser.add_argument("--nvtx", action="store_true",
                        help="NVTX ranges for each block, its attention and feed-forward, "
                             "and naive attention's three parts")
    parser.add_argument("--memory", type=Path, default=None, metavar="FILE",
                        help="CUDA only: record the allocator history of fresh steps to FILE (a pickle), "
                             "draw FILE with suffix .png and save the per-phase peak table")
    parser.add_argument("--memory-steps", type=positive_int, default=3, help="steps recorded by --memory")
    parser.add_argument("--name", type=results_name, default=None,
                        help="results file name (default: e2e_<mode>)")
    return parser


def speedups(rows: list[dict[str, Any]], baseline: str) -> pd.DataFrame:
    """Per (size, context, precision) and attention other than `baseline`: baseline's time / its time for
    the forward, the backward and the step (above 1: faster than baseline; the optimizer's step does not
    involve attention). Empty unless both ran; OOM cells are blank."""
    timed = ["fwd ms", "bwd ms", "step ms"]
    setting = ("size", "context", "precision")
    baselines = {tuple(row[k] for k in setting): row for row in rows if row["attention"] == baseline}
    ratios = []
    for row in rows:
        base = baselines.get(tuple(row[k] for k in setting))
        if base is None or row["attention"] == baseline:
            continue
        ratio = {**{k: row[k] for k in setting}, "attention": row["attention"]}
        for column in timed:
            mine, theirs = row.get(column), base.get(column)
            numbers = isinstance(mine, float) and isinstance(theirs, float) and mine > 0
            ratio[f"{column.split()[0]} x {baseline}"] = theirs / mine if numbers else ""
        ratios.append(ratio)
    return pd.DataFrame(ratios)


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("warmup", "steps", "batch_size", "vocab_size", "profile_steps", "memory_steps"):
        value = getattr(args, name)
        minimum = 0 if name == "warmup" else 1
        if value < minimum:
            parser.error(f"--{name.replace('_', '-')}={value} must be >= {minimum}")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first step compiles")
    bad = [c for c in args.context if c < 1]
    if bad:
        parser.error(f"--context: {bad} must be positive")
    if args.memory is not None and args.memory.suffix == ".png":
        parser.error("--memory FILE is the snapshot pickle; the PNG is written beside it")
    if args.memory is not None:
        check_writable(parser, "--memory", args.memory)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    validate(parser, args)
    dev = device()
    set_matmul_precision(args.tf32)
    name = args.name or f"e2e_{args.mode.replace('-', '_')}"
    if args.nvtx and args.compile:
        console.print("[yellow]--nvtx with --compile: the ranges break the compiled graph into pieces"
                      "[/yellow]")
    if args.memory is not None and dev.type != "cuda":
        console.print("[yellow]--memory needs CUDA (the allocator history is CUDA's): "
                      "skipped on this machine[/yellow]")
        args.memory = None
    configs = [Config(size, context, precision, attention) for precision, attention, size, context
               in itertools.product(args.precision, args.attention, args.size, args.context)]
    metadata = {"mode": args.mode, "batch_size": str(args.batch_size), "tf32": str(args.tf32),
                "compile": args.compile_backend if args.compile else "no"}
    rows, summaries = [], []
    with progress() as bar:
        task = bar.add_task(name, total=len(configs))
        for config in configs:
            bar.update(task, description=config.tag)
            key = {"size": config.size, "context": config.context, "precision": config.precision,
                   "attention": config.attention}
            result = or_oom(lambda config=config: measure(config, args, dev))
            if result == OOM:
                result = {"step ms": OOM}
            if args.compile:  # drop compiled graphs (they hold the model) and reset the recompile limit
                torch._dynamo.reset()
            free_device_memory()
            report = result.pop("kernels", None)
            rows.append({**key, **result})
            if report is not None:
                table, summary = kernel_tables(report, config)
                summaries += summary
                save_results(table, f"{name}_kernels_{config.tag}", args, metadata)
                for phase, kernels in report.tables.items():
                    print_table(pd.DataFrame(kernels.rows(limit=8)), float_format="{:.1f}",
                                title=f"{config.tag} {phase}: top 8 of {len(kernels.kernels)} kernels "
                                      f"({report.source}, {report.steps} step(s))")
            if args.memory is not None:
                peaks = record_memory(config, args, dev, memory_path(args.memory, config, len(configs) > 1))
                print_table(peaks, f"{config.tag}: peak memory per phase (GiB)")
                save_results(peaks, f"{name}_memory_{config.tag}", args, metadata)
            bar.advance(task)
    columns = list(dict.fromkeys(column for row in rows for column in row))  # an OOM row has fewer
    df = pd.DataFrame([{c: row.get(c, "") for c in columns} for row in rows]).map(as_cell)
    compiled = f", compiled ({args.compile_backend})" if args.compile else ""
    print_table(df, f"{name}: batch {args.batch_size}, {args.mode}, {args.warmup} warm-up + {args.steps} "
                    f"steps on {device_name()}{compiled}")
    save_results(df, name, args, metadata)
    ratios = speedups(rows, baseline="sdpa")
    if not ratios.empty:
        print_table(ratios.map(as_cell), f"{name}: speedup over sdpa (its time / this one's){compiled}")
        save_results(ratios.map(as_cell), f"{name}_vs_sdpa", args, metadata)
    if summaries:
        summary = pd.DataFrame(summaries).map(as_cell)
        print_table(summary, "kernel time per phase: matrix multiplies vs the rest")
        save_results(summary, f"{name}_kernel_summary", args, metadata)


if __name__ == "__main__":
    main()
