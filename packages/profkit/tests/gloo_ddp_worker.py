"""The ranks of test_comm.py's 2-rank gloo DDP run (a module of its own: spawned ranks import it by name)."""

import time

import torch
import torch.distributed as dist
from torch import nn

import profkit


def ddp_worker(rank, store, directory, straggler_sleep_s):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = torch.randn(32, 64)

        def step(phase):
            optimizer.zero_grad()
            with phase("forward"):
                loss = ddp(x).square().mean()
            if rank == 1:
                time.sleep(straggler_sleep_s)  # rank 1 arrives late at every all-reduce
            with phase("backward"):
                loss.backward()
            with phase("optimizer"):
                optimizer.step()

        profkit.trace(step, path=f"{directory}/rank{{rank}}.json.gz", warmup=2, steps=2)
    finally:
        dist.destroy_process_group()
