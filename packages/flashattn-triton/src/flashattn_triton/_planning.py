"""Planning: from a problem to the configs its kernels may run with, as a pure function.

``candidates(problem)`` is what the launcher tunes among at run time (triton_impl) and what
``scripts/tune.py`` times offline; the default (untuned) config is its first. ``Problem.size_key`` names the
problem's size class: problems of one class share their tuned choice (_tuning).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flashattn_triton._configs import (
    BackwardConfig,
    ForwardConfig,
    backward_candidates,
    forward_candidates,
    hopper_candidates,
    with_split_key_tiles,
)
from flashattn_triton._validation import UNBOUNDED, check_window

# Problems below this much work (problem_work: T = 32768 at B * H = 1 and d <= 64) are host-bound or
# close to it: a call's Python and launches take about as long as its kernels. Their backward adds dQ up
# without atomics (whose float32 sum costs two more tensor ops) and computes D = rowsum(dO * O) in its
# kernel, saving the preprocess launch; their forward may split its key tiles among programs; the Gluon
# kernels, tuned for throughput, are left to larger problems.
SMALL_PROBLEM_WORK = 32768 * 32768 * 64
# ... and whose query tiles of 128 rows, over all heads, are at most about two waves of an H100's 132 SMs:
# with more, the GPU is busy enough that the preprocess launch beats D's loads in every step, and atomic dQ
# can pay.
SMALL_PROBLEM_TILES = 256

Band = tuple[int, int]  # (window_left, window_right) of the kernels' BAND


def band_of(window: object, is_causal: bool) -> Band | None:
    """The band of triton_impl's window=(left, right), -1 unbounded (flash-attn's convention, checked here),
    with right = 0 under is_causal: None where it is no band, or is_causal's mask alone (the kernels'
    CAUSAL)."""
    if window is None:
        return None
    left, right = check_window(window)
    if is_causal:
        right = 0
    if left == UNBOUNDED and right == (0 if is_causal else UNBOUNDED):
        return None
    return left, right


def kernel_band(band: Band | None, seqlen_q: int, seqlen_k: int) -> dict[str, Any]:
    """The kernels' band arguments: an unbounded side (and one wider than the sequences) as the length
    that reaches every key, so that the kernels only see small nonnegative integers."""
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
    """Query-key pairs times the head dim, counted as at least 64: below it a kernel's time per pair stops
    falling with d (the softmax's exponentials, each tile's fixed costs), so long sequences of small
    heads are large problems."""
    return batch_heads * seqlen_q * seqlen_k * max(head_dim, 64)


def is_small_problem(batch_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> bool:
    """Whether a problem takes the small-problem path: its problem_work below SMALL_PROBLEM_WORK and its
    query tiles at most SMALL_PROBLEM_TILES."""
    tiles = batch_heads * -(-seqlen_q // 128)
    return problem_work(batch_heads, seqlen_q, seqlen_k, head_dim) < SMALL_PROBLEM_WORK and (
        tiles <= SMALL_PROBLEM_TILES)


def size_class(n: int) -> int:
    """n rounded up to a power of two: problems in one class share their tuned config."""
    return 1 << max(0, n - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Problem:
    """One pass ("fwd" or "bwd") of one attention problem, as far as choosing its kernels goes.

    head_dim is the kernels' (padded to 16 bytes a row); hopper: whether the Gluon kernel can run this
    layout (_dispatch); sm_count: the GPU's (0 under the interpreter); deterministic: the backward
    must be bitwise repeatable (no atomic dQ); band_span: under a band (a sliding window), the keys a
    query row's band spans, at most seqlen_k (0: no band); dropout: the pass drops probabilities (the
    Gluon kernels do not); group: query heads per K/V head (grouped-query attention above 1; batch_heads
    counts query heads); varlen: packed sequences (batch_heads, seqlen_q and seqlen_k those of the longest
    sequences), which neither the Gluon kernels nor the split key tiles take."""

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
        """What a tuned choice is kept by: everything candidates() reads, lengths, heads and a band's span
        by size class (the span sets how many key tiles a query tile walks, and how many of them are
        masked edges: a window of 128 and one of 4096 favor different tiles), and the group by size class:
        a group's query heads read one K/V head, whose tiles then come from L2 more often than from memory,
        and the backward sums their dK and dV after, so the fastest config of a grouped problem need not be
        that of one without groups. Packed sequences add "varlen" (the keys of other problems are as
        they were)."""
        return (self.pass_name, self.block_d, str(self.dtype).removeprefix("torch."), self.is_causal,
                self.precision, size_class(max(self.seqlen_q, self.seqlen_k)), size_class(self.batch_heads),
                size_class(self.group), self.uses_hopper, self.deterministic,
                self.band_span and size_class(self.band_span), self.dropout,
                *("varlen",) * self.varlen)  # fmt: skip

    @property
    def uses_hopper(self) -> bool:
        """Whether the Gluon kernels are among the candidates: where the dispatch table chose them."""
        return self.hopper


def candidates(problem: Problem) -> list[ForwardConfig | BackwardConfig]:
    """The configs problem's pass may run with, the default first. They depend on the problem through its
    size_key only (split key tiles are decided by the size class), so one tuned choice serves a class."""
    table = forward_candidates if problem.pass_name == "fwd" else backward_candidates
    listed: list = table(problem.block_d, problem.element_size, problem.interpret)
    seqlen_class = size_class(max(problem.seqlen_q, problem.seqlen_k))
    if problem.pass_name == "bwd" and (problem.small or problem.deterministic):
        # Host-bound problems skip the atomic dQ (see SMALL_PROBLEM_WORK); a deterministic backward must.
        exact = [c for c in listed if not c.atomic_dq]
        if exact or problem.deterministic:
            listed = exact or [dataclasses.replace(listed[0], atomic_dq=False)]
    if problem.pass_name == "fwd" and problem.small and problem.sm_count and not problem.varlen:
        # A query tile walks the keys of its band only: a band's split pays where that span is long.
        key_class = size_class(problem.band_span) if problem.band_span else seqlen_class
        listed = with_split_key_tiles(listed, seqlen_class, key_class, size_class(problem.batch_heads),
                                      problem.sm_count)  # fmt: skip
    if problem.uses_hopper:  # after the default: untuned runs (FLASHATTN_TRITON_AUTOTUNE=0) keep the
        # portable kernel, and the tuner skips a Gluon build that another Triton version refuses
        # A program a K/V head's key tile runs the group's query heads in turn: balanced where every key
        # tile has the same work (not causal, no band).
        per_kv_head = problem.group > 1 and not (problem.is_causal or problem.band_span)
        listed = listed + hopper_candidates(problem.pass_name, problem.block_d, per_kv_head)
    return listed


def describe(config: ForwardConfig | BackwardConfig) -> str:
    """The numbers of a config joined by '/', then its flags, its kv_splits and consumers beyond 1 and the dQ
    launch's own steps and stages by name."""
    flags = ("hopper", "persistent", "per_kv_head", "transposed_grads", "split")
    dq_steps = ("dq_block_m", "dq_stages")
    numbers = [x for name, x in dataclasses.asdict(config).items()
               if name not in (*flags, "kv_splits", "consumers", *dq_steps) and x is not None]  # fmt: skip
    named = [name for name in flags if getattr(config, name, False)]
    for name in ("kv_splits", "consumers"):
        count = getattr(config, name, 1)
        named += [f"{name}={count}"] * (count > 1)
    named += [f"{name}={getattr(config, name)}" for name in dq_steps if getattr(config, name, None)]
    return " ".join(["/".join(str(int(x)) for x in numbers), *named])
