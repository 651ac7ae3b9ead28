"""Autocast by name: ``profkit.autocast("bf16")`` or a null context for full precision."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "float32": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def autocast_dtype(precision: str | torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype a precision names: bfloat16, float16, or None for float32 (no autocast)."""
    if precision is None or precision == torch.float32:
        return None
    if isinstance(precision, torch.dtype):
        if precision not in (torch.bfloat16, torch.float16):
            raise ValueError(f"precision={precision}: autocast supports torch.bfloat16 and torch.float16")
        return precision
    key = str(precision).lower()
    if key not in _DTYPES:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(_DTYPES)} "
                         "(or a torch.dtype, or None)")
    return _DTYPES[key]


def autocast(precision: str | torch.dtype | None,
             device_type: str | torch.device | None = None) -> AbstractContextManager[object]:
    """``torch.autocast(device_type, dtype)`` for bf16/fp16, ``nullcontext()`` for fp32/None.

    ``device_type`` defaults to "cuda" when CUDA is available, else "cpu".
    """
    dtype = autocast_dtype(precision)
    if dtype is None:
        return nullcontext()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    return torch.autocast(device_type=device_type, dtype=dtype)
