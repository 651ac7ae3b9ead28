"""Kernels for Hopper (sm_90) in Gluon, Triton's lower-level dialect: explicit shared memory, TMA,
mbarriers, asynchronous wgmma and warp specialization, which the Triton-language kernels cannot express.
Written against Triton 3.6's Gluon (``available()`` says whether this Triton has it); the launchers offer
them to their tuner where they apply (``supports``) and keep the Triton-language kernels elsewhere.

Forward (``_hopper_kernels.attn_fwd``, decisions.md#gluon-forward): FA3's ping-pong. Two 4-warp consumers
own 64 query rows each and take turns issuing S = QKᵀ, so that one's softmax runs during the other's
products; a loader partition streams 128-key tiles of K and V through a ring of mbarrier-guarded stages.

Backward (``_hopper_kernels.attn_bwd``, decisions.md#gluon-backward): ``_kernels.attn_bwd``'s algorithm with
ATOMIC_DQ. One program owns 128 keys of one (z, h) (two consumer warpgroups of 64), keeps K and V in
shared memory, and a one-warp loader streams the query tiles of 64 rows that see them (Q, dO, L, D).
Per step, with the transposed scores (keys are the rows):

    S^T  = K Q^T ;  dP^T = V dO^T                 (issued back to back: dP^T runs during the softmax)
    P^T  = exp2(S^T * qk_scale - L2[q])           (L2 = L * log2 e)
    dV  += P^T dO                                 (P^T from registers; runs during dS)
    dS^T = P^T * (dP^T - D[q])
    dQ_q += scale * dS K                          (dS^T through shared memory; a TMA reduce-add of fp32)
    dK  += dS^T Q                                 (left in flight into the next step)
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from flashattn_triton._tiles import Tiles

# Head dims each kernel compiles for without spills (the backward at d = 128 spilled 352 bytes and lost
# to the Triton kernel).
HEAD_DIMS = {"fwd": (64, 128), "bwd": (16, 32, 64)}
LOADER_REGISTERS = 24  # the backward's loader only issues TMA copies; setmaxnreg gives the rest away
FORWARD_CONSUMER_REGISTERS = 240


@functools.cache
def _gluon() -> Any:
    """The kernels module, or None when this Triton has no Gluon for Hopper (checked once)."""
    try:
        from flashattn_triton import _hopper_kernels
    except (ImportError, AttributeError):
        return None
    return _hopper_kernels


def available() -> bool:
    """Whether the Gluon kernels can be offered: this Triton has Gluon for Hopper and
    FLASHATTN_TRITON_GLUON is not 0 (the switch to keep the Triton-language kernels everywhere)."""
    if os.environ.get("FLASHATTN_TRITON_GLUON", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return _gluon() is not None


def supports(pass_name: str, q: torch.Tensor, tensors: tuple[torch.Tensor, ...], head_dim: int) -> bool:
    """Whether the Gluon kernel of pass_name ("fwd" or "bwd") runs this problem: Hopper, 16-bit, a head
    dim of HEAD_DIMS[pass_name], Tq = Tk a multiple of 128, contiguous tensors (q, k, v[, out, dO]) all of
    q's shape (so not grouped-query attention, whose K and V have fewer heads)."""
    sixteen_bit = q.dtype in (torch.bfloat16, torch.float16)
    if not (q.is_cuda and sixteen_bit and head_dim == q.shape[-1] in HEAD_DIMS[pass_name]):
        return False
    seqlen = q.shape[-2]
    if seqlen % 128 or any(t.shape != q.shape or not t.is_contiguous() for t in tensors):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0) and available()


def kernel(pass_name: str) -> Any:
    kernels = _gluon()
    return kernels.attn_fwd if pass_name == "fwd" else kernels.attn_bwd


def _rows(t: torch.Tensor, n: int) -> Tiles:
    """A descriptor over the (Z*H*T, d) view of a contiguous (Z, H, T, d) tensor, tiles of n rows."""
    head_dim = t.shape[-1]
    return Tiles(t.view(-1, head_dim), (n, head_dim), _gluon().tiles)


def forward_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 block_m: int, block_n: int, stages: int, is_causal: bool, scale: float) -> dict[str, Any]:
    """attn_fwd's arguments: each consumer's block_m / 2 query rows, block_n keys a step."""
    rows = block_m // 2
    return dict(q_desc=_rows(q, rows), k_desc=_rows(k, block_n), v_desc=_rows(v, block_n),
                o_desc=_rows(out, rows), L=lse, T=q.shape[2], ZH=q.shape[0] * q.shape[1],
                qk_scale=scale * _gluon().LOG2E, CAUSAL=is_causal, STAGES=stages,
                CONSUMER_REGS=FORWARD_CONSUMER_REGISTERS)  # fmt: skip


def backward_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                  dk: torch.Tensor, dv: torch.Tensor, dq_acc: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, block_m: int, block_n: int, stages: int, is_causal: bool,
                  scale: float) -> dict[str, Any]:
    """attn_bwd's arguments: descriptors over the (Z*H*T, d) views (dq_acc: float32, zeroed) and over L
    and D as (Z*H*T,) vectors."""
    kernels = _gluon()
    return dict(q_desc=_rows(q, block_m), k_desc=_rows(k, block_n), v_desc=_rows(v, block_n),
                do_desc=_rows(grad_out, block_m), dk_desc=_rows(dk, block_n), dv_desc=_rows(dv, block_n),
                dq_desc=_rows(dq_acc, block_m), l_desc=Tiles(lse.view(-1), (block_m,), kernels.tiles),
                dl_desc=Tiles(delta.view(-1), (block_m,), kernels.tiles), T=q.shape[2],
                ZH=q.shape[0] * q.shape[1], qk_scale=scale * kernels.LOG2E, scale=scale, CAUSAL=is_causal,
                STAGES=stages, LOADER_REGS=LOADER_REGISTERS)  # fmt: skip
