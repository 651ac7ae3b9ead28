"""The no-regression check: each eager bfloat16 triton cell of a new benchmarks.flash sweep against a
committed one, for the cells with T >= 8192 or batch*heads >= 16.

    python packages/flashattn-triton/scripts/compare_sweep.py \
        results/nvidia-h100-80gb-hbm3/flash_sdpa.csv NEW.csv

Prints new / old time per pass (above 1.03: more than 3% slower) and, next to it, the same for the
speedup over SDPA flash measured in each run (which cancels a GPU running slower as a whole).
"""

from __future__ import annotations

import argparse

import pandas as pd

KEY = ["batch*heads", "T", "d"]


def triton_cells(path: str) -> pd.DataFrame:
    df = pd.read_csv(path, comment="#")
    df = df[(df["impl"] == "triton") & (df["dtype"] == "bfloat16")]
    return df[(df["T"] >= 8192) | (df["batch*heads"] >= 16)].set_index(KEY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--limit", type=float, default=1.03)
    args = parser.parse_args()
    old, new = triton_cells(args.old), triton_cells(args.new)
    rows = []
    for which in ("fwd", "bwd", "fwd+bwd"):
        time_ratio = pd.to_numeric(new[f"{which} ms"], errors="coerce") / pd.to_numeric(old[f"{which} ms"],
                                                                                       errors="coerce")
        speedup_ratio = pd.to_numeric(old[f"{which} x flash"], errors="coerce") / pd.to_numeric(
            new[f"{which} x flash"], errors="coerce")
        for cell in time_ratio.dropna().index:
            rows.append({"pass": which, **dict(zip(KEY, cell, strict=True)),
                         "new/old time": round(time_ratio[cell], 3),
                         "old/new x flash": round(speedup_ratio.get(cell, float("nan")), 3)})
    table = pd.DataFrame(rows).sort_values("new/old time", ascending=False)
    print(table.to_string(index=False))
    slower = table[table["new/old time"] > args.limit]
    print(f"\n{len(slower)} of {len(table)} cells more than {args.limit - 1:.0%} slower than {args.old}")


if __name__ == "__main__":
    main()
