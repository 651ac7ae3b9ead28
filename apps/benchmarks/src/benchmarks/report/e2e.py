"""The end-to-end model benchmark: step times, throughput, MFU, and the profiled kernel summaries."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd

from benchmarks.report.core import (
    Context,
    ResultFile,
    Section,
    axes,
    find_column,
    first_oom,
    in_prose,
    is_oom,
    median_of,
    missing_columns,
    missing_note,
    numeric,
    plain,
    shorten,
    style,
    value_range,
)


def is_e2e_main_or_kernels(name: str) -> bool:
    return name.startswith("e2e") and "_memory_" not in name


def is_e2e_main(name: str) -> bool:
    return (name.startswith("e2e") and "_kernels_" not in name and not name.endswith("_kernel_summary")
            and "_memory_" not in name)


def render_e2e(ctx: Context) -> list[str]:
    lines: list[str] = []
    for f in (f for f in ctx.files if is_e2e_main(f.name)):
        title = f"{f.name}: mode {f.meta.get('mode', '?')}, batch {f.meta.get('batch_size', '?')}"
        lines += ctx.table(f, title)
        lines += [*e2e_findings(ctx, f), ""]
    for f in (f for f in ctx.files if f.name.endswith("_kernel_summary")):
        lines += ctx.table(f, "Kernel time per phase: matrix multiplies vs the rest")
        lines += [*kernel_summary_findings(f.df), ""]
    for f in (f for f in ctx.files if "_kernels_" in f.name):
        lines += top_kernels(ctx, f)
    return lines


def e2e_findings(ctx: Context, f: ResultFile) -> list[str]:
    df = f.df
    missing = missing_columns(df, ["size", "context", "step ms"])
    if missing:
        return [missing_note("The analysis", missing)]
    df = df.assign(step=numeric(df["step ms"]))
    variants = [c for c in ("precision", "attention") if c in df.columns and df[c].nunique() > 1]
    lines = []  # about speed: a GPU's results only (ctx.speed)
    if "tokens/s" in df.columns and numeric(df["tokens/s"]).notna().any():
        best = df.loc[numeric(df["tokens/s"]).idxmax()]
        which = "".join(f", {best[c]}" for c in variants)
        lines.append(f"- Highest throughput: {best['size']} at context {best['context']}{which}: "
                     f"{in_prose(float(best['tokens/s']))} tokens/s ({float(best['step']):.4g} ms per step).")
    if "MFU %" in df.columns and numeric(df["MFU %"]).notna().any():
        mfu = numeric(df["MFU %"])
        best = df.loc[mfu.idxmax()]
        lines.append(f"- Best MFU: {mfu.max():.1f}% ({best['size']}, context {best['context']}"
                     + "".join(f", {best[c]}" for c in variants) + f"); median {mfu.median():.1f}%.")
    if {"precision"} <= set(df.columns) and {"fp32", "bf16"} <= set(df["precision"].astype(str)):
        keys = [c for c in ("size", "context", "attention") if c in df.columns]
        fp32, bf16 = df[df["precision"] == "fp32"], df[df["precision"] == "bf16"]
        pairs = fp32.merge(bf16, on=keys, suffixes=("_32", "_16"))
        speedup = (pairs["step_32"] / pairs["step_16"]).dropna()
        if len(speedup):
            top = pairs.loc[speedup.idxmax()]
            where = f"{top['size']} at context {top['context']}"
            many = (f" (median {speedup.median():.2f}x over {len(speedup)} pairs); the largest gain is "
                    f"{where}." if len(speedup) > 1 else f" ({where}).")
            faster = value_range(speedup.min(), speedup.max())
            lines.append(f"- bf16 autocast against fp32: {faster} faster{many}")
    contexts = sorted(numeric(df["context"]).dropna().unique())
    if len(contexts) > 1:
        lo, hi = contexts[0], contexts[-1]
        growth = []
        first_variant = df[variants[0]].iloc[0] if variants else None
        for size, rows in df.groupby("size", sort=False):
            if variants:
                rows = rows[rows[variants[0]] == first_variant]
            at = dict(zip(numeric(rows["context"]), rows["step"], strict=True))
            if not math.isnan(at.get(lo, math.nan)) and not math.isnan(at.get(hi, math.nan)):
                growth.append(f"{size} {at[hi] / at[lo]:.2f}x")
        if growth:
            which = f" ({first_variant})" if variants else ""
            lines.append(f"- From context {lo:.0f} to {hi:.0f} ({hi / lo:.0f}x the tokens) the step time "
                         f"grows {', '.join(growth)}{which}.")
    if {"fwd ms", "bwd ms"} <= set(df.columns):
        ratio = (numeric(df["bwd ms"]) / numeric(df["fwd ms"])).dropna()
        if len(ratio):
            lines.append(f"- Backward time against forward time: {median_of(ratio)}.")
    ooms = first_oom(df, "step ms", "context", ["size", *variants])
    lines = ctx.speed(*lines)
    lines.append(f"- Out of memory: {'; '.join(ooms)}." if ooms else "- No configuration ran out of memory.")
    plot = e2e_plot(ctx, f, df, variants) if ctx.measures_speed else None
    return lines + (["", plot] if plot else [])


def e2e_plot(ctx: Context, f: ResultFile, df: pd.DataFrame, variants: list[str]) -> str | None:
    if numeric(df["context"]).nunique() < 2:  # one context length: the table says it all
        return None
    fig, (ax,) = axes()
    sizes = list(dict.fromkeys(df["size"]))
    colors = plt.get_cmap("viridis")([i / max(1, len(sizes) - 1) * 0.9 for i in range(len(sizes))])
    dashes = ["-", "--", ":", "-."]
    groups = df.groupby(["size", *variants], sort=False)
    variant_values = {v: list(dict.fromkeys(df[v])) for v in variants}
    for key, rows in groups:
        key = key if isinstance(key, tuple) else (key,)
        size = key[0]
        ls = dashes[variant_values[variants[0]].index(key[1]) % 4] if variants else "-"
        ok = rows[rows["step"].notna()]
        if ok.empty:
            continue
        label = " ".join(map(str, key))
        if is_oom(rows["step ms"]).any():
            label += f" (OOM from {plain(numeric(rows.loc[is_oom(rows['step ms']), 'context']).min())})"
        ax.plot(numeric(ok["context"]), ok["step"], ls, marker="o", ms=4, color=colors[sizes.index(size)],
                label=label)
    style(ax, "context length (tokens)", "step time (ms)",
          f"{f.name}: batch {f.meta.get('batch_size', '?')}, {f.meta.get('device', '')}", base_x=2)
    return ctx.figure(f.name, fig, f"{f.name}: step time against context length per model size")


def kernel_summary_findings(df: pd.DataFrame) -> list[str]:
    missing = missing_columns(df, ["phase", "matmul %"])
    if missing:
        return [missing_note("The matmul share", missing)]
    keys = [c for c in ("size", "context", "precision", "attention") if c in df.columns]
    lines = []
    for key, rows in df.groupby(keys, sort=False) if keys else [((), df)]:
        key = key if isinstance(key, tuple) else (key,)
        pairs = zip(rows["phase"], numeric(rows["matmul %"]), strict=True)
        shares = ", ".join(f"{m:.0f}% of {p}" for p, m in pairs if not math.isnan(m))
        label = ", ".join(f"context {v}" if k == "context" else str(v)
                          for k, v in zip(keys, key, strict=True))
        lines.append(f"- {label}: matrix multiplies take {shares} kernel time.")
    return lines


def top_kernels(ctx: Context, f: ResultFile, per_phase: int = 5) -> list[str]:
    df = f.df
    phase, name = find_column(df, "Phase"), find_column(df, "Name")
    share = find_column(df, "Time (%)", "Time %")
    if phase is None or name is None or share is None:
        return ctx.table(f)
    order = {p: i for i, p in enumerate(dict.fromkeys(df[phase]))}  # phases in the table's own order
    top = (df.assign(_share=numeric(df[share]), _phase=df[phase].map(order))
           .sort_values(["_phase", "_share"], ascending=[True, False])
           .groupby(phase, sort=False).head(per_phase).drop(columns=["_share", "_phase"]))
    top = top.assign(**{name: top[name].map(shorten)})
    keep = [c for c in (phase, share, find_column(df, "Total Time"), find_column(df, "Instances"),
                        find_column(df, "Avg"), name) if c]
    return ctx.table(f, f"{f.name}: top {per_phase} kernels per phase", top[keep])


SECTION = Section(
    key="e2e",
    title="End-to-end model benchmark",
    command="python -m benchmarks.e2e",
    matches=is_e2e_main_or_kernels,
    render=render_e2e,
)
