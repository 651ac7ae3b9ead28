"""float32 accuracy of flash_attention's forward and backward against float64, next to SDPA's float32.

    PYTHONPATH=packages/flashattn-triton/src python lab/flashattn-triton/scripts/accuracy.py

Per shape (batch*heads, T, d), causal, with float32 matmuls at "highest" precision: the relative
Frobenius error |got - want| / |want| of O, dQ, dK and dV, want computed by SDPA in float64 from the
same inputs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashattn_triton


def errors(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
           want: list[torch.Tensor]) -> list[float]:  # fmt: skip
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    got = [out.detach(), *torch.autograd.grad(out, leaves, grad_out.float())]
    return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x4096x64,1x8192x128,1x4096x64", help="BHxTxD list")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    implementations = {
        "flash_attention": lambda q, k, v: flashattn_triton.flash_attention(q, k, v, is_causal=True),
        "sdpa float32": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    print(f"{'shape':>14} {'implementation':>16} {'O':>9} {'dQ':>9} {'dK':>9} {'dV':>9}")
    for shape in args.shapes.split(","):
        batch_heads, seqlen, head_dim = map(int, shape.split("x"))
        generator = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad_out = (torch.randn(1, batch_heads, seqlen, head_dim, device="cuda", dtype=torch.float64,
                                         generator=generator).float().double() for _ in range(4))  # fmt: skip
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        want = [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]
        for name, attention in implementations.items():
            measured = errors(attention, q, k, v, grad_out, want)
            print(f"{shape:>14} {name:>16} " + " ".join(f"{e:9.1e}" for e in measured))


if __name__ == "__main__":
    main()
