"""Host time per call of FlashAttentionTriton on a problem small enough that the GPU work is negligible
(B = 1, T = 1024, d = 64, bfloat16, causal): the time without a profiler, where it goes (cProfile),
and the same time for SDPA's flash backend and an empty Python autograd.Function, for scale."""

import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl
from host_timing import host_us

from flashattn_triton import FlashAttentionTriton
from flashattn_triton.triton_impl import triton_backward, triton_forward

q, k, v = (
    torch.randn(1, 1, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
)
grad = torch.randn_like(q)


def forward():
    return FlashAttentionTriton.apply(q, k, v, True)


def forward_backward():
    torch.autograd.grad(forward(), (q, k, v), grad)


class Passthrough(torch.autograd.Function):
    """The floor of any Python autograd.Function: one allocation forward, the gradient back."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def sdpa_flash():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


for name, fn in [("fwd", forward), ("fwd+bwd", forward_backward)]:
    print(f"== {name}: host {host_us(fn):.1f} us a call (no profiler)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)

@triton.jit
def _touch(x):
    tl.store(x, tl.load(x) + 1)


flag = torch.zeros(1, device="cuda")
touch = _touch[(1,)](flag)[(1, 1, 1)]  # the compiled kernel, launched directly as _Launcher does
out, lse = triton_forward(q, k, v, True, 0.125)
saved = {name: fn() for name, fn in [("triton", forward), ("sdpa", sdpa_flash),
                                      ("passthrough", lambda: Passthrough.apply(q))]}  # fmt: skip
floors = {
    "triton_forward called directly": lambda: triton_forward(q, k, v, True, 0.125),
    "triton_backward called directly": lambda: triton_backward(q, k, v, out, lse, grad, True, 0.125),
    "triton bwd through autograd": lambda: torch.autograd.grad(saved["triton"], (q, k, v), grad,
                                                               retain_graph=True),  # fmt: skip
    "Passthrough bwd": lambda: torch.autograd.grad(saved["passthrough"], (q,), grad, retain_graph=True),
    "Passthrough fwd+bwd": lambda: torch.autograd.grad(Passthrough.apply(q), (q,), grad),
    "sdpa-flash fwd": sdpa_flash,
    "sdpa-flash bwd": lambda: torch.autograd.grad(saved["sdpa"], (q, k, v), grad, retain_graph=True),
    "sdpa-flash fwd+bwd": lambda: torch.autograd.grad(sdpa_flash(), (q, k, v), grad),
    "torch.empty": lambda: torch.empty(1024, device="cuda"),
    "a compiled Triton kernel's launch": lambda: touch(flag),
}
for name, fn in floors.items():
    print(f"== {name}: host {host_us(fn):.1f} us a call")


def stage_times(function: type, saved_out: torch.Tensor, inputs: tuple, calls: int = 300) -> str:
    """Median host microseconds of a backward-only autograd call, split where the Function's backward
    is entered and left: the engine's part before (hand-off to its device thread, saved tensors),
    the backward itself, and the engine's part after (gradient checks, hand-back)."""
    stamps: dict[str, float] = {}
    original = function.backward

    def timed_backward(ctx, *grads):
        stamps["enter"] = time.perf_counter()
        result = original(ctx, *grads)
        stamps["leave"] = time.perf_counter()
        return result

    function.backward = staticmethod(timed_backward)
    parts: list[tuple[float, float, float]] = []
    try:
        for i in range(calls + 30):
            start = time.perf_counter()
            torch.autograd.grad(saved_out, inputs, grad, retain_graph=True)
            end = time.perf_counter()
            if i >= 30:
                enter, leave = stamps["enter"], stamps["leave"]
                parts.append((enter - start, leave - enter, end - leave))
    finally:
        function.backward = original
    torch.cuda.synchronize()
    before, inside, after = (sorted(column)[len(column) // 2] * 1e6 for column in zip(*parts, strict=True))
    return f"engine before {before:.1f} us, backward {inside:.1f} us, engine after {after:.1f} us"


class PlainTriton(FlashAttentionTriton):
    """FlashAttentionTriton with a backward that is not wrapped in once_differentiable."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grads = triton_backward(q, k, v, out, lse, grad_out, ctx.is_causal, plan.scale, forward_plan=plan)
        return *grads, None, None


print("== triton bwd stages:", stage_times(FlashAttentionTriton, saved["triton"], (q, k, v)))
print("== no once_differentiable bwd stages:",
      stage_times(PlainTriton, PlainTriton.apply(q, k, v, True), (q, k, v)))  # fmt: skip
print("== Passthrough bwd stages:", stage_times(Passthrough, saved["passthrough"], (q,)))
