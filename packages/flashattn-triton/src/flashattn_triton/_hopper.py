"""The Gluon backend (sm_90): launchers and arguments of _hopper_kernels, written in Gluon, Triton's
lower-level dialect (explicit shared memory, TMA, mbarriers, asynchronous wgmma, warp specialization), against
Triton 3.6. ``available()`` says whether this Triton ships Gluon for Hopper, from its files; the kernels
module loads when a Gluon kernel first runs.

Forward (``attn_fwd``): FA3's ping-pong. Two 4-warp consumers of 64 query rows each take turns issuing S =
QKᵀ, so that one's softmax runs during the other's products; a loader streams 128-key tiles of K and V through
a ring of mbarrier-guarded stages.

Backward (``attn_bwd``): ``_kernels.attn_bwd``'s algorithm with ATOMIC_DQ. A program owns 128 keys of one (z,
h) in shared memory, and a one-warp loader streams the query tiles that see them (Q, dO, L, D). Per step, with
the keys as rows:

    S^T  = K Q^T ;  dP^T = V dO^T                 (dP^T runs during the softmax)
    P^T  = exp2(S^T * qk_scale - L2[q])           (L2 = L * log2 e)
    dV  += P^T dO ;  dS^T = P^T * (dP^T - D[q])
    dQ_q += scale * dS K                          (a TMA reduce-add of fp32; d = 128: dQ^T = K^T dS^T)
    dK  += dS^T Q

Both also run as persistent programs, one an SM, over a work schedule (``work_schedule``). The backward's
other forms (two consumer partitions, FA3's query-major steps at d = 128, a program a K/V head under
grouped-query attention) are BackwardConfig's flags. Each tensor is a matrix whose rows are its time steps
(``matrix``): (B, H, T, d) or (B, T, H, d) memory, with a head layout of its own. CAUSAL with WINDOW hides
keys more than window_left before the query.
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
# A work item's fixed cost in steps (its loads, its epilogue) in work_schedule's cost model, fitted to
# measured persistent programs.
ITEM_STEPS = {"fwd": 3.5, "bwd": 1.9}
# With fewer than two programs a head, heads start HEADS_A_CHUNK at a time, CHUNK_SHIFT tiles apart.
HEADS_A_CHUNK, CHUNK_SHIFT = 4, 2
_schedules: dict[tuple, torch.Tensor] = {}  # _schedule_args's, by problem and device


@functools.cache
def _gluon_shipped() -> bool:
    """Whether this Triton has Gluon for Hopper, read from its files: importing Gluon costs a process's first
    call time that one running Triton-language kernels only need not pay."""
    spec = importlib.util.find_spec("triton")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    gluon = [Path(root) / "experimental" / "gluon" for root in locations]
    return any((g / "language" / "nvidia" / "hopper").is_dir() and (g / "nvidia" / "hopper.py").is_file()
               for g in gluon)  # fmt: skip


def available() -> bool:
    """Whether the Gluon kernels can be offered: this Triton ships Gluon for Hopper and FLASHATTN_TRITON_GLUON
    is not 0."""
    if not env_flag("FLASHATTN_TRITON_GLUON", True):
        return False
    return _gluon_shipped()


def head_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(zr, hr, hc) of a (Z, H, T, d) tensor over the matrix of its time steps (``matrix``): head (z, h)
    starts at row z * zr + h * hr, column h * hc. (Z, H, T, d) memory: hr = T, hc = 0; (Z, T, H, d) memory (a
    model's transposed or fused projection): hr = 0, hc = d's stride. None for another layout, or one TMA
    cannot take (16-byte aligned start and strides, unit stride along d)."""
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
    """A descriptor moving n-row tiles (of d / parts columns: a consumer partition's share) over the matrix of
    t's time steps, and head_layout(t)."""
    layout = head_layout(t)
    stride_t, head_dim = t.stride(2), t.shape[-1]
    rows = (t.shape[0] - 1) * layout[0] + (t.shape[1] - 1) * layout[1] + t.shape[2]
    columns = (t.shape[1] - 1) * layout[2] + head_dim
    view = t.as_strided((rows, columns), (stride_t, 1))
    return Tiles(view, (n, head_dim // parts), gluon_kernels().tiles), layout


def tile_steps(pass_name: str, seqlen: int, block_m: int, block_n: int, causal: bool,
               window_left: int | None) -> list[int]:
    """The steps of each tile's work item, in item order (the backward's key tiles, the forward's query tiles;
    the longest first under causal)."""
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
    """Which work items (tile j of head h: item j * heads + h) each of `programs` persistent programs runs, as
    int32 on device: the programs' offsets, their items, and one more (the kernels read the item after a
    program's last). steps: each tile's (tile_steps), beside ITEM_STEPS[pass_name] an item.

    With two programs a head or more: tile-major rounds of one item a program, every other round walked back
    (a heavy item then a light one), so a head's items run side by side and share its tensors in L2. With
    fewer, a head's items rarely ran at once and each streamed them from DRAM: heads then start HEADS_A_CHUNK
    at a time, CHUNK_SHIFT tiles apart, each item going to the program a cost model frees first. Never in a
    CUDA graph capture (it is copied to the GPU)."""
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
    """PERSISTENT, ROUNDS and the work schedule of a launch of at most sm_count programs (made once a
    problem), or with None a program an item. The forward computes rounds in the kernel (ROUNDS) rather than
    read them."""
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
    """The kernels' arguments of each named descriptor: name_desc and its head layout (name_zr, name_hr,
    name_hc)."""
    args = {}
    for name, (tiles, (rows_per_z, rows_per_h, columns_per_h)) in descriptors.items():
        args.update({f"{name}_desc": tiles, f"{name}_zr": rows_per_z, f"{name}_hr": rows_per_h,
                     f"{name}_hc": columns_per_h})  # fmt: skip
    return args


def _band_args(is_causal: bool, mask_args: dict[str, Any]) -> dict[str, Any]:
    """CAUSAL, WINDOW and window_left from the plan's mask arguments: the Gluon kernels' band is causal,
    hiding keys more than window_left before the query."""
    band = mask_args["BAND"]
    return dict(CAUSAL=is_causal or band, WINDOW=band, window_left=mask_args["window_left"])


def forward_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 block_m: int, block_n: int, stages: int, is_causal: bool, scale: float,
                 mask_args: dict[str, Any], sm_count: int | None = None) -> dict[str, Any]:  # fmt: skip
    """attn_fwd's arguments: each consumer's block_m / 2 query rows, block_n keys a step. sm_count: persistent
    programs, as many at most, that double-buffer Q."""
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
    """attn_bwd's arguments: descriptors as matrix makes them (dk, dv per query head, or per K/V head with
    per_kv_head; dq_acc float32 (Z, H, T, d), zeroed), L and D as vectors. sm_count: persistent programs, as
    many at most, that double-buffer K and V. consumers: partitions that each store block_n / consumers keys'
    dK, dV and add d / consumers columns of dQ."""
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
    """The Gluon kernel of pass_name over a program a work item, or with config.persistent one an SM at most.
    """
    grid = persistent_programs(work_items, sm_count) if config.persistent else work_items
    return Launcher(kernel(pass_name), (grid,), config)


def persistent_programs(work_items: int, sm_count: int) -> int:
    """A persistent launch's programs: one an SM at most."""
    return min(work_items, sm_count)


def _head_args(q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    """T, H (query heads), group (query heads per K/V head) and ZH (programs per query tile)."""
    batch, heads, seqlen = q.shape[:3]
    return dict(T=seqlen, H=heads, group=heads // k.shape[1], ZH=batch * heads)
