"""NCCL smoke test, run by test_nccl.py under torchrun (one rank per GPU); exits non-zero on a failure.

Every strategy, and FSDP with and without bf16 compute, on CUDA matches one process trained on the whole
batch; with torch's
bf16_compress_hook and under join() on uneven inputs it matches torch DDP on the same data; a
bucket's gradients are views of one buffer; CPU parameters are refused with NCCL.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from minddp import FSDP, STRATEGIES, BucketedDDP, make_ddp

PER_RANK = 4


def model() -> nn.Module:
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    net[2].requires_grad_(False)
    return net


def train_like_torch(wrap, rank: int, device: torch.device, hook, uneven: bool) -> list[torch.Tensor]:
    """Parameters after AdamW steps on rank-dependent data (rank r has 2 + r batches if ``uneven``)."""
    torch.manual_seed(rank)
    ddp = wrap(model().to(device), device_ids=[device.index])
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    with ddp.join(enable=uneven):
        for step in range(2 + rank if uneven else 3):
            g = torch.Generator(device=device).manual_seed(100 * rank + step)
            x = torch.randn(PER_RANK, 16, device=device, generator=g)
            y = torch.randn(PER_RANK, 4, device=device, generator=g)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in ddp.module.parameters()]


def fsdp_matches_one_process(rank: int, world: int, device: torch.device) -> None:
    """FSDP (reduce-scatter and all-gather on NCCL; a plain SUM at one rank) against one process on the
    whole batch computing with the same weights: fp32 under AdamW, and bf16 copies of every parameter
    under SGD. (bf16 gradients summed over ranks round differently from one process's; AdamW's step is
    about lr * sign(g) for a gradient near 0, so such a rounding moved one weight of 512 by lr (2 H200s).
    SGD's step is lr * g, within bf16's rounding of the reference's.)"""
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        reference = model().to(device)
        fsdp = FSDP(copy.deepcopy(reference), compute_dtype=dtype)
        optimizer = torch.optim.AdamW if dtype is None else torch.optim.SGD
        opts = [optimizer(m.parameters(), lr=1e-2) for m in (fsdp, reference)]
        for step in range(3):
            g = torch.Generator(device=device).manual_seed(step)
            x = torch.randn(world * PER_RANK, 16, device=device, generator=g)
            y = torch.randn(world * PER_RANK, 4, device=device, generator=g)
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            nn.functional.mse_loss(fsdp(x[rows]).float(), y[rows]).backward()
            fsdp.finish_gradient_synchronization()
            low = reference if dtype is None else copy.deepcopy(reference).to(dtype)
            nn.functional.mse_loss(low(x.to(low[0].weight.dtype)).float(), y).backward()
            for p, q in zip(reference.parameters(), low.parameters(), strict=True):
                if q.grad is not None and q is not p:
                    p.grad = q.grad.float()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        tolerance = {} if dtype is None else {"rtol": 2e-2, "atol": 2e-3}
        full = fsdp.gather_full_params()
        for name, q in reference.named_parameters():
            torch.testing.assert_close(full[name], q, **tolerance, msg=f"FSDP {dtype}: {name} on rank {rank}")


def torch_ddp(module: nn.Module, **kwargs) -> DistributedDataParallel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(module, **kwargs)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    cases = [("naive", {}), ("flat", {}), ("overlap", {}), ("bucketed", {}),
             ("bucketed", {"bucket_size_mb": 0})]
    for strategy, kwargs in cases:
        torch.manual_seed(0)
        reference = model().to(device)
        torch.manual_seed(rank)
        ddp = make_ddp(strategy, model().to(device), device_ids=[local_rank], **kwargs)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ddp, reference)]
        for step in range(3):
            g = torch.Generator(device=device).manual_seed(step)
            x = torch.randn(world * PER_RANK, 16, device=device, generator=g)
            y = torch.randn(world * PER_RANK, 4, device=device, generator=g)
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()  # returns with averaged gradients
            nn.functional.mse_loss(reference(x), y).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6,
                                       msg=f"{strategy} {kwargs}: {name} on rank {rank}")

    for strategy in STRATEGIES:
        for hook, uneven in ((default_hooks.bf16_compress_hook, False), (None, True)):
            ours = train_like_torch(functools.partial(make_ddp, strategy), rank, device, hook, uneven)
            theirs = train_like_torch(torch_ddp, rank, device, hook, uneven)
            # bf16 sums of more than two values may round differently in the two bucket layouts.
            loose = {"rtol": 1e-2, "atol": 1e-3} if hook is not None and world > 2 else {}
            for p, q in zip(ours, theirs, strict=True):
                torch.testing.assert_close(p, q, **loose, msg=f"{strategy} vs torch DDP, hook {hook}, "
                                                               f"uneven {uneven}")

    fsdp_matches_one_process(rank, world, device)

    one_bucket = BucketedDDP(model().to(device), bucket_size_mb=None)
    one_bucket(torch.randn(2, 16, device=device)).sum().backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in one_bucket.parameters() if p.grad is not None}
    assert len(storages) == 1, "the gradients of one bucket must be views of one buffer"

    try:
        make_ddp("bucketed", model())
    except ValueError as exc:
        assert "cannot serve" in str(exc), exc
    else:
        raise AssertionError("CPU parameters with NCCL must be refused")
    dist.destroy_process_group()
    if rank == 0:
        print(f"nccl smoke test passed on {world} GPU(s)")


if __name__ == "__main__":
    main()
