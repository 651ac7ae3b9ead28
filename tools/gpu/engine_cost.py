"""What the autograd engine charges a backward, host time a call (us, no synchronization inside the
loop), three rounds: torch.autograd.grad through FlashAttentionTriton, through a floor Function
(allocates what ours does, launches nothing), through a Function written like the floor that runs our
forward and backward; our backward called directly and from a thread of its own; and ours and the floor
with the engine's device threads off (torch.autograd.set_multithreading_enabled(False)), which shows
the cost of handing the backward to the engine's CUDA thread and back.

    PYTHONPATH=packages/flashattn-triton/src:tools/gpu python3 tools/gpu/engine_cost.py
"""

import threading

import torch
from host_timing import Floor, host_us

from flashattn_triton import FlashAttentionTriton, triton_impl


class FloorShaped(torch.autograd.Function):
    """Our forward and backward in a Function written like host_timing.Floor."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        out, lse, plan = triton_impl._forward(q, k, v, is_causal, scale, None)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grads = triton_impl.triton_backward(q, k, v, out, lse, grad_out, True, plan.scale, forward_plan=plan)
        return *grads, None, None


def in_thread(fn) -> float:
    result = []
    thread = threading.Thread(target=lambda: result.append(host_us(fn)))
    thread.start()
    thread.join()
    return result[0]


def report(seq: int) -> None:
    shape = (1, 1, seq, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    outs = {
        "floor": Floor.apply(q, k, v, True, None),
        "ours": FlashAttentionTriton.apply(q, k, v, True),
        "ours in a floor-shaped Function": FloorShaped.apply(q, k, v, True, None),
    }
    detached = [t.detach() for t in (q, k, v)]
    o, lse, plan = triton_impl._forward(*detached, True, None, None)

    def direct():
        triton_impl.triton_backward(*detached, o, lse, grad, True, plan.scale, forward_plan=plan)

    def backward(out):
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    rows: dict[str, list[float]] = {}
    for _ in range(3):
        for name, out in outs.items():
            rows.setdefault(f"autograd.grad: {name}", []).append(host_us(backward(out)))
        rows.setdefault("triton_backward directly", []).append(host_us(direct))
        rows.setdefault("triton_backward in a thread", []).append(in_thread(direct))
        with torch.autograd.set_multithreading_enabled(False):
            for name in ("ours", "floor"):
                rows.setdefault(f"autograd.grad: {name}, no device threads", []).append(
                    host_us(backward(outs[name]))
                )
    print(f"== (1, {seq}, 64) bfloat16 causal: host us a call, 3 rounds")
    for name, times in rows.items():
        print(f"  {name:50s}", " ".join(f"{t:7.1f}" for t in times))


for seq in (1024, 4096):
    report(seq)
