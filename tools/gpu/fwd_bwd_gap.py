"""Why forward+backward can time above forward plus backward: each part timed alone and together, by
do_bench and by events inside one iteration, with the caching allocator's cudaMalloc count and the
host time of a call (no synchronization), for each shape BATCH*HEADSxTxD[xDTYPE] given (causal; the
dtype bfloat16 unless named); then the GPU's timeline of one do_bench iteration of each autograd pass
(kernels from the end of its L2 flush, and how long the GPU waited for the host in between).

    python3 tools/gpu/fwd_bwd_gap.py 16x16384x64,1x16384x128,1x4096x64xfloat32
"""

import sys

import torch
from host_timing import host_us
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from flashattn_triton import FlashAttentionTriton
from flashattn_triton.triton_impl import triton_backward, triton_forward


def report(batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype) -> None:
    shape = (1, batch_heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    scale = head_dim**-0.5
    out = FlashAttentionTriton.apply(q, k, v, True)
    o, lse = triton_forward(q, k, v, True, scale)

    def both_autograd():
        torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad)

    def both_direct():
        o2, lse2 = triton_forward(q, k, v, True, scale)
        triton_backward(q, k, v, o2, lse2, grad, True, scale)

    runs = {
        "fwd (autograd)": lambda: FlashAttentionTriton.apply(q, k, v, True),
        "bwd (autograd, retained graph)": lambda: torch.autograd.grad(out, (q, k, v), grad,
                                                                      retain_graph=True),  # fmt: skip
        "fwd+bwd (autograd)": both_autograd,
        "fwd (direct)": lambda: triton_forward(q, k, v, True, scale),
        "bwd (direct)": lambda: triton_backward(q, k, v, o, lse, grad, True, scale),
        "fwd+bwd (direct)": both_direct,
    }
    print(f"== ({batch_heads}, {seq}, {head_dim}) {dtype}")
    for name, fn in runs.items():
        fn()
        mallocs = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        times = [do_bench(fn, warmup=5, rep=25, return_mode="median") for _ in range(3)]
        grown = torch.cuda.memory_stats().get("segment.all.allocated", 0) - mallocs
        host_ms = host_us(fn, calls=50, warmup=1) / 1e3
        print(f"{name:32} do_bench x3 {' '.join(f'{ms:.4f}' for ms in times)} ms, host {host_ms:.4f} ms "
              f"a call (cudaMalloc calls during timing: {grown})")  # fmt: skip

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
    for name in ("fwd (autograd)", "bwd (autograd, retained graph)", "fwd+bwd (autograd)"):
        timeline(runs[name], name)


def timeline(fn, name: str) -> None:
    """The kernels of the last of three do_bench-like iterations (a 256 MB L2 flush, then fn), each with
    its start after the flush ended and its length, and the GPU's idle time among them (us)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)  # fmt: skip
    flushes = [i for i, e in enumerate(kernels)
               if e.time_range.elapsed_us() > 60 and "fill" in e.name.lower()]  # fmt: skip
    last = kernels[flushes[-1] :]
    begin = last[0].time_range.end
    busy = sum(e.time_range.elapsed_us() for e in last[1:])
    span = last[-1].time_range.end - begin
    print(f"-- timeline of {name}: {span:.1f} us from the flush's end, GPU idle {span - busy:.1f} us")
    for e in last[1:]:
        print(f"   {e.time_range.start - begin:9.1f} +{e.time_range.elapsed_us():9.1f}  {e.name[:60]}")


for spec in (sys.argv[1] if len(sys.argv) > 1 else "16x16384x64").split(","):
    batch_heads, seq, head_dim, *dtype = spec.split("x")
    report(int(batch_heads), int(seq), int(head_dim), getattr(torch, dtype[0] if dtype else "bfloat16"))
