"""The kernels' side of _dropout: which probabilities of a tile dropout keeps, shared by the tuned kernels
(_kernels) and the feature kernels (_feature_kernels), so that both drop the same ones as the PyTorch path.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rng_state(Rng, DROPOUT: tl.constexpr):
    """(seed, offset) from Rng, _dropout.draw_rng's int64 (2,) on the device (read here, never on the host:
    a CUDA graph replays the draw); zeros without DROPOUT, where Rng may be None."""
    if DROPOUT:
        seed = tl.load(Rng)
        offset = tl.load(Rng + 1)
    else:
        seed = 0
        offset = 0
    return seed, offset


@triton.jit
def kept(seed, row_calls, start_n, threshold, BLOCK_N: tl.constexpr):
    """Which probabilities of keys start_n .. start_n + BLOCK_N - 1 (start_n a multiple of 4) dropout keeps,
    (R, BLOCK_N), in the R rows whose key 0 takes its number from the Philox call at row_calls ((R,) int64,
    the offset included): key j takes output j % 4 of the call at row_calls + j // 4 (tl.randint4x), and is
    kept iff that number is at least threshold (< 2**32)."""
    calls = row_calls[:, None] + (start_n // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, calls)
    numbers = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # r0, r1, r2, r3 per call
    return numbers >= tl.to_tensor(threshold).to(tl.uint32)  # (a constexpr where threshold is 1)
