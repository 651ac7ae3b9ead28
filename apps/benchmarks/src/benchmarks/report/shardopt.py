"""Optimizer-state sharding: memory per rank, time per iteration, its communication overlap, the goals."""

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

SHARDOPT_PARTS = ["parameters_MB", "gradients_MB", "optimizer_state_MB", "other_MB"]


def render_shardopt(ctx: Context) -> list[str]:
    lines: list[str] = []
    memory, timing, goal = (ctx.get(f"shardopt_{n}") for n in ("memory", "time", "goal"))
    if memory is not None:
        lines += ctx.table(memory, "Memory per rank (largest over ranks), MB")
        if "memory_accounting" in memory.meta:
            lines.append(f"- Accounting: {memory.meta['memory_accounting']}.")
        lines += [*shardopt_memory_findings(ctx, memory.df), ""]
    if timing is not None:
        lines += ctx.table(timing, "Time per iteration and per optimizer step, ms")
        df = timing.df
        if missing_columns(df, ["optimizer", "iteration_ms"]):
            lines.append(missing_note("The comparison", missing_columns(df, ["optimizer", "iteration_ms"])))
        else:
            it = dict(zip(df["optimizer"], numeric(df["iteration_ms"]), strict=True))
            base = next((k for k in it if "unsharded" in k), None)
            speed = []  # a GPU's results only (ctx.speed)
            for name, ms in it.items():
                if name != base and base:
                    speed.append(f"- {name}: {ms:.4g} ms per iteration, {(ms / it[base] - 1) * 100:+.1f}% "
                                 f"against {base} ({it[base]:.4g} ms).")
            if {"ShardedOptimizer", "ZeroRedundancyOptimizer"} <= it.keys():
                delta = it["ShardedOptimizer"] / it["ZeroRedundancyOptimizer"] - 1
                speed.append(f"- ShardedOptimizer against ZeroRedundancyOptimizer: {delta * 100:+.1f}% per "
                             "iteration.")
            lines += ctx.speed(*speed)
        lines += shardopt_overlap_lines(ctx, df)
        lines.append("")
    if goal is not None:
        lines += ctx.table(goal, "Goals")
        df = goal.df
        if not missing_columns(df, ["criterion", "measured", "limit"]):
            for r in df.itertuples(index=False):
                ok = float(r.measured) <= float(r.limit)
                verdict = (f"- {r.criterion}: {float(r.measured):.4g} against {float(r.limit):.4g}: "
                           f"{'met' if ok else 'not met'}.")
                lines += ctx.speed(verdict) if is_time(str(r.criterion)) else [verdict]
        lines.append("")
    return lines


def is_time(criterion: str) -> bool:
    """Whether a goal's criterion compares times ('... step <= ... step (ms)'): not a CPU run's to judge."""
    return criterion.endswith("(ms)")


def shardopt_overlap_lines(ctx: Context, df: pd.DataFrame) -> list[str]:
    if missing_columns(df, ["optimizer", *TRACED_COLUMNS]):
        return []
    return overlap_lines(ctx, df["optimizer"], df, "shardopt_overlap", "communication overlap per optimizer")


def shardopt_memory_findings(ctx: Context, df: pd.DataFrame) -> list[str]:
    missing = missing_columns(df, ["optimizer", "phase", "optimizer_state_MB"])
    if missing:
        return [missing_note("The comparison", missing)]
    after = df[df["phase"] == "after step"].set_index("optimizer")
    state = numeric(after["optimizer_state_MB"])
    lines = []
    base = next((k for k in state.index if "unsharded" in k), None)
    if base:
        for name, mb in state.items():
            if name != base:
                lines.append(f"- Optimizer state per rank after the step: {name} {in_prose(mb, 4)} MB, "
                             f"{times_less(mb, state[base], base)} ({in_prose(state[base], 4)} MB).")
    if "peak_MB" in df:
        peak = numeric(df.set_index(["optimizer", "phase"])["peak_MB"]).dropna()
        if len(peak):
            top = peak.groupby(level=0).max()
            lines.append("- Peak memory per rank over the iteration: "
                         + ", ".join(f"{k} {in_prose(v, 4)} MB" for k, v in top.items()) + ".")
    return lines + ["", shardopt_plot(ctx, df)]


def shardopt_plot(ctx: Context, df: pd.DataFrame) -> str | None:
    """Stacked parameters / gradients / optimizer state / other, one panel per optimizer, a bar per moment."""
    parts = [c for c in SHARDOPT_PARTS if c in df]
    optimizers = list(dict.fromkeys(df["optimizer"]))
    fig, panels = plt.subplots(1, len(optimizers), figsize=(3.6 * len(optimizers) + 1, 4.5), sharey=True,
                               squeeze=False)
    for ax, name in zip(panels[0], optimizers, strict=True):
        rows = df[df["optimizer"] == name]
        stacked_bars(ax, rows["phase"].astype(str), rows, parts)
        ax.set_title(name, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    panels[0][0].set_ylabel("memory per rank (MB)")
    panels[0][-1].legend(fontsize=8)
    fig.suptitle("Memory with and without optimizer-state sharding")
    return ctx.figure("shardopt_memory", fig, "memory per rank by optimizer and moment")


SECTION = Section(
    key="shardopt",
    title="Optimizer-state sharding",
    command="python -m benchmarks.shardopt",
    matches=prefixed("shardopt"),
    render=render_shardopt,
)
