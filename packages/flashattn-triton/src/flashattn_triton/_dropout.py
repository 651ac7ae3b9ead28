"""Dropout of attention probabilities from a counter-based generator, so that the backward regenerates the
forward's mask instead of storing it.

A call draws ``rng = (seed, offset)`` (int64, (2,)) from torch's default generator for the device
(:func:`draw_rng`): ``torch.manual_seed(s)`` repeats the masks. One Philox4x32-10 call (``tl.randint4x``: key
= the seed's halves, counter = (c, its high half, 0, 0)) gives four 32-bit outputs, 16 bytes, one for each of
16 adjacent keys of a row: key j takes byte j % 4 of output j // 4, from the least significant. Probability
(b, h, i, j) takes byte j % 16 of the call at c = offset + b * stride_b + h * stride_h + i * stride_i + j //
16, rows ``ceil(Tk / 16)`` calls apart (:meth:`Dropout.dense`): the row-major (B, H, Tq, Tk) counter space,
rows padded to 16 keys.

A probability is dropped iff its byte is below ``threshold(p)`` = round(p * 256), within [1, 255] for 0 < p <
1 (0 for p = 0, 256 for p = 1), so the effective p is threshold(p) / 256 (:func:`effective_p`; 0.1 becomes
0.1015625), and kept ones are scaled by ``kept_scale(p)`` = 1 / (1 - effective p), which keeps the expectation
exact. (SDPA's flash backend also draws bytes and drops 0.1015625 for p = 0.1, but scales by 1 / (1 - p).)
:func:`philox` computes ``tl.randint4x``'s outputs with int64 tensor arithmetic, so the PyTorch path drops
what the kernels drop.
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
    """(seed, offset), int64, from torch's default generator for `device` (under CUDA graph capture, part of
    the graph)."""
    return torch.randint(0, 2**SEED_BITS, (2,), dtype=torch.int64, device=device)


def check_rng(dropout_p: float, rng_state: torch.Tensor | None) -> None:
    """An implementation's check that a call with dropout came with its (seed, offset)."""
    if dropout_p > 0.0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state, the (seed, offset) of _dropout.draw_rng")


BYTE_VALUES = 256  # a probability's random number is one byte of a Philox output


def threshold(dropout_p: float) -> int:
    """A byte b drops its probability iff b < threshold(p): p in 256ths, within [1, 255] for 0 < p < 1, 0 for
    p = 0, 256 for p = 1."""
    if dropout_p in (0.0, 1.0):
        return int(dropout_p * BYTE_VALUES)
    return min(max(round(dropout_p * BYTE_VALUES), 1), BYTE_VALUES - 1)


def effective_p(dropout_p: float) -> float:
    """The probability that dropout_p actually drops: threshold(dropout_p) / 256."""
    return threshold(dropout_p) / BYTE_VALUES


def kept_scale(dropout_p: float) -> float:
    """The factor of kept probabilities, 1 / (1 - effective_p(p)); 0 for p = 1."""
    kept_bytes = BYTE_VALUES - threshold(dropout_p)
    return BYTE_VALUES / kept_bytes if kept_bytes else 0.0


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b (a, b < 2**32) in int64, b split into 16-bit halves."""
    low_part = (b & 0xFFFF) * a  # < 2**48
    high_part = (b >> 16) * a
    high = (high_part + (low_part >> 16)) >> 16
    low = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return high, low


def philox(seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tl.randint4x(seed, counter)``'s four outputs (uint32 values in int64) for int64 counters >= 0."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(ROUNDS):
        high_b, low_b = _mul_hi_lo(_ROUND_B, c2)
        high_a, low_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


KEYS_PER_CALL = 16  # the bytes of Philox4x32's four 32-bit outputs: one call serves 16 adjacent keys


def calls_per_row(seqlen_k: int) -> int:
    """Philox calls per query row: its keys in groups of KEYS_PER_CALL, the last one padded."""
    return -(-seqlen_k // KEYS_PER_CALL)


@dataclasses.dataclass(frozen=True)
class Dropout:
    """One problem's dropout: p, rng = (seed, offset), and the counter strides (in Philox calls) of a (batch,
    head, row) step; key j takes byte j % 16 of the call at offset + base + those steps + j // 16."""

    p: float
    rng: torch.Tensor
    stride_b: int
    stride_h: int
    stride_i: int
    base: int = 0

    @classmethod
    def dense(cls, p: float, rng: torch.Tensor, heads: int, seqlen_q: int, seqlen_k: int) -> Dropout:
        """The counters of a (B, H, Tq, Tk) problem: rows of calls_per_row(Tk) calls, in row-major order."""
        row = calls_per_row(seqlen_k)
        return cls(p, rng, heads * seqlen_q * row, seqlen_q * row, row)

    @classmethod
    def packed(cls, p: float, rng: torch.Tensor, total_q: int, max_seqlen_k: int,
               first_row: int = 0) -> Dropout:  # fmt: skip
        """Packed sequences' counters: those of a (1, H, total_q, max_seqlen_k) problem, rows from first_row.
        """
        row = calls_per_row(max_seqlen_k)
        return cls(p, rng, 0, total_q * row, row, first_row * row)

    def scale_tile(self, batch: int, heads: int, rows: range, cols: range) -> torch.Tensor:
        """float32 (batch, heads, len(rows), len(cols)): kept_scale(p) where kept, 0 where dropped."""
        device = self.rng.device
        first_call, end_call = cols.start // KEYS_PER_CALL, -(-cols.stop // KEYS_PER_CALL)
        counter = (
            torch.arange(batch, device=device).view(-1, 1, 1, 1) * self.stride_b
            + torch.arange(heads, device=device).view(-1, 1, 1) * self.stride_h
            + torch.arange(rows.start, rows.stop, device=device).view(-1, 1) * self.stride_i
            + torch.arange(first_call, end_call, device=device)
            + (self.base + self.rng[1])
        )
        # Each call's 16 bytes in key order (byte k of output w for key 4w + k), from key first_call * 16.
        outputs = torch.stack(philox(self.rng[0], counter), -1).unsqueeze(-1)
        shifts = torch.arange(0, 32, 8, device=device)
        random_bytes = ((outputs >> shifts) & 0xFF).flatten(-3)
        first = cols.start - first_call * KEYS_PER_CALL
        kept = random_bytes[..., first : first + len(cols)] >= threshold(self.p)
        return kept.to(torch.float32) * kept_scale(self.p)
