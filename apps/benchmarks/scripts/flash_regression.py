"""Compare a new benchmarks.flash results file with a baseline, cell by cell: flashattn-triton's time per pass
(new / baseline) for the cells that are not host-bound (T >= 8192 or batch*heads >= 16), next to the same
ratio for each SDPA backend of the cell, which shows how much the machine itself moved. Exits 1 if any of
ours is slower than the bound (issue 19: 3% against run 54).

    python3 apps/benchmarks/scripts/flash_regression.py results/nvidia-h100-80gb-hbm3/flash_sdpa.csv NEW.csv
"""

from __future__ import annotations

import sys

import pandas as pd

from benchmarks.common import ArgumentParser, positive_float

KEY = ["batch*heads", "T", "d", "dtype", "causal"]
PASSES = ["fwd ms", "bwd ms", "fwd+bwd ms"]


def ratios(baseline: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, impl) in both files: new time / baseline time for each pass."""
    both = baseline.merge(new, on=[*KEY, "impl"], suffixes=(" old", " new"))
    out = both[[*KEY, "impl"]].copy()
    for name in PASSES:
        out[name.replace(" ms", "")] = (both[f"{name} new"] / both[f"{name} old"]).round(3)
    return out


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline")
    parser.add_argument("new")
    parser.add_argument("--bound", type=positive_float, default=1.03,
                        help="largest new/baseline time allowed")
    parser.add_argument("--impl", default="triton")
    args = parser.parse_args()
    baseline, new = (pd.read_csv(path, comment="#") for path in (args.baseline, args.new))
    table = ratios(baseline, new)
    table = table[(table["T"] >= 8192) | (table["batch*heads"] >= 16)]
    if table.empty:
        print(f"{args.new}: no cell in common with {args.baseline}")
        return 1
    wide = table.pivot_table(index=KEY, columns="impl", values=["fwd", "bwd", "fwd+bwd"])
    impls = [args.impl, *sorted(set(table["impl"]) - {args.impl})]
    wide = wide[[(p, impl) for p in ("fwd", "bwd", "fwd+bwd") for impl in impls if (p, impl) in wide]]
    wide.columns = [f"{p} {impl}" for p, impl in wide.columns]
    print(f"new / baseline time ({args.new} / {args.baseline}):")
    print(wide.to_string())
    ours = table[table["impl"] == args.impl].set_index(KEY)[["fwd", "bwd", "fwd+bwd"]]
    slower = ours[(ours > args.bound).any(axis=1)]
    print(f"{len(slower)} of {len(ours)} {args.impl} cells slower than {args.bound}x the baseline in a pass")
    if not slower.empty:
        print(slower.to_string())
    return 1 if len(slower) else 0


if __name__ == "__main__":
    sys.exit(main())
