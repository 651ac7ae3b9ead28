"""FlashAttention-2 in plain PyTorch: the reference tiled algorithm, on any device.

Forward: the queries are cut into tiles of TILE_Q rows and the keys into tiles of TILE_K; for each key
tile, every query tile that can see it (all of them, or under causal masking those at or below the
diagonal) updates its running max, running sum and output accumulator, all in float32. The query
tiles are a batch dimension rather than a Python loop, which is what a GPU does with them anyway;
no more than Tq x TILE_K scores exist at a time, never Tq x Tk.

Backward: one pass over the key tiles; P is recomputed from L, D = rowsum(dO * O), and dQ is
accumulated in float32.

Precision: the products that feed an exponential or a difference (the scores Q K^T and dP = dO V^T)
are taken in float32, as the kernels' float32 accumulators keep them; P V, dS K, dS^T Q and P^T dO take
their operands in the input dtype, as the kernels do.

The per-key-tile step of the backward is compiled with ``torch.compile`` on CUDA (it fuses the
exponentials and masks between the matrix products). On CPU it runs eagerly: compiling there needs a
C++ toolchain and costs more time than the small CPU problems it would speed up. If compiling fails
for any reason the step falls back to eager once, with a warning, and stays eager.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from flashattn_triton._autograd import AttentionFunction
from flashattn_triton._validation import check_inputs

TILE_Q = 64
TILE_K = 64


def torch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    tile_q: int = TILE_Q,
    tile_k: int = TILE_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L): O like q, L = logsumexp of the scaled scores, float32 of shape q.shape[:-1]."""
    *lead, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[-2]
    num_tiles = math.ceil(seqlen_q / tile_q)
    # Padded rows (zeros) are computed like real ones and dropped at the end.
    q_tiles = (
        F.pad(q, (0, 0, 0, num_tiles * tile_q - seqlen_q))
        .reshape(*lead, num_tiles, tile_q, head_dim)
        .to(torch.float32)
    )
    rows = torch.arange(num_tiles * tile_q, device=q.device).view(num_tiles, tile_q, 1)
    row_max = torch.full((*lead, num_tiles, tile_q), float("-inf"), dtype=torch.float32, device=q.device)
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros((*lead, num_tiles, tile_q, head_dim), dtype=torch.float32, device=q.device)
    for start in range(0, seqlen_k, tile_k):
        # Query tile i holds rows [i*tile_q, (i+1)*tile_q): it sees key `start` iff i >= start // tile_q.
        first = start // tile_q if is_causal else 0
        if first >= num_tiles:
            break
        k_tile = k[..., start : start + tile_k, :].unsqueeze(-3)
        v_tile = v[..., start : start + tile_k, :].unsqueeze(-3)
        scores = (q_tiles[..., first:, :, :] @ k_tile.transpose(-1, -2).to(torch.float32)) * scale
        if is_causal:
            cols = torch.arange(start, start + k_tile.shape[-2], device=q.device)
            scores = scores.masked_fill(cols > rows[first:], float("-inf"))
        m_old = row_max[..., first:, :]
        # Each row's first visited tile contains key 0, so m_new is finite and masked entries give 0.
        m_new = torch.maximum(m_old, scores.amax(-1))
        p = torch.exp(scores - m_new.unsqueeze(-1))
        alpha = torch.exp(m_old - m_new)
        row_sum[..., first:, :] = row_sum[..., first:, :] * alpha + p.sum(-1)
        acc[..., first:, :, :] = acc[..., first:, :, :] * alpha.unsqueeze(-1) + (p.to(v.dtype) @ v_tile).to(
            torch.float32
        )
        row_max[..., first:, :] = m_new
    out = (acc / row_sum.unsqueeze(-1)).to(q.dtype).reshape(*lead, num_tiles * tile_q, head_dim)
    lse = (row_max + torch.log(row_sum)).reshape(*lead, num_tiles * tile_q)
    return out[..., :seqlen_q, :].contiguous(), lse[..., :seqlen_q].contiguous()


def _backward_key_tile(
    q: torch.Tensor,
    q32: torch.Tensor,
    k_tile: torch.Tensor,
    v_tile: torch.Tensor,
    grad_out: torch.Tensor,
    grad_out32: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    first_row: int,
    first_key: int,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient pieces from one key tile: (dQ rows first_row.. in float32, dK tile, dV tile).

    q (q32 its float32 copy), grad_out (grad_out32), lse and delta hold the query rows from first_row on:
    the rows that can see the tile.
    """
    scores = (q32 @ k_tile.transpose(-1, -2).to(torch.float32)) * scale
    p = torch.exp(scores - lse.unsqueeze(-1))
    if is_causal:
        rows = torch.arange(first_row, first_row + q.shape[-2], device=q.device).unsqueeze(-1)
        cols = torch.arange(first_key, first_key + k_tile.shape[-2], device=q.device)
        p = p.masked_fill(cols > rows, 0.0)
    grad_v = p.to(grad_out.dtype).transpose(-1, -2) @ grad_out
    grad_p = grad_out32 @ v_tile.transpose(-1, -2).to(torch.float32)
    grad_s = (p * (grad_p - delta.unsqueeze(-1))).to(q.dtype)
    grad_k = ((grad_s.transpose(-1, -2) @ q).to(torch.float32) * scale).to(k_tile.dtype)
    grad_q = (grad_s @ k_tile).to(torch.float32) * scale
    return grad_q, grad_k, grad_v


class _CompiledOnCuda:
    """fn compiled with torch.compile for CUDA tensors, eager elsewhere or once compiling has failed."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        if self.failed or not args[0].is_cuda:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # a missing compiler, an unsupported platform, a dynamo bug...
            self.failed = True
            warnings.warn(
                f"torch.compile failed for FlashAttentionTorch's backward, running it eagerly from now "
                f"on: {type(exc).__name__}: {str(exc)[:300]}",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args)


_backward_step = _CompiledOnCuda(_backward_key_tile)


def torch_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    is_causal: bool,
    scale: float,
    tile_k: int = TILE_K,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) by recomputing P tile by tile from L, with D = rowsum(dO * O). grad_lse, the gradient
    of L where L is used too, adds to dS = P (dP - D) as P dL: it is subtracted from D."""
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    q32, grad_out32 = q.to(torch.float32), grad_out.to(torch.float32)
    delta = (grad_out32 * out.to(torch.float32)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_k = torch.zeros_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for start in range(0, seqlen_k, tile_k):
        first_row = start if is_causal else 0  # under causal masking rows before `start` see no key here
        if first_row >= seqlen_q:
            break
        stop = start + tile_k
        piece_q, piece_k, piece_v = _backward_step(
            q[..., first_row:, :],
            q32[..., first_row:, :],
            k[..., start:stop, :],
            v[..., start:stop, :],
            grad_out[..., first_row:, :],
            grad_out32[..., first_row:, :],
            lse[..., first_row:],
            delta[..., first_row:],
            scale,
            first_row,
            start,
            is_causal,
        )
        grad_q[..., first_row:, :] += piece_q
        grad_k[..., start:stop, :] = piece_k
        grad_v[..., start:stop, :] = piece_v
    return grad_q.to(q.dtype), grad_k, grad_v


class FlashAttentionTorch(AttentionFunction):
    """FlashAttention-2 forward and backward in PyTorch (any device): ``FlashAttentionTorch.apply(q, k, v)``.

    q: (..., Tq, d), k and v: (..., Tk, d) with the same leading dims and dtype (float16, bfloat16 or
    float32). Saves Q, K, V, O and L (float32, shape q.shape[:-1]) for the backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        scale = check_inputs(q, k, v, is_causal, scale)
        out, lse = torch_forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch_backward(q, k, v, out, lse, grad_out, ctx.is_causal, ctx.scale)
        return grad_q, grad_k, grad_v, None, None
