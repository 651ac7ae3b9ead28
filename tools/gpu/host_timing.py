"""Host time of a call and of a benchmark cell, and the floor Function, shared by the tools/gpu scripts (each
runs as `python3 tools/gpu/NAME.py`)."""

import time

import torch


def host_us(fn, calls: int = 300, warmup: int = 30) -> float:
    """Microseconds of host time a call, after a warm-up (no synchronization inside the loop)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def cell_us(fn) -> float:
    """Microseconds a call as benchmarks.flash times a cell: do_bench's median, its L2 flush in front."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


class Floor(torch.autograd.Function):
    """A Python autograd.Function that allocates what FlashAttentionTriton does and launches nothing: what
    the autograd engine and a Python Function cost by themselves."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = torch.empty((3, *q.shape), dtype=q.dtype, device=q.device).unbind()
        return *grads, None, None
