"""Fully sharded data parallel: memory per rank and time per iteration, beside the memory model."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from benchmarks.report.core import (
    Context,
    Section,
    in_prose,
    missing_columns,
    missing_note,
    numeric,
    prefixed,
    stacked_bars,
    times_less,
)
from benchmarks.report.overlap import TRACED_COLUMNS, overlap_lines

FSDP_PARTS = ["params_MB", "grads_MB", "optimizer_MB", "other_MB"]


def render_fsdp(ctx: Context) -> list[str]:
    lines: list[str] = []
    for f in ctx.files:  # one a model size (fsdp, fsdp_xl, ...)
        lines += ctx.table(f, "Memory per rank (largest over ranks, MB) and time per iteration (ms); "
                              "model_* columns: the memory model")
        missing = missing_columns(f.df, ["strategy", "compute", "iteration_ms", "params_MB", "peak_MB",
                                         "model_params_MB"])  # fmt: skip
        if missing:
            lines += [missing_note("The comparison", missing), ""]
            continue
        lines += [*fsdp_findings(ctx, f.df), "", fsdp_plot(ctx, f.df) or "", *fsdp_overlap_lines(ctx, f.df)]
    return lines


def fsdp_overlap_lines(ctx: Context, df: pd.DataFrame) -> list[str]:
    if missing_columns(df, TRACED_COLUMNS):
        return []
    labels = [f"{s} {c}" for s, c in zip(df["strategy"], df["compute"], strict=True)]
    lines = overlap_lines(ctx, labels, df, "fsdp_overlap", "communication overlap per strategy and dtype")
    return ["", *lines] if lines else []


def fsdp_findings(ctx: Context, df: pd.DataFrame) -> list[str]:
    by = df.assign(params=numeric(df["params_MB"]), model=numeric(df["model_params_MB"]),
                   time=numeric(df["iteration_ms"]), peak=numeric(df["peak_MB"]))
    by = by.set_index(["strategy", "compute"])
    lines = []
    for compute in dict.fromkeys(df["compute"]):
        cases = {s: by.loc[(s, compute)] for s in ("torch-ddp", "minddp-fsdp", "torch-fsdp2")
                 if (s, compute) in by.index}
        ours = cases.get("minddp-fsdp")
        if ours is None:
            continue
        if "torch-ddp" in cases:
            ddp = cases["torch-ddp"]["params"]
            lines.append(f"- {compute}: minddp.FSDP holds {in_prose(ours['params'], 4)} MB of parameters "
                         f"per rank, {times_less(ours['params'], ddp, 'DDP')} ({in_prose(ddp, 4)} MB); the "
                         f"model predicts {in_prose(ours['model'], 4)} MB.")
        if "torch-fsdp2" in cases:
            theirs = cases["torch-fsdp2"]
            time, peak = ours["time"] / theirs["time"] - 1, ours["peak"] / theirs["peak"] - 1
            lines += ctx.speed(f"- {compute}: minddp.FSDP {in_prose(ours['time'], 4)} ms per iteration "
                               f"against FSDP2's {in_prose(theirs['time'], 4)} ms ({time * 100:+.1f}%); peak "
                               f"{in_prose(ours['peak'], 4)} MB a rank against "
                               f"{in_prose(theirs['peak'], 4)} MB ({peak * 100:+.1f}%).")
    return lines


def fsdp_plot(ctx: Context, df: pd.DataFrame) -> str | None:
    """Stacked parameters / gradients / optimizer state / other per rank, a bar per strategy and dtype."""
    parts = [c for c in FSDP_PARTS if c in df]
    labels = [f"{s}\n{c}" for s, c in zip(df["strategy"], df["compute"], strict=True)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(df)), 4.5))
    stacked_bars(ax, labels, df, parts)
    ax.set(ylabel="memory per rank (MB)", title="Memory per rank: DDP against FSDP")
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return ctx.figure("fsdp_memory", fig, "memory per rank by strategy and compute dtype")


SECTION = Section(
    key="fsdp",
    title="Fully sharded data parallel",
    command="python -m benchmarks.fsdp",
    matches=prefixed("fsdp"),
    render=render_fsdp,
)
