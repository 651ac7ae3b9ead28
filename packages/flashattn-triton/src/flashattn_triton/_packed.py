"""Packed sequences (flash-attn's varlen layout) on the tuned kernels: where they take them, and what they add
to a call's plan and to the kernels' arguments (attn_fwd's and attn_bwd's VARLEN path, in which each program
describes its own sequence's rows)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Packed(NamedTuple):
    """Packed sequences: q (total_q, Hq, d), k and v (total_k, Hkv, d) with Hkv dividing Hq, sequence b the
    rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, checked by the caller: _validation.varlen_op_arguments),
    max_seqlen_q/_k at least its longest. For the tuned kernels where the dispatch table sends them."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


_NOT_PACKED = {"CuSeqlensQ": None, "CuSeqlensK": None, "VARLEN": False}


def plan_parts(packed: Packed | None) -> tuple[tuple[torch.Tensor, ...], tuple[int, int, int] | None,
                                               dict[str, Any]]:  # fmt: skip
    """What packed sequences (or None) add to a call's plan: to its tensors (the cu_seqlens, contiguous: the
    kernels index them by sequence) and its key ((batch, max_seqlen_q, max_seqlen_k), triton_impl._plan's
    varlen), and to the kernels' arguments."""
    if packed is None:
        return (), None, _NOT_PACKED
    cu_seqlens_q, cu_seqlens_k = packed.cu_seqlens_q.contiguous(), packed.cu_seqlens_k.contiguous()
    varlen = (cu_seqlens_q.numel() - 1, packed.max_seqlen_q, packed.max_seqlen_k)
    return (cu_seqlens_q, cu_seqlens_k), varlen, {"CuSeqlensQ": cu_seqlens_q, "CuSeqlensK": cu_seqlens_k,
                                                  "VARLEN": True}  # fmt: skip
