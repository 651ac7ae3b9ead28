"""Where the host time of a FlashAttentionTriton call goes: cProfile of many calls on a problem small
enough that the GPU work is negligible (B = 1, T = 1024, d = 64, bfloat16, causal)."""

import cProfile
import pstats
import time

import torch

from flashattn_triton import FlashAttentionTriton

q, k, v = (torch.randn(1, 1, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad = torch.randn_like(q)


def forward():
    return FlashAttentionTriton.apply(q, k, v, True)


def forward_backward():
    torch.autograd.grad(forward(), (q, k, v), grad)


for name, fn in [("fwd", forward), ("fwd+bwd", forward_backward)]:
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(300):
        fn()
    host_us = (time.perf_counter() - start) / 300 * 1e6
    torch.cuda.synchronize()
    print(f"== {name}: host {host_us:.1f} us a call (no profiler)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
