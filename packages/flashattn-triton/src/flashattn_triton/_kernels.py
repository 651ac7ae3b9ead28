"""The Triton kernels: FlashAttention-2 forward (and the combine of its split form), the backward's
D = rowsum(dO * O), the backward, and grouped-query attention's sums of dK and dV over each group.

Tiles move through tensor descriptors over (Z, H, T, d) views: on Hopper and later they are TMA
copies, which hold no addresses in registers and zero-fill (or, for stores, clip) whatever lies
outside the tensor, so ragged sequence ends and a head dim padded up to BLOCK_D need no load masks.
The host passes descriptors it built (Hopper and later, and the interpreter) or plain pointers to
contiguous tensors, from which the kernels build device-side descriptors (older GPUs, where Triton
lowers them to ordinary loads).

One program works on one tile of one (z, h). The grids are one-dimensional with the tile index
varying fastest, so the programs of one head run together and share its K and V through L2. Where the
query tiles are too few for the GPU, the forward splits each one's key tiles among programs (SPLIT_KV)
and a second kernel, attn_fwd_combine, weighs their partial results.

Scores live in the log2 domain: ``qk_scale = scale * log2(e)`` folds the softmax scale and the
change of base into one multiply, so the exponentials are ``exp2``. L is stored as the natural-log
logsumexp of the scaled scores (the public contract) and turned back into log2 where it is read.

float32 at full accuracy (INPUT_PRECISION "tf32x3") runs as three TF32 products per product
(3xTF32: a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi, with a_hi exactly TF32 and a_lo = a - a_hi). The host
passes each input as a pair, high parts in batches [0, Z) and remainders in [Z, 2Z) of one (2Z, H, T, d)
tensor, so that tiles reach the matrix units from shared memory like any other load; only P and dS are
split in registers. (Triton's own tf32x3 splits every operand in registers, which spills at d = 128.)
The forward's V comes transposed (see _load_value_parts); the backward can accumulate its gradients
transposed (attn_bwd's TRANSPOSED_GRADS), for the same reason.

Grouped-query attention: K and V have heads // group heads, and query head h reads K/V head h // group.
group is a runtime integer: Triton specializes an argument of 1 as a constant, so attention with as many
K/V heads as query heads compiles to the kernels it had before. The forward reads K and V in place. The
backward keeps one program per (tile, query head), its work balanced as without groups, and writes dK and
dV per query head into (Z, H, Tk, d) tensors (FlashAttention-2's "expanded" gradients), which group_sum then
sums over each group: no atomics, and no program walks a whole group's rows.

Segments: a key tile is either fully visible to a query tile (no mask computed at all) or it needs
a mask (the causal diagonal, or the ragged end of the keys). Each loop runs the unmasked tiles first
and the masked ones after, and causal tiles that are fully masked are never visited. Ragged query
rows load as zeros, are never stored, and in the backward read L = +inf so that their P is exactly 0.

Band (BAND, a sliding window): query i sees key j iff i - window_left <= j <= i + window_right, both
runtime integers (the host passes an unbounded side as the sequence length, and a causal window as
window_right = 0), so one compiled kernel serves every window; without BAND the code is compiled out.
Every loop visits only the tiles that meet the band (_band_segments): masked tiles at its lower and
upper edges, unmasked ones between them. A band's edge tile may hold no key of some of its rows, so
its online softmax keeps m = -inf for such rows and subtracts 0 instead; a row that sees no key at
all (possible only where Tq != Tk) gets O = 0 and L = -inf.

Dropout (DROPOUT, compiled out otherwise): each tile's kept mask comes from Philox at counters derived
from the (seed, offset) on the device (kept, _dropout's mapping: one tl.randint4x call per 16 adjacent
keys, a byte each), in the forward and again in the backward; nothing is stored. A row's counters are
those of its query head (z, h), with or without groups.

Packed sequences (VARLEN, compiled out otherwise): flash-attn's layout, Q (total_q, H, d), K and V (total_k,
H / group, d), sequence z the rows cu_seqlens[z] to cu_seqlens[z + 1]. The grids are those of a (B, H,
max_seqlen) problem; each program reads its sequence's bounds and returns if its tile starts past the
sequence's end. A host-built descriptor would span every sequence and zero-fill only past the last one, so
the programs build their own (_packed_descriptor): a (1, H, seqlen, d) view of the sequence's rows, strided
H * d, which TMA zero-fills and clips at the sequence's end. Every mask then works as it does at the end of
a tensor, with the sequence's lengths, and no tile reads or writes a row of the next sequence.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
# The band's bounds are not specialized on (as integers of 1 or multiples of 16 would be): one compiled
# kernel serves every window.
_WINDOW = ["window_left", "window_right"]


@triton.jit
def _strided_descriptor(arg, batch, heads, rows, cols, row_stride, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):  # fmt: skip
    """arg itself if the host passed a descriptor, else one over the (Z, H, rows, cols) at arg, its rows
    row_stride elements apart and packed otherwise, moving (BLOCK_R, BLOCK_C) tiles."""
    if isinstance(arg, tl.tensor_descriptor):
        return arg
    else:
        row = row_stride.to(tl.int64)
        return tl.make_tensor_descriptor(
            arg,
            shape=[batch, heads, rows, cols],
            strides=[heads * rows * row, rows * row, row, 1],
            block_shape=[1, 1, BLOCK_R, BLOCK_C],
        )


@triton.jit
def _descriptor(arg, batch, heads, seqlen, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """arg itself if the host passed a descriptor, else one over the contiguous (Z, H, T, d) at arg."""
    return _strided_descriptor(arg, batch, heads, seqlen, head_dim, head_dim, BLOCK_T, BLOCK_D)


@triton.jit
def _input_descriptor(arg, batch, heads, seqlen, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """_descriptor of an input, which under tf32x3 holds 2 * batch (high parts, then remainders)."""
    parts = 2 if INPUT_PRECISION == "tf32x3" else 1
    return _descriptor(arg, parts * batch, heads, seqlen, head_dim, BLOCK_T, BLOCK_D)


@triton.jit
def _value_descriptor(arg, batch, heads, seqlen, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """_input_descriptor of V in the forward. Under tf32x3, V's parts come transposed, (2 * batch, H,
    head_dim, T) with rows padded to 16 bytes, in (BLOCK_D, BLOCK_T) tiles (see _load_value_parts)."""
    if INPUT_PRECISION != "tf32x3":
        return _input_descriptor(arg, batch, heads, seqlen, head_dim, BLOCK_T, BLOCK_D, INPUT_PRECISION)
    else:
        padded = tl.cdiv(seqlen, 4) * 4
        return _strided_descriptor(arg, 2 * batch, heads, head_dim, seqlen, padded, BLOCK_D, BLOCK_T)


@triton.jit
def _packed_descriptor(arg, first_row, rows, heads, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """A descriptor over one packed sequence: the rows [first_row, first_row + rows) of the contiguous
    (total, heads, head_dim) at arg, as a (1, heads, rows, head_dim) view (row stride heads * head_dim). Built
    by the program, it zero-fills loads and clips stores at the sequence's end as a host-built one does at
    the tensor's: no tile reads or writes a row of the next sequence."""
    row = heads.to(tl.int64) * head_dim
    return tl.make_tensor_descriptor(
        arg + first_row.to(tl.int64) * row,
        shape=[1, heads, rows, head_dim],
        strides=[row, head_dim, row, 1],  # (dim 0 is never stepped along)
        block_shape=[1, 1, BLOCK_T, BLOCK_D],
    )


@triton.jit
def _rows_descriptor(arg, batch, heads, seqlen, head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                     PARTS: tl.constexpr, VARLEN: tl.constexpr, first_row):  # fmt: skip
    """_descriptor of (PARTS * batch, H, T, d) at arg (PARTS = 2 for tf32x3's inputs), or under VARLEN the
    _packed_descriptor of the sequence of seqlen rows from first_row."""
    if VARLEN:
        return _packed_descriptor(arg, first_row, seqlen, heads, head_dim, BLOCK_T, BLOCK_D)
    else:
        return _descriptor(arg, PARTS * batch, heads, seqlen, head_dim, BLOCK_T, BLOCK_D)


@triton.jit
def _sequence(CuSeqlens, z):
    """(first row, length) of packed sequence z."""
    first = tl.load(CuSeqlens + z)
    return first, tl.load(CuSeqlens + z + 1) - first


@triton.jit
def _load_tile(desc, z, h, row, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    return desc.load([z, h, row, 0]).reshape(BLOCK_T, BLOCK_D)


@triton.jit
def _load_parts(desc, z, batch, h, row, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """An input tile as (high, low) parts: under tf32x3 the two halves of the pair, else the tile twice
    (the second never used)."""
    tile = _load_tile(desc, z, h, row, BLOCK_T, BLOCK_D)
    if INPUT_PRECISION == "tf32x3":
        low = _load_tile(desc, z + batch, h, row, BLOCK_T, BLOCK_D)
    else:
        low = tile
    return tile, low


@triton.jit
def _load_value_parts(desc, z, batch, h, row, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """_load_parts of a V tile from _value_descriptor. Under tf32x3 the tiles arrive transposed and are
    used as (BLOCK_T, BLOCK_D) views with T contiguous in shared memory: TF32 wgmma takes its B operand
    only K-major, and a row-major V tile would be transposed through registers on every step."""
    if INPUT_PRECISION == "tf32x3":
        high = desc.load([z, h, 0, row]).reshape(BLOCK_D, BLOCK_T)
        low = desc.load([z + batch, h, 0, row]).reshape(BLOCK_D, BLOCK_T)
        return tl.trans(high), tl.trans(low)
    else:
        return _load_parts(desc, z, batch, h, row, BLOCK_T, BLOCK_D, INPUT_PRECISION)


@triton.jit
def _split(x, INPUT_PRECISION: tl.constexpr):
    """x as (high, low) parts: under tf32x3 high keeps x's 10 leading mantissa bits (exactly TF32) and
    low = x - high; else (x, x)."""
    if INPUT_PRECISION == "tf32x3":
        high = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        low = x - high
    else:
        high = x
        low = x
    return high, low


@triton.jit
def _whole(high, low, INPUT_PRECISION: tl.constexpr):
    """The tile that _load_parts gave as (high, low), for a product that takes it as its A operand (split
    again there). Under tf32x3 the sum in registers: Triton keeps a loaded A operand in shared memory, where
    TF32 wgmma needs it K-major (a transposed one is copied through registers first), while one that went
    through arithmetic is read from shared memory straight into the registers of the product, in the layout
    it needs; the sum holds half the registers of the parts until then."""
    if INPUT_PRECISION == "tf32x3":
        whole = high + low
    else:
        whole = high
    return whole


@triton.jit
def _dot(a, a_low, b, b_low, acc, INPUT_PRECISION: tl.constexpr):
    """a @ b (+ acc); under tf32x3 from the parts, the small products first."""
    if INPUT_PRECISION == "tf32x3":
        acc = tl.dot(a_low, b, acc, input_precision="tf32")
        acc = tl.dot(a, b_low, acc, input_precision="tf32")
        acc = tl.dot(a, b, acc, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


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
def _visible(rows, cols, seqlen_k, CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr, window_left,
             window_right, BAND_MASK: tl.constexpr):  # fmt: skip
    """Which (row, col) scores the masks keep: key <= query under CAUSAL_MASK, key < seqlen_k under
    KEY_MASK, row - window_left <= key <= row + window_right under BAND_MASK (which implies KEY_MASK; at
    least one of them is set)."""
    if BAND_MASK:
        visible = _in_band(rows[:, None], cols[None, :], window_left, window_right)
        visible = visible & (cols[None, :] < seqlen_k)
    elif CAUSAL_MASK:
        visible = rows[:, None] >= cols[None, :]
        if KEY_MASK:
            visible = visible & (cols[None, :] < seqlen_k)
    else:
        visible = cols[None, :] < seqlen_k
    return visible


@triton.jit
def _in_band(rows, cols, window_left, window_right):
    return (cols >= rows - window_left) & (cols <= rows + window_right)


@triton.jit
def _band_segments(start, size, before, after, length, BLOCK: tl.constexpr):
    """The tiles of BLOCK indices (along an axis of `length`) that the band meets for the indices [start,
    start + size) of the other axis, index x seeing [x - before, x + after]: (lo, unmasked_lo, unmasked_hi,
    hi), masked tiles in [lo, unmasked_lo) and [unmasked_hi, hi), tiles that every x sees whole in
    [unmasked_lo, unmasked_hi). Tile-aligned but for hi (and unmasked_lo where it equals hi); the loops
    over [a, b) visit the tiles that begin before b. (Operands of // stay >= 0: Triton's integer division
    truncates.)"""
    lo = tl.maximum(start - before, 0) // BLOCK * BLOCK
    hi = tl.minimum(start + size + after, length)
    unmasked_lo = tl.cdiv(tl.maximum(start + size - 1 - before, 0), BLOCK) * BLOCK
    unmasked_lo = tl.maximum(lo, tl.minimum(unmasked_lo, hi))
    unmasked_hi = tl.maximum(unmasked_lo, tl.minimum(start + 1 + after, length) // BLOCK * BLOCK)
    return lo, unmasked_lo, unmasked_hi, hi


@triton.jit
def _rng_state(Rng, DROPOUT: tl.constexpr):
    """Dropout's (seed, offset) from Rng, _dropout.draw_rng's int64 (2,) on the device (read here, never on
    the host: a CUDA graph replays the draw); zeros without DROPOUT, where Rng may be None."""
    if DROPOUT:
        seed = tl.load(Rng)
        offset = tl.load(Rng + 1)
    else:
        seed = 0
        offset = 0
    return seed, offset


@triton.jit
def kept(seed, row_calls, start_n, threshold, BLOCK_N: tl.constexpr):
    """Which probabilities of keys start_n .. start_n + BLOCK_N - 1 (start_n a multiple of 16) dropout keeps,
    (R, BLOCK_N), in the R rows whose key 0 takes its byte from the Philox call at row_calls ((R,) int64,
    the offset included): key j takes byte j % 4 of output (j // 4) % 4 of the call at row_calls + j // 16
    (tl.randint4x), and is kept iff that byte is at least threshold (0 .. 256). The mapping of _dropout,
    whose PyTorch path drops the same probabilities; the feature kernels draw theirs here too."""
    tl.static_assert(BLOCK_N % 16 == 0, "one Philox call serves 16 keys")
    calls = row_calls[:, None] + (start_n // 16 + tl.arange(0, BLOCK_N // 16))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, calls)
    # Key 16c + 4w + k takes byte k (word >> 8k & 255) of word w of call c: the words interleaved in order
    # (R, BLOCK_N // 4), then split by a broadcast shift (R, BLOCK_N // 4, 4), row-major as the keys are
    # (a shift, not two more interleaves: the mask needs no layout conversion, decisions.md#dropout-bytes).
    words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    random_bytes = (words[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
    return tl.reshape(random_bytes >= threshold, (row_calls.shape[0], BLOCK_N))


@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, q, q_low, k_desc, v_desc, z, batch, h_kv, offs_m, lo, hi, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, window_left, window_right, BAND_MASK: tl.constexpr, seed, row_calls,
    dropout_threshold, DROPOUT: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key tiles [lo, hi) of K/V head h_kv; masks only when CAUSAL_MASK / KEY_MASK
    / BAND_MASK say so. Under DROPOUT, P V takes P times the kept mask (kept, from the rows' row_calls),
    unscaled: every kept probability has the same factor 1 / (1 - p), which attn_fwd applies to O once. l
    sums P undropped: L stays the softmax's logsumexp."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k, k_low = _load_parts(k_desc, z, batch, h_kv, start_n, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        qk = _dot(q, q_low, tl.trans(k), tl.trans(k_low), None, INPUT_PRECISION)
        if CAUSAL_MASK or KEY_MASK or BAND_MASK:
            visible = _visible(offs_m, start_n + offs_n, seqlen_k, CAUSAL_MASK, KEY_MASK, window_left,
                               window_right, BAND_MASK)  # fmt: skip
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            if BAND_MASK:
                # A row may have seen no key yet (m_new = -inf): subtracting 0 instead keeps its p and
                # alpha 0, not exp2(-inf + inf) = NaN, and its m stays -inf for the tiles to come.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                # Every row sees key 0 in the first tile it visits, so m_new is finite and the
                # masked entries become exp2(-inf) = 0, never NaN.
                m_ref = m_new
            p = tl.math.exp2(qk - m_ref[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_ref = m_new
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            # A bare select, the factor left to the end: selecting p * dropout_scale, LLVM vectorizes the
            # byte compares and packs their results into bit fields (decisions.md#dropout-bare-select).
            p = tl.where(kept(seed, row_calls, start_n, dropout_threshold, BLOCK_N), p, 0.0)
        v, v_low = _load_value_parts(v_desc, z, batch, h_kv, start_n, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        p, p_low = _split(p.to(v.dtype), INPUT_PRECISION)
        acc = _dot(p, p_low, v, v_low, acc * alpha[:, None], INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_WINDOW)
def attn_fwd(
    Q, K, V, Out, L, Partials, batch, heads, group, seqlen_q, seqlen_k, head_dim, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, SPLIT_KV: tl.constexpr, window_left, window_right, BAND: tl.constexpr,
    Rng, dropout_threshold, dropout_scale, DROPOUT: tl.constexpr, CuSeqlensQ, CuSeqlensK,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, z*h): O and L for BLOCK_M query rows, against K/V head h // group.
    Grid: (tiles * Z * H,).
    Under SPLIT_KV, grid (tiles * Z * H, splits): program (i, s) walks the s-th share of the key tiles
    and stores its partial O and log2-sum-exp in Partials for attn_fwd_combine to weigh (dropout, applied
    to P before P V, leaves them weighable as they are). BAND (not with CAUSAL, which it includes as
    window_right = 0): the band of the module docstring.

    DROPOUT drops probabilities as _dropout says (Rng: its (seed, offset) tensor; the probability kept iff
    its Philox byte >= dropout_threshold, then scaled by dropout_scale = 1 / (1 - effective p)): the
    counters of row (z, h, i) start at offset + ((z * H + h) * Tq + i) * ceil(Tk / 16), those of
    Dropout.dense.

    VARLEN (packed sequences; not with SPLIT_KV, BAND or tf32x3): z is a sequence, rows cu_seqlens[z] to
    cu_seqlens[z + 1] of the packed (total, H, d) Q, Out and (total, H / group, d) K, V (CuSeqlensQ/K),
    seqlen_q and seqlen_k the longest sequences (the grid's); a program whose tile lies past its sequence's
    end returns at once. Its descriptors span its sequence alone (_packed_descriptor), so every mask below
    works with the sequence's lengths. L is (total, H); the dropout counters those of Dropout.packed: row
    (h, i) of a (1, H, total_q, max Tk) problem."""
    tl.static_assert(not (BAND and CAUSAL), "a causal band is BAND with window_right = 0")
    tl.static_assert(not (VARLEN and (SPLIT_KV or BAND or INPUT_PRECISION == "tf32x3")))
    num_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    tile = pid % num_tiles
    bh = pid // num_tiles
    if CAUSAL or BAND:  # the last query tiles see the most keys (or as many as any): start them first
        tile = num_tiles - 1 - tile
    z = bh // heads
    h = bh % heads
    h_kv = h // group  # the K/V head of this query head's group
    kv_heads = heads // group
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    calls_per_row = tl.cdiv(seqlen_k, 16)
    if VARLEN:
        first_q, seqlen_q = _sequence(CuSeqlensQ, z)
        first_k, seqlen_k = _sequence(CuSeqlensK, z)
        if start_m >= seqlen_q:
            return
        head_row = h.to(tl.int64) * tl.load(CuSeqlensQ + batch) + first_q  # this head's first counter row
        l_rows = L + (first_q + offs_m).to(tl.int64) * heads + h
        z = 0
        q_desc = _packed_descriptor(Q, first_q, seqlen_q, heads, head_dim, BLOCK_M, BLOCK_D)
        k_desc = _packed_descriptor(K, first_k, seqlen_k, kv_heads, head_dim, BLOCK_N, BLOCK_D)
        v_desc = _packed_descriptor(V, first_k, seqlen_k, kv_heads, head_dim, BLOCK_N, BLOCK_D)
        o_desc = _packed_descriptor(Out, first_q, seqlen_q, heads, head_dim, BLOCK_M, BLOCK_D)
    else:
        head_row = bh.to(tl.int64) * seqlen_q
        l_rows = L + head_row + offs_m
        q_desc = _input_descriptor(Q, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D, INPUT_PRECISION)
        k_desc = _input_descriptor(K, batch, kv_heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        v_desc = _value_descriptor(V, batch, kv_heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        if not SPLIT_KV:
            o_desc = _descriptor(Out, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D)
    q, q_low = _load_parts(q_desc, z, batch, h, start_m, BLOCK_M, BLOCK_D, INPUT_PRECISION)
    seed, rng_offset = _rng_state(Rng, DROPOUT)
    row_calls = rng_offset + (head_row + offs_m) * calls_per_row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    start_n = 0  # the unmasked tiles [start_n, unmasked_end), then the masked ones up to masked_end
    if BAND:  # and the masked tiles [band_start, band_end) at the band's lower edge
        band_start, start_n, unmasked_end, masked_end = _band_segments(
            start_m, BLOCK_M, window_left, window_right, seqlen_k, BLOCK_N)  # fmt: skip
        band_end = start_n
    elif CAUSAL:
        # Tile [n, n + BLOCK_N) is unmasked for every row of this tile iff n + BLOCK_N <= start_m + 1.
        unmasked_end = (tl.minimum(start_m + 1, seqlen_k) // BLOCK_N) * BLOCK_N
        masked_end = tl.minimum(start_m + BLOCK_M, seqlen_k)
    else:
        unmasked_end = (seqlen_k // BLOCK_N) * BLOCK_N
        masked_end = seqlen_k
    if SPLIT_KV:
        # Split s takes the unmasked tiles [s * u / S, (s + 1) * u / S) and the last split the masked ones
        # too. So a split either sees no key (l = 0) or its rows all see its first key (unmasked_end <=
        # start_m): m stays finite where the masks are applied (a band's masked tiles keep it finite
        # themselves).
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        last = split == splits - 1
        unmasked_tiles = (unmasked_end - start_n) // BLOCK_N
        if BAND:  # the lower edge, as the upper, in the last split only
            band_start = tl.where(last, band_start, band_end)
        unmasked_end = start_n + (split + 1) * unmasked_tiles // splits * BLOCK_N
        start_n += split * unmasked_tiles // splits * BLOCK_N
        masked_end = tl.where(last, masked_end, unmasked_end)
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, q, q_low, k_desc, v_desc, z, batch, h_kv, offs_m, start_n, unmasked_end, seqlen_k,
        qk_scale, BLOCK_N, BLOCK_D, False, False, INPUT_PRECISION, window_left, window_right, False, seed,
        row_calls, dropout_threshold, DROPOUT,
    )  # fmt: skip
    if BAND:
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, q, q_low, k_desc, v_desc, z, batch, h_kv, offs_m, band_start, band_end,
            seqlen_k, qk_scale, BLOCK_N, BLOCK_D, False, True, INPUT_PRECISION, window_left, window_right,
            True, seed, row_calls, dropout_threshold, DROPOUT,
        )  # fmt: skip
    # The causal diagonal (a band's upper edge) and the ragged end of the keys (empty for non-causal with
    # full key tiles).
    acc, l_i, m_i = _fwd_key_tiles(
        acc, l_i, m_i, q, q_low, k_desc, v_desc, z, batch, h_kv, offs_m, unmasked_end, masked_end, seqlen_k,
        qk_scale, BLOCK_N, BLOCK_D, CAUSAL, True, INPUT_PRECISION, window_left, window_right, BAND, seed,
        row_calls, dropout_threshold, DROPOUT,
    )  # fmt: skip

    if DROPOUT:  # the kept probabilities' factor, left out of the loops
        acc = acc * dropout_scale
    if SPLIT_KV:
        # Partials (float32): O of (splits, Z * H, tiles * BLOCK_M) rows, normalized (0 where no key was
        # seen), then each row's m + log2(l) (-inf there, which gives that split weight 0).
        partial_rows = num_tiles * BLOCK_M
        row = (split * batch * heads + bh).to(tl.int64) * partial_rows + offs_m
        offs_o = row[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        tl.store(Partials + offs_o, acc / tl.where(l_i == 0, 1.0, l_i)[:, None])
        lse_start = splits.to(tl.int64) * batch * heads * partial_rows * BLOCK_D
        tl.store(Partials + lse_start + row, m_i + tl.math.log2(l_i))
    else:
        lse = (m_i + tl.math.log2(l_i)) * _LN2
        tl.store(l_rows, lse, mask=offs_m < seqlen_q)
        if BAND or VARLEN:  # rows that saw no key (l = 0, acc = 0, lse = -inf) get O = 0
            l_i = tl.where(l_i == 0, 1.0, l_i)
        _store_tile(o_desc, z, h, start_m, (acc / l_i[:, None]).to(q.dtype), BLOCK_M, BLOCK_D)


@triton.jit
def attn_fwd_combine(
    Partials, Out, L, batch_heads, heads, seqlen_q, partial_rows, head_dim, stride_oz, stride_oh, stride_om,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """O and L of BLOCK_M rows from attn_fwd's SPLITS partials (O_s, lse_s), partial_rows a head each:
    lse = log2 sum_s 2^lse_s and O = sum_s 2^(lse_s - lse) O_s. Out: (Z, H, seqlen_q, head_dim) of any
    strides with unit stride along d (the query's layout, _inputs.output_like); L contiguous (Z, H, T).
    Grid: (tiles * Z * H,). The loops over the splits unroll, so that every split's loads are in flight at
    once: the kernel is one memory round trip long, not one a split."""
    # (batch_heads and partial_rows may arrive as constexprs: Triton specializes integer arguments of 1)
    partial_l = Partials + tl.full([], SPLITS, tl.int64) * batch_heads * partial_rows * BLOCK_D
    num_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // num_tiles
    rows = pid % num_tiles * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    in_rows = rows < seqlen_q
    # The largest lse_s of each row first: finite unless the row saw no key at all (a band's, where
    # Tq != Tk), whose weights then are exp2(-inf - 0) = 0, total 0, O 0 and L -inf.
    lse_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        partial = (s * batch_heads + bh).to(tl.int64) * partial_rows + rows
        lse_max = tl.maximum(lse_max, tl.load(partial_l + partial, mask=in_rows, other=0.0))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        partial = (s * batch_heads + bh).to(tl.int64) * partial_rows + rows
        weight = tl.math.exp2(tl.load(partial_l + partial, mask=in_rows, other=0.0) - lse_max)
        o = tl.load(Partials + partial[:, None] * BLOCK_D + cols[None, :], mask=in_rows[:, None], other=0.0)
        acc += weight[:, None] * o
        total += weight
    tl.store(L + bh.to(tl.int64) * seqlen_q + rows, (lse_max + tl.math.log2(total)) * _LN2, mask=in_rows)
    out = (acc / tl.where(total == 0, 1.0, total)[:, None]).to(Out.dtype.element_ty)
    in_tile = in_rows[:, None] & (cols < head_dim)[None, :]
    z, h = bh // heads, bh % heads
    out_rows = z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh + rows.to(tl.int64) * stride_om
    tl.store(Out + out_rows[:, None] + cols[None, :], out, mask=in_tile)


@triton.jit
def attn_bwd_preprocess(
    Out, DO, Delta, DQ_ACC, stride_oz, stride_oh, stride_om, stride_dz, stride_dh, stride_dm,
    heads, seqlen_q, head_dim, dq_acc_rows,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Delta = rowsum(dO * O) in float32 (unit stride along d), and where DQ_ACC is given (the atomic
    backward's float32 dQ sum, (Z, H, dq_acc_rows, BLOCK_D)) its rows zeroed: one pass over the rows
    instead of a fill launch of its own. Grid: (Z * H, row tiles of max(seqlen_q, dq_acc_rows))."""
    bh = tl.program_id(0)
    z = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if DQ_ACC is not None:
        zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc_rows = bh.to(tl.int64) * dq_acc_rows + offs_m[:, None]
        tl.store(DQ_ACC + acc_rows * BLOCK_D + offs_d[None, :], zeros, mask=offs_m[:, None] < dq_acc_rows)
    if tl.program_id(1) * BLOCK_M < seqlen_q:
        mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
        rows = offs_m[:, None].to(tl.int64)
        o = tl.load(Out + z * stride_oz + h * stride_oh + rows * stride_om + offs_d[None, :], mask=mask)
        do = tl.load(DO + z * stride_dz + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=mask)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(Delta + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def group_sum(
    DK, DV, DK_SUM, DV_SUM, kv_heads, seqlen, head_dim, stride_z, stride_h, stride_t, stride_kz, stride_kh,
    stride_kt, stride_vz, stride_vh, stride_vt, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grouped-query attention's dK and dV from the backward's per-query-head gradients: DK_SUM[z, j] =
    sum_g DK[z, j * GROUP + g] over the GROUP query heads that read K/V head j (and DV_SUM from DV), summed
    in float32 and rounded once (as torch.sum of 16-bit values). DK and DV (Z, H, T, d) share their strides;
    DK_SUM and DV_SUM (Z, H / GROUP, T, d) have their own (a model's (B, T, H, d) memory); unit stride along
    d throughout. Both sums in one program, every load issued before the stores. Grid: (row tiles * Z *
    H / GROUP,)."""
    num_tiles = tl.cdiv(seqlen, BLOCK_T)
    pid = tl.program_id(0)
    zj = pid // num_tiles
    z = (zj // kv_heads).to(tl.int64)
    j = (zj % kv_heads).to(tl.int64)
    rows = ((pid % num_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < seqlen) & (cols < head_dim)
    first_head = z * stride_z + j * GROUP * stride_h + rows * stride_t + cols
    dk = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        dk += tl.load(DK + first_head + g * stride_h, mask=mask).to(tl.float32)
        dv += tl.load(DV + first_head + g * stride_h, mask=mask).to(tl.float32)
    dk_rows = z * stride_kz + j * stride_kh + rows * stride_kt + cols
    dv_rows = z * stride_vz + j * stride_vh + rows * stride_vt + cols
    tl.store(DK_SUM + dk_rows, dk.to(DK_SUM.dtype.element_ty), mask=mask)
    tl.store(DV_SUM + dv_rows, dv.to(DV_SUM.dtype.element_ty), mask=mask)


@triton.jit
def _row_delta(delta_src, do, z, h, row, seqlen_q, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr, DELTA_FROM_O: tl.constexpr):  # fmt: skip
    """D of the rows [row, row + BLOCK_T): read from the preprocess's output (delta_src points at this
    head's D), or under DELTA_FROM_O computed here as rowsum(dO * O) from the dO tile in hand and O's
    (delta_src a descriptor of O; not under tf32x3, whose dO is in parts). Rows past the end get 0."""
    if DELTA_FROM_O:
        o = _load_tile(delta_src, z, h, row, BLOCK_T, BLOCK_D)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    else:
        rows = row + tl.arange(0, BLOCK_T)
        delta = _load_rows(delta_src + rows, rows, seqlen_q, 0.0, CHECK_ROWS)
    return delta


@triton.jit
def _bwd_query_tiles(
    dk, dv, k, k_low, v, v_low, k_dq, q_desc, do_desc, bh, z, batch, h, l_ptrs, delta_src, dq_acc,
    dq_acc_rows, dq_first_row, offs_n, lo, hi, seqlen_q, qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, ROW_MASK: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TRANSPOSED_GRADS: tl.constexpr, window_left, window_right, BAND_MASK: tl.constexpr, seed, head_calls,
    calls_per_row, key_start, dropout_threshold, dropout_scale, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key tile, accumulated over the query tiles [lo, hi) (transposed scores); with
    ATOMIC_DQ also this tile's share of dQ (dS K_dq, with K_dq = scale * K; under tf32x3 K_dq = K and the
    share is scaled), added atomically to a float32 buffer padded to whole tiles. With TRANSPOSED_GRADS
    dk and dv hold dKᵀ and dVᵀ (see attn_bwd). CAUSAL_MASK or BAND_MASK (at most one) mask the scores.
    Under DROPOUT the forward's mask M again (row i's counters at head_calls + i * calls_per_row, key_start
    the tile's first key): dV += (P∘M)ᵀ dO, its factor 1 / (1 - p) left to attn_bwd (as the forward's to
    O), and dS = P∘(M∘dP / (1 - p) - D)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m0
        q, q_low = _load_parts(q_desc, z, batch, h, start_m, BLOCK_M, BLOCK_D, INPUT_PRECISION)
        if TRANSPOSED_GRADS:
            q_whole = _whole(q, q_low, INPUT_PRECISION)
        # Rows past the end read L = +inf, so their P is exactly 0 and they add nothing.
        l2 = _load_rows(l_ptrs + rows, rows, seqlen_q, float("inf"), ROW_MASK) * _LOG2E
        if BAND_MASK:
            # A row that sees no key (L = -inf) may still be in the band of the keys past the end, which
            # this tile's (never stored) rows hold: read as +inf, its P is 0 there too, not inf (whose
            # dS would reach dQ through the zero rows of K as inf * 0 = NaN).
            l2 = tl.where(l2 == float("-inf"), float("inf"), l2)
        qk_t = _dot(k, k_low, tl.trans(q), tl.trans(q_low), None, INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - l2[None, :])
        if BAND_MASK:
            p_t = tl.where(_in_band(rows[None, :], offs_n[:, None], window_left, window_right), p_t, 0.0)
        elif CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        do, do_low = _load_parts(do_desc, z, batch, h, start_m, BLOCK_M, BLOCK_D, INPUT_PRECISION)
        if DROPOUT:
            row_calls = head_calls + rows.to(tl.int64) * calls_per_row
            keep_t = tl.trans(kept(seed, row_calls, key_start, dropout_threshold, BLOCK_N))
            p_high, p_low = _split(tl.where(keep_t, p_t, 0.0).to(do.dtype), INPUT_PRECISION)
        else:
            p_high, p_low = _split(p_t.to(do.dtype), INPUT_PRECISION)
        if TRANSPOSED_GRADS:  # dVᵀ += dOᵀ P
            do_t, do_t_low = _split(tl.trans(_whole(do, do_low, INPUT_PRECISION)), INPUT_PRECISION)
            dv = _dot(do_t, do_t_low, tl.trans(p_high), tl.trans(p_low), dv, INPUT_PRECISION)
        else:  # dV += Pᵀ dO
            dv = _dot(p_high, p_low, do, do_low, dv, INPUT_PRECISION)
        delta = _row_delta(delta_src, do, z, h, start_m, seqlen_q, BLOCK_M, BLOCK_D, ROW_MASK, DELTA_FROM_O)
        dp_t = _dot(v, v_low, tl.trans(do), tl.trans(do_low), None, INPUT_PRECISION)
        if DROPOUT:
            dp_t = dp_t * tl.where(keep_t, dropout_scale, 0.0)  # (the select's form: see _fwd_key_tiles)
        ds_high, ds_low = _split((p_t * (dp_t - delta[None, :])).to(q.dtype), INPUT_PRECISION)
        if TRANSPOSED_GRADS:  # dKᵀ += Qᵀ dS
            q_t, q_t_low = _split(tl.trans(q_whole), INPUT_PRECISION)
            dk = _dot(q_t, q_t_low, tl.trans(ds_high), tl.trans(ds_low), dk, INPUT_PRECISION)
        else:  # dK += dSᵀ Q
            dk = _dot(ds_high, ds_low, q, q_low, dk, INPUT_PRECISION)
        if ATOMIC_DQ:
            dq = _dot(tl.trans(ds_high), tl.trans(ds_low), k_dq, k_low, None, INPUT_PRECISION)
            if INPUT_PRECISION == "tf32x3":
                dq = dq * scale
            _add_tile(dq_acc, bh, z, h, dq_acc_rows, dq_first_row + start_m, dq, BLOCK_M, BLOCK_D)
    return dk, dv


@triton.jit
def _bwd_key_tiles(
    dq, q, q_low, do, do_low, l2, delta, k_desc, v_desc, z, batch, h_kv, offs_m, lo, hi, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TRANSPOSED_GRADS: tl.constexpr, window_left, window_right,
    BAND_MASK: tl.constexpr, seed, row_calls, dropout_threshold, dropout_scale, DROPOUT: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile (dQᵀ with TRANSPOSED_GRADS), accumulated over the key tiles [lo, hi) of K/V
    head h_kv; under DROPOUT with dS = P∘(M∘dP / (1 - p) - D), M the forward's mask (rows' counters from
    row_calls)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k, k_low = _load_parts(k_desc, z, batch, h_kv, start_n, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        if TRANSPOSED_GRADS:
            k_whole = _whole(k, k_low, INPUT_PRECISION)
        v, v_low = _load_parts(v_desc, z, batch, h_kv, start_n, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        qk = _dot(q, q_low, tl.trans(k), tl.trans(k_low), None, INPUT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - l2[:, None])
        if CAUSAL_MASK or KEY_MASK or BAND_MASK:
            visible = _visible(offs_m, start_n + offs_n0, seqlen_k, CAUSAL_MASK, KEY_MASK, window_left,
                               window_right, BAND_MASK)  # fmt: skip
            p = tl.where(visible, p, 0.0)
        dp = _dot(do, do_low, tl.trans(v), tl.trans(v_low), None, INPUT_PRECISION)
        if DROPOUT:
            dp = dp * tl.where(kept(seed, row_calls, start_n, dropout_threshold, BLOCK_N), dropout_scale, 0.0)
        ds_high, ds_low = _split((p * (dp - delta[:, None])).to(k.dtype), INPUT_PRECISION)
        if TRANSPOSED_GRADS:  # dQᵀ += Kᵀ dSᵀ
            k_t, k_t_low = _split(tl.trans(k_whole), INPUT_PRECISION)
            dq = _dot(k_t, k_t_low, tl.trans(ds_high), tl.trans(ds_low), dq, INPUT_PRECISION)
        else:  # dQ += dS K
            dq = _dot(ds_high, ds_low, k, k_low, dq, INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=_WINDOW)
def attn_bwd(
    Q_S, DO_S, K_S, V_S, Q_T, DO_T, K_T, V_T, DQ, DK, DV, L, Delta, O_S, O_T, DQ_ACC,
    batch, heads, group, seqlen_q, seqlen_k, head_dim, dq_acc_rows, qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TRANSPOSED_GRADS: tl.constexpr, PHASE: tl.constexpr, window_left, window_right, BAND: tl.constexpr,
    Rng, dropout_threshold, dropout_scale, DROPOUT: tl.constexpr, CuSeqlensQ, CuSeqlensK,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """Program i of a head owns key tile i and query tile i, both of BLOCK_N rows: it computes dK and
    dV of its keys stepping through the queries BLOCK_M at a time, then dQ of its queries stepping
    through the keys BLOCK_M at a time; no T x T tensor. Under causal masking key tile i has the most
    work when i is small and query tile i when i is large, so every program does about the same work.
    Grid: (max(key tiles, query tiles) * Z * H,).

    Programs are per query head h, reading K/V head h // group: DK and DV are (Z, H, Tk, d), each query
    head's share of its K/V head's gradients, for the host to sum over the group.

    With ATOMIC_DQ the dK/dV loop also adds each (already scaled) dQ share into DQ_ACC (float32,
    zeroed, (Z, H, dq_acc_rows, BLOCK_D), dq_acc_rows a multiple of BLOCK_M >= seqlen_q) and the dQ
    phase is skipped: 5 matrix products per tile pair instead of 7, paid for in reduction traffic (TMA
    reductions when DQ_ACC is a descriptor, element atomics when a pointer). Grid: (key tiles * Z * H,).

    D = rowsum(dO * O) comes from Delta (attn_bwd_preprocess) or, under DELTA_FROM_O, from O's tiles
    next to each dO tile (O_S, O_T; Delta unused): one launch less for small problems, whose host time
    counts more than the extra loads.

    Q_S, DO_S, K_S, V_S, O_S move tiles of BLOCK_M rows (the steps); Q_T, DO_T, K_T, V_T, O_T, DQ, DK, DV
    tiles of BLOCK_N rows (the program's own).

    TRANSPOSED_GRADS (made for tf32x3, right for any precision; not with ATOMIC_DQ) accumulates
    dKᵀ = Qᵀ dS, dVᵀ = dOᵀ P and dQᵀ = Kᵀ dSᵀ: TF32 wgmma reads a shared-memory operand only K-major, and
    dK = dSᵀ Q, dV = Pᵀ dO, dQ = dS K would take Q, dO, K as such an operand along their rows, which
    row-major tiles only give through a copy transposed in registers each step (which spills at d = 128).
    Transposed, the loaded tiles are the A operands, read into registers (_whole), and P, dS the
    shared-memory B operands, stored K-major as they are computed.

    PHASE is "both", or "dkdv" then "dq" for the two launches of a split backward (not with ATOMIC_DQ):
    ptxas then allocates each phase's registers on its own, where float32's at d = 128 share a kernel only
    with spills. The dQ launch takes the query tiles from the last (the most keys under causal masking).
    Grids: (key tiles * Z * H,) and (query tiles * Z * H,).

    BAND (not with CAUSAL): the band of the module docstring. Key tile [start, start + BLOCK_N) meets the
    query rows [start - window_right, start + BLOCK_N - 1 + window_left], query tile [start, start +
    BLOCK_N) the keys [start - window_left, start + BLOCK_N - 1 + window_right]: the loops visit only
    those tiles, masked at the band's edges.

    DROPOUT regenerates the forward's mask (attn_fwd's arguments and counters). D = rowsum(dO * O) holds
    as it is: O is the dropped output, and sum_j P_ij M_ij dP_ij / (1 - p) = dO_i . O_i.

    VARLEN: packed sequences as in attn_fwd, the grid's tiles those of the longest sequences; every tensor
    of rows is packed, (total, H, d) (DK, DV: (total_k, H, d)), L and Delta are (H, total_q), DQ_ACC is
    (1, H, dq_acc_rows, BLOCK_D) with dq_acc_rows >= total_q + BLOCK_M (the tiles past a sequence's end add
    exact zeros there: their rows read L = +inf), its rows those of the packed queries.
    """
    tl.static_assert(not (BAND and CAUSAL), "a causal band is BAND with window_right = 0")
    tl.static_assert(not (VARLEN and (BAND or INPUT_PRECISION == "tf32x3")))
    if ATOMIC_DQ or PHASE == "dkdv":
        num_tiles = tl.cdiv(seqlen_k, BLOCK_N)
    elif PHASE == "dq":
        num_tiles = tl.cdiv(seqlen_q, BLOCK_N)
    else:
        num_tiles = tl.maximum(tl.cdiv(seqlen_k, BLOCK_N), tl.cdiv(seqlen_q, BLOCK_N))
    pid = tl.program_id(0)
    tile = pid % num_tiles
    if (CAUSAL or BAND) and PHASE == "dq":
        tile = num_tiles - 1 - tile
    bh = pid // num_tiles
    z = bh // heads
    h = bh % heads
    h_kv = h // group  # the K/V head of this query head's group
    kv_heads = heads // group
    start = tile * BLOCK_N
    seed, rng_offset = _rng_state(Rng, DROPOUT)
    calls_per_row = tl.cdiv(seqlen_k, 16)
    parts = 2 if INPUT_PRECISION == "tf32x3" else 1
    if VARLEN:
        first_q, seqlen_q = _sequence(CuSeqlensQ, z)
        first_k, seqlen_k = _sequence(CuSeqlensK, z)
        if start >= tl.maximum(seqlen_q, seqlen_k):  # past both of its sequence's ends
            return
        head_row = h.to(tl.int64) * tl.load(CuSeqlensQ + batch) + first_q  # of L, Delta and the counters
        bh = h  # DQ_ACC's head
        z = 0
    else:
        first_q = 0
        first_k = 0
        head_row = bh.to(tl.int64) * seqlen_q
    l_base = L + head_row
    head_calls = rng_offset + head_row * calls_per_row
    if DELTA_FROM_O:
        delta_step = _rows_descriptor(O_S, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D,
                                      1, VARLEN, first_q)  # fmt: skip
        delta_own = _rows_descriptor(O_T, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D,
                                     1, VARLEN, first_q)  # fmt: skip
    else:
        delta_step = Delta + head_row
        delta_own = delta_step
    q_step = _rows_descriptor(Q_S, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D, parts, VARLEN, first_q)
    do_step = _rows_descriptor(DO_S, batch, heads, seqlen_q, head_dim, BLOCK_M, BLOCK_D,
                               parts, VARLEN, first_q)  # fmt: skip

    if PHASE != "dq" and start < seqlen_k:
        offs_n = start + tl.arange(0, BLOCK_N)
        k_own = _rows_descriptor(K_T, batch, kv_heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D, parts, VARLEN,
                                 first_k)  # fmt: skip
        v_own = _rows_descriptor(V_T, batch, kv_heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D, parts, VARLEN,
                                 first_k)  # fmt: skip
        k, k_low = _load_parts(k_own, z, batch, h_kv, start, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        v, v_low = _load_parts(v_own, z, batch, h_kv, start, BLOCK_N, BLOCK_D, INPUT_PRECISION)
        if ATOMIC_DQ and INPUT_PRECISION != "tf32x3":
            # The softmax scale of dQ, folded into its keys once instead of into every share.
            k_dq = (k.to(tl.float32) * scale).to(k.dtype)
        else:
            k_dq = k
        if TRANSPOSED_GRADS:
            dk = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
            dv = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
        else:
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        last = seqlen_q  # the query rows [first, last) see these keys
        if BAND:  # and those of [unmasked_start, unmasked_end) see them all
            first, unmasked_start, unmasked_end, last = _band_segments(
                start, BLOCK_N, window_right, window_left, seqlen_q, BLOCK_M)  # fmt: skip
        elif CAUSAL:  # query rows before `start` see none of these keys
            first = (start // BLOCK_M) * BLOCK_M
        else:
            first = 0
        if TRANSPOSED_GRADS:
            # One loop, masked throughout (a few selects a step): across the three loops below, ptxas
            # spills the wgmma descriptors of K and V and reloads them on every step.
            dk, dv = _bwd_query_tiles(
                dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                DQ_ACC, dq_acc_rows, first_q, offs_n, first, last, seqlen_q, qk_scale, scale, BLOCK_M,
                BLOCK_D, CAUSAL, True, ATOMIC_DQ, DELTA_FROM_O, INPUT_PRECISION, TRANSPOSED_GRADS,
                window_left, window_right, BAND, seed, head_calls, calls_per_row, start, dropout_threshold,
                dropout_scale, BLOCK_N, DROPOUT,
            )  # fmt: skip
        elif BAND:  # the unmasked query tiles, then the band's edges (either may hold the ragged last tile)
            dk, dv = _bwd_query_tiles(
                dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                DQ_ACC, dq_acc_rows, first_q, offs_n, unmasked_start, unmasked_end, seqlen_q, qk_scale, scale,
                BLOCK_M, BLOCK_D, False, False, ATOMIC_DQ, DELTA_FROM_O, INPUT_PRECISION, False, window_left,
                window_right, False, seed, head_calls, calls_per_row, start, dropout_threshold, dropout_scale,
                BLOCK_N, DROPOUT,
            )  # fmt: skip
            dk, dv = _bwd_query_tiles(
                dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                DQ_ACC, dq_acc_rows, first_q, offs_n, first, unmasked_start, seqlen_q, qk_scale, scale,
                BLOCK_M, BLOCK_D, False, True, ATOMIC_DQ, DELTA_FROM_O, INPUT_PRECISION, False, window_left,
                window_right, True, seed, head_calls, calls_per_row, start, dropout_threshold, dropout_scale,
                BLOCK_N, DROPOUT,
            )  # fmt: skip
            dk, dv = _bwd_query_tiles(
                dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                DQ_ACC, dq_acc_rows, first_q, offs_n, unmasked_end, last, seqlen_q, qk_scale, scale, BLOCK_M,
                BLOCK_D, False, True, ATOMIC_DQ, DELTA_FROM_O, INPUT_PRECISION, False, window_left,
                window_right, True, seed, head_calls, calls_per_row, start, dropout_threshold, dropout_scale,
                BLOCK_N, DROPOUT,
            )  # fmt: skip
        else:
            full_end = (seqlen_q // BLOCK_M) * BLOCK_M
            if CAUSAL:
                # Query tiles that begin at or after start + BLOCK_N - 1 see all of these keys.
                diagonal_end = tl.cdiv(start + BLOCK_N - 1, BLOCK_M) * BLOCK_M
                dk, dv = _bwd_query_tiles(
                    dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                    DQ_ACC, dq_acc_rows, first_q, offs_n, first, tl.minimum(diagonal_end, seqlen_q), seqlen_q,
                    qk_scale, scale, BLOCK_M, BLOCK_D, True, True, ATOMIC_DQ, DELTA_FROM_O, INPUT_PRECISION,
                    False, window_left, window_right, False, seed, head_calls, calls_per_row, start,
                    dropout_threshold, dropout_scale, BLOCK_N, DROPOUT,
                )  # fmt: skip
                unmasked_start = diagonal_end
            else:
                unmasked_start = 0
            dk, dv = _bwd_query_tiles(
                dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                DQ_ACC, dq_acc_rows, first_q, offs_n, unmasked_start, full_end, seqlen_q, qk_scale, scale,
                BLOCK_M, BLOCK_D, False, False, ATOMIC_DQ, DELTA_FROM_O, INPUT_PRECISION, False, window_left,
                window_right, False, seed, head_calls, calls_per_row, start, dropout_threshold, dropout_scale,
                BLOCK_N, DROPOUT,
            )  # fmt: skip
            # The ragged last query tile (empty when seqlen_q % BLOCK_M == 0).
            dk, dv = _bwd_query_tiles(
                dk, dv, k, k_low, v, v_low, k_dq, q_step, do_step, bh, z, batch, h, l_base, delta_step,
                DQ_ACC, dq_acc_rows, first_q, offs_n, tl.maximum(unmasked_start, full_end), seqlen_q,
                seqlen_q, qk_scale, scale, BLOCK_M, BLOCK_D, False, True, ATOMIC_DQ, DELTA_FROM_O,
                INPUT_PRECISION, False, window_left, window_right, False, seed, head_calls, calls_per_row,
                start, dropout_threshold, dropout_scale, BLOCK_N, DROPOUT,
            )  # fmt: skip
        if TRANSPOSED_GRADS:
            dk = tl.trans(dk)
            dv = tl.trans(dv)
        dk_desc = _rows_descriptor(DK, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D, 1, VARLEN, first_k)
        dv_desc = _rows_descriptor(DV, batch, heads, seqlen_k, head_dim, BLOCK_N, BLOCK_D, 1, VARLEN, first_k)
        _store_tile(dk_desc, z, h, start, (dk * scale).to(k.dtype), BLOCK_N, BLOCK_D)
        if DROPOUT:  # the kept probabilities' factor, left out of the loops
            dv = dv * dropout_scale
        _store_tile(dv_desc, z, h, start, dv.to(v.dtype), BLOCK_N, BLOCK_D)

    if not ATOMIC_DQ and PHASE != "dkdv":
        if start < seqlen_q:
            offs_m = start + tl.arange(0, BLOCK_N)
            q_own = _rows_descriptor(Q_T, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D, parts, VARLEN,
                                     first_q)  # fmt: skip
            do_own = _rows_descriptor(DO_T, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D, parts, VARLEN,
                                      first_q)  # fmt: skip
            q, q_low = _load_parts(q_own, z, batch, h, start, BLOCK_N, BLOCK_D, INPUT_PRECISION)
            do, do_low = _load_parts(do_own, z, batch, h, start, BLOCK_N, BLOCK_D, INPUT_PRECISION)
            l2 = _load_rows(l_base + offs_m, offs_m, seqlen_q, float("inf"), True) * _LOG2E
            delta = _row_delta(delta_own, do, z, h, start, seqlen_q, BLOCK_N, BLOCK_D, True, DELTA_FROM_O)
            if TRANSPOSED_GRADS:
                dq = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
            else:
                dq = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            k_step = _rows_descriptor(K_S, batch, kv_heads, seqlen_k, head_dim, BLOCK_M, BLOCK_D, parts,
                                      VARLEN, first_k)  # fmt: skip
            v_step = _rows_descriptor(V_S, batch, kv_heads, seqlen_k, head_dim, BLOCK_M, BLOCK_D, parts,
                                      VARLEN, first_k)  # fmt: skip
            row_calls = head_calls + offs_m.to(tl.int64) * calls_per_row
            # The keys [band_start, masked_end) meet these queries: unmasked in [unmasked_start,
            # unmasked_end), masked below it (a band's lower edge) and above (the diagonal, the ragged end).
            band_start = 0
            unmasked_start = 0
            if BAND:
                band_start, unmasked_start, unmasked_end, masked_end = _band_segments(
                    start, BLOCK_N, window_left, window_right, seqlen_k, BLOCK_M)  # fmt: skip
            elif CAUSAL:
                unmasked_end = (tl.minimum(start + 1, seqlen_k) // BLOCK_M) * BLOCK_M
                masked_end = tl.minimum(start + BLOCK_N, seqlen_k)
            else:
                unmasked_end = (seqlen_k // BLOCK_M) * BLOCK_M
                masked_end = seqlen_k
            if TRANSPOSED_GRADS:  # one loop, as for dK and dV
                dq = _bwd_key_tiles(
                    dq, q, q_low, do, do_low, l2, delta, k_step, v_step, z, batch, h_kv, offs_m, band_start,
                    masked_end, seqlen_k, qk_scale, BLOCK_M, BLOCK_D, CAUSAL, True, INPUT_PRECISION,
                    TRANSPOSED_GRADS, window_left, window_right, BAND, seed, row_calls, dropout_threshold,
                    dropout_scale, DROPOUT,
                )  # fmt: skip
            else:
                dq = _bwd_key_tiles(
                    dq, q, q_low, do, do_low, l2, delta, k_step, v_step, z, batch, h_kv, offs_m,
                    unmasked_start, unmasked_end, seqlen_k, qk_scale, BLOCK_M, BLOCK_D, False, False,
                    INPUT_PRECISION, False, window_left, window_right, False, seed, row_calls,
                    dropout_threshold, dropout_scale, DROPOUT,
                )  # fmt: skip
                if BAND:
                    dq = _bwd_key_tiles(
                        dq, q, q_low, do, do_low, l2, delta, k_step, v_step, z, batch, h_kv, offs_m,
                        band_start, unmasked_start, seqlen_k, qk_scale, BLOCK_M, BLOCK_D, False, True,
                        INPUT_PRECISION, False, window_left, window_right, True, seed, row_calls,
                        dropout_threshold, dropout_scale, DROPOUT,
                    )  # fmt: skip
                dq = _bwd_key_tiles(
                    dq, q, q_low, do, do_low, l2, delta, k_step, v_step, z, batch, h_kv, offs_m, unmasked_end,
                    masked_end, seqlen_k, qk_scale, BLOCK_M, BLOCK_D, CAUSAL, True, INPUT_PRECISION, False,
                    window_left, window_right, BAND, seed, row_calls, dropout_threshold, dropout_scale,
                    DROPOUT,
                )  # fmt: skip
            if TRANSPOSED_GRADS:
                dq = tl.trans(dq)
            dq_desc = _rows_descriptor(DQ, batch, heads, seqlen_q, head_dim, BLOCK_N, BLOCK_D,
                                       1, VARLEN, first_q)  # fmt: skip
            _store_tile(dq_desc, z, h, start, (dq * scale).to(q.dtype), BLOCK_N, BLOCK_D)


@triton.jit
def tf32_parts(
    X, Parts, heads, seqlen, head_dim, stride_xz, stride_xh, stride_xt, stride_pp, stride_pz, stride_ph,
    stride_pt, stride_pd, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The TF32 parts of a float32 X (Z, H, T, d), unit stride along d, for the tf32x3 kernels: Parts[0] =
    X with its 13 low mantissa bits cleared (exactly TF32), Parts[1] = X - Parts[0], Parts (2, Z, H, T, d)
    at any strides (a transposed copy has unit stride along T). One read and two writes, for BLOCK_T rows
    of one (z, h) a program. Grid: (row tiles * Z * H,)."""
    num_tiles = tl.cdiv(seqlen, BLOCK_T)
    pid = tl.program_id(0)
    bh = pid // num_tiles
    z = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    rows = ((pid % num_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < seqlen) & (cols < head_dim)
    x = tl.load(X + z * stride_xz + h * stride_xh + rows * stride_xt + cols, mask=mask)
    high, low = _split(x, "tf32x3")
    # An infinite x goes whole into the low part, with a high part of 0: x - high would be inf - inf =
    # NaN, which would reach every row of the products, and an inf kept in the high part would meet the
    # other operand's low part, exactly 0 wherever that operand is exactly TF32 (P = 1 at a row's
    # maximum), as 0 * inf = NaN. In the low part it meets only the other operand's high part, so that
    # the three products give what one float32 product gives (inf, or NaN against an exact 0, as SDPA's).
    infinite = tl.abs(x) == float("inf")
    low = tl.where(infinite, x, low)
    high = tl.where(infinite, 0.0, high)
    parts = Parts + z * stride_pz + h * stride_ph + rows * stride_pt + cols * stride_pd
    tl.store(parts, high, mask=mask)
    tl.store(parts + stride_pp, low, mask=mask)
