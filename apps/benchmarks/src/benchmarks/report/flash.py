"""FlashAttention-2 (Triton) against SDPA's backends and PyTorch: winners, speedups, throughput."""

from __future__ import annotations

import pandas as pd

from benchmarks.flash import shown_with_noise
from benchmarks.report.core import (
    Context,
    ResultFile,
    Section,
    axes,
    first_oom,
    geomean,
    missing_columns,
    missing_note,
    numeric,
    plain,
    prefixed,
    style,
)


def render_flash(ctx: Context) -> list[str]:
    lines: list[str] = []
    for f in ctx.files:
        lines += flash_section(ctx, f)
    return lines


def flash_passes(df: pd.DataFrame) -> list[str]:
    return [c.removesuffix(" ms") for c in df.columns if c.endswith(" ms")]


def flash_baseline(df: pd.DataFrame, rows: pd.DataFrame) -> str | None:
    """The first 'x <backend>' speedup family with numbers in these rows."""
    for label in ("flash", "cudnn", "efficient"):
        cols = [c for c in df.columns if c.endswith(f" x {label}")]
        if cols and any(numeric(rows[c]).notna().any() for c in cols):
            return label
    return None


def flash_section(ctx: Context, f: ResultFile) -> list[str]:
    df = f.df
    missing = missing_columns(df, ["batch*heads", "T", "d", "dtype", "impl"])
    passes = flash_passes(df)
    if missing or not passes:
        return [*ctx.table(f), missing_note("The analysis", missing or ["<pass> ms"])]
    sweep_bh = df["batch*heads"].mode().iloc[0]
    sweep = df[df["batch*heads"] == sweep_bh]
    extra = df[df["batch*heads"] != sweep_bh]
    main_pass = "fwd+bwd" if "fwd+bwd" in passes else passes[-1]
    digest = flash_digest(shown_with_noise(sweep), main_pass)
    lines = ctx.table(f, f"{main_pass} ms by T and implementation at one d and dtype; all {len(df)} rows, "
                         "every pass, TFLOP/s and speedups are in the csv", digest)
    speed: list[str] = []  # a GPU's results only (ctx.speed)
    for dtype, rows in sweep.groupby("dtype", sort=False):
        for p in passes:
            times = rows.assign(ms=numeric(rows[f"{p} ms"])).dropna(subset=["ms"])
            if times.empty:
                continue
            winners = times.loc[times.groupby(["T", "d"])["ms"].idxmin(), "impl"].value_counts()
            cells = times.groupby(["T", "d"]).ngroups
            counts = ", ".join(f"{impl} in {n}" for impl, n in winners.items())
            speed.append(f"- {dtype} {p}: fastest {counts} of {cells} (T, d) cells.")
        base = flash_baseline(df, rows[rows["impl"] == "triton"])
        if base:
            mine = rows[rows["impl"] == "triton"]
            long = mine[numeric(mine["T"]) >= 1024] if (numeric(mine["T"]) >= 1024).any() else mine
            parts = []
            for p in passes:
                col = f"{p} x {base}"
                if col in mine:
                    values = numeric(long[col]).dropna()
                    if len(values):
                        best = long.loc[values.idxmax()]
                        parts.append(f"{p} {geomean(values):.2f}x (best {values.max():.2f}x at "
                                     f"T={plain(best['T'])}, d={plain(best['d'])})")
            if parts:
                speed.append(f"- Triton over SDPA {base}, {dtype}, T >= {numeric(long['T']).min():.0f} "
                             "(geometric mean): " + "; ".join(parts) + ".")
    ooms = [f"{impl}: {'; '.join(found)}" for impl, rows in df.groupby("impl", sort=False)
            if (found := first_oom(rows, f"{main_pass} ms", "T", ["dtype", "d"]))]
    speed += flash_peak_throughput(sweep, main_pass)
    for key, rows in extra.groupby(["batch*heads", "T", "d", "dtype"], sort=False):
        times = rows.assign(ms=numeric(rows[f"{main_pass} ms"])).dropna(subset=["ms"]).sort_values("ms")
        if len(times):
            speed.append(f"- Shape {key[0]}x{key[1]}x{key[2]} {key[3]}, {main_pass}: "
                         + ", ".join(f"{r.impl} {r.ms:.3g} ms" for r in times.itertuples()) + ".")
    lines += ctx.speed(*speed)
    lines.append(f"- Out of memory: {' | '.join(ooms)}." if ooms else "- No cell ran out of memory.")
    if ctx.measures_speed:
        lines += ["", flash_speedup_plot(ctx, f.name, df, sweep, passes),
                  flash_time_plot(ctx, f.name, sweep, main_pass)]
    return lines


def flash_peak_throughput(sweep: pd.DataFrame, p: str) -> list[str]:
    """Each implementation's best TFLOP/s in one pass, per dtype."""
    column = f"{p} TFLOP/s"
    if column not in sweep:
        return []
    lines = []
    for dtype, rows in sweep.assign(tflops=numeric(sweep[column])).dropna(subset=["tflops"]).groupby("dtype"):
        best = rows.loc[rows.groupby("impl", sort=False)["tflops"].idxmax()]
        best = best.sort_values("tflops", ascending=False)
        each = ", ".join(f"{r.impl} {r.tflops:.3g} TFLOP/s (T={plain(r.T)}, d={plain(r.d)})"
                         for r in best.itertuples())
        lines.append(f"- Best {p} throughput, {dtype}: {each}.")
    return lines


def flash_digest(sweep: pd.DataFrame, p: str) -> pd.DataFrame:
    """T x implementation of one pass's ms, for the d and dtype the sweep covers most."""
    d = sweep["d"].mode().iloc[0] if 64 not in set(sweep["d"]) else 64
    dtype = "bfloat16" if "bfloat16" in set(sweep["dtype"]) else sweep["dtype"].mode().iloc[0]
    rows = sweep[(sweep["d"] == d) & (sweep["dtype"] == dtype)]
    table = rows.pivot_table(index="T", columns="impl", values=f"{p} ms", aggfunc="first", sort=False)
    return table.reset_index().rename(columns={"T": f"T (d={d}, {dtype}, {p} ms)"})


def flash_speedup_plot(ctx: Context, name: str, df: pd.DataFrame, sweep: pd.DataFrame,
                       passes: list[str]) -> str | None:
    fig, panels = axes(len(passes))
    triton = sweep[sweep["impl"] == "triton"]
    for ax, p in zip(panels, passes, strict=True):
        for (dtype, d), rows in triton.groupby(["dtype", "d"], sort=False):
            # An extra shape can repeat a sweep cell (1x65536x128): one point per T, in order.
            rows = rows.drop_duplicates("T", keep="last").sort_values("T")
            base = flash_baseline(df, rows)
            if base and f"{p} x {base}" in rows:
                ax.plot(numeric(rows["T"]), numeric(rows[f"{p} x {base}"]), "-" if dtype == "bfloat16"
                        else "--", marker="o", ms=3, label=f"{dtype} d={d} vs sdpa-{base}")
        style(ax, "sequence length T", "speedup (SDPA time / Triton time)", f"Triton over SDPA, {p}",
              base_x=2, logy=False)
        ax.axhline(1, color="black", lw=1)  # after style(): not a measured size to tick, no legend entry
    return ctx.figure(f"{name}_speedup", fig, f"{name}: Triton FlashAttention speedup over SDPA")


def flash_time_plot(ctx: Context, name: str, sweep: pd.DataFrame, p: str) -> str:
    digest = flash_digest(sweep, p)
    fig, (ax,) = axes()
    t = digest.columns[0]
    for impl in digest.columns[1:]:
        times = numeric(digest[impl])
        if times.notna().any():  # an implementation that does not run here gets no legend entry
            ax.plot(digest[t], times, marker="o", ms=3, label=impl)
    style(ax, "sequence length T", f"{p} time (ms)", t.removeprefix("T "), base_x=2)
    return ctx.figure(f"{name}_time", fig, f"{name}: attention implementations, time against sequence length")


SECTION = Section(
    key="flash",
    title="FlashAttention-2 (Triton) against SDPA and PyTorch",
    command="python -m benchmarks.flash",
    matches=prefixed("flash"),
    render=render_flash,
)
