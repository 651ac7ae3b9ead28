"""Rebuild docs/report.md and its plots from every results file, with a section per experiment.

Reads ``<results-dir>/<device>/<name>.csv`` (metadata in leading ``# key: value`` lines). For each
experiment it picks one device's results (a GPU's over the CPU's; the latest run among GPUs),
shows the tables, the metadata and the command that regenerates them, draws plots beside the
report, and states what the numbers say, computed from the data. An experiment without results
gets a line saying which command to run. Needs no GPU.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from benchmarks.common import OOM, console, make_parser, parse_args, read_results  # noqa: E402

TOUR_ARGS: list[str] = ["--out", "out/tour/docs/report.md"]  # never over the committed docs/report.md
NOT_GPU = {"cpu", "analytic"}
MAX_TABLE_ROWS = 60


@dataclass
class ResultFile:
    path: Path
    device: str  # the results sub-folder: a device slug, 'cpu' or 'analytic'
    name: str  # file stem: '<experiment>' or '<experiment>_<part>'
    df: pd.DataFrame
    meta: dict[str, str]


def load_results(results_dir: Path) -> list[ResultFile]:
    """Every results CSV under results_dir/<device>/; unreadable files are reported and skipped."""
    files = []
    for path in sorted(Path(results_dir).glob("*/*.csv")):
        try:
            df, meta = read_results(path)
        except Exception as exc:  # a half-written or foreign CSV must not take the whole report down
            console.print(f"[yellow]skipping {path}: {exc}[/yellow]")
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


def markdown_table(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".5g")


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
    key: str
    title: str
    command: str  # what to run when nothing is measured yet
    matches: Callable[[str], bool]
    render: Callable[[Context], list[str]]


def prefixed(*prefixes: str) -> Callable[[str], bool]:
    return lambda name: any(name == p or name.startswith(p + "_") for p in prefixes)


# --- precision ------------------------------------------------------------------------------------

def render_precision(ctx: Context) -> list[str]:
    lines: list[str] = []
    acc = ctx.get("precision_accumulation")
    if acc is not None:
        lines += ctx.table(acc, "Summing 0.01 one thousand times (exact: 10)")
        df = acc.df
        need = [c for c in ("accumulator", "addend", "sum") if c not in df.columns]
        if need:
            lines.append(missing_note("The comparison", need))
        else:
            error = (numeric(df["sum"]) - 10.0).abs()
            label = df["accumulator"].astype(str) + " accumulator, " + df["addend"].astype(str) + " addends"
            best, worst = error.idxmin(), error.idxmax()
            sums = numeric(df["sum"])
            lines.append(
                f"- Closest to 10: {label[best]} (sum {in_prose(sums[best], 6)}, error {error[best]:.2g}). "
                f"Farthest: {label[worst]} (sum {in_prose(sums[worst], 6)}, error {error[worst]:.2g}), "
                f"{error[worst] / max(error[best], 1e-300):,.0f}x the error.")
            fp32_acc = df["accumulator"].astype(str).eq("float32")
            low_addend = df["addend"].astype(str).str.startswith("float16")
            if (fp32_acc & low_addend).any():
                e = error[fp32_acc & low_addend]
                lines.append(
                    f"- A float32 accumulator with float16 addends still errs by {e.min():.2g}: the error "
                    "of 0.01 rounded to float16 is added a thousand times; upcasting each addend "
                    f"{'does not change that' if e.nunique() == 1 else 'changes it'}.")
            lines.append("")
    auto = ctx.get("precision_autocast")
    if auto is not None:
        lines += ctx.table(auto, "dtypes under autocast")
        df = auto.df
        name_col = df.columns[0]
        for dtype in df.columns[1:]:
            values = df[dtype].astype(str).str.removeprefix("torch.")
            low = df[name_col][values.eq(dtype)].tolist()
            full = df[name_col][values.eq("float32")].tolist()
            lines.append(f"- Under {dtype} autocast, {', '.join(low) or 'nothing'} "
                         f"{'is' if len(low) == 1 else 'are'} {dtype}; "
                         f"{', '.join(full) or 'nothing'} stay{'s' if len(full) == 1 else ''} float32.")
        lines.append("")
    return lines


# --- accounting -----------------------------------------------------------------------------------

def _values(f: ResultFile | None) -> dict[str, float]:
    if f is None or not {"symbol", "value"} <= set(f.df.columns):
        return {}
    return dict(zip(f.df["symbol"].astype(str), numeric(f.df["value"]), strict=True))


def _tokens_of(symbols: Iterable[str], prefix: str) -> list[int]:
    found = []
    for s in symbols:
        if s.startswith(prefix + "(T=") and s.endswith(")"):
            found.append(int(s[len(prefix) + 3:-1]))
    return sorted(found)


def render_accounting(ctx: Context) -> list[str]:
    constants = ctx.get("accounting_constants")
    const = ({} if constants is None else
             dict(zip(constants.df["symbol"].astype(str), constants.df["value"].astype(str), strict=True)))
    mem = _values(ctx.get("accounting_memory"))
    parts = [
        ("accounting_memory", "XXL on one device: fp32 weights, gradients, AdamW state; bf16 activations",
         lambda values: _memory_findings(values)),
        ("accounting_fsdp", "FSDP: state and half the activations sharded over N devices",
         lambda values: _fsdp_findings(ctx, values, mem, const)),
        ("accounting_tpu", "TPU v5p mesh, FSDP x tensor parallel (forward pass per block)",
         lambda values: _tpu_findings(values, const)),
        ("accounting_ddp", "Bucketed DDP: exposed communication o n_b + (s / n_b) / w",
         lambda values: _ddp_findings(ctx, values, const)),
    ]
    lines: list[str] = []
    for name, title, findings in parts:
        f = ctx.get(name)
        if f is not None:
            lines += ctx.table(f, title)
            lines += [*findings(_values(f)), ""]
    if constants is not None:
        lines += ctx.table(constants, "Constants and their sources")
    return lines


def _memory_findings(mem: dict[str, float]) -> list[str]:
    if not {"S", "S/H100", "a"} <= mem.keys():
        return [missing_note("The summary", ["S", "S/H100", "a"])]
    lines = [f"- The training state alone is {in_prose(mem['S'])} GB, {mem['S/H100']:.1f} H100-80GB's worth; "
             f"every token of a step adds {mem['a']:.3g} MB of saved activations."]
    for t in _tokens_of(mem, "A"):
        acts = mem[f"A(T={t})"]
        lines.append(f"  - {t:,} tokens: {in_prose(acts)} GB of activations "
                     f"({acts / (mem['S'] + acts):.1%} of the {in_prose(mem['S'] + acts)} GB total).")
    return lines


def _fsdp_findings(ctx: Context, fs: dict[str, float], mem: dict[str, float],
                   const: dict[str, str]) -> list[str]:
    capacity = float(const["cap"]) if _is_number(const.get("cap", "")) else None
    cap = f"{capacity:g} GB" if capacity else "the capacity"
    lines = []
    for t in _tokens_of(fs, "N_min"):
        n = fs[f"N_min(T={t})"]
        what = f"{t:,} tokens" if t else "The training state alone"
        if math.isnan(n):
            half = mem.get(f"A(T={t})", float("nan")) / 2
            lines.append(f"- {what}: no N fits under {cap}: the unsharded half of the activations "
                         f"({in_prose(half)} GB) exceeds it on every device.")
        else:
            lines.append(f"- {what}: at least **{int(n)}** devices ({fs[f'M_N(T={t})']:.3f} GB each).")
    plot = fsdp_memory_plot(ctx, mem, fs, capacity)
    return lines + (["", plot] if plot else [])


def _tpu_findings(tp: dict[str, float], const: dict[str, str]) -> list[str]:
    if "B/N" not in tp:
        return [missing_note("The summary", ["B/N"])]
    if math.isnan(tp["B/N"]):
        return ["- No batch makes this mesh compute-bound: tensor parallelism alone exceeds the ICI budget "
                f"(Y above F M_Y / alpha = {tp.get('Y_max', float('nan')):.3g})."]
    fsdp_binds = tp["T_fsdp"] >= tp["T_tp"]
    binding, other = ("FSDP weight gathers", "T_tp") if fsdp_binds else ("TP activation comms", "T_fsdp")
    return [
        f"- With X = {const.get('X', '?')} (FSDP) and Y = {const.get('Y', '?')} (TP), the forward is "
        f"compute-bound above **{tp['B/N']:.4g} tokens per chip**, an overall batch of **{in_prose(tp['B'])} "
        f"tokens** over {int(tp['N'])} chips. The {binding} bind; the other comms take "
        f"{tp[other] / tp['T_math']:.0%} of the matmul time there.",
        f"- The comms-optimal FSDP degree at that batch is X = {tp['X_opt']:.1f}; with the best split for "
        f"each batch the floor is {tp['(B/N)_min']:.3g} tokens per chip ({in_prose(tp['B_min'])} overall).",
    ]


def _ddp_findings(ctx: Context, dd: dict[str, float], const: dict[str, str]) -> list[str]:
    overheads = sorted(int(s[len("n_b*(o="):-3]) for s in dd if s.startswith("n_b*(o="))
    if not overheads or "t_1" not in dd:
        return [missing_note("The summary", ["n_b*(o=...)", "t_1"])]
    lines = []
    for us in overheads:
        best = dd[f"t*(o={us}us)"]
        lines.append(f"- o = {us} µs: best bucket {in_prose(dd[f'size*(o={us}us)'])} MB "
                     f"({dd[f'n_int(o={us}us)']:.0f} buckets), exposing {best:.3g} ms against "
                     f"{dd['t_1']:.3g} ms for a single bucket ({dd['t_1'] / best:.0f}x less).")
    plot = bucket_model_plot(ctx, dd, const, overheads)
    return lines + (["", plot] if plot else [])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def fsdp_memory_plot(ctx: Context, mem: dict[str, float], fs: dict[str, float],
                     capacity_gb: float | None) -> str | None:
    from benchmarks.accounting import fsdp_bytes_per_device

    tokens = _tokens_of(mem, "A")
    if "S" not in mem:
        return None
    devices = [2**k for k in range(0, 11)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in [0, *tokens]:
        acts = mem.get(f"A(T={t})", 0.0)
        per_device = [fsdp_bytes_per_device(mem["S"], acts, n) for n in devices]
        n_min = fs.get(f"N_min(T={t})", float("nan"))
        label = "state only" if t == 0 else f"{t:,} tokens"
        label += ", never fits" if math.isnan(n_min) else f", N_min = {n_min:.0f}"
        (line,) = ax.plot(devices, per_device, lw=1.5, label=label)
        if not math.isnan(n_min):
            ax.plot(n_min, fsdp_bytes_per_device(mem["S"], acts, int(n_min)), "o", color=line.get_color())
    if capacity_gb:
        ax.axhline(capacity_gb, color="black", ls="--", lw=1, label=f"{capacity_gb:g} GB per device")
    ax.set(xscale="log", yscale="log", xlabel="FSDP devices N", ylabel="memory per device (GB)",
           title="XXL under FSDP: (S + A/2)/N + A/2")
    ax.set_xticks(devices, [str(n) for n in devices])
    ax.yaxis.set_major_formatter(plain_log_ticks)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ctx.figure("accounting_fsdp_memory", fig, "XXL memory per device under FSDP")


def bucket_model_plot(ctx: Context, dd: dict[str, float], const: dict[str, str],
                      overheads: list[int]) -> str | None:
    from benchmarks.accounting import GB, MB, bucket_overhead

    if "s" not in dd or not _is_number(const.get("w", "")):
        return None
    s, w = dd["s"] * GB, float(const["w"]) * GB
    sizes = [10 ** (k / 20) for k in range(0, 81)]  # 1 MB .. 10 GB
    sizes = [b for b in sizes if b * MB <= s]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for us in overheads:
        exposed = [bucket_overhead(s, w, us * 1e-6, s / (b * MB)) * 1e3 for b in sizes]
        (line,) = ax.plot(sizes, exposed, label=f"o = {us} µs, best {dd[f'size*(o={us}us)']:.0f} MB")
        ax.plot(dd[f"size*(o={us}us)"], dd[f"t*(o={us}us)"], "o", color=line.get_color())
    ax.set(xscale="log", yscale="log", xlabel="bucket size (MB)", ylabel="exposed communication (ms)",
           title=f"Bucket model, {dd['s']:.3g} GB of gradients at w = {float(const['w']):g} GB/s")
    ax.xaxis.set_major_formatter(plain_log_ticks)
    ax.yaxis.set_major_formatter(plain_log_ticks)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ctx.figure("accounting_ddp_buckets", fig, "exposed communication vs bucket size")


# --- shared by the measured sections --------------------------------------------------------------

def axes(panels: int = 1) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, grid = plt.subplots(1, panels, figsize=(7 if panels == 1 else 5.2 * panels, 4.5), squeeze=False)
    return fig, list(grid[0])


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
    if logx and 0 < len(xs) <= 12:  # few measured sizes: tick exactly those
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


# --- e2e ------------------------------------------------------------------------------------------

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
    lines = []
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
            lines.append(f"- bf16 autocast against fp32: {speedup.min():.2f}x to {speedup.max():.2f}x faster "
                         f"(median {speedup.median():.2f}x over {len(speedup)} pairs); the largest gain is "
                         f"{top['size']} at context {top['context']}.")
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
            lines.append(f"- The backward takes {ratio.median():.2f}x the forward (median; "
                         f"{ratio.min():.2f}x to {ratio.max():.2f}x).")
    ooms = first_oom(df, "step ms", "context", ["size", *variants])
    lines.append(f"- Out of memory: {'; '.join(ooms)}." if ooms else "- No configuration ran out of memory.")
    plot = e2e_plot(ctx, f, df, variants)
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


# --- memory (e2e --memory) ------------------------------------------------------------------------

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


# --- attention ------------------------------------------------------------------------------------

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
    lines = []
    eager = next((v for v in variants if v == "eager"), None)
    compiled = next((v for v in variants if v.startswith("compiled")), None)
    if eager and compiled:
        for p in ("fwd", "bwd"):
            if f"{p} ms {eager}" in df and f"{p} ms {compiled}" in df:
                ratio = (numeric(df[f"{p} ms {eager}"]) / numeric(df[f"{p} ms {compiled}"])).dropna()
                if len(ratio):
                    top = df.loc[ratio.idxmax()]
                    lines.append(f"- {'Forward' if p == 'fwd' else 'Backward'}: {compiled} is "
                                 f"{ratio.median():.2f}x the speed of eager (median; {ratio.min():.2f}x to "
                                 f"{ratio.max():.2f}x, best at d={plain(top['d'])}, T={plain(top['T'])}).")
    t_from = numeric(df["T"]).median()
    long = df[numeric(df["T"]) >= t_from]
    for v in variants:
        for p in ("fwd", "bwd"):
            col = f"{p} ms {v}"
            if col in df:
                slopes = pd.Series([log_slope(numeric(rows["T"]), numeric(rows[col]))
                                    for _, rows in long.groupby("d")]).dropna()
                if len(slopes):
                    spread = f"{slopes.min():.2f} to {slopes.max():.2f}"
                    lines.append(f"- {v} {p} time grows as T^{slopes.median():.2f} for T >= {t_from:g} "
                                 f"(median over d of a log-log fit, {spread}; 2 is quadratic).")
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
        lines.append(f"- Memory before backward, measured / predicted: median {ratio.median():.3f} "
                     f"({ratio.min():.3f} to {ratio.max():.3f}) for eager{formula}.")
    if not any(is_oom(df[c]).any() for c in df.columns if c.startswith("fwd ms ")):
        lines.append("- No configuration ran out of memory.")
    return lines + ["", attention_plot(ctx, f, df, variants)]


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


# --- flash ----------------------------------------------------------------------------------------

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
    digest = flash_digest(sweep, main_pass)
    lines = ctx.table(f, f"{main_pass} ms by T and implementation at one d and dtype; all {len(df)} rows, "
                         "every pass, TFLOP/s and speedups are in the csv", digest)
    for dtype, rows in sweep.groupby("dtype", sort=False):
        for p in passes:
            times = rows.assign(ms=numeric(rows[f"{p} ms"])).dropna(subset=["ms"])
            if times.empty:
                continue
            winners = times.loc[times.groupby(["T", "d"])["ms"].idxmin(), "impl"].value_counts()
            cells = times.groupby(["T", "d"]).ngroups
            counts = ", ".join(f"{impl} in {n}" for impl, n in winners.items())
            lines.append(f"- {dtype} {p}: fastest {counts} of {cells} (T, d) cells.")
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
                lines.append(f"- Triton over SDPA {base}, {dtype}, T >= {numeric(long['T']).min():.0f} "
                             "(geometric mean): " + "; ".join(parts) + ".")
    ooms = [f"{impl}: {'; '.join(found)}" for impl, rows in df.groupby("impl", sort=False)
            if (found := first_oom(rows, f"{main_pass} ms", "T", ["dtype", "d"]))]
    lines.append(f"- Out of memory: {' | '.join(ooms)}." if ooms else "- No cell ran out of memory.")
    lines += flash_peak_throughput(sweep, main_pass)
    for key, rows in extra.groupby(["batch*heads", "T", "d", "dtype"], sort=False):
        times = rows.assign(ms=numeric(rows[f"{main_pass} ms"])).dropna(subset=["ms"]).sort_values("ms")
        if len(times):
            lines.append(f"- Shape {key[0]}x{key[1]}x{key[2]} {key[3]}, {main_pass}: "
                         + ", ".join(f"{r.impl} {r.ms:.3g} ms" for r in times.itertuples()) + ".")
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


# --- allreduce ------------------------------------------------------------------------------------

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
        for backend, rows in df.assign(bus=bus).groupby("backend", sort=False):
            best = rows.loc[rows["bus"].idxmax()]
            lines.append(f"- {backend}: peak bus bandwidth {best['bus']:.3g} GB/s at "
                         f"{plain(best['size (MiB)'])} MiB over {best['world size']} ranks.")
            biggest = rows[numeric(rows["size (MiB)"]) == numeric(rows["size (MiB)"]).max()]
            if biggest["world size"].nunique() > 1:
                lines.append(f"  - at {biggest['size (MiB)'].iloc[0]} MiB by world size: "
                             + ", ".join(f"{r['world size']} ranks {r['bus']:.3g} GB/s"
                                         for _, r in biggest.iterrows()) + ".")
        for fit in fit_allreduce(df):
            lines.append(link_fit_line(fit))
        lines += ["", allreduce_plot(ctx, df), ""]
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


# --- ddp ------------------------------------------------------------------------------------------

def ddp_labels(df: pd.DataFrame) -> pd.Series:
    """'naive', 'bucketed (25 MiB)', or 'bucketed (25 MiB, 7 buckets)' when the count is recorded."""
    def column(name: str) -> pd.Series:
        return numeric(df[name]) if name in df else pd.Series(math.nan, index=df.index)

    labels = []
    for strategy, size, count in zip(df["strategy"], column("bucket MiB"), column("buckets"), strict=True):
        if strategy != "bucketed" or math.isnan(size):
            labels.append(str(strategy))
        else:
            buckets = "" if math.isnan(count) else f", {count:g} buckets"
            labels.append(f"bucketed ({size:g} MiB{buckets})")
    return pd.Series(labels, index=df.index)


def render_ddp(ctx: Context) -> list[str]:
    lines: list[str] = []
    for f in ctx.files:
        df = f.df
        facts = [f"{f.meta['model']} model" if "model" in f.meta else "", f.meta.get("precision", ""),
                 f"{f.meta['ranks']} ranks" if "ranks" in f.meta else ""]
        lines += ctx.table(f, ", ".join(["DDP step time", *filter(None, facts)]))
        missing = missing_columns(df, ["strategy", "step ms"])
        if missing:
            lines.append(missing_note("The analysis", missing))
            continue
        df = df.assign(step=numeric(df["step ms"]), label=ddp_labels(df))
        single = df[df["strategy"] == "single"]["step"]
        dist = df[(df["strategy"] != "single") & df["step"].notna()].sort_values("step")
        if single.notna().any() and len(dist):
            ref = float(single.iloc[0])
            best, worst = dist.iloc[0], dist.iloc[-1]
            lines.append(f"- One device alone (same per-device batch): {ref:.4g} ms per step. Fastest "
                         f"data-parallel: {best['label']} {best['step']:.4g} ms ({best['step'] / ref:.3f}x "
                         f"single); slowest: {worst['label']} {worst['step']:.4g} ms "
                         f"({worst['step'] / ref:.3f}x).")
            if "exposed comm ms" in df:
                lines.append("- Communication not hidden behind backward (step - single): " + ", ".join(
                    f"{r['label']} {float(r['exposed comm ms']):.3g} ms" for _, r in dist.iterrows()) + ".")
            bucketed = dist[dist["strategy"] == "bucketed"]
            torch_ddp = dist[dist["strategy"] == "torch"]
            if len(bucketed):
                b = bucketed.iloc[0]
                verdict = "meets" if b["step"] / ref <= 1.10 else "misses"
                change = (b["step"] / torch_ddp["step"].iloc[0] - 1) * 100 if len(torch_ddp) else math.nan
                against = "." if math.isnan(change) else f"; {change:+.1f}% against torch DDP, same run."
                lines.append(f"- Best bucketed: {b['label']}, {b['step'] / ref:.3f}x single ({verdict} the "
                             f"1.10x goal){against}")
            lines.append(ddp_prediction(ctx, f, bucketed))
        lines += ["", ddp_plot(ctx, df), ""]
    return lines


def ddp_prediction(ctx: Context, f: ResultFile, bucketed: pd.DataFrame) -> str | None:
    """The bucket model's optimum from this device's all-reduce fit, beside the measured best bucket."""
    from benchmarks.accounting import BYTES_FP32, MB, best_integer_bucket_count, model_parameter_count
    from benchmarks.model import MODEL_SIZES

    allreduce = [r for r in ctx.all_results if r.name == "allreduce" and r.device == f.device]
    size = f.meta.get("model")
    if not allreduce or len(bucketed) < 2 or size not in MODEL_SIZES:
        return None
    ranks = int(f.meta.get("ranks", 2))
    backend = f.meta.get("backend", "nccl")
    fits = [x for x in fit_allreduce(allreduce[0].df) if x.backend == backend and x.ranks == ranks]
    if not fits or fits[0].overhead_s <= 0 or not fits[0].bandwidth > 0:
        return None
    s = BYTES_FP32 * model_parameter_count(size)
    n = best_integer_bucket_count(s, fits[0].bandwidth, fits[0].overhead_s)
    return (f"- With this device's all-reduce fit (o = {fits[0].overhead_s * 1e6:.3g} µs, w = "
            f"{fits[0].bandwidth / 1e9:.3g} GB/s) the bucket model predicts {s / n / MB:.0f} MB buckets; "
            f"the fastest measured was {bucketed.iloc[0]['label']}.")


def ddp_plot(ctx: Context, df: pd.DataFrame) -> str:
    bucketed = df[(df["strategy"] == "bucketed") & df["step"].notna()]
    sweep = "bucket MiB" in df and bucketed["bucket MiB"].nunique() > 1
    fig, panels = axes(2 if sweep else 1)
    ax = panels[0]
    rows = df[df["step"].notna()]
    std = numeric(rows["step std"]) if "step std" in rows else None
    colors = ["tab:gray" if s == "single" else "tab:blue" for s in rows["strategy"]]
    ax.barh(rows["label"], rows["step"], xerr=std, color=colors)
    ax.invert_yaxis()
    style(ax, "step time (ms), mean ± std", "", "Step time per strategy", logx=False, logy=False)
    if sweep:
        ax = panels[1]
        b = bucketed.sort_values("bucket MiB")
        std = numeric(b["step std"]) if "step std" in b else None
        ax.errorbar(numeric(b["bucket MiB"]), b["step"], yerr=std, marker="o", label="bucketed")
        for name, color in (("torch", "tab:red"), ("single", "tab:gray")):
            ref = df[df["strategy"] == name]["step"]
            if ref.notna().any():
                ax.axhline(float(ref.iloc[0]), color=color, ls="--", label=f"{name}")
        style(ax, "bucket size (MiB)", "step time (ms)", "Bucketed DDP: bucket size", logy=False)
    return ctx.figure("ddp_step_time", fig, "DDP step time per strategy and bucket size")


# --- shardopt -------------------------------------------------------------------------------------

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
            for name, ms in it.items():
                if name != base and base:
                    lines.append(f"- {name}: {ms:.4g} ms per iteration, {(ms / it[base] - 1) * 100:+.1f}% "
                                 f"against {base} ({it[base]:.4g} ms).")
            if {"ShardedOptimizer", "ZeroRedundancyOptimizer"} <= it.keys():
                delta = it["ShardedOptimizer"] / it["ZeroRedundancyOptimizer"] - 1
                lines.append(f"- ShardedOptimizer against ZeroRedundancyOptimizer: {delta * 100:+.1f}% per "
                             "iteration.")
        lines.append("")
    if goal is not None:
        lines += ctx.table(goal, "Goals")
        df = goal.df
        if not missing_columns(df, ["criterion", "measured", "limit"]):
            for r in df.itertuples(index=False):
                ok = float(r.measured) <= float(r.limit)
                lines.append(f"- {r.criterion}: {float(r.measured):.4g} against {float(r.limit):.4g}: "
                             f"{'met' if ok else 'not met'}.")
        lines.append("")
    return lines


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
                             f"{state[base] / mb:.2f}x less than {base} ({in_prose(state[base], 4)} MB).")
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
        bottom = pd.Series(0.0, index=rows.index)
        for part, color in zip(parts, plt.get_cmap("tab10").colors, strict=False):
            values = numeric(rows[part]).fillna(0).clip(lower=0)
            ax.bar(rows["phase"].astype(str), values, bottom=bottom, color=color,
                   label=part.removesuffix("_MB").replace("_", " "))
            bottom += values
        ax.set_title(name, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    panels[0][0].set_ylabel("memory per rank (MB)")
    panels[0][-1].legend(fontsize=8)
    fig.suptitle("Memory with and without optimizer-state sharding")
    return ctx.figure("shardopt_memory", fig, "memory per rank by optimizer and moment")


# --- generic --------------------------------------------------------------------------------------

def render_tables(ctx: Context) -> list[str]:
    """Every file's table, for experiments without a dedicated analysis."""
    lines: list[str] = []
    for f in ctx.files:
        lines += ctx.table(f)
    return lines


SECTIONS: list[Section] = [
    Section("e2e", "End-to-end model benchmark", "python -m benchmarks.e2e", is_e2e_main_or_kernels,
            render_e2e),
    Section("attention", "Attention: naive PyTorch, eager and compiled", "python -m benchmarks.attention",
            prefixed("attention"), render_attention),
    Section("flash", "FlashAttention-2 (Triton) against SDPA and PyTorch", "python -m benchmarks.flash",
            prefixed("flash"), render_flash),
    Section("precision", "Mixed precision", "python -m benchmarks.precision", prefixed("precision"),
            render_precision),
    Section("memory", "Memory timeline and peaks", "python -m benchmarks.e2e --size 2.7B --memory FILE",
            lambda name: name.startswith("e2e") and "_memory_" in name, render_memory),
    Section("allreduce", "All-reduce bandwidth", "python -m benchmarks.allreduce", prefixed("allreduce"),
            render_allreduce),
    Section("ddp", "Data-parallel training strategies", "python -m benchmarks.ddp", prefixed("ddp"),
            render_ddp),
    Section("shardopt", "Optimizer-state sharding", "python -m benchmarks.shardopt", prefixed("shardopt"),
            render_shardopt),
    Section("accounting", "Memory and communication accounting (analytic)", "python -m benchmarks.accounting",
            prefixed("accounting"), render_accounting),
]


def display_command(command: str) -> str:
    """The recorded command without its --results-dir (results/ is the default the report reads)."""
    args = shlex.split(command)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--results-dir":
            skip = True
        elif not arg.startswith("--results-dir="):
            kept.append(arg)
    return shlex.join(kept)


def metadata_lines(ctx: Context, other_devices: list[str]) -> list[str]:
    files = ctx.files
    commands = list(dict.fromkeys(display_command(f.meta["command"]) for f in files if f.meta.get("command")))
    first = files[0].meta
    shown = " and ".join(f"`{c}`" for c in commands) or "(no command recorded)"
    lines = [f"Regenerate with {shown}.", ""]
    if files[0].device == "analytic":
        lines.append(f"Computed from formulas, no device involved ({first.get('date', 'undated')}).")
    else:
        facts = [f"device **{first.get('device', files[0].device)}**"]
        facts += [f"{key} {first[key]}" for key in ("gpu_count", "torch", "triton", "date") if first.get(key)]
        lines.append("Measured on " + ", ".join(facts) + ".")
    if ctx.shared_settings:
        lines.append("Settings: " + "; ".join(f"{k} {v}" for k, v in ctx.shared_settings.items()) + ".")
    if other_devices:
        lines.append(f"Results also exist for: {', '.join(other_devices)} (under the results folder).")
    return [*lines, ""]


def render_section(section: Section, results: list[ResultFile], out_dir: Path,
                   report_path: Path) -> tuple[list[str], list[Path]]:
    lines = [f"## {section.title}", ""]
    mine = [f for f in results if section.matches(f.name)]
    if not mine:
        return [*lines, f"Not measured yet: run `{section.command}`.", ""], []
    device = choose_device(mine)
    files = [f for f in mine if f.device == device]
    others = sorted({f.device for f in mine} - {device})
    ctx = Context(files, out_dir, report_path, results)
    lines += metadata_lines(ctx, others)
    try:
        lines += [line for line in section.render(ctx) if line is not None]
    except Exception:  # one section's surprise must not lose the others; the error is in the report
        console.print(f"[red]section {section.key} failed:[/red]\n{traceback.format_exc()}")
        lines += [f"_The analysis of this section failed: `{traceback.format_exc().splitlines()[-1]}`. "
                  "Its tables follow._", ""]
        lines += render_tables(ctx)
    return lines, ctx.plots


def build_report(results_dir: Path, out: Path) -> tuple[Path, list[Path]]:
    """Write the report and its plots; returns the report's path and the plots written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    results = load_results(results_dir)
    devices = sorted({f.device for f in results})
    body: list[str] = []
    plots: list[Path] = []
    for section in SECTIONS:
        lines, section_plots = render_section(section, results, out.parent, out)
        body += lines
        plots += section_plots
    header = [
        "# Benchmark report",
        "",
        f"Generated by `python -m benchmarks.report` from {len(results)} results files under "
        f"`{os.path.relpath(results_dir, out.parent)}` "
        f"({', '.join(devices) if devices else 'none yet'}). Every statement below is computed from those "
        "files.",
        "",
        *(f"- [{s.title}](#{_anchor(s.title)})" for s in SECTIONS),
        "",
    ]
    out.write_text("\n".join(header + body).rstrip() + "\n")
    return out, plots


def _anchor(title: str) -> str:
    """GitHub's heading anchor."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> None:
    parser = make_parser("report", __doc__)
    for action in parser._actions:  # the shared options, read here rather than written
        if action.dest == "results_dir":
            action.help = "read every <results-dir>/<device>/<name>.csv"
        elif action.dest == "no_save":
            action.help = "print the report instead of writing it and its plots"
    parser.add_argument("--out", type=Path, default=Path("docs/report.md"),
                        help="the report; plots are written beside it")
    args = parse_args(parser, argv)
    if not args.results_dir.is_dir():
        console.print(f"[yellow]--results-dir {args.results_dir} does not exist: every section will say "
                      "'not measured yet'[/yellow]")
    if args.no_save:  # build it where it harms nothing, show the text
        with tempfile.TemporaryDirectory() as scratch:
            path, _ = build_report(args.results_dir, Path(scratch) / args.out.name)
            console.print(path.read_text(), markup=False, highlight=False, soft_wrap=True)
        return
    path, plots = build_report(args.results_dir, args.out)
    console.print(f"wrote {path} and {len(plots)} plot(s)")


if __name__ == "__main__":
    main()
