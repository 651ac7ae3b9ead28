"""How close a small problem's host time is to its floor, next to SDPA's. Every pass of the benchmark
(fwd, bwd through torch.autograd.grad, fwd+bwd) is timed as benchmarks.flash times it (do_bench median
with its L2 flush, us) and as host time a call (no synchronization inside the loop, us), for

  sdpa        SDPA's flash backend (float32: memory-efficient), in sdpa_kernel() as benchmarks.flash calls it
  sdpa-bare   the same backend chosen once outside the loop (no context manager a call)
  triton      FlashAttentionTriton.apply
  floor       a Python autograd.Function that allocates what ours does and launches nothing: what the
              autograd engine and a Python Function cost by themselves

Then the GPU time of a large problem's forward+backward, kernel by kernel (torch.profiler).

    PYTHONPATH=packages/flashattn-triton/src:tools/gpu python3 tools/gpu/host_floor.py
"""

import sys

import torch
from host_timing import Floor, cell_us, host_us
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn_triton import FlashAttentionTriton

SHAPES = [(1024, 64, torch.bfloat16), (1024, 16, torch.bfloat16), (4096, 128, torch.bfloat16),
          (8192, 32, torch.bfloat16), (1024, 64, torch.float32), (4096, 128, torch.float32)]  # fmt: skip


def sdpa(backend: SDPBackend, in_context: bool):
    def run(q, k, v):
        if not in_context:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def only(backend: SDPBackend) -> None:
    """SDPA restricted to `backend` for the calls outside sdpa_kernel()."""
    torch.backends.cuda.enable_flash_sdp(backend == SDPBackend.FLASH_ATTENTION)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(backend == SDPBackend.EFFICIENT_ATTENTION)
    torch.backends.cuda.enable_math_sdp(False)


def small_problems() -> None:
    for seq, head_dim, dtype in SHAPES:
        q, k, v = (torch.randn(1, 1, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        grad = torch.randn_like(q)
        backend = SDPBackend.FLASH_ATTENTION if dtype != torch.float32 else SDPBackend.EFFICIENT_ATTENTION
        only(backend)
        impls = {
            "sdpa": sdpa(backend, True),
            "sdpa-bare": sdpa(backend, False),
            "triton": lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True),
            "floor": lambda q, k, v: Floor.apply(q, k, v, True, None),
        }
        print(f"== (1, {seq}, {head_dim}) {str(dtype)[6:]} causal, us")
        print(f"{'impl':10s} {'fwd cell':>9s} {'fwd host':>9s} {'bwd cell':>9s} {'bwd host':>9s} "
              f"{'f+b cell':>9s} {'f+b host':>9s}")  # fmt: skip
        for round_index in range(2):
            for name, fn in impls.items():
                saved = fn(q, k, v)
                passes = [
                    lambda fn=fn: fn(q, k, v),  # noqa: B023 (timed inside this iteration)
                    lambda saved=saved: torch.autograd.grad(saved, (q, k, v), grad, retain_graph=True),  # noqa: B023
                    lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), grad),  # noqa: B023
                ]
                row = []
                for run in passes:
                    row += [cell_us(run), host_us(run, calls=200, warmup=20)]
                print(f"{name:10s} " + " ".join(f"{x:9.1f}" for x in row) + f"  round {round_index}")
    backends = torch.backends.cuda
    for enable in (backends.enable_flash_sdp, backends.enable_cudnn_sdp, backends.enable_mem_efficient_sdp,
                   backends.enable_math_sdp):  # fmt: skip
        enable(True)


def large_problem_kernels() -> None:
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(1, 16, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    grad = torch.randn_like(q)
    for _ in range(3):
        torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad)
        torch.cuda.synchronize()
    print("== (16, 16384, 64) bf16 causal fwd+bwd, 10 calls: GPU time by kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, file=sys.stderr)
    small_problems()
    large_problem_kernels()
