"""Block sizes, warps and pipeline stages of the Triton kernels, per (head dim, dtype, causal).

The table was measured on an H100 (PERF.md has the sweeps behind it). Where a config does not fit a
smaller GPU's shared memory, the launcher steps down through :func:`smaller` until one does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


def _check_blocks(config: object, names: list[str], largest: int) -> None:
    for name in names:
        size = getattr(config, name)
        if size < 16 or size > largest or size & (size - 1):
            raise ValueError(f"{name}={size}: block sizes are powers of two from 16 to {largest}")


@dataclass(frozen=True)
class ForwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_blocks(self, ["block_m", "block_n"], 256)


@dataclass(frozen=True)
class BackwardConfig:
    """Each program owns block_n keys and block_n queries; for dK/dV it steps through the queries
    block_m at a time, for dQ through the keys. With atomic_dq, dQ is instead added up atomically from
    the dK/dV loop."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    atomic_dq: bool = False

    def __post_init__(self) -> None:
        # 128 at most: the atomic variant pads its float32 dQ to whole tiles of 128 rows.
        _check_blocks(self, ["block_m", "block_n"], 128)


# Small tiles for the interpreter: several tiles per test problem, so every mask path runs.
INTERPRETER_FORWARD = ForwardConfig(32, 16, 4, 1)
INTERPRETER_BACKWARD = BackwardConfig(16, 32, 4, 1)

# (block_d, bytes per element) -> config; causal and non-causal share one entry unless measured apart.
_FORWARD = {
    (16, 2): ForwardConfig(128, 64, 4, 3),
    (32, 2): ForwardConfig(128, 64, 4, 3),
    (64, 2): ForwardConfig(128, 64, 4, 3),
    (128, 2): ForwardConfig(128, 64, 8, 3),
    (256, 2): ForwardConfig(64, 32, 4, 2),
    (16, 4): ForwardConfig(64, 64, 4, 2),
    (32, 4): ForwardConfig(64, 64, 4, 2),
    (64, 4): ForwardConfig(64, 32, 4, 2),
    (128, 4): ForwardConfig(64, 32, 8, 2),
    (256, 4): ForwardConfig(32, 32, 4, 1),
}
_BACKWARD = {
    (16, 2): BackwardConfig(32, 128, 4, 3),
    (32, 2): BackwardConfig(32, 128, 4, 3),
    (64, 2): BackwardConfig(32, 128, 4, 3),
    (128, 2): BackwardConfig(32, 128, 8, 2),
    (256, 2): BackwardConfig(16, 64, 8, 1),
    (16, 4): BackwardConfig(32, 64, 4, 2),
    (32, 4): BackwardConfig(32, 64, 4, 2),
    (64, 4): BackwardConfig(32, 128, 8, 2),
    (128, 4): BackwardConfig(16, 64, 8, 1),
    (256, 4): BackwardConfig(16, 32, 4, 1),
}


def forward_config(block_d: int, element_size: int, causal: bool, interpret: bool) -> ForwardConfig:
    return INTERPRETER_FORWARD if interpret else _FORWARD[(block_d, element_size)]


def backward_config(block_d: int, element_size: int, causal: bool, interpret: bool) -> BackwardConfig:
    return INTERPRETER_BACKWARD if interpret else _BACKWARD[(block_d, element_size)]


def smaller(config: ForwardConfig | BackwardConfig) -> ForwardConfig | BackwardConfig | None:
    """The next config down for a GPU with less shared memory: fewer stages, then smaller tiles."""
    if config.num_stages > 1:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 16:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 16:
        return replace(config, block_m=config.block_m // 2)
    return None
