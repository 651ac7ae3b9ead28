"""Mixed precision: the accumulation experiment and the dtypes autocast picks."""

from __future__ import annotations

from benchmarks.report.core import Context, Section, in_prose, missing_note, numeric, prefixed


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


SECTION = Section(
    key="precision",
    title="Mixed precision",
    command="python -m benchmarks.precision",
    matches=prefixed("precision"),
    render=render_precision,
)
