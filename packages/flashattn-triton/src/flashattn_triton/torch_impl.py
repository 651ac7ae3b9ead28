"""The PyTorch backend: FlashAttention-2 in plain PyTorch, every feature of flash_attention on any device, the
reference semantics the kernels match (the problem: ops' contract), and the naive reference_attention the
tests compare with.

Forward: one pass over key tiles of TILE_K keys, the rows the band lets see a tile updating their running max,
sum and output in float32: never Tq x Tk scores at once. K and V broadcast over a group's query heads, never
repeated. Backward: one pass over the key tiles, P recomputed from L, D = rowsum(dO * O), dQ accumulated in
float32, each tile's dK and dV summed over its group. The products that feed an exponential or a difference (Q
K^T, dO V^T) are taken in float32, the others in the input dtype, as the kernels take them.

The backward's key-tile step is compiled with torch.compile on CUDA (it fuses the exponentials and masks); on
CPU it runs eagerly (compiling needs a C++ toolchain and costs more than the small problems gain). A failed
compile falls back to eager once, with a warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flashattn_triton._dropout import Dropout, check_rng
from flashattn_triton._validation import UNBOUNDED, AttentionFunction, Band, as_4d, check_inputs

TILE_K = 64


class _Problem:
    """One call's tensors in the grouped layout, and each key tile's query rows, band, mask and dropout."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, band: Band,
                 dropout: Dropout | None) -> None:  # fmt: skip
        batch, self.heads, self.seqlen_q, head_dim = q.shape
        self.kv_heads, self.seqlen_k = k.shape[1], k.shape[2]
        self.group = self.heads // self.kv_heads if self.kv_heads else 1
        self.grouped = (batch, self.kv_heads, self.group)
        self.band = band
        self.device = q.device
        self.dropout = dropout
        self.mask = None if attn_mask is None else self._grouped_mask(attn_mask)

    def grouped_queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hq, Tq, ...) as (B, Hkv, G, Tq, ...): a view."""
        return x.view(*self.grouped, *x.shape[2:])

    def grouped_keys(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, Tk, d) as (B, Hkv, 1, Tk, d), broadcast over the group."""
        return x.unsqueeze(2)

    def _grouped_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The mask (4 dims or fewer) as 5 dims broadcastable to (B, Hkv, G, Tq, Tk), size-1 dims kept."""
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.shape[1] == 1:
            return mask.unsqueeze(1)
        return mask.view(mask.shape[0], self.kv_heads, self.group, *mask.shape[2:])

    def rows(self, start: int, stop: int) -> range:
        """The query rows that may see some key of [start, stop) within the band."""
        band = self.band
        first, last = 0, self.seqlen_q
        if band.window_right != UNBOUNDED:  # j <= i + offset + right
            first = max(first, start - band.diagonal_offset - band.window_right)
        if band.window_left != UNBOUNDED:  # j >= i + offset - left
            last = min(last, stop - 1 - band.diagonal_offset + band.window_left + 1)
        return range(first, max(first, last))

    def visible(self, rows: range, cols: range) -> torch.Tensor | None:
        """Which of the tile's scores the band and a bool mask keep, or None where they keep all."""
        band, device = self.band, self.device
        keep = None
        if band.bounded:
            i = torch.arange(rows.start, rows.stop, device=device).view(-1, 1) + band.diagonal_offset
            j = torch.arange(cols.start, cols.stop, device=device)
            keep = torch.ones(len(rows), len(cols), dtype=torch.bool, device=device)
            if band.window_right != UNBOUNDED:
                keep &= j <= i + band.window_right
            if band.window_left != UNBOUNDED:
                keep &= j >= i - band.window_left
        if self.mask is not None and self.mask.dtype == torch.bool:
            tile = self._mask_tile(rows, cols)
            keep = tile if keep is None else keep & tile
        return keep

    def bias(self, rows: range, cols: range) -> torch.Tensor | None:
        """The float mask's tile in float32, broadcastable to (B, Hkv, G, R, C), or None."""
        if self.mask is None or self.mask.dtype == torch.bool:
            return None
        return self._mask_tile(rows, cols).to(torch.float32)

    def _mask_tile(self, rows: range, cols: range) -> torch.Tensor:
        mask = self.mask
        if mask.shape[-2] != 1:
            mask = mask[..., rows.start : rows.stop, :]
        if mask.shape[-1] != 1:
            mask = mask[..., cols.start : cols.stop]
        return mask

    def dropout_scale(self, rows: range, cols: range) -> torch.Tensor | None:
        """kept_scale(p) where kept, 0 where dropped, (B, Hkv, G, R, C) float32; None without dropout."""
        if self.dropout is None:
            return None
        tile = self.dropout.scale_tile(self.grouped[0], self.heads, rows, cols)
        return self.grouped_queries(tile)

    def key_tiles(self, tile_k: int) -> list[tuple[range, range]]:
        """(query rows, keys) of every key tile that some row sees."""
        tiles = []
        for start in range(0, self.seqlen_k, tile_k):
            cols = range(start, min(start + tile_k, self.seqlen_k))
            rows = self.rows(cols.start, cols.stop)
            if len(rows):
                tiles.append((rows, cols))
        return tiles


def _dropout(dropout_p: float, rng_state: torch.Tensor | None, q: torch.Tensor,
             seqlen_k: int) -> Dropout | None:  # fmt: skip
    if dropout_p == 0.0:
        return None
    check_rng(dropout_p, rng_state)
    _, heads, seqlen_q, _ = q.shape
    return Dropout.dense(dropout_p, rng_state, heads, seqlen_q, seqlen_k)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      rng_state: torch.Tensor | None = None, scale: float,
                      window_left: int = UNBOUNDED, window_right: int = UNBOUNDED, diagonal_offset: int = 0,
                      cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                      max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                      tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O (B, Hq, Tq, d), L float32 (B, Hq, Tq)) of the ops' problem; with cu_seqlens, of packed sequences
    (varlen_forward)."""
    band = Band(window_left, window_right, diagonal_offset)
    if cu_seqlens_q is not None:
        return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              dropout_p=dropout_p, rng_state=rng_state, scale=scale, band=band,
                              tile_k=tile_k)  # fmt: skip
    problem = _Problem(q, k, attn_mask, band, _dropout(dropout_p, rng_state, q, k.shape[2]))
    return _forward(problem, q, k, v, scale, tile_k)


def _forward(problem: _Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             tile_k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    q32 = problem.grouped_queries(q).to(torch.float32)
    k, v = problem.grouped_keys(k), problem.grouped_keys(v)
    stats_shape = q32.shape[:-1]
    row_max = torch.full(stats_shape, float("-inf"), dtype=torch.float32, device=q.device)
    row_sum = torch.zeros(stats_shape, dtype=torch.float32, device=q.device)
    acc = torch.zeros(q32.shape, dtype=torch.float32, device=q.device)
    for rows, cols in problem.key_tiles(tile_k):
        r, c = slice(rows.start, rows.stop), slice(cols.start, cols.stop)
        scores = (q32[..., r, :] @ k[..., c, :].transpose(-1, -2).to(torch.float32)) * scale
        bias = problem.bias(rows, cols)
        if bias is not None:
            scores = scores + bias
        visible = problem.visible(rows, cols)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        m_old = row_max[..., r]
        m_new = torch.maximum(m_old, scores.amax(-1))
        # A row that has seen no key yet keeps m = -inf: subtract 0 there, so that exp gives 0, not NaN.
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(scores - m_safe.unsqueeze(-1))
        alpha = torch.exp(m_old - m_safe)
        row_sum[..., r] = row_sum[..., r] * alpha + p.sum(-1)
        dropout = problem.dropout_scale(rows, cols)
        if dropout is not None:
            p = p * dropout
        pv = (p.to(v.dtype) @ v[..., c, :]).to(torch.float32)
        acc[..., r, :] = acc[..., r, :] * alpha.unsqueeze(-1) + pv
        row_max[..., r] = m_new
    # A row that saw no key keeps m = -inf and gets 0, as from SDPA; any other is divided out, so that a NaN
    # among its scores makes it NaN as in SDPA (a test on row_sum > 0 would read a NaN sum as "no key").
    seen = row_max != float("-inf")
    out = torch.where(seen.unsqueeze(-1), acc / row_sum.unsqueeze(-1), 0.0).to(q.dtype)
    lse = torch.where(seen, row_max + torch.log(row_sum), float("-inf"))
    return out.view(q.shape), lse.view(q.shape[:-1])


def _backward_key_tile(q: torch.Tensor, q32: torch.Tensor, k_tile: torch.Tensor, v_tile: torch.Tensor,
                       grad_out: torch.Tensor, grad_out32: torch.Tensor, lse: torch.Tensor,
                       delta: torch.Tensor, scale: float, visible: torch.Tensor | None,
                       bias: torch.Tensor | None, dropout: torch.Tensor | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One key tile's (dQ of its rows in float32, dK, dV): q, grad_out (and their float32 copies), lse (+inf
    where a row sees no key) and delta hold the rows that see the tile, grouped (B, Hkv, G, R, ...); k_tile
    and v_tile are (B, Hkv, 1, C, d); visible, bias, dropout: the tile's, or None."""
    scores = (q32 @ k_tile.transpose(-1, -2).to(torch.float32)) * scale
    if bias is not None:
        scores = scores + bias
    p = torch.exp(scores - lse.unsqueeze(-1))
    if visible is not None:
        p = p.masked_fill(~visible, 0.0)
    grad_p = grad_out32 @ v_tile.transpose(-1, -2).to(torch.float32)
    if dropout is not None:
        grad_v = (p * dropout).to(grad_out.dtype).transpose(-1, -2) @ grad_out
        grad_p = grad_p * dropout
    else:
        grad_v = p.to(grad_out.dtype).transpose(-1, -2) @ grad_out
    grad_s = (p * (grad_p - delta.unsqueeze(-1))).to(q.dtype)
    grad_k = (grad_s.transpose(-1, -2) @ q).to(torch.float32).sum(2) * scale
    grad_q = (grad_s @ k_tile).to(torch.float32) * scale
    return grad_q, grad_k, grad_v.to(torch.float32).sum(2)


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
            warnings.warn(f"torch.compile failed for FlashAttentionTorch's backward, running it eagerly from "
                          f"now on: {type(exc).__name__}: {str(exc)[:300]}", RuntimeWarning, stacklevel=2)
            return self.fn(*args)


_backward_step = _CompiledOnCuda(_backward_key_tile)


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                       dropout_p: float = 0.0, rng_state: torch.Tensor | None = None, scale: float,
                       window_left: int = UNBOUNDED, window_right: int = UNBOUNDED, diagonal_offset: int = 0,
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       max_seqlen_q: int = 0, max_seqlen_k: int = 0, grad_lse: torch.Tensor | None = None,
                       tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dQ, dK, dV) of attention_forward's problem from its O and L, P recomputed tile by tile; grad_lse (dS =
    P (dP - D + dL)) is subtracted from D. The mask gets no gradient."""
    band = Band(window_left, window_right, diagonal_offset)
    if cu_seqlens_q is not None:
        return varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                               dropout_p=dropout_p, rng_state=rng_state, scale=scale, band=band,
                               grad_lse=grad_lse, tile_k=tile_k)  # fmt: skip
    problem = _Problem(q, k, attn_mask, band, _dropout(dropout_p, rng_state, q, k.shape[2]))
    return _backward(problem, grad_out, q, k, v, out, lse, grad_lse, scale, tile_k)


def _backward(problem: _Problem, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None, scale: float,
              tile_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    grouped_q, grouped_do = problem.grouped_queries(q), problem.grouped_queries(grad_out)
    q32, grad_out32 = grouped_q.to(torch.float32), grouped_do.to(torch.float32)
    delta = (grad_out32 * problem.grouped_queries(out).to(torch.float32)).sum(-1)
    if grad_lse is not None:
        delta = delta - problem.grouped_queries(grad_lse)
    # Rows that saw no key (L = -inf) get P = exp(S - inf) = 0.
    lse = problem.grouped_queries(lse)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    grouped_k, grouped_v = problem.grouped_keys(k), problem.grouped_keys(v)
    grad_q = torch.zeros(q32.shape, dtype=torch.float32, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for rows, cols in problem.key_tiles(tile_k):
        r, c = slice(rows.start, rows.stop), slice(cols.start, cols.stop)
        piece_q, piece_k, piece_v = _backward_step(
            grouped_q[..., r, :], q32[..., r, :], grouped_k[..., c, :], grouped_v[..., c, :],
            grouped_do[..., r, :], grad_out32[..., r, :], lse[..., r], delta[..., r], scale,
            problem.visible(rows, cols), problem.bias(rows, cols), problem.dropout_scale(rows, cols),
        )  # fmt: skip
        grad_q[..., r, :] += piece_q
        grad_k[..., c, :] = piece_k
        grad_v[..., c, :] = piece_v
    return grad_q.to(q.dtype).view(q.shape), grad_k, grad_v


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(query start, query end, key start, key end) of each packed sequence."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return list(zip(starts_q, starts_q[1:], starts_k, starts_k[1:], strict=False))


def _sequence(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a packed (total, H, d) as (1, H, T, d): a view."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


def _varlen_problem(q: torch.Tensor, k: torch.Tensor, sequence: tuple[int, int, int, int], band: Band,
                    dropout_p: float, rng_state: torch.Tensor | None,
                    max_seqlen_k: int) -> _Problem:  # fmt: skip
    """One sequence's problem, its dropout counters those of Dropout.packed."""
    q_start, q_end, k_start, k_end = sequence
    q_seq, k_seq = _sequence(q, q_start, q_end), _sequence(k, k_start, k_end)
    dropout = None
    if dropout_p > 0.0:
        check_rng(dropout_p, rng_state)
        dropout = Dropout.packed(dropout_p, rng_state, q.shape[0], max_seqlen_k, q_start)
    return _Problem(q_seq, k_seq, None, band, dropout)


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, dropout_p: float,
                   rng_state: torch.Tensor | None, scale: float, band: Band,
                   tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O (total_q, Hq, d), L (total_q, Hq)) of packed sequences, each as attention_forward of it alone."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for sequence in _sequences(cu_seqlens_q, cu_seqlens_k):
        q_start, q_end, k_start, k_end = sequence
        if q_end == q_start or k_end == k_start:
            continue
        problem = _varlen_problem(q, k, sequence, band, dropout_p, rng_state, max_seqlen_k)
        out_seq, lse_seq = _forward(problem, _sequence(q, q_start, q_end), _sequence(k, k_start, k_end),
                                    _sequence(v, k_start, k_end), scale, tile_k)  # fmt: skip
        out[q_start:q_end] = out_seq[0].transpose(0, 1)
        lse[q_start:q_end] = lse_seq[0].transpose(0, 1)
    return out, lse


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, dropout_p: float,
                    rng_state: torch.Tensor | None, scale: float, band: Band,
                    grad_lse: torch.Tensor | None = None, tile_k: int = TILE_K,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dQ, dK, dV), packed like q, k, v, of varlen_forward."""
    grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    for sequence in _sequences(cu_seqlens_q, cu_seqlens_k):
        q_start, q_end, k_start, k_end = sequence
        if q_end == q_start or k_end == k_start:
            continue
        problem = _varlen_problem(q, k, sequence, band, dropout_p, rng_state, max_seqlen_k)
        rows, keys = (q_start, q_end), (k_start, k_end)
        grad_lse_seq = None if grad_lse is None else grad_lse[q_start:q_end].transpose(0, 1).unsqueeze(0)
        lse_seq = lse[q_start:q_end].transpose(0, 1).unsqueeze(0)
        pieces = _backward(
            problem, _sequence(grad_out, *rows), _sequence(q, *rows), _sequence(k, *keys),
            _sequence(v, *keys), _sequence(out, *rows), lse_seq, grad_lse_seq, scale, tile_k,
        )  # fmt: skip
        for grad, piece, (start, end) in zip(grads, pieces, (rows, keys, keys), strict=True):
            grad[start:end] = piece[0].transpose(0, 1)
    return tuple(grads)


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                  tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O, L) of the Functions' problem: q (..., Tq, d), k and v (..., Tk, d), top-left causal."""
    out, lse = attention_forward(as_4d(q), as_4d(k), as_4d(v), scale=scale,
                                 window_right=0 if is_causal else UNBOUNDED, tile_k=tile_k)  # fmt: skip
    return out.view(q.shape), lse.view(q.shape[:-1])


def torch_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, is_causal: bool, scale: float,
                   tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dQ, dK, dV) of torch_forward."""
    grads = attention_backward(
        as_4d(grad_out), as_4d(q), as_4d(k), as_4d(v), as_4d(out), as_4d(lse.unsqueeze(-1))[..., 0],
        scale=scale, window_right=0 if is_causal else UNBOUNDED, tile_k=tile_k,
    )  # fmt: skip
    return tuple(g.reshape(t.shape) for g, t in zip(grads, (q, k, v), strict=True))


class FlashAttentionTorch(AttentionFunction):
    """FlashAttention-2 in PyTorch on any device: ``FlashAttentionTorch.apply(q, k, v)``, q (..., Tq, d), k
    and v (..., Tk, d) with q's leading dims and dtype."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                scale: float | None = None) -> torch.Tensor:  # fmt: skip
        scale = check_inputs(q, k, v, is_causal, scale)
        out, lse = torch_forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:  # fmt: skip
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch_backward(q, k, v, out, lse, grad_out, ctx.is_causal, ctx.scale)
        return grad_q, grad_k, grad_v, None, None


def _reference_scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:  # top-left aligned: query i sees keys j <= i
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                        scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(scale * q k^T) v in q's dtype, the T x T scores in memory: for checks and baselines only."""
    return torch.softmax(_reference_scores(q, k, is_causal, scale), dim=-1) @ v


def reference_logsumexp(q: torch.Tensor, k: torch.Tensor, is_causal: bool = False,
                        scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """logsumexp of the scaled (masked) scores over the keys: the L that the forward saves."""
    return torch.logsumexp(_reference_scores(q, k, is_causal, scale), dim=-1)
