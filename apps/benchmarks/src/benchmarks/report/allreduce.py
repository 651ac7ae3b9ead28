"""All-reduce bandwidth, and a latency/bandwidth fit per backend and world size."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from benchmarks.report.core import (
    Context,
    Section,
    axes,
    missing_columns,
    missing_note,
    numeric,
    plain,
    prefixed,
    style,
)


@dataclass(frozen=True)
class LinkFit:
    """median time = overhead + bytes / bandwidth, least squares over one backend and world size."""

    backend: str
    ranks: int
    overhead_s: float
    bandwidth: float  # bytes/s


def fit_allreduce(df: pd.DataFrame) -> list[LinkFit]:
    fits = []
    for (backend, ranks), rows in df.groupby(["backend", "world size"], sort=False):
        x = numeric(rows["size (MiB)"]) * 2**20
        y = numeric(rows["median ms"]) / 1e3
        keep = x.notna() & y.notna()
        x, y = x[keep], y[keep]
        if x.nunique() < 2:
            continue
        slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        fits.append(LinkFit(str(backend), int(ranks), float(y.mean() - slope * x.mean()),
                            1 / slope if slope > 0 else float("nan")))
    return fits


def render_allreduce(ctx: Context) -> list[str]:
    lines: list[str] = []
    for f in ctx.files:
        df = f.df
        lines += ctx.table(f, "All-reduce (sum, float32)")
        missing = missing_columns(df, ["backend", "world size", "size (MiB)", "median ms", "bus GB/s"])
        if missing:
            lines.append(missing_note("The analysis", missing))
            continue
        bus = numeric(df["bus GB/s"])
        speed: list[str] = []  # a GPU's results only (ctx.speed)
        for backend, rows in df.assign(bus=bus).groupby("backend", sort=False):
            best = rows.loc[rows["bus"].idxmax()]
            speed.append(f"- {backend}: peak bus bandwidth {best['bus']:.3g} GB/s at "
                         f"{plain(best['size (MiB)'])} MiB over {best['world size']} ranks.")
            biggest = rows[numeric(rows["size (MiB)"]) == numeric(rows["size (MiB)"]).max()]
            if biggest["world size"].nunique() > 1:
                speed.append(f"  - at {biggest['size (MiB)'].iloc[0]} MiB by world size: "
                             + ", ".join(f"{r['world size']} ranks {r['bus']:.3g} GB/s"
                                         for _, r in biggest.iterrows()) + ".")
        speed += [link_fit_line(fit) for fit in fit_allreduce(df)]
        lines += [*ctx.speed(*speed), "", allreduce_plot(ctx, df) if ctx.measures_speed else None, ""]
    return lines


def link_fit_line(fit: LinkFit) -> str:
    from benchmarks.accounting import BYTES_FP32, MB, best_integer_bucket_count, model_parameter_count

    text = (f"- Fit of time = o + bytes / w, {fit.backend} over {fit.ranks} ranks: "
            f"o = {fit.overhead_s * 1e6:.3g} µs, w = {fit.bandwidth / 1e9:.3g} GB/s (algorithm bandwidth).")
    if fit.overhead_s <= 0 or not fit.bandwidth > 0:
        return text + " The intercept is not positive: the sizes are too large to resolve the per-call cost."
    s = BYTES_FP32 * model_parameter_count("xl")
    n = best_integer_bucket_count(s, fit.bandwidth, fit.overhead_s)
    return text + (f" The bucket model then puts the xl model's {s / 1e9:.3g} GB of gradients in {n} buckets "
                   f"of {s / n / MB:.0f} MB (n_b* = sqrt(s / (w o))).")


def allreduce_plot(ctx: Context, df: pd.DataFrame) -> str:
    fig, (ax,) = axes()
    for (backend, ranks), rows in df.groupby(["backend", "world size"], sort=True):
        ax.plot(numeric(rows["size (MiB)"]), numeric(rows["bus GB/s"]), "-" if backend == "nccl" else "--",
                marker="o", ms=4, label=f"{backend}, {ranks} ranks")
    style(ax, "tensor size (MiB, float32)", "bus bandwidth (GB/s)", "All-reduce bus bandwidth")
    return ctx.figure("allreduce_bandwidth", fig, "all-reduce bus bandwidth against size")


SECTION = Section(
    key="allreduce",
    title="All-reduce bandwidth",
    command="python -m benchmarks.allreduce",
    matches=prefixed("allreduce"),
    render=render_allreduce,
)
