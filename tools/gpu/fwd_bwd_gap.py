"""Why forward+backward can time above forward plus backward: each part timed alone and together, by
do_bench and by events inside one iteration, with the caching allocator's cudaMalloc count."""

import torch
from triton.testing import do_bench

from flashattn_triton import FlashAttentionTriton
from flashattn_triton.triton_impl import triton_backward, triton_forward

B, T, D = 16, 16384, 64
q, k, v = (torch.randn(1, B, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
scale = D**-0.5
out = FlashAttentionTriton.apply(q, k, v, True)
o, lse = triton_forward(q, k, v, True, scale)


def both_autograd():
    torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad)


def both_direct():
    o2, lse2 = triton_forward(q, k, v, True, scale)
    triton_backward(q, k, v, o2, lse2, grad, True, scale)


runs = {
    "fwd (autograd)": lambda: FlashAttentionTriton.apply(q, k, v, True),
    "bwd (autograd, retained graph)": lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
    "fwd+bwd (autograd)": both_autograd,
    "fwd (direct)": lambda: triton_forward(q, k, v, True, scale),
    "bwd (direct)": lambda: triton_backward(q, k, v, o, lse, grad, True, scale),
    "fwd+bwd (direct)": both_direct,
}
for name, fn in runs.items():
    fn()
    mallocs = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    ms = do_bench(fn, warmup=5, rep=50, return_mode="median")
    grown = torch.cuda.memory_stats().get("segment.all.allocated", 0) - mallocs
    print(f"{name:32} {ms:.4f} ms  (cudaMalloc calls during timing: {grown})")

events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
parts = []
for _ in range(20):
    torch.cuda.synchronize()
    events[0].record()
    o2, lse2 = triton_forward(q, k, v, True, scale)
    events[1].record()
    triton_backward(q, k, v, o2, lse2, grad, True, scale)
    events[2].record()
    torch.cuda.synchronize()
    parts.append((events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])))
parts.sort(key=sum)
fwd_ms, bwd_ms = parts[len(parts) // 2]
print(f"events, one iteration (median): fwd {fwd_ms:.4f} ms, bwd {bwd_ms:.4f} ms")
