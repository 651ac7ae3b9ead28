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

TOUR_ARGS: list[str] = []
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


def fmt(value: float, digits: int = 3) -> str:
    """A number for prose: 3 significant digits, thousands separators for big ones."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if abs(value) >= 1e3:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


plain_log_ticks = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")


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

    def get(self, name: str) -> ResultFile | None:
        return next((f for f in self.files if f.name == name), None)

    def link(self, path: Path) -> str:
        return os.path.relpath(path, self.report_path.parent).replace(os.sep, "/")

    def table(self, f: ResultFile, title: str | None = None) -> list[str]:
        """The file's table in Markdown, or its first rows and a link when it is long."""
        lines = [f"**{title or f.name}** ([csv]({self.link(f.path)}))", ""]
        if len(f.df) > MAX_TABLE_ROWS:
            lines += [markdown_table(f.df.head(MAX_TABLE_ROWS)), "",
                      f"_First {MAX_TABLE_ROWS} of {len(f.df)} rows; the full table is in the csv._"]
        else:
            lines.append(markdown_table(f.df))
        return [*lines, ""]

    def figure(self, name: str, fig: plt.Figure, caption: str) -> str:
        """Save fig as <out_dir>/<name>.png and return the Markdown that shows it."""
        path = self.out_dir / f"{name}.png"
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
            lines.append(
                f"- Closest to 10: {label[best]} (sum {fmt(numeric(df['sum'])[best], 6)}, error "
                f"{error[best]:.2g}). Farthest: {label[worst]} (sum {fmt(numeric(df['sum'])[worst], 6)}, "
                f"error {error[worst]:.2g}), {error[worst] / max(error[best], 1e-300):,.0f}x the error.")
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
    lines = [f"- The training state alone is {fmt(mem['S'])} GB, {mem['S/H100']:.1f} H100-80GB's worth; "
             f"every token of a step adds {mem['a']:.3g} MB of saved activations."]
    for t in _tokens_of(mem, "A"):
        acts = mem[f"A(T={t})"]
        lines.append(f"  - {t:,} tokens: {fmt(acts)} GB of activations "
                     f"({acts / (mem['S'] + acts):.1%} of the {fmt(mem['S'] + acts)} GB total).")
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
                         f"({fmt(half)} GB) exceeds it on every device.")
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
        f"compute-bound above **{tp['B/N']:.4g} tokens per chip**, an overall batch of **{fmt(tp['B'])} "
        f"tokens** over {int(tp['N'])} chips. The {binding} bind; the other comms take "
        f"{tp[other] / tp['T_math']:.0%} of the matmul time there.",
        f"- The comms-optimal FSDP degree at that batch is X = {tp['X_opt']:.1f}; with the best split for "
        f"each batch the floor is {tp['(B/N)_min']:.3g} tokens per chip ({fmt(tp['B_min'])} overall).",
    ]


def _ddp_findings(ctx: Context, dd: dict[str, float], const: dict[str, str]) -> list[str]:
    overheads = sorted(int(s[len("n_b*(o="):-3]) for s in dd if s.startswith("n_b*(o="))
    if not overheads or "t_1" not in dd:
        return [missing_note("The summary", ["n_b*(o=...)", "t_1"])]
    lines = []
    for us in overheads:
        best = dd[f"t*(o={us}us)"]
        lines.append(f"- o = {us} µs: best bucket {fmt(dd[f'size*(o={us}us)'])} MB "
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


# --- generic --------------------------------------------------------------------------------------

def render_tables(ctx: Context) -> list[str]:
    """Every file's table, for experiments without a dedicated analysis."""
    lines: list[str] = []
    for f in ctx.files:
        lines += ctx.table(f)
    return lines


SECTIONS: list[Section] = [
    Section("e2e", "End-to-end model benchmark", "python -m benchmarks.e2e", prefixed("e2e"), render_tables),
    Section("attention", "Attention: naive PyTorch, eager and compiled", "python -m benchmarks.attention",
            prefixed("attention"), render_tables),
    Section("flash", "FlashAttention-2 (Triton) against SDPA and PyTorch", "python -m benchmarks.flash",
            prefixed("flash"), render_tables),
    Section("precision", "Mixed precision", "python -m benchmarks.precision", prefixed("precision"),
            render_precision),
    Section("memory", "Memory timeline and peaks", "python -m benchmarks.e2e --memory FILE",
            prefixed("memory"), render_tables),
    Section("allreduce", "All-reduce bandwidth", "python -m benchmarks.allreduce", prefixed("allreduce"),
            render_tables),
    Section("ddp", "Data-parallel training strategies", "python -m benchmarks.ddp", prefixed("ddp"),
            render_tables),
    Section("shardopt", "Optimizer-state sharding", "python -m benchmarks.shardopt", prefixed("shardopt"),
            render_tables),
    Section("accounting", "Memory and communication accounting (analytic)", "python -m benchmarks.accounting",
            prefixed("accounting"), render_accounting),
]


def metadata_lines(ctx: Context, files: list[ResultFile], other_devices: list[str]) -> list[str]:
    commands = list(dict.fromkeys(f.meta.get("command", "") for f in files if f.meta.get("command")))
    first = files[0].meta
    lines = [f"Regenerate: {' ; '.join(f'`{c}`' for c in commands) or '(no command recorded)'}", ""]
    facts = [f"device **{first.get('device', files[0].device)}**"]
    facts += [f"{key} {first[key]}" for key in ("gpu_count", "torch", "triton", "date") if first.get(key)]
    lines.append("Measured on " + ", ".join(facts) + ".")
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
    lines += metadata_lines(ctx, files, others)
    try:
        lines += section.render(ctx)
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
    parser = make_parser("report", __doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/report.md"),
                        help="the report; plots are written beside it")
    args = parse_args(parser, argv)
    if not args.results_dir.is_dir():
        console.print(f"[yellow]--results-dir {args.results_dir} does not exist: every section will say "
                      "'not measured yet'[/yellow]")
    path, plots = build_report(args.results_dir, args.out)
    console.print(f"wrote {path} and {len(plots)} plot(s)")


if __name__ == "__main__":
    main()
