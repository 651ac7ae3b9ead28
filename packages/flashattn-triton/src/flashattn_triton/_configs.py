"""The tuned Triton kernels' configs (block sizes, warps, stages) and planning: ``candidates(problem)``, the
configs a problem may run with (the default first), which the launcher tunes among and ``scripts/tune.py``
times offline; problems of one ``Problem.size_key`` share a tuned choice (_tuning). Where no candidate fits a
GPU's shared memory, :func:`smaller` steps down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from flashattn_triton._validation import UNBOUNDED, check_window


def _check_blocks(config: object, names: list[str], largest: int) -> None:
    for name in names:
        size = getattr(config, name)
        if size < 16 or size > largest or size & (size - 1):
            raise ValueError(f"{name}={size}: block sizes are powers of two from 16 to {largest}")


MAX_KV_SPLITS = 16


@dataclass(frozen=True)
class ForwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # a per-thread register cap (Triton's maxnreg): more programs per SM
    hopper: bool = False  # the Gluon kernel of _hopper: two consumers of block_m / 2 rows, num_warps each
    # Programs per query tile, each walking a share of its key tiles, combined by a second launch.
    kv_splits: int = 1
    # The Gluon kernel in persistent programs (one an SM), each item's loads overlapping the last one's end.
    persistent: bool = False

    def __post_init__(self) -> None:
        _check_blocks(self, ["block_m", "block_n"], 256)
        if self.persistent and not self.hopper:
            raise ValueError(f"{self}: persistent programs are the Gluon kernel's (hopper=True)")
        if not (isinstance(self.kv_splits, int) and 1 <= self.kv_splits <= MAX_KV_SPLITS):
            raise ValueError(f"kv_splits={self.kv_splits}: an int from 1 to {MAX_KV_SPLITS}")
        if self.hopper and self.kv_splits > 1:
            raise ValueError(f"{self}: the Hopper forward walks every key tile of a query tile (kv_splits=1)")
        if self.hopper and not (self.block_n == self.block_m and self.num_warps * 32 == self.block_m
                                and self.num_stages >= 2):  # fmt: skip
            raise ValueError(f"{self}: the Hopper forward needs block_n = block_m, num_warps = block_m / 32 "
                             "(two consumers of 16 rows a warp) and num_stages >= 2")


@dataclass(frozen=True)
class BackwardConfig:
    """A program owns block_n keys and queries, stepping through queries block_m at a time for dK/dV and keys
    for dQ; atomic_dq adds dQ atomically in the dK/dV loop. hopper: the Gluon kernel (num_stages ring stages,
    consumers partitions of num_warps warps). transposed_grads accumulates dKᵀ, dVᵀ, dQᵀ (every operand
    K-major); split runs dK/dV and dQ as two launches, the dQ one with dq_block_m and dq_stages where given.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    atomic_dq: bool = False
    max_registers: int | None = None
    hopper: bool = False
    transposed_grads: bool = False
    split: bool = False
    dq_block_m: int | None = None
    dq_stages: int | None = None
    # The Gluon kernel in persistent programs (one an SM), each item's loads overlapping the last one's end.
    persistent: bool = False
    # The Gluon kernel with a program a K/V head's key tile through its group's query heads (dK, dV summed).
    per_kv_head: bool = False
    # The Gluon kernel's consumer partitions: two over half the keys each skip steps that see none of theirs.
    consumers: int = 1

    def __post_init__(self) -> None:
        # 128 at most: the atomic variant pads its float32 dQ to whole tiles of 128 rows.
        _check_blocks(self, ["block_m", "block_n"], 128)
        if self.dq_block_m is not None:
            _check_blocks(self, ["dq_block_m"], 128)
        if (self.dq_block_m is not None or self.dq_stages is not None) and not self.split:
            raise ValueError(f"{self}: dq_block_m and dq_stages belong to a split backward's dQ launch "
                             "(split=True)")
        if self.dq_stages is not None and not (isinstance(self.dq_stages, int) and self.dq_stages >= 1):
            raise ValueError(f"dq_stages={self.dq_stages}: an int from 1")
        fits_hopper = (self.atomic_dq and self.consumers * self.num_warps * 16 == self.block_n
                       and self.num_stages >= 2)  # fmt: skip
        if self.hopper and not fits_hopper:
            raise ValueError(f"{self}: the Hopper kernel adds dQ atomically (atomic_dq=True), gives each "
                             "warp 16 keys (num_warps = block_n / 16 / consumers) and needs num_stages >= 2")
        if self.consumers not in (1, 2) or (self.consumers == 2 and not (
                self.hopper and self.block_m * 2 == self.block_n and not self.per_kv_head)):
            raise ValueError(f"consumers={self.consumers}: 1, or 2 in the Hopper kernel (hopper=True) with "
                             "block_m = block_n / 2 and not per_kv_head")
        if self.persistent and not self.hopper:
            raise ValueError(f"{self}: persistent programs are the Gluon kernel's (hopper=True)")
        if self.per_kv_head and not (self.hopper and not self.persistent):
            raise ValueError(f"{self}: a program a K/V head is the Gluon kernel's (hopper=True), not "
                             "persistent")
        if self.atomic_dq and (self.transposed_grads or self.split):
            raise ValueError(f"{self}: transposed_grads and split change the dQ phase, which atomic_dq skips")


# Small tiles for the interpreter: several tiles per test problem, so every mask path runs.
INTERPRETER_FORWARD = ForwardConfig(32, 16, 4, 1)
INTERPRETER_BACKWARD = BackwardConfig(16, 32, 4, 1)

F, B = ForwardConfig, BackwardConfig
# Candidates per (block_d, bytes per element), the untuned default first, each building for sm_90 without
# register spills in its loops but one (lab/flashattn-triton/decisions.md: #tune-candidates). float32's
# backward from d = 64 accumulates transposed gradients (every TF32 operand K-major); at d = 128 it also runs
# as two launches (#fp32-split-backward) and avoids 8-warp tiles, whose spills cost most.
_FORWARD = {
    (64, 2): [F(64, 128, 4, 3), F(64, 128, 4, 4), F(64, 64, 4, 3), F(64, 128, 4, 2)],
    (128, 2): [F(64, 64, 4, 3), F(128, 64, 8, 3), F(64, 128, 4, 2)],
    (256, 2): [F(64, 32, 4, 2)],
    (32, 4): [F(64, 64, 4, 2)],
    (64, 4): [F(64, 64, 4, 2), F(64, 32, 4, 2), F(128, 64, 8, 2)],
    (128, 4): [F(64, 32, 4, 2)],
    (256, 4): [F(64, 32, 8, 1)],
}
_BACKWARD = {
    (64, 2): [B(64, 64, 4, 3, True), B(64, 128, 8, 2), B(32, 64, 4, 3), B(64, 64, 4, 4, True),
              B(32, 64, 4, 4, max_registers=128), B(64, 64, 4, 4), B(32, 128, 8, 2)],
    (128, 2): [B(64, 128, 8, 2), B(32, 128, 8, 2), B(32, 64, 4, 3)],
    (256, 2): [B(16, 64, 8, 1)],
    (32, 4): [B(32, 64, 4, 2)],
    (64, 4): [B(32, 128, 8, 2), B(32, 64, 4, 3, transposed_grads=True), B(32, 64, 4, 1)],
    (128, 4): [B(16, 64, 4, 3, transposed_grads=True),
               B(32, 64, 4, 2, transposed_grads=True, split=True, dq_block_m=16, dq_stages=3)],
    (256, 4): [B(32, 32, 8, 1)],
}


def _row(table: dict, block_d: int, element_size: int) -> list:
    # Head dims up to 64 (and float32's up to 32) share the candidates of the next size up. A copy: a
    # caller's list may grow (split key tiles, a test's variants) without changing the table.
    smallest = 64 if element_size == 2 else 32
    return list(table[(max(block_d, smallest), element_size)])


def forward_candidates(block_d: int, element_size: int, interpret: bool) -> list[ForwardConfig]:
    return [INTERPRETER_FORWARD] if interpret else _row(_FORWARD, block_d, element_size)


# Split key tiles (ForwardConfig.kv_splits) are tried where one program a query tile leaves the GPU short of
# work (fewer programs than two an SM) and chains are long enough for the split to pay for its combine.
KV_SPLITS = (2, 4, 8)
SPLIT_MIN_KEY_TILES = 16


def with_split_key_tiles(candidates: list[ForwardConfig], seqlen_q: int, seqlen_k: int, batch_heads: int,
                         sm_count: int) -> list[ForwardConfig]:  # fmt: skip
    """The candidates, then each that leaves the GPU short of work with its key tiles split KV_SPLITS ways."""
    short = [c for c in candidates if not c.hopper and seqlen_k >= SPLIT_MIN_KEY_TILES * c.block_n
             and -(-seqlen_q // c.block_m) * batch_heads < 2 * sm_count]  # fmt: skip
    return candidates + [replace(c, kv_splits=n) for n in KV_SPLITS for c in short]


def backward_candidates(block_d: int, element_size: int, interpret: bool) -> list[BackwardConfig]:
    return [INTERPRETER_BACKWARD] if interpret else _row(_BACKWARD, block_d, element_size)


# The Gluon kernels (Triton 3.6), timed after the Triton-language candidates where _dispatch takes them. The
# register cap covers the program; its warp-specialized partitions trade registers (setmaxnreg). The
# backward per head dim (up to 64: 64's): at d = 128, 32 query rows a step with transposed scores or 64 in
# FA3's query-major form; up to d = 64 also persistent (at d = 128 they would need 2 stages, which lost)
# and as two consumer partitions of 4 warps.
HOPPER_FORWARD = [F(128, 128, 4, 2, max_registers=168, hopper=True),
                  F(128, 128, 4, 2, max_registers=168, hopper=True, persistent=True)]
HOPPER_BACKWARD = {
    64: [B(64, 128, 8, 4, atomic_dq=True, max_registers=168, hopper=True),
         B(64, 128, 8, 4, atomic_dq=True, max_registers=168, hopper=True, persistent=True),
         B(64, 128, 4, 4, atomic_dq=True, max_registers=168, hopper=True, consumers=2),
         B(64, 128, 4, 4, atomic_dq=True, max_registers=168, hopper=True, persistent=True, consumers=2)],
    128: [B(32, 128, 8, 4, atomic_dq=True, max_registers=168, hopper=True),
          B(64, 128, 8, 2, atomic_dq=True, max_registers=168, hopper=True),
          B(64, 128, 8, 3, atomic_dq=True, max_registers=168, hopper=True)],
}
# Programs a K/V head's key tile through its group's query heads (GQA without causal masks): the 64-row
# d = 128 kernels only; elsewhere the loop over the heads spilled.
HOPPER_BACKWARD_PER_KV_HEAD = {128: [replace(c, per_kv_head=True) for c in HOPPER_BACKWARD[128][1:]]}


def hopper_candidates(pass_name: str, block_d: int,
                      per_kv_head: bool = False) -> list[ForwardConfig | BackwardConfig]:
    """The Gluon kernel's candidates for pass_name at head dim block_d; with per_kv_head, also the backward's
    programs a K/V head's tile (grouped-query attention)."""
    if pass_name == "fwd":
        return list(HOPPER_FORWARD)
    own = max(block_d, 64)
    return HOPPER_BACKWARD[own] + (HOPPER_BACKWARD_PER_KV_HEAD.get(own, []) if per_kv_head else [])


def dq_launch(config: BackwardConfig) -> BackwardConfig:
    """The config of a split backward's dQ launch: its own steps and stages where it has them."""
    return replace(config, block_m=config.dq_block_m or config.block_m, num_stages=config.dq_stages or
                   config.num_stages, dq_block_m=None, dq_stages=None)  # fmt: skip


def smaller(config: ForwardConfig | BackwardConfig) -> ForwardConfig | BackwardConfig | None:
    """The next config down for a GPU with less shared memory: Gluon to the Triton-language kernel, a split's
    own dQ steps dropped, then fewer stages, then smaller tiles."""
    if config.hopper:
        kernel_only = {"per_kv_head": False, "consumers": 1} if isinstance(config, BackwardConfig) else {}
        return replace(config, hopper=False, max_registers=None, persistent=False, **kernel_only)
    if getattr(config, "dq_block_m", None) or getattr(config, "dq_stages", None):
        return replace(config, dq_block_m=None, dq_stages=None)
    if config.num_stages > 1:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 16:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 16:
        return replace(config, block_m=config.block_m // 2)
    return None


# Problems below this much work (T = 32768 at B * H = 1, d <= 64), and with at most about two waves of
# 128-row query tiles on an H100, are host-bound: their backward adds dQ without atomics and computes
# D = rowsum(dO * O) in its kernel (one launch fewer), their forward may split key tiles, and the Gluon
# kernels, tuned for throughput, are left to larger problems.
SMALL_PROBLEM_WORK = 32768 * 32768 * 64
SMALL_PROBLEM_TILES = 256

Band = tuple[int, int]  # (window_left, window_right) of the kernels' BAND


def band_of(window: object, is_causal: bool) -> Band | None:
    """The band of triton_impl's window=(left, right) (-1 unbounded, checked here), right = 0 under is_causal;
    None where it is no band or is_causal alone (the kernels' CAUSAL)."""
    if window is None:
        return None
    left, right = check_window(window)
    if is_causal:
        right = 0
    if left == UNBOUNDED and right == (0 if is_causal else UNBOUNDED):
        return None
    return left, right


def kernel_band(band: Band | None, seqlen_q: int, seqlen_k: int) -> dict[str, Any]:
    """The kernels' band arguments, an unbounded or too wide side as the length that reaches every key."""
    if band is None:
        return {"window_left": 0, "window_right": 0, "BAND": False}
    left, right = band
    return {"window_left": seqlen_q if left == UNBOUNDED else min(left, seqlen_q),
            "window_right": seqlen_k if right == UNBOUNDED else min(right, seqlen_k),
            "BAND": True}  # fmt: skip


def band_span(band: Band | None, seqlen_q: int, seqlen_k: int) -> int:
    """Problem.band_span: the keys a query row's band spans (0 without a band)."""
    if band is None:
        return 0
    bounds = kernel_band(band, seqlen_q, seqlen_k)
    return min(bounds["window_left"] + bounds["window_right"] + 1, seqlen_k)


def problem_work(batch_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> int:
    """Query-key pairs times the head dim, counted as at least 64 (below it a kernel's time per pair stops
    falling with d)."""
    return batch_heads * seqlen_q * seqlen_k * max(head_dim, 64)


def is_small_problem(batch_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> bool:
    """Whether a problem takes the small-problem path (SMALL_PROBLEM_WORK, SMALL_PROBLEM_TILES)."""
    tiles = batch_heads * -(-seqlen_q // 128)
    return problem_work(batch_heads, seqlen_q, seqlen_k, head_dim) < SMALL_PROBLEM_WORK and (
        tiles <= SMALL_PROBLEM_TILES)


def size_class(n: int) -> int:
    """n rounded up to a power of two: problems in one class share their tuned config."""
    return 1 << max(0, n - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


@dataclass(frozen=True)
class Problem:
    """One pass ("fwd" or "bwd") of one attention problem, as far as choosing its kernels goes: head_dim
    padded to 16 bytes a row; hopper: the dispatch table chose the Gluon kernels; sm_count: 0 under the
    interpreter; band_span: the keys a query row's band spans (0: no band); group: query heads per K/V head
    (batch_heads counts query heads); varlen: packed sequences, seqlen_q and seqlen_k the longest."""

    pass_name: str
    batch_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    is_causal: bool
    precision: str
    sm_count: int
    interpret: bool = False
    hopper: bool = False
    deterministic: bool = False
    band_span: int = 0
    dropout: bool = False
    group: int = 1
    varlen: bool = False

    @property
    def small(self) -> bool:
        return is_small_problem(self.batch_heads, self.seqlen_q, self.seqlen_k, self.head_dim)

    @property
    def block_d(self) -> int:
        return block_d(self.head_dim)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def size_key(self) -> tuple:
        """What a tuned choice is kept by: all that candidates() reads, with lengths, heads, a band's span and
        the group by size class (a span sets how many key tiles a query tile walks; a group's K/V tiles come
        from L2 more often). Packed sequences add "varlen"."""
        return (self.pass_name, self.block_d, str(self.dtype).removeprefix("torch."), self.is_causal,
                self.precision, size_class(max(self.seqlen_q, self.seqlen_k)), size_class(self.batch_heads),
                size_class(self.group), self.hopper, self.deterministic,
                self.band_span and size_class(self.band_span), self.dropout,
                *("varlen",) * self.varlen)  # fmt: skip


def candidates(problem: Problem) -> list[ForwardConfig | BackwardConfig]:
    """The configs a problem's pass may run with, the default first: a function of its size_key, so that one
    tuned choice serves a class."""
    table = forward_candidates if problem.pass_name == "fwd" else backward_candidates
    listed: list = table(problem.block_d, problem.element_size, problem.interpret)
    seqlen_class = size_class(max(problem.seqlen_q, problem.seqlen_k))
    if problem.pass_name == "bwd" and (problem.small or problem.deterministic):
        # Host-bound problems skip the atomic dQ (see SMALL_PROBLEM_WORK); a deterministic backward must.
        exact = [c for c in listed if not c.atomic_dq]
        if exact or problem.deterministic:
            listed = exact or [replace(listed[0], atomic_dq=False)]
    if problem.pass_name == "fwd" and problem.small and problem.sm_count and not problem.varlen:
        # A query tile walks the keys of its band only: a band's split pays where that span is long.
        key_class = size_class(problem.band_span) if problem.band_span else seqlen_class
        listed = with_split_key_tiles(listed, seqlen_class, key_class, size_class(problem.batch_heads),
                                      problem.sm_count)  # fmt: skip
    if problem.hopper:  # after the default: untuned runs (FLASHATTN_TRITON_AUTOTUNE=0) keep the
        # portable kernel, and the tuner skips a Gluon build that another Triton version refuses. A program
        # a K/V head's tile is balanced where every key tile has the same work (not causal, no band).
        per_kv_head = problem.group > 1 and not (problem.is_causal or problem.band_span)
        listed = listed + hopper_candidates(problem.pass_name, problem.block_d, per_kv_head)
    return listed


def describe(config: ForwardConfig | BackwardConfig) -> str:
    """A config's numbers joined by '/', then its flags, kv_splits and consumers beyond 1, and the dQ launch's
    steps and stages by name."""
    flags = ("hopper", "persistent", "per_kv_head", "transposed_grads", "split")
    dq_steps = ("dq_block_m", "dq_stages")
    numbers = [x for name, x in asdict(config).items()
               if name not in (*flags, "kv_splits", "consumers", *dq_steps) and x is not None]  # fmt: skip
    named = [name for name in flags if getattr(config, name, False)]
    for name in ("kv_splits", "consumers"):
        count = getattr(config, name, 1)
        named += [f"{name}={count}"] * (count > 1)
    named += [f"{name}={getattr(config, name)}" for name in dq_steps if getattr(config, name, None)]
    return " ".join(["/".join(str(int(x)) for x in numbers), *named])
