"""Dropout of attention probabilities from a counter-based generator, so that the backward regenerates the
forward's mask instead of storing it.

A call draws ``rng = (seed, offset)`` (int64, shape (2,)) from torch's default generator for the device
(:func:`draw_rng`), so ``torch.manual_seed(s)`` before two calls gives the same masks. Probability (b, h,
i, j) is kept iff Philox4x32-10 (Triton's ``tl.randint``: key = the seed's two halves, counter = (offset
+ n, its high half, 0, 0)) at n = b * stride_b + h * stride_h + i * stride_i + j gives at least
``threshold(p) = round(p * 2**32)``; kept ones are scaled by 1 / (1 - p). :func:`philox` computes the same
numbers as ``tl.randint`` with int64 tensor arithmetic on any device, so the PyTorch path and the kernels
drop the same probabilities.
"""

from __future__ import annotations

import dataclasses

import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
SEED_BITS = 62  # seeds and offsets drawn below 2**62: the counters added to an offset stay below 2**63


def draw_rng(device: torch.device) -> torch.Tensor:
    """(seed, offset), int64, drawn from torch's default generator for `device` (also under CUDA graph
    capture, where the draw is part of the graph)."""
    return torch.randint(0, 2**SEED_BITS, (2,), dtype=torch.int64, device=device)


def check_rng(dropout_p: float, rng_state: torch.Tensor | None) -> None:
    """An implementation's check that a call with dropout came with its (seed, offset)."""
    if dropout_p > 0.0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state, the (seed, offset) of _dropout.draw_rng")


def threshold(dropout_p: float) -> int:
    """A 32-bit random number r drops its probability iff r < threshold(dropout_p)."""
    return min(round(dropout_p * 2**32), _MASK32)


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b, for a < 2**32 and b a tensor of values < 2**32, in int64 without
    overflow: b is split into 16-bit halves."""
    low_part = (b & 0xFFFF) * a  # < 2**48
    high_part = (b >> 16) * a
    high = (high_part + (low_part >> 16)) >> 16
    low = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return high, low


def philox(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.randint(seed, counter)`` (uint32 values, held in int64) for int64 counters >= 0."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(ROUNDS):
        high_b, low_b = _mul_hi_lo(_ROUND_B, c2)
        high_a, low_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0


@dataclasses.dataclass(frozen=True)
class Dropout:
    """The dropout of one problem: probability p, rng = (seed, offset), and the counter strides of a
    (batch, head, query row) step; the counter of key j is offset + base + those steps + j."""

    p: float
    rng: torch.Tensor
    stride_b: int
    stride_h: int
    stride_i: int
    base: int = 0

    @classmethod
    def dense(cls, p: float, rng: torch.Tensor, heads: int, seqlen_q: int, seqlen_k: int) -> Dropout:
        """The counters of a (B, H, Tq, Tk) problem: its elements numbered in row-major order."""
        return cls(p, rng, heads * seqlen_q * seqlen_k, seqlen_q * seqlen_k, seqlen_k)

    def scale_tile(self, batch: int, heads: int, rows: range, cols: range) -> torch.Tensor:
        """float32 (batch, heads, len(rows), len(cols)): 1 / (1 - p) where kept, 0 where dropped."""
        device = self.rng.device
        counter = (
            torch.arange(batch, device=device).view(-1, 1, 1, 1) * self.stride_b
            + torch.arange(heads, device=device).view(-1, 1, 1) * self.stride_h
            + torch.arange(rows.start, rows.stop, device=device).view(-1, 1) * self.stride_i
            + torch.arange(cols.start, cols.stop, device=device)
            + (self.base + self.rng[1])
        )
        kept = philox(self.rng[0], counter) >= threshold(self.p)
        return kept.to(torch.float32) / (1.0 - self.p)
