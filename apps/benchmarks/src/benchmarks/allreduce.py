"""All-reduce time and bus bandwidth: gloo on CPU processes and NCCL on GPUs, by tensor size and world size.

Each cell all-reduces (sum) one float32 tensor of the given size, after warm-up calls, a number
of times; every timed call starts after a barrier with the device synchronized and ends with it
synchronized again, and its time is the slowest rank's. The table gives the median and fastest
of those times and the bandwidths of the median:

    algorithm bandwidth = bytes / time
    bus bandwidth       = 2 (n - 1) / n * bytes / time     (n ranks; what a ring moves per link,
                                                            comparable across world sizes)

Sizes are in MiB (2^20 bytes); bandwidths in GB/s (10^9 bytes/s). Sizes above 400 MiB get fewer
calls (at least 3 timed), so 1 GiB on CPU processes stays short. NCCL runs only at world sizes
up to the number of GPUs. A plot of bus bandwidth against size, one line per backend and world
size, is written beside the table (allreduce.png).

Spawns its own workers for each backend and world size, or runs under torchrun at torchrun's
world size (then each backend uses the default group: gloo for CPU tensors, NCCL for CUDA ones):
    torchrun --nproc-per-node 8 -m benchmarks.allreduce
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from benchmarks.common import (
    console,
    int_list,
    make_parser,
    nonnegative_int,
    parse_args,
    positive_float,
    positive_int,
    print_table,
    save_results,
    str_list,
)
from minddp.launch import launch, tensor_device, under_torchrun
from profkit import synchronize

TOUR_ARGS = ["--backends", "gloo", "--world-sizes", "2", "--sizes-mb", "1,10", "--iters", "5"]
MiB = 2**20
BIG_CELL_BYTES = 4 * 1024 * MiB  # at most this many bytes all-reduced per cell, above the minimum calls
MIN_TIMED_CALLS = 3


def calls_for(size_bytes: int, requested: int) -> int:
    """How many calls a cell of ``size_bytes`` gets: ``requested``, capped for big tensors, at least 3."""
    return max(MIN_TIMED_CALLS, min(requested, BIG_CELL_BYTES // size_bytes))


def bus_bandwidth(size_bytes: float, seconds: float, world_size: int) -> float:
    """Bytes per second each link carries in a ring all-reduce: 2 (n-1)/n * size / time."""
    return 2 * (world_size - 1) / world_size * size_bytes / seconds


def measure(backend: str, sizes_mb: list[int], warmup: int, iters: int) -> list[dict[str, object]]:
    """Run on every rank (identical collectives everywhere): one backend's rows at this world size."""
    device = tensor_device(backend)
    world_size = dist.get_world_size()
    rows = []
    for size_mb in sizes_mb:
        size_bytes = size_mb * MiB
        tensor = torch.zeros(size_bytes // 4, dtype=torch.float32, device=device)
        calls = calls_for(size_bytes, iters)
        for _ in range(min(warmup, calls)):
            dist.all_reduce(tensor)
        seconds = []
        for _ in range(calls):
            synchronize(device)
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
        median = statistics.median(times)
        rows.append({
            "backend": backend, "device": device.type, "world size": world_size, "size (MiB)": size_mb,
            "calls": calls, "median ms": median * 1e3, "min ms": min(times) * 1e3,
            "alg GB/s": size_bytes / median / 1e9,
            "bus GB/s": bus_bandwidth(size_bytes, median, world_size) / 1e9,
        })
        if dist.get_rank() == 0:
            console.print(f"  {backend} x{world_size} {size_mb:>5} MiB: {median * 1e3:9.3f} ms, "
                          f"bus {rows[-1]['bus GB/s']:7.2f} GB/s")
        del tensor
    return rows


def plot(df: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (backend, world_size), cells in df.groupby(["backend", "world size"], sort=True):
        ax.plot(cells["size (MiB)"], cells["bus GB/s"], marker="o",
                linestyle="-" if backend == "nccl" else "--", label=f"{backend}, {world_size} ranks")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (MiB, float32)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser("allreduce", __doc__)
    parser.add_argument("--backends", type=str_list(["gloo", "nccl"]),
                        default="gloo,nccl" if torch.cuda.is_available() else "gloo",
                        help="comma-separated: gloo (CPU processes), nccl (one GPU per rank; by default "
                             "only with GPUs)")
    parser.add_argument("--sizes-mb", type=int_list, default="1,10,100,1024",
                        help="float32 tensor sizes in MiB")
    parser.add_argument("--world-sizes", type=int_list, default="2,4,6",
                        help="ranks per run (NCCL: only up to the GPU count); ignored under torchrun")
    parser.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed calls per cell")
    parser.add_argument("--iters", type=positive_int, default=10,
                        help="timed calls per cell (fewer above 400 MiB)")
    parser.add_argument("--timeout", type=positive_float, default=1800,
                        help="seconds before a run's workers are killed")
    args = parse_args(parser, argv)
    if any(n < 2 for n in args.world_sizes):
        parser.error("--world-sizes: an all-reduce needs at least 2 ranks")
    if any(s < 1 for s in args.sizes_mb):
        parser.error("--sizes-mb: sizes must be at least 1 MiB")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")

    world_sizes = [int(os.environ["WORLD_SIZE"])] if under_torchrun() else args.world_sizes
    rows: list[dict[str, object]] = []
    for backend in args.backends:
        for world_size in world_sizes:
            if backend == "nccl" and not under_torchrun() and world_size > torch.cuda.device_count():
                console.print(f"[yellow]nccl x{world_size}: skipped, this host has "
                              f"{torch.cuda.device_count()} GPU(s)[/yellow]")
                continue
            console.print(f"[bold]{backend}, {world_size} ranks[/bold]")
            result = launch(measure, None if under_torchrun() else world_size, backend,
                            args=(backend, args.sizes_mb, args.warmup, args.iters), timeout_s=args.timeout)
            rows += result or []
    if under_torchrun() and dist.get_rank() != 0:
        return
    if not rows:
        console.print("[yellow]nothing measured: no backend and world size this host can run[/yellow]")
        return
    df = pd.DataFrame(rows)
    print_table(df, "All-reduce (sum, float32): median time and bandwidth")
    csv_path = save_results(df, "allreduce", args)
    if csv_path is not None:
        plot(df, csv_path.with_suffix(".png"), "All-reduce bus bandwidth")
        console.print(f"[dim]wrote {csv_path.with_suffix('.png')}[/dim]")


if __name__ == "__main__":
    main()
