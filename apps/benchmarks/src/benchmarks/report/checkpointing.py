"""Activation checkpointing: held activations against the model, peak memory, step time, largest context."""

from __future__ import annotations

import pandas as pd

from benchmarks.report.core import (
    Context,
    Section,
    axes,
    in_prose,
    missing_columns,
    missing_note,
    numeric,
    prefixed,
    style,
    times_less,
    value_range,
)


def render_checkpointing(ctx: Context) -> list[str]:
    lines: list[str] = []
    f = ctx.get("checkpointing")
    if f is not None:
        lines += ctx.table(f, "Per policy and context: activations held between forward and backward "
                              "(measured, and the model of docs/checkpointing.md), peak, step time")
        missing = missing_columns(f.df, ["policy", "context", "step_ms", "activations_MB", "model_MB"])
        if missing:
            lines.append(missing_note("The comparison", missing))
        else:
            plot = checkpointing_plot(ctx, f.df) if ctx.measures_speed else None
            lines += [*checkpointing_findings(ctx, f.df), "", plot]
    limits = ctx.get("checkpointing_max_context")
    if limits is not None:
        lines += ctx.table(limits, "Largest context each policy trains at")
    return lines


def checkpointing_findings(ctx: Context, df: pd.DataFrame) -> list[str]:
    df = df.assign(measured=numeric(df["activations_MB"]), model=numeric(df["model_MB"]),
                   time=numeric(df["step_ms"]))
    lines = []
    compared = df.dropna(subset=["measured", "model"])
    if len(compared):
        ratio = compared["measured"] / compared["model"]
        lines.append(f"- Held activations against the model: measured/model "
                     f"{value_range(ratio.min(), ratio.max(), '{:.3f}')} over {len(compared)} cells.")
    longest = df[df["context"] == df["context"].max()].set_index("policy")
    if "none" in longest.index:
        base = longest.loc["none"]
        others = longest.drop(index="none")
        for policy, row in others.iterrows():
            measured = pd.notna(row["measured"]) and pd.notna(base["measured"])
            column = "measured" if measured else "model"
            memory, reference = row[column], base[column]
            lines.append(f"- context {int(row['context'])}, {policy}: activations "
                         f"{'' if measured else 'predicted '}{in_prose(memory, 4)} MB "
                         f"({times_less(memory, reference, 'none')}).")
        change = (others["time"] / base["time"] - 1) * 100
        steps = ", ".join(f"{policy} {in_prose(row['time'], 4)} ms ({change[policy]:+.0f}%)"
                          for policy, row in others.iterrows())
        lines += ctx.speed(f"- Step time at context {int(base['context'])}, against none's "
                           f"{in_prose(base['time'], 4)} ms: {steps}." if steps else None)
    return lines


def checkpointing_plot(ctx: Context, df: pd.DataFrame) -> str | None:
    """Memory against step time, a line per policy through its contexts."""
    peak = numeric(df["peak_MB"]) if "peak_MB" in df else pd.Series(float("nan"), index=df.index)
    memory, label = (peak, "peak memory (MB)") if peak.notna().any() else (numeric(df["model_MB"]),
                                                                            "predicted activations (MB)")
    fig, (ax,) = axes()
    for policy in dict.fromkeys(df["policy"]):
        rows = df["policy"] == policy
        ax.plot(numeric(df.loc[rows, "step_ms"]), memory[rows], marker="o", label=policy)
    style(ax, "step time (ms)", label, "Activation checkpointing: memory against time, per policy")
    return ctx.figure("checkpointing_memory_time", fig, "memory against step time per checkpointing policy")


SECTION = Section(
    key="checkpointing",
    title="Activation checkpointing",
    command="python -m benchmarks.checkpointing",
    matches=prefixed("checkpointing"),
    render=render_checkpointing,
)
