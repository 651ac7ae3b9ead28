"""Host time per call of FlashAttentionTriton (forward, and forward+backward) on a tiny problem,
where the GPU work is negligible: what each call costs the CPU before the kernels even start."""

import time

import torch
from triton.testing import do_bench

from flashattn_triton import FlashAttentionTriton, triton_impl

q, k, v = (torch.randn(1, 1, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad = torch.randn_like(q)


def forward():
    return FlashAttentionTriton.apply(q, k, v, True)


def forward_backward():
    forward().backward(grad)


for name, fn in [("fwd", forward), ("fwd+bwd", forward_backward)]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn()
    host_us = (time.perf_counter() - start) / 200 * 1e6
    torch.cuda.synchronize()
    gpu_us = do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
    print(f"host descriptors={triton_impl._host_descriptors(q.device, 1024 * 1024 * 64)!s:5} {name:8} "
          f"host {host_us:7.1f} us/call, do_bench {gpu_us:7.1f} us")
