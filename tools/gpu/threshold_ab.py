"""The small-problem path against the large-problem one (triton_impl.SMALL_PROBLEM_WORK) for problems near
the threshold, in one process: each pass timed as benchmarks.flash times it (do_bench median with its L2
flush, us), with the configs the tuner chose, two rounds.

    PYTHONPATH=packages/flashattn-triton/src python3 tools/gpu/threshold_ab.py [BHxTxD,...]
"""

import sys

import torch
from host_timing import cell_us

from flashattn_triton import FlashAttentionTriton, triton_impl

SHAPES = "1x32768x32,1x32768x16,1x16384x32,1x16384x16,1x16384x64,2x16384x32,4x8192x32"
DEFAULT = triton_impl.SMALL_PROBLEM_WORK


def main() -> None:
    for shape in (sys.argv[1] if len(sys.argv) > 1 else SHAPES).split(","):
        batch_heads, seq, head_dim = map(int, shape.split("x"))
        q, k, v = (torch.randn(1, batch_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        grad = torch.randn_like(q)
        print(f"== ({batch_heads}, {seq}, {head_dim}) bf16 causal, work / threshold "
              f"{batch_heads * seq * seq * head_dim / DEFAULT:.2f}; us")  # fmt: skip
        for round_index in range(2):
            for name, threshold in (("small path", 1 << 62), ("large path", 0)):
                triton_impl.SMALL_PROBLEM_WORK = threshold
                triton_impl._plans.clear()
                triton_impl._chosen.clear()
                out = FlashAttentionTriton.apply(q, k, v, True)
                torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
                fwd = cell_us(lambda: FlashAttentionTriton.apply(q, k, v, True))  # noqa: B023
                bwd = cell_us(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))  # noqa: B023
                chosen = ", ".join(f"{key[0]} {triton_impl._describe(c)}"
                                   for key, c in triton_impl._chosen.items())  # fmt: skip
                print(f"{name:11s} fwd {fwd:8.1f} bwd {bwd:8.1f}  {chosen}  round {round_index}", flush=True)
    triton_impl.SMALL_PROBLEM_WORK = DEFAULT


if __name__ == "__main__":
    main()
