"""Portable Triton kernels for every feature of flash_attention: grouped-query attention, bands (windows,
causal masks of any alignment), bool and float masks, dropout and packed sequences (varlen).

Problem and semantics are _validation's (and torch_impl's, the reference). Tiles move through plain
pointers and strides, as in Triton's fused-attention tutorial, so that any layout runs without a copy:
a broadcast mask dimension is read with stride 0, a packed (total, H, d) tensor is a (1, H, total, d)
one whose programs start at their sequence's row.

- GQA: the program of query head h reads K/V head h // group. The dK/dV programs own one K/V head's
  key tile and loop over the group's query heads: no K/V is repeated and nothing is added atomically.
- Band: query i sees key j iff i + offset - left <= j <= i + offset + right (HAS_LEFT / HAS_RIGHT say
  which bounds exist). Each loop runs only over the tiles that intersect the band.
- Masks: loaded tile by tile (MASK: 0 none, 1 bool as uint8, 2 float added to the scores); a bool tile
  that keeps nothing is skipped before its products.
- Dropout: Philox (_kernels.kept: tl.randint4x, one call per 16 keys, a byte each) at the counter
  offset + z * stride_b + h * stride_h + row * stride_i + key // 16, keyed by the seed; the backward draws
  the same bytes (see _dropout, which computes them in PyTorch). Nothing is stored.
- Varlen: with VARLEN, sequence z spans rows cu_seqlens[z]:cu_seqlens[z + 1]; programs past its end exit.
- The backward is two launches with no atomics, so it is deterministic: dK/dV (one program per key tile
  and K/V head), then dQ (one per query tile and query head). D = rowsum(dO * O) comes in from the host.

A row that sees no key gets O = 0 and L = -inf; the backward reads such an L as +inf (P = 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashattn_triton._kernels import kept

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _sequence(cu_seqlens, z, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of sequence z: packed under VARLEN, else (0, seqlen); the first row an int64
    tensor either way (a literal 0 would be a constexpr, which has no .to)."""
    if VARLEN:
        start = tl.load(cu_seqlens + z).to(tl.int64)
        length = tl.load(cu_seqlens + z + 1) - start
    else:
        start = z.to(tl.int64) * 0
        length = seqlen
    return start, length


@triton.jit
def _key_range(start_m, seqlen_k, offset, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):  # fmt: skip
    """[lo, hi) of the key tiles that rows start_m .. start_m + BLOCK_M - 1 may see, lo a tile start."""
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(start_m + offset - left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(start_m + BLOCK_M + offset + right, seqlen_k)
    return lo, hi


@triton.jit
def _query_range(start_n, seqlen_q, offset, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):  # fmt: skip
    """[lo, hi) of the query tiles whose rows may see keys start_n .. start_n + BLOCK_N - 1."""
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:  # j <= i + offset + right
        lo = tl.maximum(start_n - offset - right, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:  # j >= i + offset - left
        hi = tl.minimum(start_n + BLOCK_N + left - offset, seqlen_q)
    return lo, hi


@triton.jit
def _unmasked_keys(start_m, lo, hi, seqlen_k, offset, left, right, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   MASK: tl.constexpr):  # fmt: skip
    """[a, b), tile starts within [lo, hi): the key tiles that every row of start_m .. start_m + BLOCK_M - 1
    sees whole (inside the band and the keys, no mask), so that they need no mask at all."""
    hi_up = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    full_lo = lo
    if HAS_LEFT:  # j >= i + offset - left for the tile's last row
        first = tl.maximum(start_m + BLOCK_M - 1 + offset - left, 0)
        full_lo = tl.maximum(tl.cdiv(first, BLOCK_N) * BLOCK_N, lo)
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_RIGHT:  # j <= i + offset + right for its first row
        full_hi = tl.minimum(tl.maximum(start_m + offset + right + 1, 0) // BLOCK_N * BLOCK_N, full_hi)
    if MASK != 0:
        full_hi = lo  # every tile reads the mask
    a = tl.minimum(full_lo, hi_up)
    return a, tl.maximum(a, tl.minimum(full_hi, hi_up))


@triton.jit
def _visible(rows, cols, seqlen_q, seqlen_k, offset, left, right, mask_ptrs, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, MASK: tl.constexpr):  # fmt: skip
    """Which (row, key) scores the band, the key range and a bool mask keep."""
    visible = (cols[None, :] < seqlen_k) & (rows[:, None] < seqlen_q)
    if HAS_LEFT:
        visible = visible & (cols[None, :] >= rows[:, None] + offset - left)
    if HAS_RIGHT:
        visible = visible & (cols[None, :] <= rows[:, None] + offset + right)
    if MASK == 1:
        visible = visible & (tl.load(mask_ptrs, mask=visible, other=0) != 0)
    return visible


@triton.jit
def _scores(q, k, visible, qk_scale, mask_ptrs, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """The tile's scores in the log2 domain (scale and float mask applied), -inf where not visible."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if MASK == 2:
        s += tl.load(mask_ptrs, mask=visible, other=0.0).to(tl.float32) * _LOG2E
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _live(visible, MASK: tl.constexpr):
    """Whether a tile needs its products: under a bool mask, whether it keeps anything (a cheap test
    before two products); else always (the loops visit only tiles that intersect the band)."""
    if MASK == 1:
        live = tl.max(visible.to(tl.int32)) > 0
    else:
        live = True
    return live


@triton.jit
def _keep(seed_ptr, row_calls, start_n, threshold, BLOCK_N: tl.constexpr):
    """Which probabilities of keys start_n .. start_n + BLOCK_N - 1 dropout keeps in the rows whose Philox
    calls start at row_calls (without the offset)."""
    seed = tl.load(seed_ptr)
    offset = tl.load(seed_ptr + 1)
    return kept(seed, offset + row_calls, start_n, threshold, BLOCK_N)


@triton.jit
def _counters(z, h, rows, stride_b, stride_h, stride_i):
    """The dropout counters (Philox calls) of key 0 in the rows (z, h, rows)."""
    return z.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows.to(tl.int64) * stride_i


@triton.jit
def _tile_ptrs(base, rows, stride_t, BLOCK_D: tl.constexpr):
    return base + rows.to(tl.int64)[:, None] * stride_t + tl.arange(0, BLOCK_D)[None, :]


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_base, v_base, mask_base, counter_base, Rng, rows, lo, hi, seqlen_q, seqlen_k,
    head_dim, stride_kt, stride_vt, stride_mk, qk_scale, offset, left, right, threshold, dropout_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """The online softmax over the key tiles [lo, hi); the band, key range and mask applied if MASKED."""
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_ptrs = mask_base + cols.to(tl.int64)[None, :] * stride_mk
        if MASKED:
            visible = _visible(rows, cols, seqlen_q, seqlen_k, offset, left, right, mask_ptrs, HAS_LEFT,
                               HAS_RIGHT, MASK)  # fmt: skip
            live = _live(visible, MASK)
        else:
            live = True
        if live:
            in_keys = (cols[:, None] < seqlen_k) & (dims[None, :] < head_dim)
            k = tl.load(_tile_ptrs(k_base, cols, stride_kt, BLOCK_D), mask=in_keys, other=0.0)
            if MASKED:
                s = _scores(q, k, visible, qk_scale, mask_ptrs, MASK, INPUT_PRECISION)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen no key yet keep m = -inf: subtract 0 there, so that exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:
                keep = _keep(Rng, counter_base, start_n, threshold, BLOCK_N)
                p = tl.where(keep, p * dropout_scale, 0.0)
            v = tl.load(_tile_ptrs(v_base, cols, stride_vt, BLOCK_D), mask=in_keys, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, Out, L, Mask, Rng, CuSeqlensQ, CuSeqlensK,
    stride_qz, stride_qh, stride_qt, stride_kz, stride_kh, stride_kt, stride_vz, stride_vh, stride_vt,
    stride_oz, stride_oh, stride_ot, stride_lz, stride_lh, stride_lt,
    stride_mz, stride_mh, stride_mq, stride_mk,
    heads, group, seqlen_q, seqlen_k, head_dim, qk_scale, offset, left, right,
    threshold, dropout_scale, stride_db, stride_dh, stride_di,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """O and L of BLOCK_M query rows of one (z, query head). Grid: (query tiles, Z * Hq)."""
    z = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    q_start, seqlen_q = _sequence(CuSeqlensQ, z, seqlen_q, VARLEN)
    k_start, seqlen_k = _sequence(CuSeqlensK, z, seqlen_k, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= seqlen_q:
        return
    kv_head = h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_base = Q + z.to(tl.int64) * stride_qz + h * stride_qh + q_start.to(tl.int64) * stride_qt
    k_base = K + z.to(tl.int64) * stride_kz + kv_head * stride_kh + k_start.to(tl.int64) * stride_kt
    v_base = V + z.to(tl.int64) * stride_vz + kv_head * stride_vh + k_start.to(tl.int64) * stride_vt
    mask_base = Mask + z.to(tl.int64) * stride_mz + h * stride_mh + rows.to(tl.int64)[:, None] * stride_mq
    counter_base = _counters(z, h, q_start + rows, stride_db, stride_dh, stride_di)
    in_rows = (rows[:, None] < seqlen_q) & (dims[None, :] < head_dim)
    q = tl.load(_tile_ptrs(q_base, rows, stride_qt, BLOCK_D), mask=in_rows, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _key_range(start_m, seqlen_k, offset, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    a, b = _unmasked_keys(start_m, lo, hi, seqlen_k, offset, left, right, BLOCK_M, BLOCK_N, HAS_LEFT,
                          HAS_RIGHT, MASK)  # fmt: skip
    # Masked tiles before the unmasked ones (the band's left edge), the unmasked, masked after (its right
    # edge, the ragged end of the keys).
    for segment in tl.static_range(3):
        if segment == 0:
            seg_lo, seg_hi = lo, a
        elif segment == 1:
            seg_lo, seg_hi = a, b
        else:
            seg_lo, seg_hi = b, hi
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, mask_base, counter_base, Rng, rows, seg_lo, seg_hi, seqlen_q,
            seqlen_k, head_dim, stride_kt, stride_vt, stride_mk, qk_scale, offset, left, right, threshold,
            dropout_scale, BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, MASK, DROPOUT, INPUT_PRECISION,
            segment != 1,
        )  # fmt: skip
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    o_base = Out + z.to(tl.int64) * stride_oz + h * stride_oh + q_start.to(tl.int64) * stride_ot
    tl.store(_tile_ptrs(o_base, rows, stride_ot, BLOCK_D), out.to(Out.dtype.element_ty), mask=in_rows)
    l_base = L + z.to(tl.int64) * stride_lz + h * stride_lh + q_start.to(tl.int64) * stride_lt
    tl.store(l_base + rows.to(tl.int64) * stride_lt, lse, mask=rows < seqlen_q)


@triton.jit
def _row_stats(L, Delta, z, h, q_start, rows, seqlen_q, stride_lz, stride_lh, stride_lt):
    """log2-domain L (+inf for rows that see no key or lie past the end: P = 0 there) and D of the rows."""
    offs = z.to(tl.int64) * stride_lz + h * stride_lh + (q_start + rows).to(tl.int64) * stride_lt
    in_rows = rows < seqlen_q
    lse = tl.load(L + offs, mask=in_rows, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    delta = tl.load(Delta + offs, mask=in_rows, other=0.0)
    return lse2, delta


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_base, do_base, mask_base, counter_base, Rng, L, Delta, z, h, q_start, start_n, cols, lo,
    hi, seqlen_q, seqlen_k, head_dim, stride_qt, stride_dot, stride_mq, stride_lz, stride_lh, stride_lt,
    qk_scale, offset, left, right, threshold, dropout_scale, stride_di, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key tile accumulated over query head h's tiles [lo, hi)."""
    offs_m = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        mask_ptrs = mask_base + rows.to(tl.int64)[:, None] * stride_mq
        visible = _visible(rows, cols, seqlen_q, seqlen_k, offset, left, right, mask_ptrs, HAS_LEFT,
                           HAS_RIGHT, MASK)  # fmt: skip
        if _live(visible, MASK):
            in_rows = (rows[:, None] < seqlen_q) & (dims[None, :] < head_dim)
            q = tl.load(_tile_ptrs(q_base, rows, stride_qt, BLOCK_D), mask=in_rows, other=0.0)
            do = tl.load(_tile_ptrs(do_base, rows, stride_dot, BLOCK_D), mask=in_rows, other=0.0)
            lse2, delta = _row_stats(L, Delta, z, h, q_start, rows, seqlen_q, stride_lz, stride_lh, stride_lt)
            s = _scores(q, k, visible, qk_scale, mask_ptrs, MASK, INPUT_PRECISION)
            p = tl.math.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            if DROPOUT:
                row_calls = counter_base + (q_start + rows).to(tl.int64) * stride_di
                keep = _keep(Rng, row_calls, start_n, threshold, BLOCK_N)
                p_dropped = tl.where(keep, p * dropout_scale, 0.0)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            else:
                p_dropped = p
            dv = tl.dot(tl.trans(p_dropped.to(do.dtype)), do, dv, input_precision=INPUT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_base, v_base, mask_base, counter_base, Rng, rows, lo, hi, seqlen_q, seqlen_k,
    head_dim, stride_kt, stride_vt, stride_mk, qk_scale, offset, left, right, threshold, dropout_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile accumulated over the key tiles [lo, hi); masks if MASKED."""
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_ptrs = mask_base + cols.to(tl.int64)[None, :] * stride_mk
        if MASKED:
            visible = _visible(rows, cols, seqlen_q, seqlen_k, offset, left, right, mask_ptrs, HAS_LEFT,
                               HAS_RIGHT, MASK)  # fmt: skip
            live = _live(visible, MASK)
        else:
            live = True
        if live:
            in_keys = (cols[:, None] < seqlen_k) & (dims[None, :] < head_dim)
            k = tl.load(_tile_ptrs(k_base, cols, stride_kt, BLOCK_D), mask=in_keys, other=0.0)
            v = tl.load(_tile_ptrs(v_base, cols, stride_vt, BLOCK_D), mask=in_keys, other=0.0)
            if MASKED:
                s = _scores(q, k, visible, qk_scale, mask_ptrs, MASK, INPUT_PRECISION)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
            p = tl.math.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            if DROPOUT:
                keep = _keep(Rng, counter_base, start_n, threshold, BLOCK_N)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, L, Delta, DK, DV, Mask, Rng, CuSeqlensQ, CuSeqlensK,
    stride_qz, stride_qh, stride_qt, stride_kz, stride_kh, stride_kt, stride_vz, stride_vh, stride_vt,
    stride_doz, stride_doh, stride_dot, stride_lz, stride_lh, stride_lt,
    stride_dkz, stride_dkh, stride_dkt, stride_dvz, stride_dvh, stride_dvt,
    stride_mz, stride_mh, stride_mq, stride_mk,
    kv_heads, group, seqlen_q, seqlen_k, head_dim, qk_scale, scale, offset, left, right,
    threshold, dropout_scale, stride_db, stride_dh, stride_di,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dK and dV of BLOCK_N keys of one (z, K/V head), summed over the group's query heads, stepping
    through the query rows that see them BLOCK_M at a time. Grid: (key tiles, Z * Hkv)."""
    z = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    q_start, seqlen_q = _sequence(CuSeqlensQ, z, seqlen_q, VARLEN)
    k_start, seqlen_k = _sequence(CuSeqlensK, z, seqlen_k, VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= seqlen_k:
        return
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    in_keys = (cols[:, None] < seqlen_k) & (dims[None, :] < head_dim)
    k_base = K + z.to(tl.int64) * stride_kz + kv_head * stride_kh + k_start.to(tl.int64) * stride_kt
    v_base = V + z.to(tl.int64) * stride_vz + kv_head * stride_vh + k_start.to(tl.int64) * stride_vt
    k = tl.load(_tile_ptrs(k_base, cols, stride_kt, BLOCK_D), mask=in_keys, other=0.0)
    v = tl.load(_tile_ptrs(v_base, cols, stride_vt, BLOCK_D), mask=in_keys, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, hi = _query_range(start_n, seqlen_q, offset, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for g in range(group):
        h = kv_head * group + g
        q_base = Q + z.to(tl.int64) * stride_qz + h * stride_qh + q_start.to(tl.int64) * stride_qt
        do_base = DO + z.to(tl.int64) * stride_doz + h * stride_doh + q_start.to(tl.int64) * stride_dot
        mask_base = Mask + z.to(tl.int64) * stride_mz + h * stride_mh + cols.to(tl.int64)[None, :] * stride_mk
        counter_base = z.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        # One loop, masked throughout: split like attn_fwd's, the three loops' registers spill (sm_90).
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, mask_base, counter_base, Rng, L, Delta, z, h, q_start, start_n,
            cols, lo, hi, seqlen_q, seqlen_k, head_dim, stride_qt, stride_dot, stride_mq, stride_lz,
            stride_lh, stride_lt, qk_scale, offset, left, right, threshold, dropout_scale, stride_di, BLOCK_M,
            BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, MASK, DROPOUT, INPUT_PRECISION,
        )  # fmt: skip
    dk_base = DK + z.to(tl.int64) * stride_dkz + kv_head * stride_dkh + k_start.to(tl.int64) * stride_dkt
    dv_base = DV + z.to(tl.int64) * stride_dvz + kv_head * stride_dvh + k_start.to(tl.int64) * stride_dvt
    dk = (dk * scale).to(DK.dtype.element_ty)
    tl.store(_tile_ptrs(dk_base, cols, stride_dkt, BLOCK_D), dk, mask=in_keys)
    tl.store(_tile_ptrs(dv_base, cols, stride_dvt, BLOCK_D), dv.to(DV.dtype.element_ty), mask=in_keys)


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, L, Delta, DQ, Mask, Rng, CuSeqlensQ, CuSeqlensK,
    stride_qz, stride_qh, stride_qt, stride_kz, stride_kh, stride_kt, stride_vz, stride_vh, stride_vt,
    stride_doz, stride_doh, stride_dot, stride_lz, stride_lh, stride_lt, stride_dqz, stride_dqh, stride_dqt,
    stride_mz, stride_mh, stride_mq, stride_mk,
    heads, group, seqlen_q, seqlen_k, head_dim, qk_scale, scale, offset, left, right,
    threshold, dropout_scale, stride_db, stride_dh, stride_di,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ of BLOCK_M query rows of one (z, query head), over the key tiles they see. Grid: (query tiles,
    Z * Hq)."""
    z = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    q_start, seqlen_q = _sequence(CuSeqlensQ, z, seqlen_q, VARLEN)
    k_start, seqlen_k = _sequence(CuSeqlensK, z, seqlen_k, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= seqlen_q:
        return
    kv_head = h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    in_rows = (rows[:, None] < seqlen_q) & (dims[None, :] < head_dim)
    q_base = Q + z.to(tl.int64) * stride_qz + h * stride_qh + q_start.to(tl.int64) * stride_qt
    do_base = DO + z.to(tl.int64) * stride_doz + h * stride_doh + q_start.to(tl.int64) * stride_dot
    k_base = K + z.to(tl.int64) * stride_kz + kv_head * stride_kh + k_start.to(tl.int64) * stride_kt
    v_base = V + z.to(tl.int64) * stride_vz + kv_head * stride_vh + k_start.to(tl.int64) * stride_vt
    mask_base = Mask + z.to(tl.int64) * stride_mz + h * stride_mh + rows.to(tl.int64)[:, None] * stride_mq
    counter_base = _counters(z, h, q_start + rows, stride_db, stride_dh, stride_di)
    q = tl.load(_tile_ptrs(q_base, rows, stride_qt, BLOCK_D), mask=in_rows, other=0.0)
    do = tl.load(_tile_ptrs(do_base, rows, stride_dot, BLOCK_D), mask=in_rows, other=0.0)
    lse2, delta = _row_stats(L, Delta, z, h, q_start, rows, seqlen_q, stride_lz, stride_lh, stride_lt)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _key_range(start_m, seqlen_k, offset, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    a, b = _unmasked_keys(start_m, lo, hi, seqlen_k, offset, left, right, BLOCK_M, BLOCK_N, HAS_LEFT,
                          HAS_RIGHT, MASK)  # fmt: skip
    for segment in tl.static_range(3):  # masked, unmasked, masked (as in attn_fwd)
        if segment == 0:
            seg_lo, seg_hi = lo, a
        elif segment == 1:
            seg_lo, seg_hi = a, b
        else:
            seg_lo, seg_hi = b, hi
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_base, v_base, mask_base, counter_base, Rng, rows, seg_lo, seg_hi,
            seqlen_q, seqlen_k, head_dim, stride_kt, stride_vt, stride_mk, qk_scale, offset, left, right,
            threshold, dropout_scale, BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, MASK, DROPOUT, INPUT_PRECISION,
            segment != 1,
        )  # fmt: skip
    dq_base = DQ + z.to(tl.int64) * stride_dqz + h * stride_dqh + q_start.to(tl.int64) * stride_dqt
    dq = (dq * scale).to(DQ.dtype.element_ty)
    tl.store(_tile_ptrs(dq_base, rows, stride_dqt, BLOCK_D), dq, mask=in_rows)
