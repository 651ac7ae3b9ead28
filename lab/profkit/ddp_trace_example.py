"""profkit's README example: trace a 2-rank DDP step on CPU (gloo), then analyse and draw the traces.

    PYTHONPATH=packages/profkit/src python lab/profkit/ddp_trace_example.py [OUT_DIR]

Writes OUT_DIR/rank0.json.gz and rank1.json.gz (open them in https://ui.perfetto.dev), prints the
communication table, and draws rank 0's first step as OUT_DIR/trace_rank0.png.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import profkit


def worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)  # two ranks share the cores
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4))
    )
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    optimizer = torch.optim.AdamW(ddp.parameters())
    x = torch.randn(64, 256)

    def step(phase):
        optimizer.zero_grad()
        with phase("forward"):
            loss = ddp(x).square().mean()
        with phase("backward"):
            loss.backward()  # DDP all-reduces gradient buckets while backward runs
        with phase("optimizer"):
            optimizer.step()

    profkit.trace(step, path=f"{out}/rank{{rank}}.json.gz", warmup=2, steps=3)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    mp.spawn(worker, args=(out,), nprocs=2)
    report = profkit.analyze_comm([f"{out}/rank0.json.gz", f"{out}/rank1.json.gz"])
    print(report.format())
    png = profkit.traces.render_trace(
        f"{out}/rank0.json.gz",
        f"{out}/trace_rank0.png",
        title="Rank 0, one DDP step on 2 gloo ranks (profkit.trace)",
    )
    print(f"traces and {png} in {out}")
