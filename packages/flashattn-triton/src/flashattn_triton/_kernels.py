"""The Triton kernels: FlashAttention-2 forward, the backward's D = rowsum(dO * O), and the backward.

Layout: every tensor is seen as (Z, H, T, d) through its four strides, so batch/head views of any
layout (a transposed (B, T, H, d), say) run without a copy. One program works on one tile of one
(z, h); the grids are one-dimensional with the tile index varying fastest, so the programs of one
head run together and share its K and V through L2.

Scores live in the log2 domain: ``qk_scale = scale * log2(e)`` folds the softmax scale and the
change of base into one multiply, so the exponentials are ``exp2``. L is stored as the natural-log
logsumexp of the scaled scores (the public contract) and turned back into log2 where it is read.

Segments: a key tile is either fully visible to a query tile (no mask computed at all) or it needs
a mask (the causal diagonal, or the ragged end of the keys). Each loop runs the unmasked tiles first
and the masked ones after, and causal tiles that are fully masked are never visited. Ragged query
rows are handled by the loads (zeros in, nothing stored) and, in the backward, by reading their L as
+inf so that their P is exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load(
    ptrs, rows, n_rows, cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """A (rows, cols) tile; out-of-range rows (when CHECK_ROWS) and padded head dims read as 0."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _store(
    ptrs, tile, rows, n_rows, cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr, HEAD_DIM: tl.constexpr
):
    if CHECK_ROWS:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))
        else:
            tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=cols[None, :] < HEAD_DIM)
        else:
            tl.store(ptrs, tile)


@triton.jit
def _load_rows(ptrs, rows, n_rows, other, CHECK_ROWS: tl.constexpr):
    if CHECK_ROWS:
        values = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        values = tl.load(ptrs)
    return values


@triton.jit
def _fwd_key_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    stride_kn,
    stride_vn,
    offs_m,
    offs_n,
    offs_d,
    lo,
    hi,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    KEY_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Online softmax over the key tiles [lo, hi); masks only when CAUSAL_MASK / KEY_MASK say so."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load(k_ptrs, cols, seqlen_k, offs_d, KEY_MASK, not EVEN_D, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if CAUSAL_MASK or KEY_MASK:
            if CAUSAL_MASK:
                visible = offs_m[:, None] >= cols[None, :]
                if KEY_MASK:
                    visible = visible & (cols[None, :] < seqlen_k)
            else:
                visible = cols[None, :] < seqlen_k
            # Every row sees key 0 in the first tile it visits, so m_new is finite and the
            # masked entries become exp2(-inf) = 0, never NaN.
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_ptrs, cols, seqlen_k, offs_d, KEY_MASK, not EVEN_D, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q,
    K,
    V,
    Out,
    L,
    stride_qz,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kz,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vz,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_oz,
    stride_oh,
    stride_om,
    stride_od,
    num_heads,
    seqlen_q,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """One program per (query tile, z*h): O and L for BLOCK_M query rows. Grid: (tiles * Z * H,)."""
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    num_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    tile = pid % num_tiles
    bh = pid // num_tiles
    if CAUSAL:  # the last query tiles see the most keys: start them first
        tile = num_tiles - 1 - tile
    z = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = Q + z * stride_qz + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    k_ptrs = K + z * stride_kz + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + z * stride_vz + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    q = _load(q_ptrs, offs_m, seqlen_q, offs_d, True, not EVEN_D, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        # Tile [n, n + BLOCK_N) is unmasked for every row of this tile iff n + BLOCK_N <= start_m + 1.
        unmasked_end = (tl.minimum(start_m + 1, seqlen_k) // BLOCK_N) * BLOCK_N
        masked_end = tl.minimum(start_m + BLOCK_M, seqlen_k)
    else:
        unmasked_end = (seqlen_k // BLOCK_N) * BLOCK_N
        masked_end = seqlen_k
    acc, l_i, m_i = _fwd_key_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_d,
        0,
        unmasked_end,
        seqlen_k,
        qk_scale,
        HEAD_DIM,
        BLOCK_N,
        False,
        False,
        EVEN_D,
        INPUT_PRECISION,
    )
    # The causal diagonal and the ragged end of the keys (empty for non-causal with full key tiles).
    acc, l_i, m_i = _fwd_key_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_d,
        unmasked_end,
        masked_end,
        seqlen_k,
        qk_scale,
        HEAD_DIM,
        BLOCK_N,
        CAUSAL,
        True,
        EVEN_D,
        INPUT_PRECISION,
    )

    lse = (m_i + tl.math.log2(l_i)) * _LN2
    l_ptrs = L + bh.to(tl.int64) * seqlen_q + offs_m
    tl.store(l_ptrs, lse, mask=offs_m < seqlen_q)
    o_ptrs = Out + z * stride_oz + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    out = acc / l_i[:, None]
    _store(o_ptrs, out.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_d, True, not EVEN_D, HEAD_DIM)


@triton.jit
def attn_bwd_preprocess(
    Out,
    DO,
    Delta,
    stride_oz,
    stride_oh,
    stride_om,
    stride_od,
    stride_doz,
    stride_doh,
    stride_dom,
    stride_dod,
    num_heads,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Delta = rowsum(dO * O) in float32. Grid: (Z * H, query tiles)."""
    bh = tl.program_id(0)
    z = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load(
        Out + z * stride_oz + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        offs_m,
        seqlen_q,
        offs_d,
        True,
        BLOCK_D != HEAD_DIM,
        HEAD_DIM,
    )
    do = _load(
        DO + z * stride_doz + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
        offs_m,
        seqlen_q,
        offs_d,
        True,
        BLOCK_D != HEAD_DIM,
        HEAD_DIM,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _bwd_query_tiles(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    l_ptrs,
    delta_ptrs,
    dq_acc_ptrs,
    stride_qm,
    stride_dom,
    offs_n,
    offs_d,
    lo,
    hi,
    seqlen_q,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    ROW_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dK and dV of one key tile, accumulated over the query tiles [lo, hi) (transposed scores); with
    ATOMIC_DQ also this tile's share of dQ, added atomically to a float32 buffer padded to whole tiles."""
    offs_m0 = tl.arange(0, BLOCK_M)
    q_ptrs += lo * stride_qm
    do_ptrs += lo * stride_dom
    dq_acc_ptrs += lo * BLOCK_D
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m0
        q = _load(q_ptrs, rows, seqlen_q, offs_d, ROW_MASK, not EVEN_D, HEAD_DIM)
        # Rows past the end read L = +inf, so their P is exactly 0 and they add nothing.
        l2 = _load_rows(l_ptrs + rows, rows, seqlen_q, float("inf"), ROW_MASK) * _LOG2E
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - l2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        do = _load(do_ptrs, rows, seqlen_q, offs_d, ROW_MASK, not EVEN_D, HEAD_DIM)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        delta = _load_rows(delta_ptrs + rows, rows, seqlen_q, 0.0, ROW_MASK)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=INPUT_PRECISION)
            tl.atomic_add(dq_acc_ptrs, dq, sem="relaxed")
            dq_acc_ptrs += BLOCK_M * BLOCK_D
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _bwd_key_tiles(
    dq,
    q,
    do,
    l2,
    delta,
    k_ptrs,
    v_ptrs,
    stride_kn,
    stride_vn,
    offs_m,
    offs_d,
    lo,
    hi,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    KEY_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dQ of one query tile, accumulated over the key tiles [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n0
        k = _load(k_ptrs, cols, seqlen_k, offs_d, KEY_MASK, not EVEN_D, HEAD_DIM)
        v = _load(v_ptrs, cols, seqlen_k, offs_d, KEY_MASK, not EVEN_D, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - l2[:, None])
        if CAUSAL_MASK or KEY_MASK:
            if CAUSAL_MASK:
                visible = offs_m[:, None] >= cols[None, :]
                if KEY_MASK:
                    visible = visible & (cols[None, :] < seqlen_k)
            else:
                visible = cols[None, :] < seqlen_k
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def attn_bwd(
    Q,
    K,
    V,
    DO,
    L,
    Delta,
    DQ,
    DK,
    DV,
    DQ_ACC,
    stride_qz,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kz,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vz,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_doz,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dqz,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    stride_dkz,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvz,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    num_heads,
    seqlen_q,
    seqlen_k,
    dq_acc_rows,
    qk_scale,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M1: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Program i of a head computes dK, dV of key tile i (BLOCK_N1 keys) and then dQ of query tile i
    (BLOCK_M2 rows); no T x T tensor. Under causal masking key tile i has the most work when i is small
    and query tile i when i is large, so with BLOCK_N1 == BLOCK_M2 every program does about the same
    work. Grid: (max(key tiles, query tiles) * Z * H,).

    With ATOMIC_DQ the dK/dV loop also adds each dQ share into DQ_ACC (float32, zeroed, (Z * H,
    dq_acc_rows, BLOCK_D), dq_acc_rows a multiple of BLOCK_M1 >= seqlen_q) with atomics and the dQ
    phase is skipped: 5 matrix products per tile pair instead of 7, paid for in atomic traffic.
    Grid: (key tiles * Z * H,).
    """
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    if ATOMIC_DQ:
        num_tiles = tl.cdiv(seqlen_k, BLOCK_N1)
    else:
        num_tiles = tl.maximum(tl.cdiv(seqlen_k, BLOCK_N1), tl.cdiv(seqlen_q, BLOCK_M2))
    pid = tl.program_id(0)
    tile = pid % num_tiles
    bh = pid // num_tiles
    z = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + z * stride_qz + h * stride_qh
    k_base = K + z * stride_kz + h * stride_kh
    v_base = V + z * stride_vz + h * stride_vh
    do_base = DO + z * stride_doz + h * stride_doh
    l_base = L + bh.to(tl.int64) * seqlen_q
    delta_base = Delta + bh.to(tl.int64) * seqlen_q

    start_n = tile * BLOCK_N1
    if start_n < seqlen_k:
        offs_n = start_n + tl.arange(0, BLOCK_N1)
        offs_m1 = tl.arange(0, BLOCK_M1)
        k = _load(
            k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            offs_n,
            seqlen_k,
            offs_d,
            True,
            not EVEN_D,
            HEAD_DIM,
        )
        v = _load(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            offs_n,
            seqlen_k,
            offs_d,
            True,
            not EVEN_D,
            HEAD_DIM,
        )
        dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
        q_ptrs = q_base + offs_m1[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_base + offs_m1[:, None] * stride_dom + offs_d[None, :] * stride_dod
        dq_acc_ptrs = (
            DQ_ACC + bh.to(tl.int64) * dq_acc_rows * BLOCK_D + offs_m1[:, None] * BLOCK_D + offs_d[None, :]
        )
        full_end = (seqlen_q // BLOCK_M1) * BLOCK_M1
        if CAUSAL:
            # Query rows before start_n see none of these keys; tiles that start at or after
            # start_n + BLOCK_N1 - 1 see all of them.
            first = (start_n // BLOCK_M1) * BLOCK_M1
            diagonal_end = tl.cdiv(start_n + BLOCK_N1 - 1, BLOCK_M1) * BLOCK_M1
            dk, dv = _bwd_query_tiles(
                dk,
                dv,
                k,
                v,
                q_ptrs,
                do_ptrs,
                l_base,
                delta_base,
                dq_acc_ptrs,
                stride_qm,
                stride_dom,
                offs_n,
                offs_d,
                first,
                tl.minimum(diagonal_end, seqlen_q),
                seqlen_q,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_M1,
                True,
                True,
                EVEN_D,
                ATOMIC_DQ,
                INPUT_PRECISION,
            )
            unmasked_start = diagonal_end
        else:
            unmasked_start = 0
        dk, dv = _bwd_query_tiles(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            l_base,
            delta_base,
            dq_acc_ptrs,
            stride_qm,
            stride_dom,
            offs_n,
            offs_d,
            unmasked_start,
            full_end,
            seqlen_q,
            qk_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_M1,
            False,
            False,
            EVEN_D,
            ATOMIC_DQ,
            INPUT_PRECISION,
        )
        # The ragged last query tile (empty when seqlen_q % BLOCK_M1 == 0).
        dk, dv = _bwd_query_tiles(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            l_base,
            delta_base,
            dq_acc_ptrs,
            stride_qm,
            stride_dom,
            offs_n,
            offs_d,
            tl.maximum(unmasked_start, full_end),
            seqlen_q,
            seqlen_q,
            qk_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_M1,
            False,
            True,
            EVEN_D,
            ATOMIC_DQ,
            INPUT_PRECISION,
        )
        dk_ptrs = (
            DK + z * stride_dkz + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
        )
        dv_ptrs = (
            DV + z * stride_dvz + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
        )
        _store(
            dk_ptrs,
            (dk * scale).to(DK.dtype.element_ty),
            offs_n,
            seqlen_k,
            offs_d,
            True,
            not EVEN_D,
            HEAD_DIM,
        )
        _store(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, True, not EVEN_D, HEAD_DIM)

    start_m = tile * BLOCK_M2
    if not ATOMIC_DQ:
        if start_m < seqlen_q:
            offs_m = start_m + tl.arange(0, BLOCK_M2)
            offs_n2 = tl.arange(0, BLOCK_N2)
            q = _load(
                q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                offs_m,
                seqlen_q,
                offs_d,
                True,
                not EVEN_D,
                HEAD_DIM,
            )
            do = _load(
                do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                offs_m,
                seqlen_q,
                offs_d,
                True,
                not EVEN_D,
                HEAD_DIM,
            )
            l2 = _load_rows(l_base + offs_m, offs_m, seqlen_q, float("inf"), True) * _LOG2E
            delta = _load_rows(delta_base + offs_m, offs_m, seqlen_q, 0.0, True)
            dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
            k_ptrs = k_base + offs_n2[:, None] * stride_kn + offs_d[None, :] * stride_kd
            v_ptrs = v_base + offs_n2[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if CAUSAL:
                unmasked_end = (tl.minimum(start_m + 1, seqlen_k) // BLOCK_N2) * BLOCK_N2
                masked_end = tl.minimum(start_m + BLOCK_M2, seqlen_k)
            else:
                unmasked_end = (seqlen_k // BLOCK_N2) * BLOCK_N2
                masked_end = seqlen_k
            dq = _bwd_key_tiles(
                dq,
                q,
                do,
                l2,
                delta,
                k_ptrs,
                v_ptrs,
                stride_kn,
                stride_vn,
                offs_m,
                offs_d,
                0,
                unmasked_end,
                seqlen_k,
                qk_scale,
                HEAD_DIM,
                BLOCK_N2,
                False,
                False,
                EVEN_D,
                INPUT_PRECISION,
            )
            dq = _bwd_key_tiles(
                dq,
                q,
                do,
                l2,
                delta,
                k_ptrs,
                v_ptrs,
                stride_kn,
                stride_vn,
                offs_m,
                offs_d,
                unmasked_end,
                masked_end,
                seqlen_k,
                qk_scale,
                HEAD_DIM,
                BLOCK_N2,
                CAUSAL,
                True,
                EVEN_D,
                INPUT_PRECISION,
            )
            dq_ptrs = (
                DQ + z * stride_dqz + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
            )
            _store(
                dq_ptrs,
                (dq * scale).to(DQ.dtype.element_ty),
                offs_m,
                seqlen_q,
                offs_d,
                True,
                not EVEN_D,
                HEAD_DIM,
            )
