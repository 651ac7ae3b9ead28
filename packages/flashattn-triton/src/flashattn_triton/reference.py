"""Naive attention that materializes the Tq x Tk scores: the baseline and the tests' float64 reference."""

from __future__ import annotations

import math

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:  # top-left aligned: query i sees keys j <= i
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """softmax(scale * q k^T) v in q's dtype, the T x T scores in memory: for checks and baselines only."""
    return torch.softmax(_scores(q, k, is_causal, scale), dim=-1) @ v


def reference_logsumexp(
    q: torch.Tensor, k: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """logsumexp of the scaled (masked) scores over the keys: the L that the forward saves."""
    return torch.logsumexp(_scores(q, k, is_causal, scale), dim=-1)
