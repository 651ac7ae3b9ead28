"""Naive attention, eager and compiled: scaling with T, compile speedups, memory against the formula."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from benchmarks.report.core import (
    Context,
    ResultFile,
    Section,
    axes,
    first_oom,
    is_oom,
    log_slope,
    median_of,
    missing_columns,
    missing_note,
    numeric,
    plain,
    prefixed,
    style,
    value_range,
)


def render_attention(ctx: Context) -> list[str]:
    lines: list[str] = []
    for f in ctx.files:
        title = f"Naive attention, batch {f.meta.get('batch_size', '?')}, {f.meta.get('dtype', '')}"
        lines += ctx.table(f, title)
        lines += [*attention_findings(ctx, f), ""]
    return lines


def attention_findings(ctx: Context, f: ResultFile) -> list[str]:
    df = f.df
    missing = missing_columns(df, ["d", "T"])
    variants = [c.removeprefix("fwd ms ") for c in df.columns if c.startswith("fwd ms ")]
    if missing or not variants:
        return [missing_note("The analysis", missing or ["fwd ms <variant>"])]
    lines = []  # about speed: a GPU's results only (ctx.speed)
    eager = next((v for v in variants if v == "eager"), None)
    compiled = next((v for v in variants if v.startswith("compiled")), None)
    if eager and compiled:
        for p in ("fwd", "bwd"):
            if f"{p} ms {eager}" in df and f"{p} ms {compiled}" in df:
                ratio = (numeric(df[f"{p} ms {eager}"]) / numeric(df[f"{p} ms {compiled}"])).dropna()
                if len(ratio):
                    top = df.loc[ratio.idxmax()]
                    lines.append(f"- {'Forward' if p == 'fwd' else 'Backward'}: {compiled} is "
                                 f"{ratio.median():.2f}x the speed of eager (median; "
                                 f"{value_range(ratio.min(), ratio.max())}, best at d={plain(top['d'])}, "
                                 f"T={plain(top['T'])}).")
    t_from = numeric(df["T"]).median()
    long = df[numeric(df["T"]) >= t_from]
    for v in variants:
        for p in ("fwd", "bwd"):
            col = f"{p} ms {v}"
            if col in df:
                slopes = pd.Series([log_slope(numeric(rows["T"]), numeric(rows[col]))
                                    for _, rows in long.groupby("d")]).dropna()
                if len(slopes):
                    spread = value_range(slopes.min(), slopes.max(), "{:.2f}")
                    lines.append(f"- {v} {p} time grows as T^{slopes.median():.2f} for T >= {t_from:g} "
                                 f"(median over d of a log-log fit, {spread}; 2 is quadratic).")
    lines = ctx.speed(*lines)
    for v in variants:
        ooms = first_oom(df, f"fwd ms {v}", "T", ["d"]) if f"fwd ms {v}" in df else []
        if ooms:
            lines.append(f"- {v} runs out of memory: " + "; ".join(ooms) + ".")
        failed = df[f"fwd ms {v}"].astype(str).str.startswith("compile failed").sum()
        if failed:
            lines.append(f"- {v}: {failed} configuration(s) failed to compile.")
    mem = next((c for c in df.columns if c == f"mem MiB {eager}"), None)
    if mem and "predicted MiB" in df and numeric(df[mem]).notna().any():
        ratio = (numeric(df[mem]) / numeric(df["predicted MiB"])).dropna()
        formula = f"; formula: {f.meta['formula']}" if "formula" in f.meta else ""
        lines.append(f"- Memory before backward, measured / predicted: {median_of(ratio, '{:.3f}')} for "
                     f"eager{formula}.")
    if not any(is_oom(df[c]).any() for c in df.columns if c.startswith("fwd ms ")):
        lines.append("- No configuration ran out of memory.")
    return lines + ["", attention_plot(ctx, f, df, variants) if ctx.measures_speed else None]


def attention_plot(ctx: Context, f: ResultFile, df: pd.DataFrame, variants: list[str]) -> str:
    fig, panels = axes(2)
    dims = sorted(numeric(df["d"]).dropna().unique())
    colors = plt.get_cmap("plasma")([i / max(1, len(dims)) * 0.85 for i in range(len(dims))])
    for ax, p, title in zip(panels, ("fwd", "bwd"), ("forward", "backward"), strict=True):
        for i, d in enumerate(dims):
            rows = df[numeric(df["d"]) == d]
            for j, v in enumerate(variants):
                col = f"{p} ms {v}"
                if col in rows:
                    ax.plot(numeric(rows["T"]), numeric(rows[col]), ["-", "--", ":"][j % 3], marker="o", ms=3,
                            color=colors[i], label=f"d={d:.0f}, {v}")
        style(ax, "sequence length T", "time per pass (ms)", f"naive attention {title}", base_x=2)
    return ctx.figure("attention", fig, "attention time against sequence length")


SECTION = Section(
    key="attention",
    title="Attention: naive PyTorch, eager and compiled",
    command="python -m benchmarks.attention",
    matches=prefixed("attention"),
    render=render_attention,
)
