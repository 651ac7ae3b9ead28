"""The backward on Hopper (sm_90) in Gluon, Triton's lower-level dialect: explicit shared memory, TMA,
mbarriers, asynchronous wgmma and warp specialization, which the Triton-language kernel cannot express.

Same algorithm and contract as ``_kernels.attn_bwd`` with ATOMIC_DQ (PERF.md v12): one program owns
BLOCK_N keys of one (z, h), keeps K and V in shared memory and steps through the query tiles of BLOCK_M
rows that see them. Per step, with the transposed scores (keys are the rows):

    S^T  = K Q^T ;  dP^T = V dO^T                 (issued back to back: dP^T runs during the softmax)
    P^T  = exp2(S^T * qk_scale - L2[q])           (L2 = L * log2 e)
    dV  += P^T dO                                 (P^T from registers; runs during dS)
    dS^T = P^T * (dP^T - D[q])
    dQ_q += scale * dS K                          (dS^T through shared memory; a TMA reduce-add of fp32)
    dK  += dS^T Q                                 (left in flight into the next step)

A one-warp loader partition streams Q, dO, L and D through a STAGES-deep ring (`ready` / `empty`
mbarriers); the consumer warpgroups only compute, each owning 64 of the keys. Written against Triton
3.6's Gluon (Hopper only: ``available()`` says whether this Triton has it); the launcher falls back to the
Triton-language kernel wherever this one does not apply (``supports``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

HEAD_DIMS = (16, 32, 64)  # larger ones spill (d = 128: 352 bytes, slower than the Triton kernel)
LOADER_REGISTERS = 24  # the loader only issues TMA copies; setmaxnreg gives the rest to the consumers


@functools.cache
def _gluon() -> Any:
    """The kernels module, or None when this Triton has no Gluon for Hopper (checked once)."""
    try:
        from flashattn_triton import _hopper_kernels
    except (ImportError, AttributeError):
        return None
    return _hopper_kernels


def available() -> bool:
    return _gluon() is not None


def supports(q: torch.Tensor, tensors: tuple[torch.Tensor, ...], head_dim: int) -> bool:
    """Whether the Gluon backward runs this problem: Hopper, 16-bit, d = 16, 32 or 64, Tq = Tk a multiple
    of 128, contiguous q, k, v, out and dO (tensors)."""
    sixteen_bit = q.dtype in (torch.bfloat16, torch.float16)
    if not (q.is_cuda and sixteen_bit and head_dim == q.shape[-1] in HEAD_DIMS):
        return False
    seqlen = q.shape[-2]
    if seqlen % 128 or any(t.shape != q.shape or not t.is_contiguous() for t in tensors):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0) and available()


def kernel() -> Any:
    return _gluon().attn_bwd


def args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, dk: torch.Tensor,
         dv: torch.Tensor, dq_acc: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, block_m: int,
         block_n: int, stages: int, is_causal: bool, scale: float) -> tuple:
    """attn_bwd's arguments: descriptors over the (Z*H*T, d) views of contiguous (Z, H, T, d) tensors
    (dq_acc: float32, zeroed) and over L and D as (Z*H*T,) vectors."""
    kernels = _gluon()
    head_dim = q.shape[-1]

    def rows(t: torch.Tensor, n: int) -> Any:
        return kernels.tiles(t.view(-1, head_dim), [n, head_dim])

    def vector(t: torch.Tensor, n: int) -> Any:
        return kernels.tiles(t.view(-1), [n])

    return (rows(q, block_m), rows(k, block_n), rows(v, block_n), rows(grad_out, block_m), rows(dk, block_n),
            rows(dv, block_n), rows(dq_acc, block_m), vector(lse, block_m), vector(delta, block_m),
            q.shape[2], q.shape[0] * q.shape[1], scale * kernels.LOG2E, scale, is_causal, stages,
            LOADER_REGISTERS)  # fmt: skip
