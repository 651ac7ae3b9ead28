"""What every section uses: results files as loaded, the section's context, and the shared helpers.

A section is a :class:`Section` (its key, title, the command that measures it, which result
files are its own, and a ``render(ctx)`` returning Markdown lines); :class:`Context` gives a
renderer the chosen device's files, Markdown tables and figures saved beside the report. The
helpers below turn result cells into numbers and prose without inventing values: 'OOM' and
other non-numbers become NaN, and a missing column becomes a note saying so.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from benchmarks.common import OOM, UNDEFINED, UnreadableResults, console, read_results  # noqa: E402

NOT_GPU = {"cpu", "analytic"}
SPEED_NEEDS_A_GPU = ("- Speed: not read from this CPU run. Its timings (a few steps of tiny models on "
                     "shared cores) are in the table, marked where the noise rule flags them; speed needs "
                     "a GPU run.")
FLOAT_TEXT = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][-+]?\d+)?")  # 2.5, 4.59e14; not 16384
RESULTS_GLOB = "*/*.csv"  # <results-dir>/<device>/<name>.csv, as save_results writes them
MAX_TABLE_ROWS = 60


@dataclass
class ResultFile:
    path: Path
    device: str  # the results sub-folder: a device slug, 'cpu' or 'analytic'
    name: str  # file stem: '<experiment>' or '<experiment>_<part>'
    df: pd.DataFrame
    meta: dict[str, str]


def load_results(results_dir: Path, unreadable: list[str] | None = None) -> list[ResultFile]:
    """Every results CSV under results_dir/<device>/.

    A file that does not parse (cut short, torn, foreign) is skipped with a warning, and the
    reason appended to ``unreadable``: its numbers must not reach the report as NaN cells.
    """
    files = []
    for path in sorted(Path(results_dir).glob(RESULTS_GLOB)):
        try:
            df, meta = read_results(path)
        except (UnreadableResults, OSError) as exc:
            console.print(f"[yellow]skipping {path}: {exc}[/yellow]")
            if unreadable is not None:
                unreadable.append(str(exc) if isinstance(exc, UnreadableResults) else f"{path}: {exc}")
            continue
        files.append(ResultFile(path, path.parent.name, path.stem, df, meta))
    return files


def is_gpu(device: str) -> bool:
    return device not in NOT_GPU


def choose_device(files: list[ResultFile]) -> str:
    """GPU results over CPU ones; among several devices of a kind, the most recently measured."""
    latest: dict[str, str] = {}
    for f in files:
        latest[f.device] = max(latest.get(f.device, ""), f.meta.get("date", ""))
    return max(latest, key=lambda d: (is_gpu(d), latest[d]))


# --- helpers for sections -------------------------------------------------------------------------

def numeric(series: pd.Series) -> pd.Series:
    """Numbers, with 'OOM' and other non-numbers as NaN."""
    return pd.to_numeric(series, errors="coerce")


def is_oom(series: pd.Series) -> pd.Series:
    return series.astype(str).str.strip().eq(OOM)


def find_column(df: pd.DataFrame, *candidates: str) -> str | None:
    """The first column whose name equals, else contains, one of the candidates (case-insensitive)."""
    lower = {c.lower(): c for c in df.columns}
    for cand in candidates:
        if cand.lower() in lower:
            return lower[cand.lower()]
    for cand in candidates:
        for low, col in lower.items():
            if cand.lower() in low:
                return col
    return None


def missing_note(what: str, missing: Iterable[str]) -> str:
    return f"_{what}: not possible, the results lack {', '.join(missing)}._"


def in_prose(value: float, digits: int = 3) -> str:
    """A number for prose: 3 significant digits, thousands separators for big ones."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if abs(value) >= 1e3:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


plain_log_ticks = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")


STANDARD_METADATA = ("device", "gpu_count", "torch", "triton", "command", "date")


def settings(f: ResultFile) -> dict[str, str]:
    """A file's own metadata: the experiment's settings (short values only; long ones are notes)."""
    return {k: v for k, v in f.meta.items() if k not in STANDARD_METADATA and len(v) < 80}


def plain(value: object) -> str:
    """A table value for prose: 64.0 -> '64', 'bf16' -> 'bf16'."""
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return str(value)


def report_cell(value: object) -> str:
    """A table cell as the report prints it: no value as '-' (never 'nan'); a float, or a text written as
    one, in 5 significant digits (459000000000000.0 reads 4.59e+14); whole numbers and other text as
    they are."""
    if isinstance(value, str):
        if value.strip().lower() == "nan":
            return UNDEFINED
        if not FLOAT_TEXT.fullmatch(value.strip()):
            return value
        value = float(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return UNDEFINED
    return f"{value:.5g}" if isinstance(value, float) else str(value)


def markdown_table(df: pd.DataFrame) -> str:
    """df in Markdown, its cells as :func:`report_cell` writes them; numeric columns aligned right."""
    shown = df.astype(object).map(report_cell) if len(df) else df
    align = ["right" if pd.api.types.is_numeric_dtype(df[c]) else "left" for c in df.columns]
    return shown.to_markdown(index=False, disable_numparse=True, colalign=align or None)


def value_range(low: float, high: float, fmt: str = "{:.2f}x") -> str:
    """'1.20x to 1.70x', or '1.70x' where both ends print alike (never '1.70x to 1.70x')."""
    low_text, high_text = fmt.format(low), fmt.format(high)
    return low_text if low_text == high_text else f"{low_text} to {high_text}"


def median_of(values: pd.Series, fmt: str = "{:.2f}x") -> str:
    """'1.66x (median; 1.45x to 1.86x)', or '1.62x' where every value prints alike (one value, say)."""
    spread = value_range(values.min(), values.max(), fmt)
    median = fmt.format(values.median())
    return median if spread == median else f"{median} (median; {spread})"


def times_less(value: float, reference: float, name: str) -> str:
    """How value compares with ``name``'s reference: '25.5x less than none', '1.3x more than none', or
    'about as much as none' where the ratio prints as 1.00 (never '1.0x less than none')."""
    if not (value > 0 and reference > 0):
        return f"against {name}: n/a"
    ratio = reference / value
    if f"{ratio:.2f}" == "1.00":
        return f"about as much as {name}"
    return f"{ratio:.3g}x less than {name}" if ratio > 1 else f"{1 / ratio:.3g}x more than {name}"


@dataclass
class Context:
    """What a section renderer sees: the chosen device's files of its experiment, and where plots go."""

    files: list[ResultFile]
    out_dir: Path
    report_path: Path
    all_results: list[ResultFile] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    @property
    def shared_settings(self) -> dict[str, str]:
        """Settings (non-standard metadata) with one value across this section's files."""
        pairs = [settings(f) for f in self.files]
        return {k: v for k, v in pairs[0].items() if all(p.get(k) == v for p in pairs)} if pairs else {}

    @property
    def measures_speed(self) -> bool:
        """Whether this section's timings can be findings: they come from a GPU. A CPU run's are a few
        steps of tiny models on shared cores; its tables keep them, and no prose reads them."""
        return bool(self.files) and is_gpu(self.files[0].device)

    def speed(self, *lines: str | None) -> list[str]:
        """Statements about speed where this section's results can show it (a GPU's); from a CPU run, one
        line saying so instead."""
        if self.measures_speed:
            return [line for line in lines if line is not None]
        return [SPEED_NEEDS_A_GPU] if any(lines) else []

    def get(self, name: str) -> ResultFile | None:
        return next((f for f in self.files if f.name == name), None)

    def link(self, path: Path) -> str:
        return os.path.relpath(path, self.report_path.parent).replace(os.sep, "/")

    def table(self, f: ResultFile, title: str | None = None, shown: pd.DataFrame | None = None) -> list[str]:
        """The file's table (or `shown`, a digest of it) in Markdown, cut to its first rows when long."""
        df = f.df if shown is None else shown
        lines = [f"**{title or f.name}** ([csv]({self.link(f.path)}))", ""]
        own = {k: v for k, v in settings(f).items() if self.shared_settings.get(k) != v}
        if own:
            lines[-1:-1] = ["", "Settings: " + "; ".join(f"{k} {v}" for k, v in own.items()) + "."]
        if len(df) > MAX_TABLE_ROWS:
            lines += [markdown_table(df.head(MAX_TABLE_ROWS)), "",
                      f"_First {MAX_TABLE_ROWS} of {len(df)} rows; the full table is in the csv._"]
        else:
            lines.append(markdown_table(df))
        return [*lines, ""]

    def figure(self, name: str, fig: plt.Figure, caption: str) -> str | None:
        """Save fig as <out_dir>/<name>.png; the Markdown that shows it, or None if nothing is drawn."""
        if not any(ax.get_legend_handles_labels()[0] or ax.patches for ax in fig.axes):
            plt.close(fig)
            return None
        path = self.out_dir / f"{name}.png"
        copies = 1
        while path in self.plots:  # two results files of one experiment: keep both plots
            copies += 1
            path = self.out_dir / f"{name}_{copies}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        self.plots.append(path)
        return f"![{caption}]({self.link(path)})\n"


@dataclass(frozen=True)
class Section:
    """One experiment's part of the report (see :mod:`benchmarks.report.registry`)."""

    key: str  # a short id: 'ddp'
    title: str  # the '## heading'
    command: str  # what to run when nothing is measured yet
    matches: Callable[[str], bool]  # which result files (by stem) are this section's
    render: Callable[[Context], list[str]]  # the section's Markdown lines, after its metadata


def prefixed(*prefixes: str) -> Callable[[str], bool]:
    """``matches`` for files named '<prefix>' or '<prefix>_<part>'."""
    return lambda name: any(name == p or name.startswith(p + "_") for p in prefixes)


# --- shared by the measured sections --------------------------------------------------------------

def axes(panels: int = 1) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, grid = plt.subplots(1, panels, figsize=(7 if panels == 1 else 5.2 * panels, 4.5), squeeze=False)
    return fig, list(grid[0])


def stacked_bars(ax: plt.Axes, labels: Iterable[str], df: pd.DataFrame, parts: Iterable[str]) -> None:
    """A bar per row of df at labels, its parts' columns (MB, missing or negative as 0) stacked in order."""
    bottom = pd.Series(0.0, index=df.index)
    for part, color in zip(parts, plt.get_cmap("tab10").colors, strict=False):
        values = numeric(df[part]).fillna(0).clip(lower=0)
        ax.bar(labels, values, bottom=bottom, color=color, label=part.removesuffix("_MB").replace("_", " "))
        bottom += values


def style(ax: plt.Axes, xlabel: str, ylabel: str, title: str, logx: bool = True, logy: bool = True,
          base_x: int = 10) -> None:
    if logx:
        ax.set_xscale("log", base=base_x)
        ax.xaxis.set_major_formatter(plain_log_ticks)
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain_log_ticks)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    xs = sorted({x for line in ax.get_lines() for x in line.get_xdata() if x > 0 and math.isfinite(x)})
    if logx and 0 < len(xs) <= 12 and labels_apart(xs):  # few measured sizes, apart: tick exactly those
        ax.set_xticks(xs, [f"{x:g}" for x in xs], rotation=45 if len(xs) > 6 else 0)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        logx = False  # ticks are set: leave the minor formatter alone
    for axis, limits, log in ((ax.xaxis, ax.get_xlim(), logx), (ax.yaxis, ax.get_ylim(), logy)):
        # label the minor ticks only where the axis spans less than a decade or so: 200, 300, ...
        if log and limits[0] > 0:
            narrow = math.log10(limits[1] / limits[0]) < 1.5
            axis.set_minor_formatter(plain_log_ticks if narrow else matplotlib.ticker.NullFormatter())
    handles = ax.get_legend_handles_labels()[0]
    if len(handles) > 6:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    elif handles:
        ax.legend(fontsize=8)


def labels_apart(xs: list[float], least: float = 0.08) -> bool:
    """Whether ticks at each of xs (sorted, positive) on a log axis leave room for their labels: each
    neighbour at least ``least`` of the axis span away (about a label's width), so that none overprints
    (step times 307, 311, 351 ms did: '307311351')."""
    if len(xs) < 2:
        return True
    span = math.log(xs[-1] / xs[0])
    return all(math.log(b / a) >= least * span for a, b in zip(xs, xs[1:], strict=False))


def geomean(values: Iterable[float]) -> float:
    kept = [v for v in values if v > 0 and not math.isnan(v)]
    return math.exp(sum(map(math.log, kept)) / len(kept)) if kept else float("nan")


def missing_columns(df: pd.DataFrame, needed: Iterable[str]) -> list[str]:
    return [c for c in needed if c not in df.columns]


def first_oom(df: pd.DataFrame, value: str, along: str, by: list[str]) -> list[str]:
    """'<group>: from <along> = x' for each group of `by` with an OOM cell, x the smallest such `along`."""
    found = []
    for key, rows in df[is_oom(df[value])].groupby(by, sort=False) if by else [((), df[is_oom(df[value])])]:
        if rows.empty:
            continue
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{k}={plain(v)}" for k, v in zip(by, key, strict=True))
        found.append(f"{label + ': ' if label else ''}from {along} = {plain(numeric(rows[along]).min())}")
    return found


def log_slope(x: pd.Series, y: pd.Series) -> float:
    """k in y ~ x^k, least squares on the logs of the positive pairs."""
    keep = (x > 0) & (y > 0)
    lx, ly = x[keep].map(math.log), y[keep].map(math.log)
    if len(lx) < 2 or lx.nunique() < 2:
        return float("nan")
    return float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())


def shorten(text: str, width: int = 70) -> str:
    text = str(text)
    return text if len(text) <= width else text[: width - 1] + "…"



def render_tables(ctx: Context) -> list[str]:
    """Every file's table, for experiments without a dedicated analysis."""
    lines: list[str] = []
    for f in ctx.files:
        lines += ctx.table(f)
    return lines

