"""FlashAttention-2 in Triton vs PyTorch, naive attention and SDPA's backends: forward, backward, both.

Times (median of triton.testing.do_bench on CUDA; a wall-clock median on CPU) each implementation on
inputs of shape (1, batch*heads, T, d), causal by default:

  triton          flashattn_triton.FlashAttentionTriton (the Triton kernels)
  torch           flashattn_triton.FlashAttentionTorch (tiled PyTorch, compiled backward on CUDA)
  naive           softmax(q k^T / sqrt(d)) v with the T x T scores in memory
  sdpa-flash      torch.nn.functional.scaled_dot_product_attention, FLASH_ATTENTION backend
  sdpa-cudnn      ... CUDNN_ATTENTION backend
  sdpa-efficient  ... EFFICIENT_ATTENTION backend (on a GPU, the one that takes float32)

The sweep is batch*heads = --batch, T in --seq, d in --dims, each dtype in --dtypes, plus the
bfloat16 shapes in --shapes. A cell reads OOM when the GPU ran out of memory, unsupported when the
implementation does not run here (on a GPU, SDPA's flash and cuDNN backends take no float32; on a CPU,
SDPA's flash backend is PyTorch's CPU kernel, which takes float32 and is the baseline of every
"x flash" column there, while the Triton kernels need a GPU), and skipped when T is above
--naive-max-seq / --torch-max-seq (those two would take minutes per cell, not fail). A row whose times
contradict each other (fwd+bwd below fwd or bwd: timing noise, common on a busy CPU) prints "(noise)"
after each of its timings, and after each ratio against it.
TFLOP/s counts 4*B*T*T*d for the forward (half of it when causal) and 2.5 times that for the
backward. The columns "x flash", "x cudnn", "x efficient" are the speedup over that SDPA backend
(its time / this time: above 1 is faster); their geometric means over T >= --geomean-min-seq are
printed per dtype.

--cuda-graphs (CUDA only) captures each pass of each implementation into a CUDA graph after a warm-up
and times the graph's replays: what a model captured with torch.cuda.graph or
torch.compile(mode="reduce-overhead") pays, without the host's per-call work. A cell whose capture
failed reads "capture failed" (the error is printed). It applies to --feature's cases too.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from rich.markup import escape

from benchmarks.common import (
    CAPTURE_FAILED,
    NOT_AVAILABLE,
    OOM,
    SKIPPED,
    as_cell,
    console,
    device,
    free_device_memory,
    int_list,
    is_oom,
    make_parser,
    median_time,
    nonnegative_float,
    parse_args,
    positive_float,
    positive_int,
    print_table,
    progress,
    require_gpus,
    results_name,
    save_results,
    str_list,
    with_noise_marked,
    within_noise,
)
from benchmarks.flash_features import FEATURES, run_features, window_speedup

IMPLS = ["triton", "torch", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]
PASSES = ["fwd", "bwd", "fwd+bwd"]
BASELINES = {"flash": "sdpa-flash", "cudnn": "sdpa-cudnn", "efficient": "sdpa-efficient"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOUR_ARGS = ["--quick"]

# --quick: a short run that still says something; bigger on a GPU.
QUICK_CPU = {
    "seq": [128, 256],
    "dims": [16, 32],
    "dtypes": ["float32"],
    "shapes": [],
    "impls": ["triton", "torch", "naive", "sdpa-flash"],
}
QUICK_GPU = {
    "seq": [1024, 4096],
    "dims": [64, 128],
    "dtypes": ["bfloat16"],
    "shapes": ["16x16384x64"],
    "impls": ["triton", "naive", "sdpa-flash", "sdpa-cudnn"],
}
DEFAULTS = {
    "seq": [2**i for i in range(7, 17)],
    "dims": [16, 32, 64, 128],
    "dtypes": ["bfloat16", "float32"],
    "shapes": ["16x16384x64", "1x65536x128", "64x4096x128"],
    "impls": IMPLS,
}


@dataclass(frozen=True)
class Shape:
    batch_heads: int
    seq: int
    head_dim: int
    dtype: str


def parse_shape(text: str) -> tuple[int, int, int]:
    """'16x16384x64' -> (batch*heads, T, d)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"expected BATCHxTxD with positive integers (like 16x16384x64), got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def shape_list(text: str) -> list[str]:
    """argparse type for '16x16384x64,1x65536x128' (checked, kept as text)."""
    items = [x for x in text.split(",") if x]
    for item in items:
        try:
            parse_shape(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def forward_flops(batch_heads, seq, head_dim, causal: bool):
    """4*B*T*T*d (two matmuls), half of it under causal masking; scalars or pandas columns."""
    return 4.0 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0)


PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # the backward is 2.5 forwards: 5 matmuls to 2


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    from flashattn_triton import reference_attention

    return reference_attention(q, k, v, is_causal=causal)


def sdpa(backend_name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def attention_fn(impl: str, dev: torch.device) -> Callable[..., torch.Tensor] | None:
    """impl as f(q, k, v, causal), or None if it cannot run on this device."""
    from flashattn_triton import FlashAttentionTorch, FlashAttentionTriton
    from flashattn_triton.functional import uses_triton

    if impl == "triton":
        return (
            (lambda q, k, v, causal: FlashAttentionTriton.apply(q, k, v, causal))
            if uses_triton(dev)
            else None
        )
    if impl == "torch":
        return lambda q, k, v, causal: FlashAttentionTorch.apply(q, k, v, causal)
    if impl == "naive":
        return naive_attention
    return sdpa(
        {
            "sdpa-flash": "FLASH_ATTENTION",
            "sdpa-cudnn": "CUDNN_ATTENTION",
            "sdpa-efficient": "EFFICIENT_ATTENTION",
        }[impl]
    )


def make_timer(dev: torch.device, warmup_ms: float, rep_ms: float) -> Callable[[Callable[[], object]], float]:
    """fn -> median milliseconds: triton.testing.do_bench on CUDA, wall clock on CPU."""
    if dev.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError as exc:
            raise SystemExit("error: timing on CUDA uses triton.testing.do_bench, and Triton is not "
                             "installed: pip install './apps/benchmarks[cuda]' (CUDA builds of torch bring "
                             "it)") from exc

        return lambda fn: float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    def cpu_median(fn: Callable[[], object]) -> float:
        deadline = time.perf_counter() + warmup_ms / 1e3
        fn()
        while time.perf_counter() < deadline:
            fn()
        times: list[float] = []
        deadline = time.perf_counter() + rep_ms / 1e3
        while len(times) < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_median


def captured(run: Callable[[], object], warmups: int = 3) -> Callable[[], None]:
    """run captured into a CUDA graph on the current stream, after warm-up calls on a side stream (as
    torch.cuda.graph asks: lazy initialization, workspaces and autotuning happen there, not in the
    capture): the graph's replay. The current stream must be the one the inputs' autograd graph was made
    on (main runs every cell on a stream of its own): autograd runs a backward on its forward's stream,
    so a backward whose forward ran on another stream would leave the capture. A capture that fails
    leaves no capture behind (see _end_failed_capture)."""
    stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            run()
    except BaseException:
        _end_failed_capture(graph, stream)
        raise
    return graph.replay


def _end_failed_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Leave no trace of a failed capture. torch.cuda.graph's exit ends the capture, but where that
    raises (the capture was invalidated) it stops before the default generators leave capture mode, and
    every later random op then raises "Offset increment outside graph capture encountered unexpectedly":
    each gets a fresh state with its seed and offset."""
    with torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():  # the exception came before the capture's end
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # invalidated: the capture has ended all the same
    for generator in torch.cuda.default_generators:
        generator.graphsafe_set_state(generator.clone_state())


def first_line(exc: BaseException) -> str:
    """The first line of exc's message, after that of the error it was raised while handling: a capture
    whose body failed reports the body's error, and torch.cuda.graph's exit then raises "operation
    failed due to a previous error during capture" over it."""
    lines = [f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}" for e in (exc.__context__, exc) if e]
    return " (then) ".join(lines)


def graphed(timer: Callable[[Callable[[], object]], float]) -> Callable[[Callable[[], object]], float | str]:
    """--cuda-graphs: a timer of the replays of run's CUDA graph, CAPTURE_FAILED where the capture fails."""

    def time_replays(run: Callable[[], object]) -> float | str:
        try:
            replay = captured(run)
        except RuntimeError as exc:
            if is_oom(exc):
                raise
            console.print(f"[yellow]CUDA graph capture failed: {escape(first_line(exc))}[/yellow]")
            return CAPTURE_FAILED
        return timer(replay)

    return time_replays


def measure(
    fn: Callable[..., torch.Tensor],
    shape: Shape,
    causal: bool,
    passes: list[str],
    dev: torch.device,
    timer: Callable[[Callable[[], object]], float | str],
) -> dict[str, float | str]:
    """Median ms of each pass, NOT_AVAILABLE if fn refuses this dtype/device, OOM if memory ran out."""
    dtype = DTYPES[shape.dtype]
    generator = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(
            1, shape.batch_heads, shape.seq, shape.head_dim, device=dev, dtype=dtype, generator=generator
        ).requires_grad_()
        for _ in range(3)
    )
    grad_out = torch.randn_like(q)
    inputs = (q, k, v)
    try:
        with warnings.catch_warnings():  # SDPA warns why a backend refuses; the cell says unsupported
            warnings.simplefilter("ignore")
            out = fn(q, k, v, causal)
    except RuntimeError as exc:
        if is_oom(exc):
            free_device_memory()
            return dict.fromkeys(passes, OOM)
        if "No available kernel" in str(exc) or "No viable backend" in str(exc):
            return dict.fromkeys(passes, NOT_AVAILABLE)
        raise
    runs = {
        "fwd": lambda: fn(q, k, v, causal),
        "bwd": lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v, causal), inputs, grad_out),
    }
    result: dict[str, float | str] = {}
    for which in passes:
        try:
            result[which] = timer(runs[which])
        except Exception as exc:
            if not is_oom(exc):
                raise
            free_device_memory()
            result[which] = OOM
    return result


def skip_reason(impl: str, shape: Shape, args) -> str | None:
    if impl == "naive" and shape.seq > args.naive_max_seq:
        return SKIPPED
    if impl == "torch" and shape.seq > args.torch_max_seq:
        return SKIPPED
    return None


def _numbers(column: pd.Series) -> pd.Series:
    """The numeric cells of a column; OOM, unsupported and skipped become NaN."""
    return pd.to_numeric(column, errors="coerce").reset_index(drop=True)


def _cells(values: pd.Series) -> list:
    """Three significant digits, '-' where there is no number."""
    return [float(f"{x:.3g}") if not math.isnan(x) else "-" for x in values]


def add_ratios(df: pd.DataFrame, passes: list[str], causal: bool) -> pd.DataFrame:
    """TFLOP/s columns and, per SDPA backend present, 'x <backend>' speedups (its ms / this row's ms)."""
    key = ["batch*heads", "T", "d", "dtype"]
    out = df.reset_index(drop=True)
    flops = forward_flops(out["batch*heads"], out["T"], out["d"], causal)
    for which in passes:
        out[f"{which} TFLOP/s"] = _cells(flops * PASS_FLOPS[which] / (_numbers(out[f"{which} ms"]) * 1e9))
    for label, baseline in BASELINES.items():
        base = out[out["impl"] == baseline]
        if base.empty:
            continue
        aligned = out[key].merge(
            base[key + [f"{w} ms" for w in passes]], on=key, how="left", suffixes=("", "_base")
        )
        for which in passes:
            out[f"{which} x {label}"] = _cells(
                _numbers(aligned[f"{which} ms"]) / _numbers(out[f"{which} ms"])
            )
    return out


def passes_contradict(times: dict[str, float]) -> bool:
    """Whether a row's pass times contradict each other by the noise rule (:func:`within_noise`): a time
    below 0, or fwd+bwd below fwd or below bwd (the other pass inside it would take negative time)."""
    values = {p: t for p, t in times.items() if not math.isnan(t)}
    parts = [values[p] for p in ("fwd", "bwd") if p in values]
    inside = [values["fwd+bwd"] - part for part in parts] if "fwd+bwd" in values else []
    return any(within_noise(t) for t in [*values.values(), *inside])


def noisy_rows(df: pd.DataFrame) -> pd.Series:
    """Per row of a flash table: its pass times contradict each other (:func:`passes_contradict`)."""
    passes = [p for p in PASSES if f"{p} ms" in df.columns]
    times = pd.DataFrame({p: pd.to_numeric(df[f"{p} ms"], errors="coerce") for p in passes}, index=df.index)
    return pd.Series([passes_contradict(row) for row in times.to_dict("records")], index=df.index, dtype=bool)


def shown_with_noise(df: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: a row whose times contradict each other reads '<value> (noise)' in every
    timing column, and so does every 'x <backend>' ratio whose baseline row is such a row."""
    noisy = noisy_rows(df)
    key = [c for c in ("batch*heads", "T", "d", "dtype") if c in df.columns]
    timing = [c for c in df.columns if c.endswith((" ms", " TFLOP/s")) or " x " in c]
    shown = with_noise_marked(df, noisy, timing)
    for label, baseline in BASELINES.items():
        is_base = df["impl"] == baseline
        if not is_base.any():
            continue
        noisy_keys = df.loc[is_base & noisy, key].drop_duplicates()
        hit = df[key].merge(noisy_keys.assign(_hit=True), on=key, how="left")["_hit"].notna().to_numpy()
        hit = hit & ~noisy.to_numpy()  # those rows are marked already
        ratios = [c for c in df.columns if c.endswith(f" x {label}")]
        shown.loc[hit, ratios] = with_noise_marked(df, hit, ratios).loc[hit, ratios]
    return shown


def geomean_summary(df: pd.DataFrame, passes: list[str], min_seq: int) -> list[str]:
    """One line per (dtype, impl, SDPA backend): the geometric-mean speedup of each pass over T >= min_seq."""
    lines = []
    measured = df[~noisy_rows(df)]
    for dtype in df["dtype"].unique():
        rows = measured[(measured["dtype"] == dtype) & (measured["T"] >= min_seq)]
        for impl in [i for i in rows["impl"].unique() if not i.startswith("sdpa")]:
            mine = rows[rows["impl"] == impl]
            for label in BASELINES:
                parts = []
                for which in passes:
                    column = f"{which} x {label}"
                    values = pd.to_numeric(mine.get(column, pd.Series(dtype=float)), errors="coerce").dropna()
                    values = values[values > 0]
                    if len(values):
                        geomean = math.exp(sum(math.log(x) for x in values) / len(values))
                        parts.append(f"{which} {geomean:.2f}x (min {values.min():.2f}, n={len(values)})")
                if parts:
                    lines.append(f"{dtype} T>={min_seq}: {impl} vs sdpa-{label}: " + ", ".join(parts))
    return lines


def build_shapes(args) -> list[Shape]:
    """The extra shapes first (they matter most when --max-minutes cuts a run short), then the sweep."""
    shapes = [Shape(*parse_shape(text), "bfloat16") for text in args.shapes]
    for dtype in args.dtypes:
        shapes += [Shape(args.batch, seq, d, dtype) for d in args.dims for seq in args.seq]
    return list(dict.fromkeys(shapes))


def feature_main(args, dev: torch.device) -> pd.DataFrame:
    """--feature: each feature against its baseline (benchmarks.flash_features), one table."""
    dtype = DTYPES[(args.dtypes or ["bfloat16"])[0]]
    timer = make_timer(dev, args.warmup, args.rep)
    if args.cuda_graphs:
        timer = graphed(timer)
    # Under --cuda-graphs the cases run on a stream of their own, which captured() captures on.
    with torch.cuda.stream(torch.cuda.Stream() if args.cuda_graphs else None):
        df = run_features(args.feature, dev, dtype, args.batch, timer, args.repeats)
    print_table(df, f"flash_attention features, {dtype}, "
                    f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}")  # fmt: skip
    speedup = window_speedup(df)
    if speedup:
        console.print(speedup)
    save_results(df, f"{args.name}-features", args, {"window vs full causal": speedup} if speedup else None)
    return df


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = make_parser("flash", __doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run: T 128,256 and d 16,32 in float32 on CPU; T 1024,4096, d 64,128 in "
        "bfloat16 and 16x16384x64 on a GPU (options given explicitly still apply)",
    )
    parser.add_argument(
        "--seq",
        type=int_list,
        default=None,
        help=f"sequence lengths of the sweep (default {','.join(map(str, DEFAULTS['seq']))})",
    )
    parser.add_argument(
        "--dims", type=int_list, default=None, help="head dims of the sweep (default 16,32,64,128)"
    )
    parser.add_argument(
        "--dtypes", type=str_list(DTYPES), default=None, help="dtypes of the sweep (default bfloat16,float32)"
    )
    parser.add_argument("--batch", type=positive_int, default=1, help="batch*heads of the sweep")
    parser.add_argument(
        "--shapes",
        type=shape_list,
        default=None,
        help="extra bfloat16 shapes BATCH*HEADSxTxD (default 16x16384x64,1x65536x128,64x4096x128; "
        "'' for none)",
    )
    parser.add_argument(
        "--impls", type=str_list(IMPLS), default=None,
        help=f"implementations among {', '.join(IMPLS)} (default all)"
    )
    parser.add_argument("--passes", type=str_list(PASSES), default=PASSES, help="passes to time")
    parser.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking"
    )
    parser.add_argument("--naive-max-seq", type=positive_int, default=16384,
                        help="skip naive attention above this T")
    parser.add_argument(
        "--torch-max-seq", type=positive_int, default=8192, help="skip FlashAttentionTorch above this T"
    )
    parser.add_argument("--warmup", type=nonnegative_float, default=10.0, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=positive_float, default=50.0, help="do_bench measuring time, ms")
    parser.add_argument("--geomean-min-seq", type=positive_int, default=1024,
                        help="geometric means over T >= this")
    parser.add_argument("--name", type=results_name, default="flash",
                        help="results file name (for runs of different sweeps)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is one")
    parser.add_argument("--max-minutes", type=positive_float, default=None,
                        help="start no cell after this long; the cells left read 'skipped'")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time each pass as the replay of a CUDA graph captured after a warm-up "
                        "(CUDA only)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="time every cell (or --feature case) this many times, in rounds over all "
                        "cells (so that a slow spell of the host hits every implementation alike), and keep "
                        "the median")
    parser.add_argument("--feature", type=str_list(FEATURES), default=None,
                        help=f"time flash_attention's features against PyTorch's best instead of the sweep "
                        f"({', '.join(FEATURES)}; bfloat16 unless --dtypes says otherwise)")
    args = parse_args(parser, argv)
    if args.device == "cuda":
        require_gpus(parser, 1)
    dev = torch.device(args.device) if args.device else device()
    if args.cuda_graphs and dev.type != "cuda":
        parser.error(f"--cuda-graphs captures CUDA graphs and needs a CUDA device, not {dev.type}")
    if args.feature:
        return feature_main(args, dev)
    preset = (QUICK_GPU if dev.type == "cuda" else QUICK_CPU) if args.quick else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    timer = make_timer(dev, args.warmup, args.rep)
    if args.cuda_graphs:
        timer = graphed(timer)
    shapes = build_shapes(args)
    cells = [(shape, impl) for shape in shapes for impl in args.impls]
    measured: list[list[dict[str, float | str]]] = [[] for _ in cells]
    deadline = math.inf if args.max_minutes is None else time.perf_counter() + args.max_minutes * 60
    rounds = [(index, cell) for _ in range(args.repeats) for index, cell in enumerate(cells)]
    # Under --cuda-graphs every cell runs on a stream of its own, which captured() captures on.
    cells_stream = torch.cuda.Stream() if args.cuda_graphs else None
    with progress() as bar, torch.cuda.stream(cells_stream):
        for index, (shape, impl) in bar.track(rounds, description="timing"):
            fn = attention_fn(impl, dev)
            reason = NOT_AVAILABLE if fn is None else skip_reason(impl, shape, args)
            if time.perf_counter() > deadline:
                reason = SKIPPED
            measured[index].append(
                dict.fromkeys(args.passes, reason)
                if reason
                else measure(fn, shape, args.causal, args.passes, dev, timer)
            )
            free_device_memory()
    rows = [
        {
            "batch*heads": shape.batch_heads,
            "T": shape.seq,
            "d": shape.head_dim,
            "dtype": shape.dtype,
            "causal": args.causal,
            "impl": impl,
            **{f"{which} ms": as_cell(median_time([r[which] for r in repeats]), 4) for which in args.passes},
        }
        for (shape, impl), repeats in zip(cells, measured, strict=True)
    ]
    df = add_ratios(pd.DataFrame(rows), args.passes, args.causal)
    print_table(
        shown_with_noise(df.drop(columns=["causal"])),
        f"attention, {'causal' if args.causal else 'not causal'}, "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}"
        f"{', CUDA graphs' if args.cuda_graphs else ''}",
    )
    summary = geomean_summary(df, args.passes, args.geomean_min_seq)
    for line in summary:
        console.print(line)
    save_results(df, args.name, args, {"geomeans": " | ".join(summary)} if summary else None)
    return df


if __name__ == "__main__":
    main()
