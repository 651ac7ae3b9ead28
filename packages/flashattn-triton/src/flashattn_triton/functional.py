"""flash_attention: the drop-in for scaled_dot_product_attention, on whichever path suits the device."""

from __future__ import annotations

import importlib.util
import warnings

import torch

from flashattn_triton.torch_impl import FlashAttentionTorch
from flashattn_triton.triton_impl import FlashAttentionTriton, interpret_requested


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton(device: torch.device) -> bool:
    """Whether flash_attention runs the Triton kernels for tensors on `device`."""
    if device.type == "cuda":
        if _triton_available():
            return True
        warnings.warn(
            "triton is not installed: flash_attention runs FlashAttentionTorch on CUDA",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return device.type == "cpu" and interpret_requested() and _triton_available()


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """softmax(scale * q k^T) v like torch.nn.functional.scaled_dot_product_attention, as FlashAttention-2.

    q: (..., Tq, d); k, v: (..., Tk, d) with q's leading dims; float16, bfloat16 or float32. Causal
    masking is top-left aligned (query i sees keys j <= i). scale defaults to 1/sqrt(d). Runs the
    Triton kernels on CUDA (and on CPU under TRITON_INTERPRET=1), FlashAttentionTorch elsewhere.
    Under torch.autocast the inputs are cast to the autocast dtype first, as SDPA's are.
    """
    device_type = q.device.type if isinstance(q, torch.Tensor) else "cpu"
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (
            t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v)
        )
        with torch.autocast(device_type, enabled=False):
            return flash_attention(q, k, v, is_causal, scale)
    function = (
        FlashAttentionTriton if isinstance(q, torch.Tensor) and uses_triton(q.device) else FlashAttentionTorch
    )
    return function.apply(q, k, v, is_causal, scale)
