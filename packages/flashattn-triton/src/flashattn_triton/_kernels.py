"""The Triton kernels: FlashAttention-2 forward, the backward's D = rowsum(dO * O), and the backward.

Tiles move through tensor descriptors over (Z, H, T, d) views: on Hopper and later they are TMA
copies, which hold no addresses in registers and zero-fill (or, for stores, clip) whatever lies
outside the tensor, so ragged sequence ends and a head dim padded up to BLOCK_D need no load masks.
The host passes descriptors it built (Hopper and later, and the interpreter) or plain pointers to
contiguous tensors, from which the kernels build device-side descriptors (older GPUs, where Triton
lowers them to ordinary loads).

One program works on one tile of one (z, h). The grids are one-dimensional with the tile index
varying fastest, so the programs of one head run together and share its K and V through L2.

Scores live in the log2 domain: ``qk_scale = scale * log2(e)`` folds the softmax scale and the
change of base into one multiply, so the exponentials are ``exp2``. L is stored as the natural-log
logsumexp of the scaled scores (the public contract) and turned back into log2 where it is read.

Segments: a key tile is either fully visible to a query tile (no mask computed at all) or it needs
a mask (the causal diagonal, or the ragged end of the keys). Each loop runs the unmasked tiles first
and the masked ones after, and causal tiles that are fully masked are never visited. Ragged query
rows load as zeros, are never stored, and in the backward read L = +inf so that their P is exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _descriptor(arg, batch, heads, seqlen, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """arg itself if the host passed a descriptor, else one over the contiguous (Z, H, T, d) at arg."""
    if isinstance(arg, tl.tensor_descriptor):
        return arg
    else:
        row = head_dim.to(tl.int64)
        return tl.make_tensor_descriptor(
            arg,
            shape=[batch, heads, seqlen, head_dim],
            strides=[heads * seqlen * row, seqlen * row, row, 1],
            block_shape=[1, 1, BLOCK_T, BLOCK_D],
        )


@triton.jit
def _load_tile(desc, z, h, row, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    return desc.load([z, h, row, 0]).reshape(BLOCK_T, BLOCK_D)


@triton.jit
def _store_tile(desc, z, h, row, tile, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    desc.store([z, h, row, 0], tile.reshape(1, 1, BLOCK_T, BLOCK_D))


@triton.jit
def _add_tile(acc, bh, z, h, rows_per_head, row, tile, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """acc[z, h, row:row + BLOCK_T] += tile atomically: one TMA reduction if the host passed a
    descriptor (Hopper), else element atomics into the contiguous float32 (Z * H, rows, BLOCK_D) at acc."""
    if isinstance(acc, tl.tensor_descriptor):
        acc.atomic_add([z, h, row, 0], tile.reshape(1, 1, BLOCK_T, BLOCK_D))
    else:
        offs = (row + tl.arange(0, BLOCK_T))[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        tl.atomic_add(acc + bh.to(tl.int64) * rows_per_head * BLOCK_D + offs, tile, sem="relaxed")


@triton.jit
def _load_rows(ptrs, rows, n_rows, other, CHECK_ROWS: tl.constexpr):
    if CHECK_ROWS:
        values = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        values = tl.load(ptrs)
    return values


@triton.jit
def _visible(rows, cols, seqlen_k, CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr):
    """Which (row, col) scores the masks keep: key <= query under CAUSAL_MASK, key < seqlen_k under
    KEY_MASK (at least one of them is set)."""
    if CAUSAL_MASK:
        visible = rows[:, None] >= cols[None, :]
        if KEY_MASK:
            visible = visible & (cols[None, :] < seqlen_k)
    else:
        visible = cols[None, :] < seqlen_k
    return visible


@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, q, k_desc, v_desc, z, h, offs_m, lo, hi, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key tiles [lo, hi); masks only when CAUSAL_MASK / KEY_MASK say so."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_tile(k_desc, z, h, start_n, BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if CAUSAL_MASK or KEY_MASK:
            visible = _visible(offs_m, start_n + offs_n, seqlen_k, CAUSAL_MASK, KEY_MASK)
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
        v = _load_tile(v_desc, z, h, start_n, BLOCK_N, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, Out, L, batch, heads, seqlen_q, seqlen_k, head_dim, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, z*h): O and L for BLOCK_M query rows. Grid: (tiles * Z * H,)."""
    num_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    tile = pid % num_tiles
    bh = pid // num_tiles
    if CAUSAL:  # the last query tiles see the most keys: start them first
        tile = num_tiles - 1 - tile
    z = bh // heads
    h = bh % heads
    q_desc = _descriptor(Q, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D)
    k_desc = _descriptor(K, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D)
    v_desc = _descriptor(V, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D)
    o_desc = _descriptor(Out, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D)
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(q_desc, z, h, start_m, BLOCK_M, BLOCK_D)

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
        acc, l_i, m_i, q, k_desc, v_desc, z, h, offs_m, 0, unmasked_end, seqlen_k, qk_scale,
        BLOCK_N, BLOCK_D, False, False, INPUT_PRECISION,
    )  # fmt: skip
    # The causal diagonal and the ragged end of the keys (empty for non-causal with full key tiles).
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, q, k_desc, v_desc, z, h, offs_m, unmasked_end, masked_end, seqlen_k, qk_scale,
        BLOCK_N, BLOCK_D, CAUSAL, True, INPUT_PRECISION,
    )  # fmt: skip

    lse = (m_i + tl.math.log2(l_i)) * _LN2
    tl.store(L + bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    _store_tile(o_desc, z, h, start_m, (acc / l_i[:, None]).to(q.dtype), BLOCK_M, BLOCK_D)


@triton.jit
def attn_bwd_preprocess(
    Out, DO, Delta, stride_oz, stride_oh, stride_om, stride_dz, stride_dh, stride_dm,
    heads, seqlen_q, head_dim,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Delta = rowsum(dO * O) in float32 (unit stride along d). Grid: (Z * H, query tiles)."""
    bh = tl.program_id(0)
    z = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(Out + z * stride_oz + h * stride_oh + rows * stride_om + offs_d[None, :], mask=mask)
    do = tl.load(DO + z * stride_dz + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=mask)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _bwd_query_tiles(
    dk, dv, k, v, k_dq, q_desc, do_desc, bh, z, h, l_ptrs, delta_ptrs, dq_acc, dq_acc_rows, offs_n, lo, hi,
    seqlen_q, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, ROW_MASK: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key tile, accumulated over the query tiles [lo, hi) (transposed scores); with
    ATOMIC_DQ also this tile's share of dQ (dS K_dq, with K_dq = scale * K), added atomically to a
    float32 buffer padded to whole tiles."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m0
        q = _load_tile(q_desc, z, h, start_m, BLOCK_M, BLOCK_D)
        # Rows past the end read L = +inf, so their P is exactly 0 and they add nothing.
        l2 = _load_rows(l_ptrs + rows, rows, seqlen_q, float("inf"), ROW_MASK) * _LOG2E
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - l2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        do = _load_tile(do_desc, z, h, start_m, BLOCK_M, BLOCK_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        delta = _load_rows(delta_ptrs + rows, rows, seqlen_q, 0.0, ROW_MASK)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k_dq, input_precision=INPUT_PRECISION)
            _add_tile(dq_acc, bh, z, h, dq_acc_rows, start_m, dq, BLOCK_M, BLOCK_D)
    return dk, dv


@triton.jit
def _bwd_key_tiles(
    dq, q, do, l2, delta, k_desc, v_desc, z, h, offs_m, lo, hi, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile, accumulated over the key tiles [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_tile(k_desc, z, h, start_n, BLOCK_N, BLOCK_D)
        v = _load_tile(v_desc, z, h, start_n, BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - l2[:, None])
        if CAUSAL_MASK or KEY_MASK:
            p = tl.where(_visible(offs_m, start_n + offs_n0, seqlen_k, CAUSAL_MASK, KEY_MASK), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def attn_bwd(
    Q_S, DO_S, K_S, V_S, Q_T, DO_T, K_T, V_T, DQ, DK, DV, L, Delta, DQ_ACC,
    batch, heads, seqlen_q, seqlen_k, head_dim, dq_acc_rows, qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program i of a head owns key tile i and query tile i, both of BLOCK_N rows: it computes dK and
    dV of its keys stepping through the queries BLOCK_M at a time, then dQ of its queries stepping
    through the keys BLOCK_M at a time; no T x T tensor. Under causal masking key tile i has the most
    work when i is small and query tile i when i is large, so every program does about the same work.
    Grid: (max(key tiles, query tiles) * Z * H,).

    With ATOMIC_DQ the dK/dV loop also adds each (already scaled) dQ share into DQ_ACC (float32,
    zeroed, (Z, H, dq_acc_rows, BLOCK_D), dq_acc_rows a multiple of BLOCK_M >= seqlen_q) and the dQ
    phase is skipped: 5 matrix products per tile pair instead of 7, paid for in reduction traffic (TMA
    reductions when DQ_ACC is a descriptor, element atomics when a pointer). Grid: (key tiles * Z * H,).

    Q_S, DO_S, K_S, V_S move tiles of BLOCK_M rows (the steps); Q_T, DO_T, K_T, V_T, DQ, DK, DV tiles
    of BLOCK_N rows (the program's own).
    """
    if ATOMIC_DQ:
        num_tiles = tl.cdiv(seqlen_k, BLOCK_N)
    else:
        num_tiles = tl.maximum(tl.cdiv(seqlen_k, BLOCK_N), tl.cdiv(seqlen_q, BLOCK_N))
    pid = tl.program_id(0)
    tile = pid % num_tiles
    bh = pid // num_tiles
    z = bh // heads
    h = bh % heads
    start = tile * BLOCK_N
    l_base = L + bh.to(tl.int64) * seqlen_q
    delta_base = Delta + bh.to(tl.int64) * seqlen_q
    q_step = _descriptor(Q_S, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D)
    do_step = _descriptor(DO_S, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D)

    if start < seqlen_k:
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_tile(_descriptor(K_T, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D), z, h, start,
                       BLOCK_N, BLOCK_D)  # fmt: skip
        v = _load_tile(_descriptor(V_T, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D), z, h, start,
                       BLOCK_N, BLOCK_D)  # fmt: skip
        if ATOMIC_DQ:  # the softmax scale of dQ, folded into its keys once instead of into every share
            k_dq = (k.to(tl.float32) * scale).to(k.dtype)
        else:
            k_dq = k
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        full_end = (seqlen_q // BLOCK_M) * BLOCK_M
        if CAUSAL:
            # Query rows before `start` see none of these keys; query tiles that begin at or after
            # start + BLOCK_N - 1 see all of them.
            first = (start // BLOCK_M) * BLOCK_M
            diagonal_end = tl.cdiv(start + BLOCK_N - 1, BLOCK_M) * BLOCK_M
            dk, dv = _bwd_query_tiles(
                dk, dv, k, v, k_dq, q_step, do_step, bh, z, h, l_base, delta_base, DQ_ACC, dq_acc_rows,
                offs_n, first, tl.minimum(diagonal_end, seqlen_q), seqlen_q, qk_scale,
                BLOCK_M, BLOCK_D, True, True, ATOMIC_DQ, INPUT_PRECISION,
            )  # fmt: skip
            unmasked_start = diagonal_end
        else:
            unmasked_start = 0
        dk, dv = _bwd_query_tiles(
            dk, dv, k, v, k_dq, q_step, do_step, bh, z, h, l_base, delta_base, DQ_ACC, dq_acc_rows, offs_n,
            unmasked_start, full_end, seqlen_q, qk_scale, BLOCK_M, BLOCK_D, False, False, ATOMIC_DQ,
            INPUT_PRECISION,
        )  # fmt: skip
        # The ragged last query tile (empty when seqlen_q % BLOCK_M == 0).
        dk, dv = _bwd_query_tiles(
            dk, dv, k, v, k_dq, q_step, do_step, bh, z, h, l_base, delta_base, DQ_ACC, dq_acc_rows, offs_n,
            tl.maximum(unmasked_start, full_end), seqlen_q, seqlen_q, qk_scale,
            BLOCK_M, BLOCK_D, False, True, ATOMIC_DQ, INPUT_PRECISION,
        )  # fmt: skip
        _store_tile(_descriptor(DK, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D), z, h, start,
                    (dk * scale).to(k.dtype), BLOCK_N, BLOCK_D)  # fmt: skip
        _store_tile(_descriptor(DV, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D), z, h, start,
                    dv.to(v.dtype), BLOCK_N, BLOCK_D)  # fmt: skip

    if not ATOMIC_DQ:
        if start < seqlen_q:
            offs_m = start + tl.arange(0, BLOCK_N)
            q_own = _descriptor(Q_T, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D)
            do_own = _descriptor(DO_T, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D)
            q = _load_tile(q_own, z, h, start, BLOCK_N, BLOCK_D)
            do = _load_tile(do_own, z, h, start, BLOCK_N, BLOCK_D)
            l2 = _load_rows(l_base + offs_m, offs_m, seqlen_q, float("inf"), True) * _LOG2E
            delta = _load_rows(delta_base + offs_m, offs_m, seqlen_q, 0.0, True)
            dq = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            k_step = _descriptor(K_S, batch, heads, seqlen_k, head_dim, BLOCK_M, BLOCK_D)
            v_step = _descriptor(V_S, batch, heads, seqlen_k, head_dim, BLOCK_M, BLOCK_D)
            if CAUSAL:
                unmasked_end = (tl.minimum(start + 1, seqlen_k) // BLOCK_M) * BLOCK_M
                masked_end = tl.minimum(start + BLOCK_N, seqlen_k)
            else:
                unmasked_end = (seqlen_k // BLOCK_M) * BLOCK_M
                masked_end = seqlen_k
            dq = _bwd_key_tiles(
                dq, q, do, l2, delta, k_step, v_step, z, h, offs_m, 0, unmasked_end, seqlen_k, qk_scale,
                BLOCK_M, BLOCK_D, False, False, INPUT_PRECISION,
            )  # fmt: skip
            dq = _bwd_key_tiles(
                dq, q, do, l2, delta, k_step, v_step, z, h, offs_m, unmasked_end, masked_end, seqlen_k,
                qk_scale, BLOCK_M, BLOCK_D, CAUSAL, True, INPUT_PRECISION,
            )  # fmt: skip
            _store_tile(_descriptor(DQ, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D), z, h, start,
                        (dq * scale).to(q.dtype), BLOCK_N, BLOCK_D)  # fmt: skip
