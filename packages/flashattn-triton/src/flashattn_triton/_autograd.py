"""What FlashAttentionTorch and FlashAttentionTriton share as autograd Functions."""

from __future__ import annotations

import torch


class AttentionFunction(torch.autograd.Function):
    """Base of the two attention Functions: ``apply(q, k, v, is_causal=False, scale=None)`` with its
    defaults and types (torch's own apply takes positional arguments only)."""

    @classmethod
    def apply(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,  # type: ignore[override]
        scale: float | None = None,
    ) -> torch.Tensor:
        return super().apply(q, k, v, is_causal, scale)
