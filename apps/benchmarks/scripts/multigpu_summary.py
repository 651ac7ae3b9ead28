"""The tables of issue 45 from the results of ``multigpu_runs.sh``: DDP against torch DDP, FSDP against
FSDP2, all-reduce bus bandwidth, and scaling at a fixed per-GPU batch.

Reads ``RESULTS/<device>/{ddp_*,profile_ddp_*,fsdp_*,allreduce_*}.csv`` (as ``multigpu_runs.sh`` names
them: the GPU count is each file's own metadata, so any names with those prefixes work) and prints five
tables:

- DDP: per run, the bare model's step (``single``), BucketedDDP's and torch DDP's (mean ± std over the
  timed steps, the slowest rank's), their ratio, and each one's exposed communication and overlap from
  its traces (``benchmarks.ddp``'s columns).
- DDP profile (``scripts/ddp_profile.py``): per configuration, NCCL kernel time, the part of it no other
  kernel overlapped, hook and host times, idle device time.
- FSDP: per run, minddp's and FSDP2's iteration time, peak memory per rank, exposed communication and
  overlap, and the ratios.
- All-reduce: bus bandwidth per world size and size.
- Scaling: per strategy and GPU count, the step time (mean over the runs at that count), tokens per second
  per GPU (per-GPU batch x context / step), and the efficiency: that throughput over the same strategy's
  at one GPU, and over the bare model's at one GPU.

The scaling table is also written as ``<device>/multigpu_scaling.csv`` and ``.md`` beside its inputs.

    python3 apps/benchmarks/scripts/multigpu_summary.py OUT/results --out OUT/summary.md
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from benchmarks.common import read_results, to_markdown, write_atomically

DDP_STRATEGIES = {"bucketed": "BucketedDDP", "torch": "torch DDP"}
FSDP_STRATEGIES = {"minddp-fsdp": "minddp FSDP", "torch-fsdp2": "torch FSDP2"}
BARE = "bare model"
Runs = list[tuple[str, pd.DataFrame, dict[str, str]]]  # (run name, table, metadata) per results file


def load(folder: Path, prefix: str) -> Runs:
    """Every ``<prefix>_*.csv`` (or ``<prefix>.csv``) in ``folder``: (run name, table, metadata)."""
    paths = sorted(p for p in folder.glob("*.csv") if p.stem == prefix or p.stem.startswith(prefix + "_"))
    return [(p.stem, *read_results(p)) for p in paths]


def tokens_per_gpu(meta: dict[str, str]) -> int:
    """Tokens per GPU per step, from a ddp ('per-rank batch': '4x512') or fsdp (batch_size, context_length)
    run's metadata."""
    if "per-rank batch" in meta:
        batch, context = meta["per-rank batch"].split("x")
        return int(batch) * int(context)
    return int(meta["batch_size"]) * int(meta["context_length"])


def ddp_table(runs: Runs) -> pd.DataFrame:
    rows = []
    for name, df, meta in runs:
        by = df.set_index("strategy")
        if not set(DDP_STRATEGIES) <= set(by.index):
            continue
        ours, theirs = by.loc["bucketed"], by.loc["torch"]
        rows.append({"run": name, "GPUs": int(meta["ranks"]), "single ms": by.loc["single", "step ms"],
                     "BucketedDDP ms": ours["step ms"], "std": ours["step std"],
                     "torch DDP ms": theirs["step ms"], "torch std": theirs["step std"],
                     "ours / torch": ours["step ms"] / theirs["step ms"],
                     "exposed ours ms": ours["exposed comm ms"],
                     "exposed torch ms": theirs["exposed comm ms"],
                     "overlap ours %": ours["overlap %"], "overlap torch %": theirs["overlap %"]})
    return pd.DataFrame(rows)


def fsdp_table(runs: Runs) -> pd.DataFrame:
    rows = []
    for name, df, meta in runs:
        for compute, group in df.groupby("compute", sort=False):
            by = group.set_index("strategy")
            if not set(FSDP_STRATEGIES) <= set(by.index):
                continue
            ours, theirs = by.loc["minddp-fsdp"], by.loc["torch-fsdp2"]
            peak = "peak_MB" in by.columns
            rows.append({"run": name, "GPUs": int(meta["world_size"]), "model": meta["model"],
                         "compute": compute,
                         "minddp ms": ours["iteration_ms"], "FSDP2 ms": theirs["iteration_ms"],
                         "time ours / FSDP2": ours["iteration_ms"] / theirs["iteration_ms"],
                         "minddp peak MB": ours["peak_MB"] if peak else math.nan,
                         "FSDP2 peak MB": theirs["peak_MB"] if peak else math.nan,
                         "peak ours / FSDP2": ours["peak_MB"] / theirs["peak_MB"] if peak else math.nan,
                         "exposed ours ms": ours["exposed_comm_ms"],
                         "exposed FSDP2 ms": theirs["exposed_comm_ms"],
                         "overlap ours %": ours["overlap_pct"], "overlap FSDP2 %": theirs["overlap_pct"]})
    return pd.DataFrame(rows)


def profile_table(runs: Runs) -> pd.DataFrame:
    frames = [df.assign(run=name, GPUs=int(meta["ranks"])) for name, df, meta in runs]
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True)
    return table[["run", "GPUs", *[c for c in table.columns if c not in ("run", "GPUs")]]]


def allreduce_table(runs: Runs) -> pd.DataFrame:
    frames = [df[["backend", "world size", "size (MiB)", "median ms", "bus GB/s"]] for _, df, _ in runs]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def step_times(ddp: Runs, fsdp: Runs, model: str, compute: str) -> pd.DataFrame:
    """(strategy, GPUs, step ms, tokens per GPU) per run and strategy; the bare model's only at one GPU,
    where nothing is shared out (at more GPUs its row is every rank training alone)."""
    rows = []
    for _, df, meta in ddp:
        gpus = int(meta["ranks"])
        for strategy, label in {**DDP_STRATEGIES, **({"single": BARE} if gpus == 1 else {})}.items():
            for step_ms in df.loc[df["strategy"] == strategy, "step ms"]:
                rows.append({"strategy": label, "GPUs": gpus, "step ms": step_ms,
                             "tokens": tokens_per_gpu(meta)})
    for _, df, meta in fsdp:
        if meta["model"] != model:
            continue
        for strategy, label in FSDP_STRATEGIES.items():
            chosen = df[(df["strategy"] == strategy) & (df["compute"] == compute)]
            for step_ms in chosen["iteration_ms"]:
                rows.append({"strategy": label, "GPUs": int(meta["world_size"]), "step ms": step_ms,
                             "tokens": tokens_per_gpu(meta)})
    return pd.DataFrame(rows, columns=["strategy", "GPUs", "step ms", "tokens"])


def scaling_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Per strategy and GPU count: mean step, tokens/s per GPU, and efficiency against one GPU (the same
    strategy's, and the bare model's)."""
    if steps.empty:
        return pd.DataFrame()
    table = steps.groupby(["strategy", "GPUs"], sort=False).agg(
        runs=("step ms", "size"), step_ms=("step ms", "mean"), tokens=("tokens", "first")).reset_index()
    table["tokens/s per GPU"] = table["tokens"] / (table["step_ms"] / 1e3)
    one_gpu = table[table["GPUs"] == 1].set_index("strategy")["tokens/s per GPU"]
    bare = one_gpu.get(BARE, math.nan)
    table["vs own 1 GPU"] = table["tokens/s per GPU"] / table["strategy"].map(one_gpu)
    table["vs bare 1 GPU"] = table["tokens/s per GPU"] / bare
    return table.rename(columns={"step_ms": "step ms"}).drop(columns="tokens").sort_values(
        ["strategy", "GPUs"], kind="stable", ignore_index=True)


def write_table(df: pd.DataFrame, folder: Path, name: str, meta: dict[str, str]) -> None:
    """``df`` as ``folder/name.csv`` (metadata lines first, as ``benchmarks.common.save_results``), and
    ``.md``."""
    header = "".join(f"# {key}: {value}\n" for key, value in meta.items())
    write_atomically(folder / f"{name}.csv", header + df.to_csv(index=False))
    bullets = "\n".join(f"- {key}: `{value}`" for key, value in meta.items())
    write_atomically(folder / f"{name}.md", f"# {name}\n\n{bullets}\n\n{to_markdown(df)}\n")


def summarize(folder: Path) -> str:
    """The five tables of one device's results folder, as Markdown; writes the scaling table beside them."""
    ddp, fsdp, allreduce = load(folder, "ddp"), load(folder, "fsdp"), load(folder, "allreduce")
    first = next((meta for _, _, meta in ddp + fsdp), {})
    model, compute = first.get("model", "?"), first.get("precision", "bf16")
    sections = [
        ("BucketedDDP (25 MiB) against torch DDP, step ms (mean over the timed steps, slowest rank)",
         ddp_table(ddp)),
        ("DDP profile: NCCL time, and the part no other kernel hid (one profiled step, rank 0)",
         profile_table(load(folder, "profile_ddp"))),
        ("minddp FSDP against torch FSDP2: iteration ms and peak memory per rank", fsdp_table(fsdp)),
        ("All-reduce bus bandwidth", allreduce_table(allreduce)),
        (f"Scaling at a fixed per-GPU batch ({model}, {compute})",
         scaling_table(step_times(ddp, fsdp, model, compute))),
    ]
    scaling = sections[-1][1]
    if not scaling.empty:
        keep = ("device", "gpu_count", "torch", "triton", "date")
        write_table(scaling, folder, "multigpu_scaling",
                    {**{k: first[k] for k in keep if k in first}, "model": model, "compute": compute,
                     "inputs": ", ".join(name for name, _, _ in ddp + fsdp)})
    return "\n\n".join(f"## {title}\n\n{to_markdown(df, '{:.4g}') if not df.empty else '(no runs)'}"
                       for title, df in sections) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path,
                        help="multigpu_runs.sh's results folder (one subfolder per device)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    folders = sorted(p for p in args.results.iterdir() if p.is_dir()) if args.results.is_dir() else []
    if not folders:
        parser.error(f"results: no device folders in {args.results}")
    text = "".join(f"# {folder.name}\n\n{summarize(folder)}" for folder in folders)
    print(text)
    if args.out is not None:
        write_atomically(args.out, text)


if __name__ == "__main__":
    main()
