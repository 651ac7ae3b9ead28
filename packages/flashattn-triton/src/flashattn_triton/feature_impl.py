"""The feature Triton backend: launchers of _feature_kernels, for every problem the tuned kernels do not take
(masks, bands other than top-left, dropout, packed sequences, each with grouped-query attention). torch_impl's
arguments and results; a deterministic backward (no atomics). Tiles follow the head dim and dtype: no tuning,
plain JIT calls, safe under CUDA graph capture after a first call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from flashattn_triton._configs import block_d
from flashattn_triton._dropout import Dropout, check_rng, kept_scale, threshold
from flashattn_triton._inputs import input_precision, output_like
from flashattn_triton._launcher import device_guard, feature_kernels, out_of_resources
from flashattn_triton._validation import UNBOUNDED


class Blocks(NamedTuple):
    """A launch's tiles: block_m query rows by block_n keys."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class Launches(NamedTuple):
    forward: Blocks
    dkdv: Blocks
    dq: Blocks


SMALLEST = Blocks(32, 32, 4, 1)  # where a launch runs out of shared memory


def _blocks(block_d: int, dtype: torch.dtype, device: torch.device) -> Launches:
    """Tiles that compile for sm_90 without register spills with every feature on; tiny ones for the
    interpreter, whose cost grows with the tiles' product."""
    if device.type != "cuda":
        tiny = Blocks(16, 16, 1, 1)
        return Launches(tiny, tiny, tiny)
    if dtype == torch.float32 or block_d > 128:
        # 4 warps: dQ's 64 x 16 tiles on 8 warps with tf32x3 wrote outside shared memory (Triton 3.6).
        tiles = Blocks(64, 32, 4, 2)
        return Launches(tiles, tiles, tiles)
    if block_d <= 64:
        return Launches(Blocks(128, 64, 8, 3), Blocks(64, 64, 8, 2), Blocks(128, 32, 8, 3))
    return Launches(Blocks(128, 32, 8, 3), Blocks(32, 64, 8, 2), Blocks(64, 32, 8, 2))


def _launch(kernel: Any, grid: Callable[[Blocks], tuple[int, int]], blocks: Blocks, *args: Any,
            **constants: Any) -> None:  # fmt: skip
    """kernel[grid(blocks)](*args) with blocks' tiles, stepping down to SMALLEST if they do not fit."""
    for attempt in (blocks, SMALLEST):
        try:
            kernel[grid(attempt)](*args, BLOCK_M=attempt.block_m, BLOCK_N=attempt.block_n,
                                  num_warps=attempt.num_warps, num_stages=attempt.num_stages, **constants)
            return
        except out_of_resources():
            if attempt == SMALLEST:
                raise


def _unit_last(x: torch.Tensor | None) -> torch.Tensor | None:
    """x with unit stride along its last dim, as the kernels index it; None for None."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(z, h, t) strides of (B, H, T, ...) x, or of packed (total, H, ...) x (z: 0)."""
    if varlen:
        return 0, x.stride(1), x.stride(0)
    return x.stride(0), x.stride(1), x.stride(2)


class _Problem(NamedTuple):
    """What every launch of one problem shares: its shapes, band, mask and dropout as kernel arguments."""

    varlen: bool
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    mask: torch.Tensor
    mask_strides: tuple[int, int, int, int]
    rng: torch.Tensor | None
    shared: tuple  # the scalar arguments after the head counts, in the kernels' order
    constants: dict


def _problem(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
             rng_state: torch.Tensor | None, scale: float, window_left: int, window_right: int,
             diagonal_offset: int, cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int,
             max_seqlen_k: int) -> _Problem:  # fmt: skip
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, heads, kv_heads = cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1]
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        counters = Dropout.packed(dropout_p, rng_state, q.shape[0], seqlen_k)
    else:
        batch, heads, seqlen_q = q.shape[:3]
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
        counters = Dropout.dense(dropout_p, rng_state, heads, seqlen_q, seqlen_k)
    if attn_mask is None:  # a stand-in that is never read (MASK = 0)
        mask, mask_strides, mask_kind = q, (0, 0, 0, 0), 0
    else:
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B, Hq, Tq, Tk) or broadcastable
        mask_strides = tuple(0 if n == 1 else s for n, s in zip(mask.shape, mask.stride(), strict=True))
        mask_kind = 1 if attn_mask.dtype == torch.bool else 2
    check_rng(dropout_p, rng_state)
    head_dim = q.shape[-1]
    band = (diagonal_offset, max(window_left, 0), max(window_right, 0))
    dropout = (threshold(dropout_p), kept_scale(dropout_p), counters.stride_b, counters.stride_h,
               counters.stride_i)  # fmt: skip
    constants = {"BLOCK_D": block_d(head_dim), "HAS_LEFT": window_left != UNBOUNDED,
                 "HAS_RIGHT": window_right != UNBOUNDED, "MASK": mask_kind, "DROPOUT": dropout_p > 0.0,
                 "VARLEN": varlen, "INPUT_PRECISION": input_precision(q.dtype)}  # fmt: skip
    return _Problem(varlen, batch, heads, kv_heads, seqlen_q, seqlen_k, mask, mask_strides, rng_state,
                    ((seqlen_q, seqlen_k, head_dim), scale, band, dropout), constants)


def feature_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    rng_state: torch.Tensor | None = None, scale: float,
                    window_left: int = UNBOUNDED, window_right: int = UNBOUNDED, diagonal_offset: int = 0,
                    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                    max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_impl.attention_forward's (O, L), from _feature_kernels.attn_fwd."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = (_unit_last(t) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    p = _problem(q, k, attn_mask, dropout_p, rng_state, scale, window_left, window_right, diagonal_offset,
                 cu_seqlens_q, max_seqlen_q, max_seqlen_k)  # fmt: skip
    out = output_like(q)  # (the kernels store by strides: in q's layout as the ops promise)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    (seqlens, scale, band, dropout), c = p.shared, p.constants
    blocks = _blocks(c["BLOCK_D"], q.dtype, q.device).forward
    strides = (*_strides(q, p.varlen), *_strides(k, p.varlen), *_strides(v, p.varlen),
               *_strides(out, p.varlen), *_strides(lse, p.varlen))  # fmt: skip
    with device_guard(q):
        grid = lambda b: (-(-p.seqlen_q // b.block_m), p.batch * p.heads)
        _launch(feature_kernels().attn_fwd, grid, blocks, q, k, v, out, lse, p.mask, p.rng, cu_seqlens_q,
                cu_seqlens_k, *strides, *p.mask_strides, p.heads, p.heads // p.kv_heads, *seqlens,
                scale * feature_kernels().LOG2E, *band, *dropout, **c)  # fmt: skip
    return out, lse


def feature_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0, rng_state: torch.Tensor | None = None, scale: float,
                     window_left: int = UNBOUNDED, window_right: int = UNBOUNDED, diagonal_offset: int = 0,
                     cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                     max_seqlen_q: int = 0, max_seqlen_k: int = 0, grad_lse: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch_impl.attention_backward's (dQ, dK, dV), from attn_bwd_dkdv then attn_bwd_dq (deterministic)."""
    q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k = (_unit_last(t) for t in (q, k, v, grad_out, cu_seqlens_q,
                                                                             cu_seqlens_k))  # fmt: skip
    p = _problem(q, k, attn_mask, dropout_p, rng_state, scale, window_left, window_right, diagonal_offset,
                 cu_seqlens_q, max_seqlen_q, max_seqlen_k)  # fmt: skip
    grads = [output_like(t).zero_() for t in (q, k, v)]  # (in their inputs' layouts, as out)
    if q.numel() == 0 or k.numel() == 0:
        return tuple(grads)
    dq, dk, dv = grads
    lse = lse.contiguous()
    delta = (grad_out.to(torch.float32) * out.to(torch.float32)).sum(-1)
    if grad_lse is not None:  # dS = P (dP - D + dL)
        delta = delta - grad_lse
    delta = delta.contiguous()
    (seqlens, scale, band, dropout), c = p.shared, p.constants
    launches = _blocks(c["BLOCK_D"], q.dtype, q.device)
    kernels = feature_kernels()
    common = (*_strides(q, p.varlen), *_strides(k, p.varlen), *_strides(v, p.varlen),
              *_strides(grad_out, p.varlen), *_strides(lse, p.varlen))  # fmt: skip
    inputs = (q, k, v, grad_out, lse, delta)
    group = p.heads // p.kv_heads
    after = (group, *seqlens, scale * kernels.LOG2E, scale, *band, *dropout)  # (after the head count)
    with device_guard(q):
        _launch(kernels.attn_bwd_dkdv, lambda b: (-(-p.seqlen_k // b.block_n), p.batch * p.kv_heads),
                launches.dkdv, *inputs, dk, dv, p.mask, p.rng, cu_seqlens_q, cu_seqlens_k, *common,
                *_strides(dk, p.varlen), *_strides(dv, p.varlen), *p.mask_strides, p.kv_heads, *after,
                **c)  # fmt: skip
        _launch(kernels.attn_bwd_dq, lambda b: (-(-p.seqlen_q // b.block_m), p.batch * p.heads), launches.dq,
                *inputs, dq, p.mask, p.rng, cu_seqlens_q, cu_seqlens_k, *common, *_strides(dq, p.varlen),
                *p.mask_strides, p.heads, *after, **c)  # fmt: skip
    return dq, dk, dv
