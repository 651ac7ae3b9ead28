"""Memory timelines and per-phase peaks (``benchmarks.e2e --memory``)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pandas as pd

from benchmarks.report.core import (
    Context,
    ResultFile,
    Section,
    axes,
    find_column,
    missing_note,
    numeric,
    style,
)


def render_memory(ctx: Context) -> list[str]:
    lines: list[str] = []
    peaks: dict[str, pd.Series] = {}
    for f in ctx.files:
        run, tag = f.name.split("_memory_", 1)  # e2e_<mode> (or --name) and the configuration's tag
        label = f"{f.meta.get('mode', run)}, {tag}"
        lines += ctx.table(f, f"Peak memory per phase: {label}")
        df = f.df
        peak_col = find_column(df, "peak allocated")
        if peak_col is None or "phase" not in df.columns:
            lines.append(missing_note("The peak summary", ["phase", "peak allocated (GiB)"]))
        else:
            values = numeric(df[peak_col])
            steps = df[df["step"].astype(str) != "all"] if "step" in df else df
            by_phase = numeric(steps[peak_col]).groupby(steps["phase"], sort=False).max()
            peaks[label] = by_phase
            if len(by_phase):
                lines.append(f"- Highest per-phase peak: {by_phase.idxmax()} at {by_phase.max():.2f} GiB; "
                             + ", ".join(f"{p} {v:.2f} GiB" for p, v in by_phase.items()) + ".")
            timeline = df[df["phase"].astype(str).str.contains("timeline")]
            if len(timeline):
                lines.append(f"- Peak active memory on the timeline: {values[timeline.index[0]]:.2f} GiB.")
        png = find_memory_png(f, tag)
        if png is None:
            lines.append(f"- _No timeline PNG found for {label}: put the PNG that `--memory` writes beside "
                         f"the results ({ctx.link(f.path.parent)}) to show it here._")
        else:
            copy = ctx.out_dir / f"{f.name}.png"
            shutil.copyfile(png, copy)
            ctx.plots.append(copy)
            lines += ["", f"![memory timeline, {label}]({ctx.link(copy)})"]
        lines.append("")
    if len(peaks) > 1:
        lines.append(memory_peaks_plot(ctx, peaks))
    return lines


def find_memory_png(f: ResultFile, tag: str) -> Path | None:
    """The timeline e2e drew: from --memory FILE in the command, next to the results file, or by tag."""
    candidates: list[Path] = []
    args = shlex.split(f.meta.get("command", ""))
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--memory" and i + 1 < len(args) else arg.partition("=")[2] \
            if arg.startswith("--memory=") else None
        if value:
            given = Path(value)
            names = [given.with_suffix(".png").name, f"{given.stem}_{tag}.png"]
            for folder in (given.parent, f.path.parent):
                candidates += [folder / n for n in names]
    candidates += sorted(f.path.parent.glob(f"*{tag}*.png"))
    return next((c for c in candidates if c.is_file()), None)


PHASE_ORDER = ["forward", "backward", "optimizer"]


def memory_peaks_plot(ctx: Context, peaks: dict[str, pd.Series]) -> str:
    table = pd.DataFrame(peaks).T
    phases = list(dict.fromkeys(p for series in peaks.values() for p in series.index))
    order = sorted(phases, key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER)))
    table = table[order].rename(index=lambda label: label.replace(", ", "\n", 1))
    fig, (ax,) = axes()
    table.plot.bar(ax=ax, rot=0)
    style(ax, "", "peak allocated (GiB)", "Peak memory per phase", logx=False, logy=False)
    return ctx.figure("memory_peaks", fig, "peak memory per phase and configuration")


SECTION = Section(
    key="memory",
    title="Memory timeline and peaks",
    command="python -m benchmarks.e2e --size 2.7B --memory FILE",
    matches=lambda name: name.startswith("e2e") and "_memory_" in name,
    render=render_memory,
)
