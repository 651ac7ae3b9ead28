"""Memory and communication accounting: the analytic tables, their findings and two plots."""

from __future__ import annotations

import math
from collections.abc import Iterable

import matplotlib.pyplot as plt

from benchmarks.report.core import (
    Context,
    ResultFile,
    Section,
    in_prose,
    missing_note,
    numeric,
    plain_log_ticks,
    prefixed,
)


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


SECTION = Section(
    key="accounting",
    title="Memory and communication accounting (analytic)",
    command="python -m benchmarks.accounting",
    matches=prefixed("accounting"),
    render=render_accounting,
)
