"""When each gradient bucket's all-reduce is launched, against when its last gradient was ready:
minddp.BucketedDDP and torch DDP on 2 gloo CPU ranks, from torch.profiler traces (issue 45).

Two models of the reference architecture (benchmarks.model), scaled so that their buckets fall as
xl's do at 25 MiB (d_model 400, d_ff 1600, 4 blocks, bucket_cap_mb 25/16: every weight but the norms
fills a bucket of its own, as at xl):
  registered-in-order   TransformerLM as it is: parameters registered in the order forward uses them
  embedding-last        the same with the embedding registered after the LM head (forward uses it first)

Per wrapper, over 5 profiled steps after 3 warm-up steps (medians over the steps, rank 0): the
all-reduces launched before backward's last gradient was ready (of all), and how long a bucket waited
between its last gradient and its launch (a bucket launches only after the ones before it): the median
bucket's wait and the longest. A gradient is ready when this script's tensor hook sees it computed,
before either wrapper's hook runs.

    PYTHONPATH=packages/minddp/src:apps/benchmarks/src python3 lab/minddp/ddp_launch_timing.py
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.model import ModelConfig, TransformerLM
from minddp import BucketedDDP
from minddp.launch import spawn

CFG = ModelConfig(d_model=400, d_ff=1600, num_layers=4, num_heads=4, context_length=64)
BUCKET_MB = 25 / 16


class EmbeddingLast(TransformerLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        embedding = self.embedding
        del self.embedding
        self.embedding = embedding  # now registered after lm_head


MODELS = {"registered-in-order": TransformerLM, "embedding-last": EmbeddingLast}


def buckets_of(ddp: torch.nn.Module, names: list[str]) -> list[list[str]]:
    if isinstance(ddp, BucketedDDP):
        return ddp.bucket_names
    logged = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return [[names[int(i)] for i in bucket.split()] for bucket in logged.split(",")]


def one_step(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> None:
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.context_length), generator=generator)
    loss = F.cross_entropy(ddp(tokens).flatten(0, 1), tokens.flatten())
    with record_function("backward"):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timing(model_name: str, wrapper: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = MODELS[model_name](CFG)
    names = [n for n, _ in model.named_parameters()]
    ddp = (BucketedDDP(model, bucket_cap_mb=BUCKET_MB) if wrapper == "minddp" else
           DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB))
    for name, p in model.named_parameters():  # a tensor hook runs as the gradient is computed, before both
        p.register_hook(lambda _, name=name: record_function(f"ready:{name}").__enter__()  # wrappers' hooks
                        .__exit__(None, None, None))
    optimizer = torch.optim.AdamW(model.parameters())
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        one_step(ddp, optimizer, generator)
    buckets = buckets_of(ddp, names)
    rows = []
    for _ in range(5):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_step(ddp, optimizer, generator)
        events = list(prof.events())
        ready = {e.name.removeprefix("ready:"): e.time_range.start
                 for e in events if e.name.startswith("ready:")}
        launches = sorted(e.time_range.start for e in events if e.name == "c10d::allreduce_")
        if len(launches) == len(buckets) + 2:  # minddp's round flags: one before the buckets, one after
            launches = launches[1:-1]
        waits = [launch - max(ready[n] for n in bucket)
                 for launch, bucket in zip(launches, buckets, strict=True)]
        last_ready = max(ready.values())
        rows.append({"launched before the last gradient": sum(t < last_ready for t in launches),
                     "buckets": len(launches), "median wait ms": statistics.median(waits) / 1e3,
                     "longest wait ms": max(waits) / 1e3})
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def all_timings() -> dict[tuple[str, str], dict[str, float]]:
    return {(m, w): timing(m, w) for m in MODELS for w in ("minddp", "torch")}


if __name__ == "__main__":
    results = spawn(all_timings, 2, backend="gloo", start_method="fork", threads_per_rank=1)[0]
    header = ["model", "wrapper", "launched before the last gradient", "buckets", "median wait ms",
              "longest wait ms"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for (model_name, wrapper), row in results.items():
        print(f"| {model_name} | {wrapper} | " + " | ".join(f"{row[k]:.3g}" for k in header[2:]) + " |")
