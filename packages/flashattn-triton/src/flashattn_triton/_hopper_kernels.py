"""Gluon kernels for Hopper, the forward and the backward (see _hopper, which imports this module only
where Triton has Gluon for Hopper; the import fails elsewhere)."""

from __future__ import annotations

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashattn_triton._kernels import LOG2E

_LOG2E = gl.constexpr(LOG2E)
_LN2 = gl.constexpr(0.6931471805599453)
_LOADER_WARPS = gl.constexpr(1)
_ELEMENTS = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def tiles(t: torch.Tensor, block: tuple[int, ...]) -> TensorDescriptor:
    """A TMA descriptor over a 1-D or 2-D t with unit stride along its last dim, moving `block` tiles
    through NVMMA-swizzled shared memory (the layout wgmma reads)."""
    layout = gl.NVMMASharedLayout.get_default_for(list(block), _ELEMENTS[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord : coord + block] += src (shared memory), one TMA bulk reduction. Gluon 3.6 has no
    wrapper; this is the op tl's descriptor atomic_add lowers to. Completion is tracked like a TMA
    store's: tma.store_wait(n) returns once all but the n newest have read their source."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    add = ir.DESCRIPTOR_REDUCE_KIND.ADD
    _semantic.builder.create_async_tma_reduce(add, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def mma_layout(num_warps, n):
    """wgmma accumulator layout of an [M, n] tile with every warp along M (M = 16 * num_warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def dq_layout(num_warps, block_d, consumers):
    """wgmma layout of a consumer partition's share of the dQ product [64 queries, d]: the warpgroups of all
    `consumers` partitions split d."""
    groups = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                     instr_shape=[16, block_d // (groups * consumers), 16])  # fmt: skip


@gluon.jit
def head_start(z, h, rows_per_z, rows_per_h, columns_per_h):
    """Where head (z, h) of a (Z, H, T, d) tensor starts in the matrix its descriptor moves tiles of
    (_hopper.matrix): its row and column."""
    return z * rows_per_z + h * rows_per_h, h * columns_per_h


@gluon.jit
def step_zero(i):
    """0 for every step i below 2**30, from an instruction LLVM cannot see through: a buffer of one indexed
    with it has the wgmma descriptors of its products computed in the step rather than hoisted out of the
    loop (see step)."""
    return gl.inline_asm_elementwise("shr.u32 $0, $1, 30;", "=r,r", [i], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def visible(x, queries, keys, window_left, fill, DIAG: gl.constexpr, EDGE: gl.constexpr):
    """x where the query sees the key, else fill (queries and keys broadcast against x): DIAG, keys after
    the query are hidden (a diagonal tile); EDGE, so are keys more than window_left before it (a
    sliding window's far edge)."""
    behind = queries - keys
    if DIAG:
        x = gl.where(behind >= 0, x, fill)
    if EDGE:
        x = gl.where(behind <= window_left, x, fill)
    return x


@gluon.jit
def probabilities(s, l2, key0, m0, qk_scale, window_left, KEYS: gl.constexpr, layout: gl.constexpr,
                  DIAG: gl.constexpr, EDGE: gl.constexpr):  # fmt: skip
    """P = exp2(S * qk_scale - L2) of a backward step's scores s (in layout; keys along dim KEYS: 0 for
    transposed_step's S^T, 1 for query_major_step's S), from key key0 and query row m0, masked as visible's
    DIAG and EDGE say."""
    QUERIES: gl.constexpr = 1 - KEYS
    N_KEYS: gl.constexpr = s.shape[KEYS]
    N_QUERIES: gl.constexpr = s.shape[QUERIES]
    p = gl.exp2(s * qk_scale - gl.expand_dims(l2, KEYS))
    keys = key0 + gl.arange(0, N_KEYS, layout=gl.SliceLayout(QUERIES, layout))
    queries = m0 + gl.arange(0, N_QUERIES, layout=gl.SliceLayout(KEYS, layout))
    return visible(p, gl.expand_dims(queries, KEYS), gl.expand_dims(keys, QUERIES), window_left, 0.0, DIAG,
                   EDGE)  # fmt: skip


@gluon.jit
def program_items(schedule, total, PERSISTENT: gl.constexpr, ROUNDS: gl.constexpr):
    """This program's work items: how many, and where the first is. With PERSISTENT its share of the `total`
    items: with ROUNDS in _hopper.work_schedule's rounds (round_item; `schedule` unread), else of `schedule`
    (work_schedule's int32 offsets of each program's items, then the items; the offset read once, so that
    program_item is one load a turn). Without PERSISTENT one item (a program an item)."""
    if not PERSISTENT:
        return 1, schedule
    pid = gl.program_id(0)
    if ROUNDS:
        programs = gl.num_programs(0)
        rounds = total // programs
        return rounds + (round_item(rounds, programs, pid) < total).to(gl.int32), schedule
    first = gl.load(schedule + pid)
    return gl.load(schedule + pid + 1) - first, schedule + gl.num_programs(0) + 1 + first


@gluon.jit
def round_item(k, programs, pid):
    """Program pid's k-th work item in work_schedule's rounds: round k of the tile-major order, walked
    forward in even rounds and backward in odd ones."""
    return gl.where(k % 2 == 0, k * programs + pid, (k + 1) * programs - 1 - pid)


@gluon.jit
def program_item(k, mine, PERSISTENT: gl.constexpr, ROUNDS: gl.constexpr):
    """This program's k-th work item (mine: program_items' first), or without PERSISTENT its program id. k may
    be one past the program's last item (a prefetch; the schedule is padded for the last program's)."""
    if not PERSISTENT:
        return gl.program_id(0)
    if ROUNDS:
        return round_item(k, gl.num_programs(0), gl.program_id(0))
    return gl.load(mine + k)


@gluon.jit
def work_item(item, T, ZH, window_left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HALF: gl.constexpr, PARTS: gl.constexpr):  # fmt: skip
    """Work item `item`: key tile item // ZH (tile 0 the heaviest under causal) of (z, h) = divmod(item % ZH,
    H), or part HALF of its keys cut in PARTS (a consumer partition's, attn_bwd's; the whole tile: 0 of 1).
    Returns their first key, item % ZH, the first query row lo their steps start from, their steps n (>= 1)
    and `edge`: from that step on (a window's) queries lose keys at the window's far edge."""
    KEYS: gl.constexpr = BLOCK_N // PARTS
    key0 = (item // ZH) * BLOCK_N + HALF * KEYS
    bh = item % ZH
    if CAUSAL:
        lo = (key0 // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    end = T
    FIRST: gl.constexpr = KEYS // BLOCK_M if CAUSAL else 1
    edge = (T - lo) // BLOCK_M
    if WINDOW:
        # Queries up to key0 + KEYS - 1 + window_left see the keys; from step `edge` on, a step's last
        # query no longer sees key0 (its first row past key0 + window_left - BLOCK_M + 1).
        end = gl.minimum(T, (key0 + KEYS + window_left + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        first_lossy = gl.maximum(key0 + window_left + 2 - BLOCK_M - lo, 0)
        edge = gl.maximum(gl.minimum((first_lossy + BLOCK_M - 1) // BLOCK_M, (end - lo) // BLOCK_M), FIRST)
    return key0, bh, lo, (end - lo) // BLOCK_M, edge


@gluon.jit
def item_heads(bh, H, T, group, PER_KV_HEAD: gl.constexpr):
    """The heads of work item bh's (work_item's): its batch element z, first query head h0, K/V head,
    number of query heads, and head h0's first row of L, D and dQ's sum (head h's: (z * H + h) * T). An
    item is a query head's (H of them a batch element), or with PER_KV_HEAD a K/V head's (H / group),
    through its group's query heads one after another."""
    if PER_KV_HEAD:
        kv_heads = H // group
        z = bh // kv_heads
        kv_head = bh % kv_heads
        h0 = kv_head * group
        return z, h0, kv_head, group, (z * H + h0) * T
    z = bh // H
    h = bh % H
    return z, h, h // group, 1, bh * T


@gluon.jit
def load_step(q_desc, do_desc, l_desc, dl_desc, q_ring, do_ring, l_ring, dl_ring, ready, empty, q_row, q_col,
              do_row, do_col, l_row, g, STAGES: gl.constexpr):  # fmt: skip
    """Q, dO, L and D of the program's step g (BLOCK_M rows from each row given) into ring stage
    g % STAGES, once the consumers released step g - STAGES on `empty` (its (g // STAGES)-th completion:
    parity ((g // STAGES) & 1) ^ 1, which a fresh barrier passes at once for g < STAGES); all four
    complete on that stage's `ready` barrier (one arrival plus the transaction bytes)."""
    s = g % STAGES
    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + l_desc.block_type.nbytes
                            + dl_desc.block_type.nbytes)  # fmt: skip
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], bar, q_ring.index(s))
    tma.async_copy_global_to_shared(do_desc, [do_row, do_col], bar, do_ring.index(s))
    tma.async_copy_global_to_shared(l_desc, [l_row], bar, l_ring.index(s))
    tma.async_copy_global_to_shared(dl_desc, [l_row], bar, dl_ring.index(s))


@gluon.jit
def load_item(
    k, item, base, q_desc, do_desc, l_desc, dl_desc, k_desc, v_desc, q_ring, do_ring, l_ring, dl_ring,
    k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc,
    do_zr, do_hr, do_hc, T, H, group, ZH, window_left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_M: gl.constexpr, PER_KV_HEAD: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """The loader's work for this program's k-th work item `item`, whose steps follow the
    program's `base` earlier ones: its K and V tiles into item buffer k % KV_BUFFERS (a tile of
    k_desc's keys for each of the CONSUMERS partitions: own_keys), once the consumers released that
    buffer's previous item (item k - KV_BUFFERS) on kv_empty ((k // KV_BUFFERS)-th completion, parity as
    load_step's), then the query tiles of its steps (load_step), each query head's (item_heads) in turn.
    Returns the program's steps up to the item's end."""
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = KEYS * CONSUMERS
    KV_BUFFERS: gl.constexpr = k_bufs.shape[0] // CONSUMERS
    key0, bh, lo, n, _ = work_item(item, T, ZH, window_left, CAUSAL, WINDOW, BLOCK_M, BLOCK_N, 0, 1)
    z, h0, kv_head, heads, bh_row = item_heads(bh, H, T, group, PER_KV_HEAD)
    kb = k % KV_BUFFERS
    kv_bar = kv_ready.index(kb)
    mbarrier.wait(kv_empty.index(kb), ((k // KV_BUFFERS) & 1) ^ 1)
    mbarrier.expect(kv_bar, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    k_row, k_col = head_start(z, kv_head, k_zr, k_hr, k_hc)
    v_row, v_col = head_start(z, kv_head, v_zr, v_hr, v_hc)
    for half in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [k_row + key0 + half * KEYS, k_col], kv_bar,
                                        own_keys(k_bufs, kb, half, CONSUMERS))  # fmt: skip
        tma.async_copy_global_to_shared(v_desc, [v_row + key0 + half * KEYS, v_col], kv_bar,
                                        own_keys(v_bufs, kb, half, CONSUMERS))  # fmt: skip
    for j in range(heads):
        base = load_head(q_desc, do_desc, l_desc, dl_desc, q_ring, do_ring, l_ring, dl_ring, ready, empty, z,
                         h0 + j, bh_row + j * T, lo, n, base, q_zr, q_hr, q_hc, do_zr, do_hr, do_hc, STAGES,
                         BLOCK_M)  # fmt: skip
    return base


@gluon.jit
def load_head(q_desc, do_desc, l_desc, dl_desc, q_ring, do_ring, l_ring, dl_ring, ready, empty, z, h, bh_row,
              lo, n, base, q_zr, q_hr, q_hc, do_zr, do_hr, do_hc, STAGES: gl.constexpr,
              BLOCK_M: gl.constexpr):  # fmt: skip
    """The query tiles of query head (z, h)'s n steps of a work item, from the program's step `base` on
    (load_step), its L and D rows from bh_row. Returns the program's steps up to their end."""
    q_row, q_col = head_start(z, h, q_zr, q_hr, q_hc)
    do_row, do_col = head_start(z, h, do_zr, do_hr, do_hc)
    first = lo - base * BLOCK_M  # the query rows of the program's step g: first + g * BLOCK_M
    for g in range(base, base + n):
        row = first + g * BLOCK_M
        load_step(q_desc, do_desc, l_desc, dl_desc, q_ring, do_ring, l_ring, dl_ring, ready, empty,
                  q_row + row, q_col, do_row + row, do_col, bh_row + row, g, STAGES)  # fmt: skip
    return base + n


@gluon.jit
def loader(
    schedule, q_desc, do_desc, l_desc, dl_desc, k_desc, v_desc, q_ring, do_ring, l_ring, dl_ring, k_bufs,
    v_bufs, ready, empty, kv_ready, kv_empty, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc, do_zr,
    do_hr, do_hc, T, H, group, ZH, window_left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_M: gl.constexpr, PER_KV_HEAD: gl.constexpr, PERSISTENT: gl.constexpr,
    ROUNDS: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """The loader partition: load_item for each work item of this program (program_items; each item's number
    read during the item before, as the consumers do). Its ring steps run on across items (the consumers count
    them alike), so the next item's K and V (in the other buffer) and first query tiles load while the
    consumers finish the current item."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0] * CONSUMERS
    items, mine = program_items(schedule, T // BLOCK_N * ZH, PERSISTENT, ROUNDS)
    base = gl.to_tensor(0)  # (a loop-carried int32)
    item = program_item(0, mine, PERSISTENT, ROUNDS)
    for k in range(items):
        following = program_item(k + 1, mine, PERSISTENT, ROUNDS)
        base = load_item(
            k, item, base, q_desc, do_desc, l_desc, dl_desc, k_desc, v_desc, q_ring, do_ring, l_ring,
            dl_ring, k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc,
            v_zr, v_hr, v_hc, do_zr, do_hr, do_hc, T, H, group, ZH, window_left, CAUSAL, WINDOW, STAGES,
            BLOCK_M, PER_KV_HEAD, CONSUMERS,
        )  # fmt: skip
        item = following


@gluon.constexpr_function
def idle_first_steps(half, keys, block_m, causal):
    """How many of a tile's first steps consumer partition `half` (over `keys` keys) takes idle: under causal
    those whose queries all precede its keys (consume_steps)."""
    return half * keys // block_m if causal else 0


@gluon.jit
def own_keys(bufs, kb, HALF: gl.constexpr, CONSUMERS: gl.constexpr):
    """Consumer partition HALF's keys of K or V (bufs) in item buffer kb: an item's K and V sit in CONSUMERS
    buffers, one a partition (attn_bwd)."""
    return bufs.index(kb * CONSUMERS + HALF)


@gluon.jit
def issue_scores(g, kb, k_bufs, v_bufs, q_ring, do_ring, ready, STAGES: gl.constexpr, s_layout: gl.constexpr,
                 HALF: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """Step g's S^T = K Q^T and dP^T = V dO^T (transposed_step's first products, over consumer partition
    HALF's keys of K and V's item buffer kb: own_keys), issued once its query tile has landed: stage
    g % STAGES completes once every STAGES steps, so its wait is for parity (g // STAGES) & 1."""
    if k_bufs.shape[0] > CONSUMERS:
        # kb varies between items: the descriptors of K and V, hoisted out of the loops, held registers
        # enough to spill (112 bytes with a window at d = 64)
        kb = kb + step_zero(g)
    s = g % STAGES
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    BLOCK_M: gl.constexpr = q_ring.shape[1]
    KEYS: gl.constexpr = k_bufs.shape[1]
    zero_s = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    s_t = warpgroup_mma(own_keys(k_bufs, kb, HALF, CONSUMERS), q_ring.index(s).permute((1, 0)), zero_s,
                        use_acc=False, is_async=True)  # fmt: skip
    dp_t = warpgroup_mma(own_keys(v_bufs, kb, HALF, CONSUMERS), do_ring.index(s).permute((1, 0)), zero_s,
                         use_acc=False, is_async=True)  # fmt: skip
    return s_t, dp_t


@gluon.jit
def step(
    g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready, dq_ring,
    ready, empty, dq_desc, dk, dv, scores, qk_scale, scale, window_left, DIAG: gl.constexpr,
    EDGE: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, s_layout: gl.constexpr, d_layout: gl.constexpr, q_layout: gl.constexpr,
    QUERY_MAJOR: gl.constexpr, HALF: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """The program's step g in the consumers' form: query_major_step's, or transposed_step's (scores:
    its S and dP already issued, or None)."""
    if QUERY_MAJOR:
        gl.static_assert(scores is None and CONSUMERS == 1)
        dk, dv = query_major_step(
            g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, dq_ring,
            ready, empty, dq_desc, dk, dv, qk_scale, scale, window_left, DIAG, EDGE, STAGES, BLOCK_M,
            BLOCK_N, BLOCK_D, s_layout,
        )  # fmt: skip
    else:
        dk, dv = transposed_step(
            g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
            dq_ring, ready, empty, dq_desc, dk, dv, scores, qk_scale, scale, window_left, DIAG, EDGE, STAGES,
            BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout, HALF, CONSUMERS,
        )  # fmt: skip
    return dk, dv


@gluon.jit
def transposed_step(
    g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready, dq_ring,
    ready, empty, dq_desc, dk, dv, scores, qk_scale, scale, window_left, DIAG: gl.constexpr,
    EDGE: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, s_layout: gl.constexpr, d_layout: gl.constexpr, q_layout: gl.constexpr,
    HALF: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """The program's step g, of consumer partition HALF of CONSUMERS over its keys of the tile (key0 the
    first), with the scores transposed (keys are the rows): the query tile from row first +
    g * BLOCK_M of the head, with K and V of buffer kb, masked as visible's DIAG and EDGE say; returns dK
    and dV of those keys (dK still in flight). scores: S^T and dP^T as issue_scores issued them (the item
    before's end did), or None: issued here.

    One partition over the whole tile keeps dS^T in ds_bufs[0] and computes dQ = dS K (its warpgroups
    split d). Two each write their dS^T into a buffer of step g's (paired_dq) and compute their half of d's
    columns over both halves' keys.

    Where d = BLOCK_N (d = 128 at 8 warps), dQ is computed transposed, dQ^T = K^T dS^T: its d rows split
    over the warps as the keys do, [d, BLOCK_M] in s_layout, which takes BLOCK_M = 32 (a 32-row dQ = dS K
    is below wgmma's 64 rows a warpgroup). Its operands come from K and dS^T indexed with step_zero: hoisted
    out of the loop, the 16 descriptors held 32 registers and the kernel spilled (at 64-row steps d = 128
    spills and serializes its wgmmas anyway: S, dP, dK and dV leave too few registers; see
    query_major_step)."""
    TRANSPOSED_DQ: gl.constexpr = BLOCK_D == BLOCK_N
    zero = step_zero(g)
    made_here = kb + zero  # buffer kb, its wgmma descriptors made in the step
    k_smem = k_bufs.index(made_here if k_bufs.shape[0] > 1 else kb)  # (as issue_scores's; one partition's)
    s = g % STAGES
    m0 = first + g * BLOCK_M
    dtype: gl.constexpr = k_smem.dtype
    if scores is None:
        s_t, dp_t = issue_scores(g, kb, k_bufs, v_bufs, q_ring, do_ring, ready, STAGES, s_layout, HALF,
                                 CONSUMERS)  # fmt: skip
    else:
        s_t, dp_t = scores
    q_s = q_ring.index(s)
    do_s = do_ring.index(s)
    columns: gl.constexpr = gl.SliceLayout(0, s_layout)
    l2 = l_ring.index(s).load(columns) * _LOG2E
    delta = dl_ring.index(s).load(columns)
    # In flight, oldest first: dK(g-1) (none at an item's first step), S(g), dP(g). Down to one retires
    # dK(g-1), the last reader of Q(g-1) (dV(g-1), the last reader of dO(g-1), retired in step g-1), and
    # S(g).
    s_t = warpgroup_mma_wait(num_outstanding=1, deps=[s_t])
    release_step(g, empty, STAGES)

    p_t = probabilities(s_t, l2, key0, m0, qk_scale, window_left, 0, s_layout, DIAG, EDGE)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    p_op = gl.convert_layout(p_t.to(dtype), a_layout)
    dp_t = warpgroup_mma_wait(num_outstanding=0, deps=[dp_t])
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)

    ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
    # dS^T to shared memory for the dQ product (its last reader here, dQ(g-1), retired in step g-1).
    # Writes by the generic proxy read by wgmma (async proxy): a fence by every writer, then a barrier.
    if CONSUMERS > 1:
        dq = paired_dq(g, ds_t, kb, k_bufs, ds_bufs, ds_ready, q_layout, HALF, None)
    else:
        ds_smem = ds_bufs.index(0)
        ds_smem.store(ds_t)
        fence_async_shared()
        gl.thread_barrier()
        if TRANSPOSED_DQ:
            dq = warpgroup_mma(k_bufs.index(made_here).permute((1, 0)), ds_bufs.index(zero),
                               gl.zeros([BLOCK_D, BLOCK_M], gl.float32, s_layout), use_acc=False,
                               is_async=True)  # fmt: skip
        else:
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, gl.zeros([BLOCK_M, BLOCK_D], gl.float32,
                               q_layout), use_acc=False, is_async=True)  # fmt: skip
    dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_s, dk, is_async=True)
    if CONSUMERS > 1:
        # (all retired: dK(g) left in flight too serialized every wgmma, C7512)
        dq, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dq, dk])
    else:
        # In flight: dV(g), dQ(g), dK(g). Down to one retires dV(g) and dQ(g); dK(g) runs on.
        dq = warpgroup_mma_wait(num_outstanding=1, deps=[dq])
    reduce_dq(g, dq, dq_ring, dq_desc, bh_row + m0, scale, TRANSPOSED_DQ, HALF)
    return dk, dv


@gluon.jit
def release_step(g, empty, STAGES: gl.constexpr):
    """Stage (g-1) % STAGES back to the loader, its products retired, and this partition's dQ buffer of
    step g (last read by step g-2's reduction) free: every consumer warp waits for its reductions but the
    newest, then one arrival (none at g = 0; an item's first step releases the last step of the item
    before)."""
    tma.store_wait(pendings=1)
    gl.thread_barrier()
    mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=g > 0)


@gluon.jit
def paired_dq(g, ds_t, kb, k_bufs, ds_bufs, ds_ready, q_layout: gl.constexpr, HALF: gl.constexpr,
              FROM: gl.constexpr):  # fmt: skip
    """Step g's dQ = dS K in consumer partition HALF's half of d's columns (of attn_bwd's two): its dS^T
    (ds_t; an idle_step's zeros) into ds_bufs[2 * (g % 2) + HALF], then the product issued once both
    partitions' are there (each arrives on ds_ready[g % 2] once its own is). Over both halves' keys (K of
    item buffer kb), or FROM's alone (the other half's keys see none of the step's queries). A partition
    writes step g + 2's dS^T only past step g + 1's arrivals, each made after that partition's dQ(g)
    retired, so its buffer is free then."""
    b = g % 2
    # Writes by the generic proxy read by wgmma (async proxy): a fence by every writer, then a barrier.
    ds_bufs.index(2 * b + HALF).store(ds_t)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ds_ready.index(b))
    mbarrier.wait(ds_ready.index(b), (g // 2) & 1)
    BLOCK_M: gl.constexpr = ds_bufs.shape[2]
    COLS: gl.constexpr = k_bufs.shape[2] // 2
    kb = kb + step_zero(g)  # (descriptors made in the step, as transposed_step's)
    dq = gl.zeros([BLOCK_M, COLS], gl.float32, q_layout)
    for half in gl.static_range(2):
        if FROM is None or FROM == half:
            dq = warpgroup_mma(ds_bufs.index(2 * b + half).permute((1, 0)),
                               k_bufs.index(2 * kb + half).slice(HALF * COLS, COLS, dim=1), dq,
                               use_acc=FROM is None and half > 0, is_async=True)  # fmt: skip
    return dq


@gluon.jit
def idle_step(g, row, kb, k_bufs, ds_bufs, ds_ready, dq_ring, empty, dq_desc, scale, STAGES: gl.constexpr,
              s_layout: gl.constexpr, q_layout: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    """Step g of consumer partition HALF (of attn_bwd's two) where its keys see none of the step's queries
    (under causal the second's first step of a tile, under a window the first's last): its dS^T is zero
    (written, for the other's dQ product), and of its products only its columns of dQ, from the other's
    dS (paired_dq), added into the sum from row `row`; then stage g - 1 back to the loader, as
    transposed_step hands it."""
    KEYS: gl.constexpr = ds_bufs.shape[1]
    BLOCK_M: gl.constexpr = ds_bufs.shape[2]
    none_seen = gl.zeros([KEYS, BLOCK_M], ds_bufs.dtype, s_layout)
    dq = paired_dq(g, none_seen, kb, k_bufs, ds_bufs, ds_ready, q_layout, HALF, 1 - HALF)
    # (waiting for every product: also this partition's dK(g-1), the last reader of Q(g-1))
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    release_step(g, empty, STAGES)
    reduce_dq(g, dq, dq_ring, dq_desc, row, scale, False, HALF)


@gluon.jit
def reduce_dq(g, dq, dq_ring, dq_desc, row, scale, TRANSPOSED: gl.constexpr, HALF: gl.constexpr):
    """Step g's dQ share `dq` (TRANSPOSED: dQ^T), times scale, added into the float32 sum from
    row `row`, in the columns of consumer partition HALF (0 alone), through shared memory (buffer
    2 * HALF + g % 2; the reduction that last read it, step g-2's, waited for) to one TMA reduce-add:
    fence, barrier, one issue."""
    buf = dq_ring.index(2 * HALF + g % 2)
    (buf.permute((1, 0)) if TRANSPOSED else buf).store(dq * scale)
    fence_async_shared()
    gl.thread_barrier()
    tma_reduce_add(dq_desc, [row, HALF * dq_ring.shape[2]], buf)


@gluon.jit
def query_major_step(
    g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, p_ds, dq_ring, ready,
    empty, dq_desc, dk, dv, qk_scale, scale, window_left, DIAG: gl.constexpr, EDGE: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    s_layout: gl.constexpr,
):  # fmt: skip
    """step's work in FA3's form, for 64-row steps at d = 128 (decisions.md#gluon-backward-query-major):
    the scores untransposed, S = Q K^T in s_layout ([BLOCK_M, BLOCK_N], the warpgroups split the keys),
    so that L and D are two registers a thread rather than 16 each; P and dS go through shared memory
    (p_ds: [2, BLOCK_M, BLOCK_N]), where dV += P^T dO, dK += dS^T Q and dQ = dS K read them. dQ has
    s_layout too (BLOCK_D = BLOCK_N). Returns dK and dV, dK still in flight. Every operand buffer is
    indexed with step_zero, as transposed_step's dQ^T operands are: hoisted, their wgmma descriptors
    spilled 312 bytes."""
    zero = step_zero(g)
    k_smem = k_bufs.index(kb + zero)
    v_smem = v_bufs.index(kb + zero)
    p_smem = p_ds.index(zero)
    ds_smem = p_ds.index(1 + zero)
    s = g % STAGES
    m0 = first + g * BLOCK_M
    dtype: gl.constexpr = k_smem.dtype
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    q_s = q_ring.index(s)
    do_s = do_ring.index(s)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_qk = warpgroup_mma(q_s, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_s, v_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    l2 = l_ring.index(s).load(rows) * _LOG2E
    delta = dl_ring.index(s).load(rows)
    # In flight, oldest first: dK(g-1), S(g), dP(g). Down to one retires dK(g-1), the last reader of Q(g-1)
    # and dS(g-1) (dV(g-1), the last of dO(g-1) and P(g-1), and dQ(g-1) retired in step g-1), and S(g).
    s_qk = warpgroup_mma_wait(num_outstanding=1, deps=[s_qk])
    gl.thread_barrier()
    mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=g > 0)

    p = probabilities(s_qk, l2, key0, m0, qk_scale, window_left, 1, s_layout, DIAG, EDGE)
    # P and dS: writes by the generic proxy read by wgmma (async proxy), a fence by every writer, then a
    # barrier (dQ reads both warpgroups' dS).
    p_smem.store(p.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    dv = warpgroup_mma(p_smem.permute((1, 0)), do_s, dv, is_async=True)
    dp = warpgroup_mma_wait(num_outstanding=1, deps=[dp])  # (dV(g) runs on)
    ds_smem.store((p * (dp - gl.expand_dims(delta, 1))).to(dtype))
    fence_async_shared()
    # dQ's buffer (one) is written below: the previous step's reduction must have read it.
    tma.store_wait(pendings=0)
    gl.thread_barrier()
    dq = warpgroup_mma(ds_smem, k_smem, gl.zeros([BLOCK_M, BLOCK_D], gl.float32, s_layout), use_acc=False,
                       is_async=True)  # fmt: skip
    dk = warpgroup_mma(ds_smem.permute((1, 0)), q_s, dk, is_async=True)
    # In flight: dV(g), dQ(g), dK(g). Down to one retires dV(g) and dQ(g); dK(g) runs on.
    dq = warpgroup_mma_wait(num_outstanding=1, deps=[dq])
    dq_buf = dq_ring.index(0)
    dq_buf.store(dq * scale)
    fence_async_shared()
    gl.thread_barrier()
    tma_reduce_add(dq_desc, [bh_row + m0, 0], dq_buf)
    return dk, dv


@gluon.jit
def consume_head(
    g0, bh_row, key0, lo, n, edge, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
    dq_ring, ready, empty, dq_desc, dk, dv, scores, qk_scale, scale, window_left, CAUSAL: gl.constexpr,
    WINDOW: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, s_layout: gl.constexpr, d_layout: gl.constexpr, q_layout: gl.constexpr,
    QUERY_MAJOR: gl.constexpr, HALF: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """One query head's n steps of consumer partition HALF's keys in a work item (work_item's key0, lo, n,
    edge for them), from the program's step g0 on, its L, D and dQ rows from bh_row: the diagonal steps masked
    (under causal; else step 0 alone, unmasked), up to two unrolled and the rest in a loop, then the steps
    that see every key in a loop, then (a window's) those from step `edge` on that lose keys at its far edge.
    Returns dK and dV (dK still in flight). scores: step g0's S and dP if already issued (else None). Peeling
    step 0 keeps ptxas from serializing every wgmma: a loop that may run zero times would feed
    zero-initialised accumulators into the epilogue's wait. Four unrolled diagonal steps (32-row steps)
    spilled at d = 128."""
    FIRST: gl.constexpr = k_bufs.shape[1] // BLOCK_M if CAUSAL else 1
    UNROLLED: gl.constexpr = FIRST if FIRST <= 2 else 1
    first = lo - g0 * BLOCK_M  # the query rows of step g: first + g * BLOCK_M
    for i in gl.static_range(UNROLLED):
        dk, dv = step(
            g0 + i, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs,
            ds_ready, dq_ring, ready, empty, dq_desc, dk, dv, scores, qk_scale, scale, window_left, CAUSAL,
            WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout, QUERY_MAJOR, HALF,
            CONSUMERS,
        )  # fmt: skip
        scores = None
    for g in range(g0 + UNROLLED, g0 + FIRST):
        dk, dv = step(
            g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
            dq_ring, ready, empty, dq_desc, dk, dv, None, qk_scale, scale, window_left, CAUSAL, WINDOW,
            STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout, QUERY_MAJOR, HALF, CONSUMERS,
        )  # fmt: skip
    for g in range(g0 + FIRST, g0 + edge):
        dk, dv = step(
            g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
            dq_ring, ready, empty, dq_desc, dk, dv, None, qk_scale, scale, window_left, False, False, STAGES,
            BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout, QUERY_MAJOR, HALF, CONSUMERS,
        )  # fmt: skip
    if WINDOW:
        for g in range(g0 + edge, g0 + n):
            dk, dv = step(
                g, first, key0, bh_row, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs,
                ds_ready, dq_ring, ready, empty, dq_desc, dk, dv, None, qk_scale, scale, window_left, False,
                True, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout, QUERY_MAJOR, HALF,
                CONSUMERS,
            )  # fmt: skip
    return dk, dv


@gluon.jit
def consume_steps(
    k, item, base, scores, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready, dq_ring,
    ready, empty, kv_ready, k_read, dq_desc, T, H, group, ZH, qk_scale, scale, window_left,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, s_layout: gl.constexpr, d_layout: gl.constexpr,
    q_layout: gl.constexpr, QUERY_MAJOR: gl.constexpr, PER_KV_HEAD: gl.constexpr, HALF: gl.constexpr,
    CONSUMERS: gl.constexpr,
):  # fmt: skip
    """The steps of this program's k-th work item `item`, which follow the program's `base`
    earlier ones: consume_head for each of its query heads (item_heads), over consumer partition HALF's keys
    (of CONSUMERS). scores: its first own step's S and dP if already issued (else
    None). Returns its dK and dV (every product retired), the program's steps up to the item's end, and the
    item's first key and head (work_item's key0, bh) for store_item.

    Of two partitions (attn_bwd's CONSUMERS), each runs every step of the item (the loader's: the whole
    tile's), its own (consume_head) and, where its keys see none of a step's queries, idle_step: under
    causal the second's first step (LEAD), under a window the first's last. Then it arrives on k_read: its
    dQ products, which read both halves of K, have retired."""
    KV_BUFFERS: gl.constexpr = k_bufs.shape[0] // CONSUMERS
    KEYS: gl.constexpr = k_bufs.shape[1]
    LEAD: gl.constexpr = idle_first_steps(HALF, KEYS, BLOCK_M, CAUSAL)
    key0, bh, lo, n, edge = work_item(item, T, ZH, window_left, CAUSAL, WINDOW, BLOCK_M, BLOCK_N, HALF,
                                      CONSUMERS)  # fmt: skip
    kb = k % KV_BUFFERS
    dk = warpgroup_mma_init(gl.zeros([KEYS, BLOCK_D], gl.float32, d_layout))
    dv = warpgroup_mma_init(gl.zeros([KEYS, BLOCK_D], gl.float32, d_layout))
    if scores is None:  # (else its issuer waited)
        mbarrier.wait(kv_ready.index(kb), (k // KV_BUFFERS) & 1)
    # A loop over all heads serialized every wgmma (C7515: moves define the accumulators): head 0 peeled.
    # item_heads is called at the item's start and again at its end (store_item): its numbers held across
    # the steps changed every build's registers.
    z, h0, kv_head, heads, bh_row = item_heads(bh, H, T, group, PER_KV_HEAD)
    for i in gl.static_range(LEAD):
        idle_step(base + i, bh_row + lo - (LEAD - i) * BLOCK_M, kb, k_bufs, ds_bufs, ds_ready, dq_ring, empty,
                  dq_desc, scale, STAGES, s_layout, q_layout, HALF)  # fmt: skip
    dk, dv = consume_head(
        base + LEAD, bh_row, key0, lo, n, edge, kb, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs,
        ds_ready, dq_ring, ready, empty, dq_desc, dk, dv, scores, qk_scale, scale, window_left, CAUSAL,
        WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout, QUERY_MAJOR, HALF, CONSUMERS,
    )  # fmt: skip
    if PER_KV_HEAD:
        for j in range(1, heads):
            dk, dv = consume_head(
                base + j * n, (z * H + h0 + j) * T, key0, lo, n, edge, kb, k_bufs, v_bufs, q_ring, do_ring,
                l_ring, dl_ring, ds_bufs, ds_ready, dq_ring, ready, empty, dq_desc, dk, dv, None, qk_scale,
                scale, window_left, CAUSAL, WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout,
                q_layout, QUERY_MAJOR, HALF, CONSUMERS,
            )  # fmt: skip
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=[dk, dv])
    steps = LEAD + n
    if CONSUMERS > 1:
        _, _, _, tile_steps, _ = work_item(item, T, ZH, window_left, CAUSAL, WINDOW, BLOCK_M, BLOCK_N, 0, 1)
        for g in range(base + steps, base + tile_steps):
            idle_step(g, bh_row + lo + (g - base - LEAD) * BLOCK_M, kb, k_bufs, ds_bufs, ds_ready, dq_ring,
                      empty, dq_desc, scale, STAGES, s_layout, q_layout, HALF)  # fmt: skip
        steps = tile_steps
        mbarrier.arrive(k_read.index(kb))
    _, _, _, heads, _ = item_heads(bh, H, T, group, PER_KV_HEAD)
    return dk, dv, base + heads * steps, key0 - HALF * KEYS, bh


@gluon.jit
def store_item(
    k, key0, bh, dk, dv, k_bufs, v_bufs, kv_empty, k_read, dk_desc, dv_desc, dk_zr, dk_hr, dk_hc, dv_zr,
    dv_hr, dv_hc, T, H, group, scale, PER_KV_HEAD: gl.constexpr, HALF: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """Work item k's dK and dV of consumer partition HALF's keys (of CONSUMERS; the tile's first key key0,
    of head bh: work_item's) out through TMA to its head (a K/V head's with PER_KV_HEAD; the partition's
    K and V buffers stage them), then the item's K/V buffer back to the loader on kv_empty (an arrival
    from each partition)."""
    KV_BUFFERS: gl.constexpr = k_bufs.shape[0] // CONSUMERS
    KEYS: gl.constexpr = k_bufs.shape[1]
    kb = k % KV_BUFFERS
    if CONSUMERS > 1:
        # the other partition's dQ products read this partition's K too: its k_read arrival came after them
        mbarrier.wait(k_read.index(kb), (k // KV_BUFFERS) & 1)
    # Every warp's products have read K and V before their buffers stage dK and dV (the dQ reductions
    # read dq_ring, not these: the stores' wait below covers them).
    gl.thread_barrier()
    k_smem = own_keys(k_bufs, kb, HALF, CONSUMERS)
    v_smem = own_keys(v_bufs, kb, HALF, CONSUMERS)
    k_smem.store((dk * scale).to(k_smem.dtype))
    v_smem.store(dv.to(v_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()
    z, h0, kv_head, _, _ = item_heads(bh, H, T, group, PER_KV_HEAD)
    out_head = kv_head if PER_KV_HEAD else h0
    dk_row, dk_col = head_start(z, out_head, dk_zr, dk_hr, dk_hc)
    dv_row, dv_col = head_start(z, out_head, dv_zr, dv_hr, dv_hc)
    tma.async_copy_shared_to_global(dk_desc, [dk_row + key0 + HALF * KEYS, dk_col], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [dv_row + key0 + HALF * KEYS, dv_col], v_smem)
    # Both stores have read the buffers: every warp's wait done, one arrival hands them to the loader
    # (for item k + KV_BUFFERS).
    tma.store_wait(pendings=0)
    gl.thread_barrier()
    mbarrier.arrive(kv_empty.index(kb))


@gluon.jit
def consumer(
    schedule, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready, dq_ring, ready, empty,
    kv_ready, kv_empty, k_read, dq_desc, dk_desc, dv_desc, dk_zr, dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H,
    group, ZH, qk_scale, scale, window_left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    s_layout: gl.constexpr, d_layout: gl.constexpr, q_layout: gl.constexpr, QUERY_MAJOR: gl.constexpr,
    PERSISTENT: gl.constexpr, ROUNDS: gl.constexpr, PER_KV_HEAD: gl.constexpr, HALF: gl.constexpr,
    CONSUMERS: gl.constexpr,
):  # fmt: skip
    """Compute partition HALF of CONSUMERS (attn_bwd's), over its keys of each tile (all of them, or half):
    for each work item of this program (program_items), consume_steps then store_item; each item's number is
    read during the item before. Persistent programs issue each item's first S and dP of their own
    (issue_scores) before the item before goes out, so that the tensor cores run them through store_item's
    epilogue rather than idle: a turn of the loop issues its item's, stores the item before, then runs its
    steps (the last item is stored after the loop).

    Barrier phases across items (the invariant the loader keeps alike): the ring's steps are counted over
    the program, g = the steps of its earlier items + the item's own, so stage g % STAGES's `ready`
    completes for the (g // STAGES)-th time at step g and `empty` is released by each partition for step
    g - 1 in step g whatever the item (an item's first step releases the previous item's last); ds_ready
    (two partitions) buffer g % 2 completes for the (g // 2)-th time at step g; K/V buffer k % KV_BUFFERS
    completes kv_ready and k_read for the (k // KV_BUFFERS)-th time at item k, and kv_empty once every
    partition's dK and dV stores have read it. The loader only waits on releases of steps and items before
    the ones it loads, so no wait depends on a later one."""
    items, mine = program_items(schedule, T // BLOCK_N * ZH, PERSISTENT, ROUNDS)
    base = gl.to_tensor(0)  # (a loop-carried int32)
    item = program_item(0, mine, PERSISTENT, ROUNDS)
    KEYS: gl.constexpr = k_bufs.shape[1]
    LEAD: gl.constexpr = idle_first_steps(HALF, KEYS, BLOCK_M, CAUSAL)
    if PERSISTENT:
        gl.static_assert(not QUERY_MAJOR, "issue_scores issues transposed_step's products")
        KV_BUFFERS: gl.constexpr = k_bufs.shape[0] // CONSUMERS
        # dK and dV of the item before, stored once this item's first S and dP are in flight (carried
        # across the loop as finished values: in-flight products carried across it serialized every
        # wgmma, C7514)
        dk = gl.zeros([KEYS, BLOCK_D], gl.float32, d_layout)
        dv = gl.zeros([KEYS, BLOCK_D], gl.float32, d_layout)
        key0 = gl.to_tensor(0)
        bh = gl.to_tensor(0)
        for k in range(items):
            following = program_item(k + 1, mine, PERSISTENT, ROUNDS)
            kb = k % KV_BUFFERS
            mbarrier.wait(kv_ready.index(kb), (k // KV_BUFFERS) & 1)
            scores = issue_scores(base + LEAD, kb, k_bufs, v_bufs, q_ring, do_ring, ready, STAGES, s_layout,
                                  HALF, CONSUMERS)  # fmt: skip
            if k > 0:
                store_item(k - 1, key0, bh, dk, dv, k_bufs, v_bufs, kv_empty, k_read, dk_desc, dv_desc, dk_zr,
                           dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, scale, PER_KV_HEAD, HALF,
                           CONSUMERS)  # fmt: skip
            dk, dv, base, key0, bh = consume_steps(
                k, item, base, scores, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
                dq_ring, ready, empty, kv_ready, k_read, dq_desc, T, H, group, ZH, qk_scale, scale,
                window_left, CAUSAL, WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout,
                QUERY_MAJOR, PER_KV_HEAD, HALF, CONSUMERS,
            )  # fmt: skip
            item = following
        store_item(items - 1, key0, bh, dk, dv, k_bufs, v_bufs, kv_empty, k_read, dk_desc, dv_desc, dk_zr,
                   dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, scale, PER_KV_HEAD, HALF,
                   CONSUMERS)  # fmt: skip
    else:
        for k in range(items):
            dk, dv, base, key0, bh = consume_steps(
                k, item, base, None, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
                dq_ring, ready, empty, kv_ready, k_read, dq_desc, T, H, group, ZH, qk_scale, scale,
                window_left, CAUSAL, WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout,
                QUERY_MAJOR, PER_KV_HEAD, HALF, CONSUMERS,
            )  # fmt: skip
            store_item(k, key0, bh, dk, dv, k_bufs, v_bufs, kv_empty, k_read, dk_desc, dv_desc, dk_zr, dk_hr,
                       dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, scale, PER_KV_HEAD, HALF,
                       CONSUMERS)  # fmt: skip


@gluon.jit
def attn_bwd(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, l_desc, dl_desc, q_zr, q_hr, q_hc, k_zr, k_hr,
    k_hc, v_zr, v_hr, v_hc, do_zr, do_hr, do_hc, dk_zr, dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, ZH,
    qk_scale, scale, window_left, schedule,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
    ROUNDS: gl.constexpr, PER_KV_HEAD: gl.constexpr, CONSUMERS: gl.constexpr, LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    """Work items: the T / BLOCK_N * ZH (key tile, head) pairs (work_item): ZH = Z * H query heads, or with
    PER_KV_HEAD Z * H / group K/V heads, an item running its group's query heads one after another
    (item_heads). Grid: one program an item, or with PERSISTENT fewer (one an SM), each running its items of
    `schedule` (_hopper.work_schedule; with ROUNDS its rounds, computed) one after another, K and V in two
    buffers: the loader loads the next item's K, V and first query tiles while the consumers finish the
    current one. Head (z, h) of a tensor starts at head_start's row and column of its descriptor's matrix (its
    _zr, _hr, _hc: _hopper.matrix's); K and V of query head h are those of head h // group, and dK and dV of
    head h go to head h of dk_desc and dv_desc (per query head: the caller sums each group's), with
    PER_KV_HEAD to its K/V head's. dq_desc: a float32 (Z*H*T, d) sum, zeroed, added into; L and D: (Z*H*T,).
    WINDOW (with CAUSAL): a query also sees no key more than window_left before it.

    CONSUMERS partitions of num_warps warps compute, 16 keys a warp: one over the tile's keys (the loader a
    one-warp partition beside it), or two over half of them each (the loader then the default partition,
    as attn_fwd's, with num_warps warps and the registers the consumers leave). Two skip the steps whose
    queries see none of their keys (decisions.md#gluon-backward-two-consumers) and meet once a step, where
    dQ = dS K reads both halves of dS (paired_dq); k_desc, v_desc, dk_desc and dv_desc then move a
    partition's keys, BLOCK_N / 2 rows, and dq_desc its d / 2 columns."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = KEYS * CONSUMERS
    BLOCK_D: gl.constexpr = q_desc.block_type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(KEYS == 16 * NUM_WARPS, "each warp owns 16 keys")
    gl.static_assert(BLOCK_N % BLOCK_M == 0)
    gl.static_assert(BLOCK_D == BLOCK_N or BLOCK_M == 64, "dQ = dS K takes 64-row steps (a warpgroup's)")
    gl.static_assert(CONSUMERS == 1 or (CONSUMERS == 2 and KEYS == BLOCK_M and BLOCK_D < BLOCK_N
                                        and not PER_KV_HEAD), "two consumers: 64-row steps, d < BLOCK_N")
    # 64-row steps at d = 128 take query_major_step's form (its registers fit), the others step's
    QUERY_MAJOR: gl.constexpr = BLOCK_M == 64 and BLOCK_D == BLOCK_N
    d_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_D)
    q_layout: gl.constexpr = dq_layout(NUM_WARPS, BLOCK_D, CONSUMERS)
    s_layout: gl.constexpr = q_layout if QUERY_MAJOR else mma_layout(NUM_WARPS, BLOCK_M)

    dtype: gl.constexpr = k_desc.dtype
    KV_BUFFERS: gl.constexpr = 2 if PERSISTENT else 1
    # K and V per item in KV_BUFFERS buffers, CONSUMERS a buffer (own_keys; step indexes K's with step_zero
    # for the dQ products)
    kv_shape: gl.constexpr = [KV_BUFFERS * CONSUMERS] + k_desc.block_type.shape
    k_bufs = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + l_desc.block_type.shape, l_desc.layout)
    dl_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + dl_desc.block_type.shape, dl_desc.layout)
    if QUERY_MAJOR:  # P and dS; one dQ buffer (a second, 32 KB at d = 128, would leave no room for 3 stages)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        dq_ring = gl.allocate_shared_memory(gl.float32, [1] + dq_desc.block_type.shape, dq_desc.layout)
    else:  # dS^T (two partitions: one a partition and step of two, paired_dq), two dQ buffers a partition
        ds_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS * CONSUMERS, KEYS, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], dtype))
        dq_ring = gl.allocate_shared_memory(gl.float32, [2 * CONSUMERS] + dq_desc.block_type.shape,
                                            dq_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_read = gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # one release per consumer partition
    for b in gl.static_range(KV_BUFFERS):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(kv_empty.index(b), count=CONSUMERS)
        mbarrier.init(k_read.index(b), count=CONSUMERS)
    for b in gl.static_range(2):
        mbarrier.init(ds_ready.index(b), count=CONSUMERS)
    # The barriers' initialisation must be visible to the async proxy (TMA) before it signals them.
    fence_async_shared()
    gl.thread_barrier()

    # (each partition's arguments written out: Gluon 3.6 takes them as a literal tuple, and a tuple held in a
    # name, to be extended with HALF, loses its constexprs)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (consumer, (schedule, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
                        dq_ring, ready, empty, kv_ready, kv_empty, k_read, dq_desc, dk_desc, dv_desc, dk_zr,
                        dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, ZH, qk_scale, scale, window_left,
                        CAUSAL, WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout,
                        QUERY_MAJOR, PERSISTENT, ROUNDS, PER_KV_HEAD, 0, CONSUMERS)),
            (loader, (schedule, q_desc, do_desc, l_desc, dl_desc, k_desc, v_desc, q_ring, do_ring, l_ring,
                      dl_ring, k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, q_zr, q_hr, q_hc, k_zr, k_hr,
                      k_hc, v_zr, v_hr, v_hc, do_zr, do_hr, do_hc, T, H, group, ZH, window_left, CAUSAL,
                      WINDOW, STAGES, BLOCK_M, PER_KV_HEAD, PERSISTENT, ROUNDS, CONSUMERS)),
        ], [_LOADER_WARPS], [LOADER_REGS])  # fmt: skip
    else:
        gl.warp_specialize([
            (loader, (schedule, q_desc, do_desc, l_desc, dl_desc, k_desc, v_desc, q_ring, do_ring, l_ring,
                      dl_ring, k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, q_zr, q_hr, q_hc, k_zr, k_hr,
                      k_hc, v_zr, v_hr, v_hc, do_zr, do_hr, do_hc, T, H, group, ZH, window_left, CAUSAL,
                      WINDOW, STAGES, BLOCK_M, PER_KV_HEAD, PERSISTENT, ROUNDS, CONSUMERS)),
            (consumer, (schedule, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
                        dq_ring, ready, empty, kv_ready, kv_empty, k_read, dq_desc, dk_desc, dv_desc, dk_zr,
                        dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, ZH, qk_scale, scale, window_left,
                        CAUSAL, WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout,
                        QUERY_MAJOR, PERSISTENT, ROUNDS, PER_KV_HEAD, 0, CONSUMERS)),
            (consumer, (schedule, k_bufs, v_bufs, q_ring, do_ring, l_ring, dl_ring, ds_bufs, ds_ready,
                        dq_ring, ready, empty, kv_ready, kv_empty, k_read, dq_desc, dk_desc, dv_desc, dk_zr,
                        dk_hr, dk_hc, dv_zr, dv_hr, dv_hc, T, H, group, ZH, qk_scale, scale, window_left,
                        CAUSAL, WINDOW, STAGES, BLOCK_M, BLOCK_N, BLOCK_D, s_layout, d_layout, q_layout,
                        QUERY_MAJOR, PERSISTENT, ROUNDS, PER_KV_HEAD, 1, CONSUMERS)),
        ], [NUM_WARPS, NUM_WARPS], [CONSUMER_REGS, CONSUMER_REGS])  # fmt: skip


# ------------------------------------------------------------------------------------------------ forward


@gluon.jit
def forward_item(item, T, ZH, window_left, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, BLOCK_N: gl.constexpr):
    """The forward's work item `item`: query tile item // ZH (under causal counted from the last, the
    longest) of (z, h) = divmod(item % ZH, H). Returns its first query row q0, item % ZH, its top key tile
    (the diagonal one under causal, walked first) and its key tiles n, from top down."""
    num_tiles = T // BLOCK_N
    tile = item // ZH
    if CAUSAL:
        tile = num_tiles - 1 - tile
        top = tile
    else:
        top = num_tiles - 1
    q0 = tile * BLOCK_N
    bottom = 0
    if WINDOW:  # the key tile of the first row's first key
        bottom = gl.maximum(q0 - window_left, 0) // BLOCK_N
    return q0, item % ZH, top, top - bottom + 1


@gluon.jit
def forward_load_item(
    k, item, base, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready,
    empty, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc, T, H, group, ZH, window_left,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """The loader's work for this program's k-th work item `item`, whose key tiles follow the
    program's `base` earlier ones: both consumers' Q tiles into Q buffer k % Q_BUFFERS, once the consumers
    released its item before (q_empty's (k // Q_BUFFERS)-th completion, parity as load_step's), then K and
    V of key tile top - j at the program's ring step base + j (the diagonal first, then descending), K and
    V on barriers of their own so that S = QKᵀ can start before V lands. Stage reuse waits for both
    consumers' release on `empty`. Returns the program's ring steps up to the item's end."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    q0, bh, top, n = forward_item(item, T, ZH, window_left, CAUSAL, WINDOW, BLOCK_N)
    z = bh // H
    h = bh % H
    q_row, q_col = head_start(z, h, q_zr, q_hr, q_hc)
    k_row, k_col = head_start(z, h // group, k_zr, k_hr, k_hc)
    v_row, v_col = head_start(z, h // group, v_zr, v_hr, v_hc)
    qb = k % Q_BUFFERS
    mbarrier.wait(q_empty.index(qb), ((k // Q_BUFFERS) & 1) ^ 1)
    mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row + q0 + i * ROWS, q_col], q_ready.index(qb),
                                        q_smem.index(2 * qb + i))  # fmt: skip
    for j in range(n):
        g = base + j
        s = g % STAGES
        mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
        key0 = (top - j) * BLOCK_N
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + key0, k_col], k_ready.index(s), k_ring.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + key0, v_col], v_ready.index(s), v_ring.index(s))
    return base + n


@gluon.jit
def forward_loader(
    schedule, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, empty, q_zr,
    q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc, T, H, group, ZH, window_left, CAUSAL: gl.constexpr,
    WINDOW: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr, ROUNDS: gl.constexpr,
):  # fmt: skip
    """The loader partition: forward_load_item for each work item of this program (program_items; each item's
    number read during the item before, as the consumers do). Its ring steps run on across items (the
    consumers count them alike), so the next item's Q (in the other buffer) and first K and V tiles load while
    the consumers finish the current item."""
    items, mine = program_items(schedule, T // k_desc.block_type.shape[0] * ZH, PERSISTENT, ROUNDS)
    base = gl.to_tensor(0)  # (a loop-carried int32)
    item = program_item(0, mine, PERSISTENT, ROUNDS)
    for k in range(items):
        following = program_item(k + 1, mine, PERSISTENT, ROUNDS)
        base = forward_load_item(
            k, item, base, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
            v_ready, empty, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc, T, H, group, ZH,
            window_left, CAUSAL, WINDOW, STAGES,
        )  # fmt: skip
        item = following


@gluon.jit
def forward_step(g, j, top, q_s, k_ring, v_ring, k_ready, v_ready, empty, turn, o, m_i, l_i, qk_scale, q0,
                 window_left, STAGES: gl.constexpr, FIRST: gl.constexpr, DIAG: gl.constexpr,
                 EDGE: gl.constexpr, ME: gl.constexpr, HALF: gl.constexpr,
                 o_layout: gl.constexpr):  # fmt: skip
    """Key tile top - j of the item, the program's ring step g, for consumer ME (query rows from q0),
    masked as visible's DIAG and EDGE say: S = QKᵀ issued on its turn (the other consumer's softmax runs
    meanwhile), the online softmax update, O = O * alpha + P V. HALF 1 or 2: only the tile's first or
    last BLOCK_N / 2 keys, where the other half is hidden from every row of this consumer (half the
    products and exponentials). Returns O, m, l (m and l in the whole tile's row layout)."""
    BM: gl.constexpr = q_s.shape[0]
    TILE: gl.constexpr = k_ring.shape[1]
    BN: gl.constexpr = TILE if HALF == 0 else TILE // 2
    FROM: gl.constexpr = BN if HALF == 2 else 0  # the step's first key in the tile
    s_layout: gl.constexpr = mma_layout(gl.num_warps(), BN)
    s_idx = g % STAGES
    key0 = (top - j) * TILE + FROM
    mbarrier.wait(k_ready.index(s_idx), (g // STAGES) & 1)
    mbarrier.wait(turn.index(ME), g & 1)  # my turn: turn[ME]'s g-th completion
    k_s = k_ring.index(s_idx)
    if HALF != 0:
        k_s = k_s.slice(FROM, BN)
    s_tok = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_layout), use_acc=False,
                          is_async=True)  # fmt: skip
    mbarrier.arrive(turn.index(1 - ME))
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    # (every row sees its own key, in step 0's diagonal tile: m is finite from there on)
    rows = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    cols = key0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    s = visible(s, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), window_left, float("-inf"), DIAG, EDGE)
    # The row max of the raw scores (qk_scale > 0), scaled once a row: exp2's argument is then one FFMA an
    # element (scaling every score first cost an FMUL an element more, 64 of a step's 471 instructions).
    if FIRST:
        m_new = gl.max(s, 1) * qk_scale
    else:
        m_old = m_i
        if HALF != 0:  # (the same rows a thread, in the half tile's layout)
            m_old = gl.convert_layout(m_i, rows.type.layout)
        m_new = gl.maximum(m_old, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_op = gl.convert_layout(p.to(q_s.dtype), a_layout)
    m_new = gl.convert_layout(m_new, m_i.type.layout)  # (no-ops but with HALF)
    if FIRST:
        l_new = gl.convert_layout(gl.sum(p, 1), l_i.type.layout)
    else:
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.convert_layout(gl.sum(p, 1), l_i.type.layout)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    mbarrier.wait(v_ready.index(s_idx), (g // STAGES) & 1)
    v_s = v_ring.index(s_idx)
    if HALF != 0:
        v_s = v_s.slice(FROM, BN)
    o_tok = warpgroup_mma(p_op, v_s, o, use_acc=not FIRST, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
    # Every warp of this consumer retired its reads of stage s_idx: one release (of two) for the loader.
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s_idx))
    return o, m_new, l_new


@gluon.jit
def forward_consume_item(
    k, item, base, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, empty, turn, o_desc, L, o_zr,
    o_hr, o_hc, T, H, ZH, qk_scale, window_left, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    WINDOW: gl.constexpr, ME: gl.constexpr,
):  # fmt: skip
    """Consumer ME's work for this program's k-th work item `item`, whose key tiles follow the program's
    `base` earlier ones: query rows [q0 + ME * BM, + BM) of its head. Step 0 (the diagonal tile, masked under
    causal) peeled, then the key tiles every row sees all of, then (a window's) those whose far keys some
    rows do not see; L and O / l out at the end (O through this item's Q buffer, handed back to the loader
    on q_empty once the store has read it: after the next item's step 0, so that no wait for the store
    holds up the next S = QKᵀ and the other consumer's turn). Returns the program's ring steps up to the
    item's end."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    BM: gl.constexpr = q_smem.shape[1]
    BD: gl.constexpr = q_smem.shape[2]
    BN: gl.constexpr = k_ring.shape[1]
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(BM == 16 * NW, "each warp owns 16 query rows")
    s_layout: gl.constexpr = mma_layout(NW, BN)
    o_layout: gl.constexpr = mma_layout(NW, BD)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q0, bh, top, n = forward_item(item, T, ZH, window_left, CAUSAL, WINDOW, BN)
    qb = k % Q_BUFFERS
    q_s = q_smem.index(2 * qb + ME)
    first_row = q0 + ME * BM
    o = gl.zeros([BM, BD], gl.float32, o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, rows_layout)
    l_i = gl.zeros([BM], gl.float32, rows_layout)
    mbarrier.wait(q_ready.index(qb), (k // Q_BUFFERS) & 1)
    # Consumer 0's rows see none of the diagonal tile's last BN / 2 keys: under a window, half a step
    # (decisions.md#gluon-forward-half-steps; under causal alone it slowed the persistent kernel).
    o, m_i, l_i = forward_step(base, 0, top, q_s, k_ring, v_ring, k_ready, v_ready, empty, turn, o, m_i, l_i,
                               qk_scale, first_row, window_left, STAGES, True, CAUSAL, WINDOW, ME,
                               1 if WINDOW and ME == 0 else 0, o_layout)  # fmt: skip
    # The previous item's O store (from its Q buffer) ran during step 0: every warp past its wait, one
    # release (of two) hands that buffer to the loader, for item k - 1 + Q_BUFFERS.
    tma.store_wait(pendings=0)
    gl.thread_barrier()
    mbarrier.arrive(q_empty.index((k + Q_BUFFERS - 1) % Q_BUFFERS), pred=k > 0)
    edge = n
    if WINDOW:  # key tiles from top - edge + 1 down start before the last row's first key
        reach = gl.maximum(first_row + BM - 1 - window_left, 0)
        edge = gl.maximum(gl.minimum(top + 1 - (reach + BN - 1) // BN, n), 1)
    for j in range(1, edge):
        o, m_i, l_i = forward_step(base + j, j, top, q_s, k_ring, v_ring, k_ready, v_ready, empty, turn, o,
                                   m_i, l_i, qk_scale, first_row, window_left, STAGES, False, False, False,
                                   ME, 0, o_layout)  # fmt: skip
    if WINDOW:
        for j in range(edge, n - 1):
            o, m_i, l_i = forward_step(base + j, j, top, q_s, k_ring, v_ring, k_ready, v_ready, empty, turn,
                                       o, m_i, l_i, qk_scale, first_row, window_left, STAGES, False, False,
                                       True, ME, 0, o_layout)  # fmt: skip
        if edge < n:  # the bottom tile: where its first BN / 2 keys are past every row's reach, half a step
            j = n - 1
            if (top - j) * BN + BN // 2 <= first_row - window_left:
                o, m_i, l_i = forward_step(base + j, j, top, q_s, k_ring, v_ring, k_ready, v_ready, empty,
                                           turn, o, m_i, l_i, qk_scale, first_row, window_left, STAGES, False,
                                           False, True, ME, 2, o_layout)  # fmt: skip
            else:
                o, m_i, l_i = forward_step(base + j, j, top, q_s, k_ring, v_ring, k_ready, v_ready, empty,
                                           turn, o, m_i, l_i, qk_scale, first_row, window_left, STAGES, False,
                                           False, True, ME, 0, o_layout)  # fmt: skip
    lse = (m_i + gl.log2(l_i)) * _LN2
    gl.store(L + bh * T + first_row + gl.arange(0, BM, layout=rows_layout), lse)
    o = o * gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout)), 1)
    gl.thread_barrier()  # every warp's wgmmas (readers of q_s) have retired
    q_s.store(o.to(q_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    o_row, o_col = head_start(bh // H, bh % H, o_zr, o_hr, o_hc)
    tma.async_copy_shared_to_global(o_desc, [o_row + first_row, o_col], q_s)
    return base + n


@gluon.jit
def forward_consumer(
    schedule, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, empty, turn, o_desc, L, o_zr, o_hr,
    o_hc, T, H, ZH, qk_scale, window_left, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
    PERSISTENT: gl.constexpr, ROUNDS: gl.constexpr, ME: gl.constexpr,
):  # fmt: skip
    """Consumer ME: forward_consume_item for each work item of this program (program_items; each item's number
    read during the item before). Barrier phases run on across items as the backward's do (consumer): ring
    stage g % STAGES completes k_ready and v_ready for the (g // STAGES)-th time at the program's step g,
    turn[ME] for the g-th time there (one completion a step from each consumer: both walk the same key tiles),
    and Q buffer k % Q_BUFFERS its (k // Q_BUFFERS)-th time at item k."""
    items, mine = program_items(schedule, T // k_ring.shape[1] * ZH, PERSISTENT, ROUNDS)
    base = gl.to_tensor(0)  # (a loop-carried int32)
    item = program_item(0, mine, PERSISTENT, ROUNDS)
    for k in range(items):
        following = program_item(k + 1, mine, PERSISTENT, ROUNDS)
        base = forward_consume_item(
            k, item, base, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, empty, turn, o_desc, L,
            o_zr, o_hr, o_hc, T, H, ZH, qk_scale, window_left, STAGES, CAUSAL, WINDOW, ME,
        )  # fmt: skip
        item = following
    tma.store_wait(pendings=0)  # the last item's O store has read its buffer


@gluon.jit
def attn_fwd(
    q_desc, k_desc, v_desc, o_desc, L, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc, o_zr, o_hr, o_hc,
    T, H, group, ZH, qk_scale, window_left, schedule, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
    STAGES: gl.constexpr, PERSISTENT: gl.constexpr, ROUNDS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    """O and L (natural log, float32 (Z*H*T,)) with FA3's ping-pong: two 4-warp consumer partitions of BM
    rows each take turns issuing their S = QKᵀ (mbarriers `turn`), so one's softmax overlaps the other's
    products; a loader partition (the default one, left with few registers) streams Q, K and V. Key tiles
    of BLOCK_N = 2 * BM, the diagonal one first. Work items: the T / BLOCK_N * Z * H (query tile of 2 * BM
    rows, head) pairs (forward_item). Grid: one program an item, or with PERSISTENT fewer (one an SM),
    each running its items of `schedule` (_hopper.work_schedule; with ROUNDS its rounds, computed) one after
    another, Q in two buffers: the loader loads the next item's Q and first K and V tiles while the
    consumers finish the current one.
    Heads start at head_start's rows and columns (as attn_bwd's); query head h reads K and V head h //
    group. WINDOW (with CAUSAL): a query also sees no key more than window_left before it."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(BLOCK_N == 2 * BM, "the diagonal key tile covers both consumers' rows")
    Q_BUFFERS: gl.constexpr = 2 if PERSISTENT else 1
    dtype: gl.constexpr = q_desc.dtype
    # Q buffer b holds consumer i's rows at index 2 * b + i
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(b), count=1)
        mbarrier.init(q_empty.index(b), count=2)  # one release per consumer
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one release per consumer
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0))  # consumer 0 goes first
    fence_async_shared()
    gl.thread_barrier()
    # The loader is the default partition: Triton leaves it the registers the consumers do not take (a
    # consumer as the default partition would ask for 256 and oversubscribe the register file).
    gl.warp_specialize([
        (forward_loader, (schedule, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                          v_ready, empty, q_zr, q_hr, q_hc, k_zr, k_hr, k_hc, v_zr, v_hr, v_hc, T, H, group,
                          ZH, window_left, CAUSAL, WINDOW, STAGES, PERSISTENT, ROUNDS)),
        (forward_consumer, (schedule, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, empty, turn,
                            o_desc, L, o_zr, o_hr, o_hc, T, H, ZH, qk_scale, window_left, STAGES, CAUSAL,
                            WINDOW, PERSISTENT, ROUNDS, 0)),
        (forward_consumer, (schedule, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, empty, turn,
                            o_desc, L, o_zr, o_hr, o_hc, T, H, ZH, qk_scale, window_left, STAGES, CAUSAL,
                            WINDOW, PERSISTENT, ROUNDS, 1)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])  # fmt: skip
