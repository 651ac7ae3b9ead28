"""Input checks shared by every path: each error names the argument at fault."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None
) -> float:
    """Validate q (..., Tq, d), k and v (..., Tk, d); return the softmax scale (default 1/sqrt(d))."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims (..., T, d), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype is {t.dtype}; supported: float16, bfloat16, float32")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype is {t.dtype} but q.dtype is {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
        if t.shape[:-2] != q.shape[:-2]:
            raise ValueError(
                f"{name}'s batch/head dims {tuple(t.shape[:-2])} differ from q's {tuple(q.shape[:-2])} "
                f"(q {tuple(q.shape)}, {name} {tuple(t.shape)}); they must be equal"
            )
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"{name}'s head dim {t.shape[-1]} differs from q's {q.shape[-1]} "
                f"(q {tuple(q.shape)}, {name} {tuple(t.shape)})"
            )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"v has {v.shape[-2]} keys but k has {k.shape[-2]} (k {tuple(k.shape)}, v {tuple(v.shape)})"
        )
    if k.shape[-2] == 0:
        raise ValueError(f"k and v need at least one key, got k of shape {tuple(k.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"head dim 0 is not supported (q of shape {tuple(q.shape)})")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


class OpArguments(NamedTuple):
    """flash_attention's arguments as the custom ops take them (ops.py states the contract): 4-D views
    (B, H, T, d) of the inputs and the band of keys each query sees."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    rng_state: torch.Tensor | None
    scale: float
    window_left: int
    window_right: int
    diagonal_offset: int


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """(..., H, T, d) as (B, H, T, d); 3-D (H, T, d) as (1, H, T, d)."""
    return x.unsqueeze(0) if x.dim() == 3 else x.reshape(x.shape[:-3].numel(), *x.shape[-3:])


def op_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    window_size: tuple[int, int] | None,
) -> OpArguments:
    """flash_attention's arguments checked (each error names the argument) and normalized for the ops."""
    scale = check_inputs(query, key, value, is_causal, scale)
    if attn_mask is not None:
        raise NotImplementedError("flashattn_triton: attn_mask is not implemented yet")
    if dropout_p != 0.0:
        raise NotImplementedError("flashattn_triton: dropout_p is not implemented yet")
    if enable_gqa:
        raise NotImplementedError("flashattn_triton: enable_gqa is not implemented yet")
    if window_size is not None:
        raise NotImplementedError("flashattn_triton: window_size is not implemented yet")
    unbounded = -1
    return OpArguments(_as_4d(query), _as_4d(key), _as_4d(value), None, 0.0, None, scale, unbounded,
                       0 if is_causal else unbounded, 0)  # fmt: skip
