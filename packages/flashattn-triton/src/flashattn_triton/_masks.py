"""Masks that only encode a band: a causal mask, or a sliding window, materialized as a tensor.

Libraries build such masks where they cannot pass ``is_causal`` (transformers does while torch.compile traces
a model, even with no padding), and a mask sends a problem to the feature kernels. ``band_of_mask`` reads a
mask's values once and says which top-left band it is, so that the problem runs as that band. Reading the
values syncs with the GPU: it happens once per mask tensor (a model's layers share one mask, and the
backward gets the forward's), never while a CUDA graph is captured or a compile traces, and never for a mask
whose values could not all be a band's.
"""

from __future__ import annotations

import weakref

import torch

UNBOUNDED = -1

# Masks already read, by id(): a weak reference to the tensor, its version counter then, and its band.
_SEEN: dict[int, tuple[weakref.ref, int, tuple[int, int] | None]] = {}
_MAX_SEEN = 64


def _readable(mask: torch.Tensor) -> bool:
    """Whether the mask's values may be read now: a plain tensor on a real device, no trace, no capture."""
    if type(mask) is not torch.Tensor or mask.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return False
    return not (mask.is_cuda and torch.cuda.is_current_stream_capturing())


def _visible(mask: torch.Tensor) -> torch.Tensor | None:
    """The keys each query sees, (Tq, Tk) bool, where mask is one 2-D pattern broadcast over its leading dims
    and every value is "see" or "hide" (bool; float 0 or -inf, or the dtype's lowest value, which hides a key
    exactly wherever its row sees another); else None."""
    if mask.dtype == torch.bool:
        visible = mask
    else:
        lowest = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= lowest)).all()):
            return None
        visible = mask == 0
    first = visible.reshape(-1, *visible.shape[-2:])[0]
    if visible.shape[:-2].numel() > 1 and not bool((visible == first).all()):
        return None
    return first


def band_mask(seqlen_q: int, seqlen_k: int, band: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The (Tq, Tk) bool mask of the top-left band (left, right): query i sees keys i - left .. i + right."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    left, right = band
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left != UNBOUNDED:
        seen &= cols >= rows - left
    if right != UNBOUNDED:
        seen &= cols <= rows + right
    return seen


def _read_band(mask: torch.Tensor) -> tuple[int, int] | None:
    visible = _visible(mask)
    if visible is None:
        return None
    seqlen_q, seqlen_k = visible.shape
    # Row 0's last key gives the right bound, the last row's first key the left one; a bound that reaches
    # the edge is unbounded (the same mask).
    last_of_first_row = seqlen_k - 1 - int(visible[0].flip(0).to(torch.uint8).argmax())
    first_of_last_row = int(visible[-1].to(torch.uint8).argmax())
    right = UNBOUNDED if last_of_first_row >= seqlen_k - 1 else last_of_first_row
    left = UNBOUNDED if first_of_last_row == 0 else seqlen_q - 1 - first_of_last_row
    band = (left, right)
    # (a band whose first and last rows see a key gives every row one: so float masks qualify too)
    if not torch.equal(visible, band_mask(seqlen_q, seqlen_k, band, visible.device)):
        return None
    return band


def band_of_mask(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> tuple[int, int] | None:
    """(left, right) of the top-left band that mask (4-D, broadcastable to (B, H, Tq, Tk)) encodes, -1
    unbounded; None where it encodes something else, or its values cannot be read now (see the module
    docstring). Only bands whose first and last query rows see a key are recognised: every row of such a
    band sees one, so a float mask's lowest value hides exactly what the band hides."""
    if mask.shape[-2:] != (seqlen_q, seqlen_k) or not _readable(mask) or not seqlen_q or not seqlen_k:
        return None
    seen = _SEEN.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    band = _read_band(mask)
    if len(_SEEN) >= _MAX_SEEN:
        _SEEN.clear()
    _SEEN[id(mask)] = (weakref.ref(mask), mask._version, band)
    return band
