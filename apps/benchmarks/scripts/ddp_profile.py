"""Where a DDP wrapper's step time goes at world size 1: the bare model, BucketedDDP and torch DDP, one
process, no bytes moved (NCCL on a GPU, gloo on CPU).

Per configuration: the median step time (forward under bf16 autocast on a GPU, backward, AdamW,
``zero_grad(set_to_none=True)``, as in ``benchmarks.ddp``) and the host's time inside
``loss.backward()`` (it returns once the work is launched); the CPU time spent inside minddp's
post-accumulate-grad hooks and its end-of-backward callback (wall time on the thread that runs them,
the autograd device thread on a GPU); and, from ``torch.profiler`` over one more step, the device
time of NCCL kernels, of copies and fills, and of the rest (compute), and how long the device sat
idle within the step; and how many host-device synchronizations torch flags in one more step
(compare with the bare model's count). An overhead that shows up as idle time is host time (the
launching thread fell behind, or waited for the device); one that shows up as kernel time is device
work.

    export PYTHONPATH=packages/flashattn-triton/src:packages/minddp/src:packages/shardopt/src
    export PYTHONPATH=$PYTHONPATH:packages/profkit/src:apps/benchmarks/src
    python3 apps/benchmarks/scripts/ddp_profile.py --size xl            # single, bucketed, torch
    python3 apps/benchmarks/scripts/ddp_profile.py --size xl --configs single,naive,overlap,torch
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import ArgumentParser, nonnegative_float, nonnegative_int, positive_int
from benchmarks.ddp import wrap
from benchmarks.model import MODEL_SIZES, TransformerLM, model_config, random_batch
from minddp import reducer
from minddp.launch import free_port

CONFIGS = ["single", "naive", "flat", "overlap", "bucketed", "torch"]  # naive..bucketed: minddp's strategies


COLUMNS = ["step ms", "bwd host ms", "hooks ms", "hook us/call", "callback ms",
           "nccl ms", "copy ms", "compute ms", "idle ms", "syncs"]


class HookClock:
    """Wall time spent inside the reducer's per-gradient hook and end-of-backward callback."""

    def __init__(self) -> None:
        self.seconds = {"hooks": 0.0, "callback": 0.0}
        self.calls = {"hooks": 0, "callback": 0}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Times the hooks of the wrappers built inside, and every reducer's callback."""
        originals = reducer._grad_ready_hook, reducer.Reducer.finish
        reducer._grad_ready_hook = lambda *args: self._timed("hooks", originals[0](*args))
        reducer.Reducer.finish = self._timed("callback", originals[1])
        try:
            yield
        finally:
            reducer._grad_ready_hook, reducer.Reducer.finish = originals

    def reset(self) -> None:
        for key in self.seconds:
            self.seconds[key], self.calls[key] = 0.0, 0

    def _timed(self, key: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            with torch.profiler.record_function(f"minddp.{key}"):
                result = function(*args)
            self.seconds[key] += time.perf_counter() - start
            self.calls[key] += 1
            return result
        return timed


def device_times(prof: profile, step_ms: float) -> dict[str, float]:
    """Device time (ms) by kernel category over the profiled step, and the time no kernel ran."""
    kinds = {"nccl ms": 0.0, "copy ms": 0.0, "compute ms": 0.0}
    intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.time_range.elapsed_us() <= 0:
            continue
        name = event.name.lower()
        kind = ("nccl ms" if "nccl" in name or "onerank" in name else  # oneRankReduce: NCCL at one rank
                "copy ms" if any(k in name for k in ("memcpy", "memset", "copy", "fill")) else "compute ms")
        kinds[kind] += event.time_range.elapsed_us() / 1e3
        intervals.append((event.time_range.start, event.time_range.end))
    busy, end = 0.0, -1.0
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    kinds["idle ms"] = step_ms - busy / 1e3 if intervals else float("nan")
    return kinds


def train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor) -> tuple[float, float]:
    """One training step as ``benchmarks.ddp`` runs it: its wall time in ms, the device synchronized,
    and how long the host spent inside ``loss.backward()`` (launching, not waiting for, the work)."""
    synchronize(tokens.device)
    start = time.perf_counter()
    with (torch.autocast("cuda", dtype=torch.bfloat16) if tokens.is_cuda else contextlib.nullcontext()):
        loss = F.cross_entropy(ddp(tokens).flatten(0, 1).float(), targets.flatten())
    backward_start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(tokens.device)
    return (time.perf_counter() - start) * 1e3, (backward_end - backward_start) * 1e3


def measure(config: str, args: argparse.Namespace, device: torch.device,
            clock: HookClock) -> dict[str, float]:
    """Step time and hook time over ``args.steps`` steps, then the device times of one profiled step."""
    cfg = model_config(args.size, args.context)
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    ddp = wrap(model, config, args.bucket_mb, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [tuple(random_batch(cfg, args.batch, args.context, device) for _ in range(2))
               for _ in range(args.warmup + args.steps + 1)]
    for tokens, targets in batches[:args.warmup]:
        train_step(ddp, optimizer, tokens, targets)
    clock.reset()
    times = [train_step(ddp, optimizer, tokens, targets) for tokens, targets in batches[args.warmup:-1]]
    row = {"step ms": statistics.median(step for step, _ in times),
           "bwd host ms": statistics.median(backward for _, backward in times),
           "hooks ms": clock.seconds["hooks"] * 1e3 / args.steps,
           "hook us/call": clock.seconds["hooks"] * 1e6 / max(1, clock.calls["hooks"]),
           "callback ms": clock.seconds["callback"] * 1e3 / args.steps}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled_ms, _ = train_step(ddp, optimizer, *batches[-1])
    if device.type == "cuda":
        row.update(device_times(prof, profiled_ms))
        row["syncs"] = float(synchronizing_calls(lambda: train_step(ddp, optimizer, *batches[-1])))
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, f"ddp_{config}_{args.size}.json"))
    return row


def synchronizing_calls(step: Callable[[], Any]) -> int:
    """How many calls that block the host until the device catches up torch flags in ``step``
    (``torch.cuda.set_sync_debug_mode``: ``.item()``, ``.tolist()``, blocking copies and the like;
    waits inside NCCL or the driver are not seen)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(MODEL_SIZES),
                        default="xl" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--configs", default="single,bucketed,torch",
                        help=f"comma-separated among {', '.join(CONFIGS)}")
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--context", type=positive_int, default=512)
    parser.add_argument("--bucket-mb", type=nonnegative_float, default=25.0)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--trace", default=None, help="a folder for each profiled step's Chrome trace")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if "single" not in configs or not set(configs) <= set(CONFIGS):
        parser.error(f"--configs: 'single' and any of {', '.join(CONFIGS[1:])}")

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    clock = HookClock()
    rows = {}
    try:
        with clock.installed():
            for config in configs:
                rows[config] = measure(config, args, device, clock)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()

    print(f"{args.size}, batch {args.batch}x{args.context}, {backend} world size 1, {args.bucket_mb:g} MiB "
          f"buckets; median of {args.steps} steps; device times from one profiled step")
    columns = [c for c in COLUMNS if c in rows["single"]] + ["overhead ms"]
    print(f"{'':10}" + "".join(f"{c:>14}" for c in columns))
    for config, row in rows.items():
        row["overhead ms"] = row["step ms"] - rows["single"]["step ms"]
        print(f"{config:10}" + "".join(f"{row[c]:14.2f}" for c in columns))


if __name__ == "__main__":
    main()
