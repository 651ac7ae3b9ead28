"""Small problems with tensor descriptors built by the kernels (each program writes and fences its own)
against descriptors built by the host (encoded once per address, triton_impl._DescriptorCache), in one
process, two rounds: each pass timed as benchmarks.flash times it (do_bench median with its L2 flush)
and as host time a call, next to SDPA's flash backend; then where the host-built path's host time goes
(cProfile of the forward and of forward+backward).

    PYTHONPATH=packages/flashattn-triton/src:tools/gpu python3 tools/gpu/descriptor_ab.py [BHxTxD[xDTYPE],...]
"""

import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F
from host_timing import cell_us, host_us
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn_triton import FlashAttentionTriton, triton_impl

SHAPES = "1x1024x16,1x1024x64,1x1024x128,1x2048x64,1x4096x32,1x4096x64,1x1024x64xfloat32,1x4096x64xfloat32"
HOST_BUILT = triton_impl._host_descriptors


def kernel_built(device: torch.device) -> bool:
    return device.type != "cuda"


def use(descriptors) -> None:
    triton_impl._host_descriptors = descriptors
    triton_impl._plans.clear()
    triton_impl._chosen.clear()


def passes(attention, q, k, v, grad) -> dict:
    out = attention(q, k, v)
    return {
        "fwd": lambda: attention(q, k, v),
        "bwd": lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), grad),
    }


def row(runs: dict) -> str:
    return "  ".join(f"{cell_us(fn):7.1f} {host_us(fn, calls=200, warmup=20):7.1f}" for fn in runs.values())


def compare(spec: str) -> None:
    batch_heads, seq, head_dim, *dtype = spec.split("x")
    dtype = getattr(torch, dtype[0] if dtype else "bfloat16")
    q, k, v = (torch.randn(1, int(batch_heads), int(seq), int(head_dim), device="cuda", dtype=dtype,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    grad = torch.randn_like(q)
    print(f"== {spec} causal, us: cell and host time a call of fwd / bwd / fwd+bwd", flush=True)

    def ours(q, k, v):
        return FlashAttentionTriton.apply(q, k, v, True)

    backend = SDPBackend.FLASH_ATTENTION if dtype != torch.float32 else SDPBackend.EFFICIENT_ATTENTION

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for round_index in range(2):
        for name, descriptors in (("kernel-built", kernel_built), ("host-built", HOST_BUILT)):
            use(descriptors)
            print(f"  {name:13s} {row(passes(ours, q, k, v, grad))}  round {round_index}", flush=True)
        print(f"  {'sdpa':13s} {row(passes(sdpa, q, k, v, grad))}", flush=True)


def where_the_host_time_goes(seq: int = 1024, head_dim: int = 64) -> None:
    q, k, v = (torch.randn(1, 1, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    grad = torch.randn_like(q)
    use(HOST_BUILT)
    runs = passes(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True), q, k, v, grad)
    for name in ("fwd", "fwd+bwd"):
        for _ in range(50):
            runs[name]()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            runs[name]()
        profile.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, (1, {seq}, {head_dim}) bf16 {name}, host-built descriptors, 500 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    for spec in (sys.argv[1] if len(sys.argv) > 1 else SHAPES).split(","):
        compare(spec)
    where_the_host_time_goes()
