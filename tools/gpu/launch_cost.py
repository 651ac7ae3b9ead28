"""Where a small problem's host time goes on the way to the GPU: each piece of a forward's and a
backward's launch path timed alone (us a call, no synchronization inside the loop), next to a PyTorch
launch and an empty Triton kernel's direct launch, at (1, 1024, 64) bfloat16 causal.

    PYTHONPATH=packages/flashattn-triton/src:tools/gpu python3 tools/gpu/launch_cost.py
"""

import inspect

import torch
import triton
from host_timing import host_us

from flashattn_triton import FlashAttentionTriton, triton_impl


@triton.jit
def empty_kernel(x):
    pass


def main() -> None:
    shape = (1, 1, 1024, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    out = FlashAttentionTriton.apply(q, k, v, True)
    torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    forward_plan = next(p for key, p in triton_impl._plans.items() if key[0] == "fwd")
    plans = {"fwd": forward_plan, "bwd": next(iter(forward_plan.backward_plans.values()))}
    print({name: triton_impl._describe(plan.config) for name, plan in plans.items()})

    # Each plan's launch arguments, recorded from one call through autograd.
    recorded, real = {}, {name: plan.launch for name, plan in plans.items()}
    for name, plan in plans.items():
        plan.launch = lambda *a, _name=name: (recorded.__setitem__(_name, a), real[_name](*a))
    FlashAttentionTriton.apply(q, k, v, True)
    torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    for name, plan in plans.items():
        plan.launch = real[name]

    x = torch.zeros(16, device="cuda")
    empty = triton_impl._Launcher(empty_kernel, (16,), None)
    empty(x)
    rows = {
        "torch.empty_like": host_us(lambda: torch.empty_like(q)),
        "x.add_(1), a PyTorch launch": host_us(lambda: x.add_(1)),
        "an empty Triton kernel, direct": host_us(lambda: empty(x)),
    }
    for name, plan in plans.items():
        split = hasattr(plan.launch, "first")  # a _LaunchPair (a split forward): time its first launch
        launcher = plan.launch.first if split else plan.launch
        args = recorded[name][:-1] if split else recorded[name]
        state = inspect.getclosurevars(launcher.compiled).nonlocals
        launch_args, launch = state["launch_args"], state["launch"]
        expanded = launch_args(args)
        stream = torch._C._cuda_getCurrentRawStream(q.device.index)
        fixed = (*state["grid"], stream, state["function"], *state["flags"], None, None,
                 state["packed_metadata"], None, None, None)  # fmt: skip
        rows[f"{name}: the plan's launch(es)"] = host_us(lambda p=plan, a=recorded[name]: p.launch(*a))
        rows[f"{name}: _LaunchArgs lookup"] = host_us(lambda la=launch_args, a=args: la(a))
        rows[f"{name}: Triton's C launch alone ({len(expanded)} arguments)"] = host_us(
            lambda f=fixed, e=expanded, run=launch: run(*f, *e)
        )
    detached = [t.detach() for t in (q, k, v)]
    o, lse = triton_impl.triton_forward(*detached, True, None)
    rows["triton_forward"] = host_us(lambda: triton_impl.triton_forward(*detached, True, None))
    rows["triton_backward"] = host_us(
        lambda: triton_impl.triton_backward(*detached, o, lse, grad, True, 0.125, forward_plan=forward_plan)
    )
    rows["FlashAttentionTriton.apply"] = host_us(lambda: FlashAttentionTriton.apply(q, k, v, True))
    rows["torch.autograd.grad (backward)"] = host_us(
        lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    )
    for row, us in rows.items():
        print(f"{row:55s} {us:8.1f} us")


main()
