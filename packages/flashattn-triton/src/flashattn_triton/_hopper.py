"""Kernels for Hopper (sm_90) in Gluon, Triton's lower-level dialect: explicit shared memory, TMA,
mbarriers, asynchronous wgmma and warp specialization, which the Triton-language kernels cannot express.
Written against Triton 3.6's Gluon (``available()`` says whether this Triton ships it, from its files: the
kernels module, which imports Gluon, loads when a Gluon kernel first runs); the launchers offer them to
their tuner where they apply (``supports``) and keep the Triton-language kernels elsewhere.

Forward (``_hopper_kernels.attn_fwd``): FA3's ping-pong. Two 4-warp consumers
own 64 query rows each and take turns issuing S = QKᵀ, so that one's softmax runs during the other's
products; a loader partition streams 128-key tiles of K and V through a ring of mbarrier-guarded stages.
Like the backward (up to d = 64), it also runs as persistent programs, one an SM (``launcher``).

Backward (``_hopper_kernels.attn_bwd``): ``_kernels.attn_bwd``'s algorithm with
ATOMIC_DQ. One program owns 128 keys of one (z, h) (two consumer warpgroups of 64), keeps K and V in
shared memory, and a one-warp loader streams the query tiles of 64 rows (32 at d = 128) that see them
(Q, dO, L, D). Per step, with the transposed scores (keys are the rows):

    S^T  = K Q^T ;  dP^T = V dO^T                 (issued back to back: dP^T runs during the softmax)
    P^T  = exp2(S^T * qk_scale - L2[q])           (L2 = L * log2 e)
    dV  += P^T dO                                 (P^T from registers; runs during dS)
    dS^T = P^T * (dP^T - D[q])
    dQ_q += scale * dS K                          (dS^T through shared memory; a TMA reduce-add of fp32;
                                                   d = 128: dQ^T = K^T dS^T)
    dK  += dS^T Q                                 (left in flight into the next step)

Persistent programs issue each item's first S and dP before the item before stores its dK and dV (the tensor
cores run through that epilogue). Up to d = 64 the consumers may also be two 4-warp partitions of 64 keys each
(BackwardConfig's consumers=2), which skip the steps whose queries see none of their keys and meet once a step
for dQ. At d = 128 it also steps through 64 query rows in FA3's query-major form (S = Q K^T, P and dS through
shared memory: _hopper_kernels.query_major_step), and for grouped-query attention a program may own a K/V
head's key tile through its group's query heads (BackwardConfig's per_kv_head: dK and dV summed in the
program).

Both take each tensor as a matrix whose rows are its time steps (``matrix``): (B, H, T, d) memory, or
(B, T, H, d) memory as a model's transposed and fused-projection views are, each tensor with a head layout
of its own. Query head h reads K/V head h // group (grouped-query attention); CAUSAL with WINDOW hides keys
more than window_left before the query (a causal sliding window).
"""

from __future__ import annotations

import functools
import heapq
import importlib.util
import itertools
from pathlib import Path
from typing import Any

import torch

from flashattn_triton._configs import BackwardConfig, ForwardConfig
from flashattn_triton._launcher import Launcher, Tiles, env_flag, gluon_kernels

LOADER_REGISTERS = 24  # the backward's loader only issues TMA copies; setmaxnreg gives the rest away
CONSUMER_REGISTERS = 240  # a 4-warp consumer partition's (the forward's two, the backward's where it has two)
# Persistent programs' work schedule (work_schedule). A work item's fixed cost in steps (its loads, its
# epilogue), fitted to measured programs over causal windows of 128 to 4096 keys: the cost model balances
# items of few steps against items of many.
ITEM_STEPS = {"fwd": 3.5, "bwd": 1.9}
# With fewer than two programs a head, heads start HEADS_A_CHUNK at a time, CHUNK_SHIFT tiles apart.
HEADS_A_CHUNK, CHUNK_SHIFT = 4, 2
_schedules: dict[tuple, torch.Tensor] = {}  # _schedule_args's, by problem and device


@functools.cache
def _gluon_shipped() -> bool:
    """Whether this Triton has Gluon for Hopper, read from its files without importing it: importing
    Gluon costs ~0.15 s of a process's first call, which a process whose tuned choices are all
    Triton-language kernels need not pay."""
    spec = importlib.util.find_spec("triton")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    gluon = [Path(root) / "experimental" / "gluon" for root in locations]
    return any((g / "language" / "nvidia" / "hopper").is_dir() and (g / "nvidia" / "hopper.py").is_file()
               for g in gluon)  # fmt: skip


def available() -> bool:
    """Whether the Gluon kernels can be offered: this Triton ships Gluon for Hopper and
    FLASHATTN_TRITON_GLUON is not 0 (the switch to keep the Triton-language kernels everywhere)."""
    if not env_flag("FLASHATTN_TRITON_GLUON", True):
        return False
    return _gluon_shipped()


def head_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
    """How a (Z, H, T, d) tensor's heads sit in the matrix ``matrix`` describes: its rows are the tensor's
    time steps (stride t.stride(2)), head (z, h) starting at row z * zr + h * hr and column h * hc; returns
    (zr, hr, hc). Heads outside the rows (Z, H, T, d memory: zr = H * T, hr = T, hc = 0) or inside them
    ((Z, T, H, d) memory, a model's transposed view, or a fused projection's: zr = T, hr = 0, hc = d's
    stride); None for another layout, or one TMA cannot take (16-byte aligned start and strides, unit
    stride along d)."""
    heads, seqlen, head_dim = t.shape[1:]
    stride_z, stride_h, stride_t, stride_d = t.stride()
    size = t.element_size()
    aligned = t.data_ptr() % 16 == 0 and stride_t * size % 16 == 0 and stride_h * size % 16 == 0
    if stride_d != 1 or not aligned or (t.shape[0] > 1 and stride_z % stride_t):
        return None
    rows_per_z = stride_z // stride_t if t.shape[0] > 1 else 0
    if heads == 1:
        return rows_per_z, 0, 0
    if stride_h % stride_t == 0 and stride_h >= seqlen * stride_t:  # whole heads after one another
        return rows_per_z, stride_h // stride_t, 0
    if (heads - 1) * stride_h + head_dim <= stride_t and stride_h >= head_dim:  # heads side by side in a row
        return rows_per_z, 0, stride_h
    return None


def kernel(pass_name: str) -> Any:
    kernels = gluon_kernels()
    return kernels.attn_fwd if pass_name == "fwd" else kernels.attn_bwd


def matrix(t: torch.Tensor, n: int, parts: int = 1) -> tuple[Tiles, tuple[int, int, int]]:
    """A descriptor moving tiles of n rows of (Z, H, T, d) t (of d / parts columns: a consumer partition's
    share), over the matrix whose rows are t's time steps (as far as its last head's last row reaches), and
    head_layout(t)."""
    layout = head_layout(t)
    stride_t, head_dim = t.stride(2), t.shape[-1]
    rows = (t.shape[0] - 1) * layout[0] + (t.shape[1] - 1) * layout[1] + t.shape[2]
    columns = (t.shape[1] - 1) * layout[2] + head_dim
    view = t.as_strided((rows, columns), (stride_t, 1))
    return Tiles(view, (n, head_dim // parts), gluon_kernels().tiles), layout


def tile_steps(pass_name: str, seqlen: int, block_m: int, block_n: int, causal: bool,
               window_left: int | None) -> list[int]:
    """The steps of each tile's work item of pass_name, in item order (_hopper_kernels.work_item's key tiles
    of the backward, forward_item's query tiles of the forward, both the longest first under causal)."""
    tiles = seqlen // block_n
    if pass_name == "fwd":  # key tiles of block_n from the top one down to the first row's first key's
        tops = [tiles - 1 - j if causal else tiles - 1 for j in range(tiles)]
        first_rows = [(top if causal else j) * block_n for j, top in enumerate(tops)]
        bottoms = [0 if window_left is None else max(row - window_left, 0) // block_n for row in first_rows]
        return [top - bottom + 1 for top, bottom in zip(tops, bottoms, strict=True)]
    steps = []  # query steps of block_m, from the key tile's first key under causal, to its last query's
    for key0 in range(0, seqlen, block_n):
        end = seqlen
        if window_left is not None:
            end = min(seqlen, -(-(key0 + block_n + window_left) // block_m) * block_m)
        steps.append((end - (key0 if causal else 0)) // block_m)
    return steps


def work_schedule(pass_name: str, steps: list[int], heads: int, programs: int,
                  device: torch.device) -> torch.Tensor:
    """Which work items (tile j of head h: item j * heads + h) each of `programs` persistent programs runs,
    in order, as int32 on device: the programs' offsets into the items that follow them, the items, and one
    more (the kernels read the item after a program's last). steps: each tile's (tile_steps), a cost beside
    ITEM_STEPS[pass_name] an item.

    With two programs a head or more, tile-major rounds (the longest tiles first, across all heads) of one
    item a program, every other round walked back so that a heavy item is followed by a light one; a head's
    items run side by side and share its Q, dO and dQ sum in L2. With fewer, a head's items rarely ran at
    once and each streamed them from DRAM (xl's (4, 25, 2048, 64) backward read 628 MB for 160 MB of
    tensors): heads then start HEADS_A_CHUNK at a time, CHUNK_SHIFT tiles apart, and each item goes to the
    program that a model of the costs frees first (a list schedule), which rounds could not balance. Never
    in a CUDA graph capture (it is copied to the GPU)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flash_attention: this problem's first call is inside a CUDA graph capture; run "
                           "it once before capturing (its persistent kernel's work schedule is made then)")
    items: list[list[int]] = [[] for _ in range(programs)]
    if in_rounds(programs, heads):  # tile-major rounds of one item a program, every other one walked back
        for k in range(-(-len(steps) * heads // programs)):
            for p in range(programs):
                item = k * programs + (p if k % 2 == 0 else programs - 1 - p)
                if item < len(steps) * heads:
                    items[p].append(item)
    else:
        order = sorted((h // HEADS_A_CHUNK * CHUNK_SHIFT + j, j, h) for j in range(len(steps))
                       for h in range(heads))  # fmt: skip
        free = [(0.0, p) for p in range(programs)]
        for _, j, h in order:
            busy, p = heapq.heappop(free)
            items[p].append(j * heads + h)
            heapq.heappush(free, (busy + steps[j] + ITEM_STEPS[pass_name], p))
    offsets = [0, *itertools.accumulate(map(len, items))]
    table = offsets + [item for mine in items for item in mine] + [0]
    return torch.tensor(table, dtype=torch.int32).to(device)


def in_rounds(programs: int, heads: int) -> bool:
    """Whether work_schedule runs tile-major rounds (two programs a head or more), not a list schedule."""
    return programs >= 2 * heads


@functools.cache
def _no_schedule(device: torch.device) -> torch.Tensor:
    """The schedule argument of a launch of a program an item (the kernels read none)."""
    return torch.empty(0, dtype=torch.int32, device=device)


def _schedule_args(pass_name: str, q: torch.Tensor, block_m: int, block_n: int, band: dict[str, Any],
                   work_heads: int, heads_an_item: int, sm_count: int | None) -> dict[str, Any]:  # fmt: skip
    """PERSISTENT, ROUNDS and the work schedule of a launch with sm_count programs at most (launcher's grid),
    made once a problem; or with None a program an item. band: _band_args'. Where work_schedule would make
    rounds, the forward computes them in the kernel (ROUNDS) rather than read them: the read cost it 2-3%,
    while the backward ran as fast or faster with it."""
    if sm_count is None:
        return dict(PERSISTENT=False, ROUNDS=False, schedule=_no_schedule(q.device))
    programs = persistent_programs(q.shape[2] // block_n * work_heads, sm_count)
    if pass_name == "fwd" and in_rounds(programs, work_heads):
        return dict(PERSISTENT=True, ROUNDS=True, schedule=_no_schedule(q.device))
    window_left = band["window_left"] if band["WINDOW"] else None
    key = (pass_name, q.shape[2], block_m, block_n, band["CAUSAL"], window_left, work_heads, heads_an_item,
           sm_count, q.device)  # fmt: skip
    schedule = _schedules.get(key)
    if schedule is None:
        steps = [n * heads_an_item for n in tile_steps(pass_name, q.shape[2], block_m, block_n,
                                                       band["CAUSAL"], window_left)]  # fmt: skip
        schedule = _schedules[key] = work_schedule(pass_name, steps, work_heads, programs, q.device)
    return dict(PERSISTENT=True, ROUNDS=False, schedule=schedule)


def _descriptor_args(descriptors: dict[str, tuple[Tiles, tuple[int, int, int]]]) -> dict[str, Any]:
    """The kernels' arguments of each named descriptor: name_desc, and its head layout as name_zr, name_hr,
    name_hc."""
    args = {}
    for name, (tiles, (rows_per_z, rows_per_h, columns_per_h)) in descriptors.items():
        args.update({f"{name}_desc": tiles, f"{name}_zr": rows_per_z, f"{name}_hr": rows_per_h,
                     f"{name}_hc": columns_per_h})  # fmt: skip
    return args


def _band_args(is_causal: bool, mask_args: dict[str, Any]) -> dict[str, Any]:
    """CAUSAL, WINDOW and window_left from the plan's mask arguments: a band (supports: its right side 0)
    is causal attention that also hides keys more than window_left before the query."""
    band = mask_args["BAND"]
    return dict(CAUSAL=is_causal or band, WINDOW=band, window_left=mask_args["window_left"])


def forward_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 block_m: int, block_n: int, stages: int, is_causal: bool, scale: float,
                 mask_args: dict[str, Any], sm_count: int | None = None) -> dict[str, Any]:  # fmt: skip
    """attn_fwd's arguments: each consumer's block_m / 2 query rows, block_n keys a step; mask_args: the
    plan's (its band). sm_count: persistent programs, as many at most (launcher's grid), that run several
    work items (work_schedule's) and double-buffer Q, so that the next item's load overlaps the current
    one's last steps."""
    rows = block_m // 2
    descriptors = {"q": matrix(q, rows), "k": matrix(k, block_n), "v": matrix(v, block_n),
                   "o": matrix(out, rows)}  # fmt: skip
    head_args, band = _head_args(q, k), _band_args(is_causal, mask_args)
    schedule = _schedule_args("fwd", q, block_m, block_n, band, head_args["ZH"], 1, sm_count)
    return dict(**_descriptor_args(descriptors), **head_args, L=lse, qk_scale=scale * gluon_kernels().LOG2E,
                STAGES=stages, CONSUMER_REGS=CONSUMER_REGISTERS, **schedule, **band)  # fmt: skip


def backward_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                  dk: torch.Tensor, dv: torch.Tensor, dq_acc: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, block_m: int, block_n: int, stages: int, is_causal: bool,
                  scale: float, mask_args: dict[str, Any], sm_count: int | None = None,
                  per_kv_head: bool = False, consumers: int = 1) -> dict[str, Any]:  # fmt: skip
    """attn_bwd's arguments: descriptors as matrix makes them (dk and dv per query head, or with
    per_kv_head per K/V head; dq_acc: float32 (Z, H, T, d), zeroed) and over L and D as (Z*H*T,) vectors.
    sm_count: persistent programs, as many at most (launcher's grid), that run several work items
    (work_schedule's) and double-buffer K and V, so that the next item's load overlaps the current one's
    last steps. per_kv_head: a work item is a K/V head's key tile, through its group of query heads
    (work_items). consumers: the kernel's consumer partitions (BackwardConfig's), each of which stores its
    block_n / consumers keys' dK and dV and adds its d / consumers columns of dQ."""
    kernels = gluon_kernels()
    keys = block_n // consumers
    descriptors = {"q": matrix(q, block_m), "k": matrix(k, keys), "v": matrix(v, keys),
                   "do": matrix(grad_out, block_m), "dk": matrix(dk, keys), "dv": matrix(dv, keys)}
    head_args, band = _head_args(q, k), _band_args(is_causal, mask_args)
    heads_an_item = head_args["group"] if per_kv_head else 1
    head_args["ZH"] //= heads_an_item
    schedule = _schedule_args("bwd", q, block_m, block_n, band, head_args["ZH"], heads_an_item, sm_count)
    return dict(**_descriptor_args(descriptors), **head_args, dq_desc=matrix(dq_acc, block_m, consumers)[0],
                l_desc=Tiles(lse.view(-1), (block_m,), kernels.tiles),
                dl_desc=Tiles(delta.view(-1), (block_m,), kernels.tiles), qk_scale=scale * kernels.LOG2E,
                scale=scale, STAGES=stages, PER_KV_HEAD=per_kv_head, CONSUMERS=consumers, **schedule,
                LOADER_REGS=LOADER_REGISTERS, CONSUMER_REGS=CONSUMER_REGISTERS, **band)  # fmt: skip


def launcher(pass_name: str, work_items: int, config: ForwardConfig | BackwardConfig,
             sm_count: int) -> Launcher:
    """The Gluon kernel of pass_name over its grid: a program a work item (attn_fwd's query tile or
    attn_bwd's key tile of a head), or with config.persistent one program an SM (its shared memory holds
    one), each running its items of work_schedule's (forward_args and backward_args make it)."""
    grid = persistent_programs(work_items, sm_count) if config.persistent else work_items
    return Launcher(kernel(pass_name), (grid,), config)


def persistent_programs(work_items: int, sm_count: int) -> int:
    """A persistent launch's programs, one an SM at most: launcher's grid, among which _schedule_args
    divides the items (the kernels read a program's share by its id)."""
    return min(work_items, sm_count)


def _head_args(q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    """T, H (query heads), group (query heads per K/V head) and ZH (programs per query tile)."""
    batch, heads, seqlen = q.shape[:3]
    return dict(T=seqlen, H=heads, group=heads // k.shape[1], ZH=batch * heads)
