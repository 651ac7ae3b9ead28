"""Masks that only encode a band (causal, or a sliding window), materialized as a tensor: libraries build them
where they cannot pass ``is_causal`` (transformers does under torch.compile), and a mask would send a problem
to the feature kernels. ``band_of_mask`` reads a mask once (one sync with the GPU: eagerly once per mask
tensor, in a compiled graph on every call, never under capture or tracing) and says which top-left band it is,
so that it runs as that band. is_causal and window_size cost nothing.
"""

from __future__ import annotations

import weakref

import torch

from flashattn_triton import _launcher
from flashattn_triton._validation import UNBOUNDED

# Masks already read, by id(): a weak reference to the tensor, its version counter then, and its band.
_SEEN: dict[int, tuple[weakref.ref, int, tuple[int, int] | None]] = {}
_MAX_SEEN = 64


def _readable(mask: torch.Tensor) -> bool:
    """Whether the mask's values may be read now: a plain tensor on a real device, no trace, no capture."""
    if type(mask) is not torch.Tensor or mask.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if _launcher.intercepted():
        return False
    return not (mask.is_cuda and torch.cuda.is_current_stream_capturing())


def _read_band(mask: torch.Tensor) -> tuple[int, int] | None:
    """The band mask encodes, read with one sync: mask must be one (Tq, Tk) pattern over its leading dims,
    each value "see" or "hide" (bool; float 0, or -inf or the dtype's lowest), equal to the band its first
    row's last key and its last row's first key bound; a bound at the edge is unbounded."""
    lead = mask.shape[:-2]
    first = mask[(0,) * len(lead)]
    seqlen_q, seqlen_k = first.shape
    checks = []
    if mask.dtype == torch.bool:
        visible = first
    else:
        checks.append(((mask == 0) | (mask <= torch.finfo(mask.dtype).min)).all())
        visible = first == 0
    if any(n > 1 and stride != 0 for n, stride in zip(lead, mask.stride()[:-2], strict=True)):
        checks.append((mask == first).all())  # (broadcast dims, stride 0, repeat it by construction)
    last_of_first_row = seqlen_k - 1 - visible[0].flip(0).to(torch.uint8).argmax()
    first_of_last_row = visible[-1].to(torch.uint8).argmax()
    # Unbounded sides as a bound that reaches every key.
    right = torch.where(last_of_first_row >= seqlen_k - 1, seqlen_k, last_of_first_row)
    left = torch.where(first_of_last_row == 0, seqlen_q, seqlen_q - 1 - first_of_last_row)
    rows = torch.arange(seqlen_q, device=mask.device)[:, None]
    cols = torch.arange(seqlen_k, device=mask.device)[None, :]
    checks.append((visible == ((cols >= rows - left) & (cols <= rows + right))).all())
    ok, left, right = torch.stack([torch.stack(checks).all().long(), left, right]).tolist()
    if not ok:
        return None
    # (a band whose first and last rows see a key gives every row one: so float masks qualify too)
    return UNBOUNDED if left >= seqlen_q else left, UNBOUNDED if right >= seqlen_k else right


def band_of_mask(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, remember: bool = True,
                 ) -> tuple[int, int] | None:  # fmt: skip
    """(left, right) of the top-left band that mask (broadcastable to (B, H, Tq, Tk)) encodes, -1 unbounded;
    None where it encodes something else or cannot be read now. Only bands whose first and last rows see a key
    count (then every row sees one, and a float mask's lowest value hides what the band hides). remember: keep
    the answer until the tensor's version changes (eager calls only)."""
    if mask.shape[-2:] != (seqlen_q, seqlen_k) or not _readable(mask) or not seqlen_q or not seqlen_k:
        return None
    seen = _SEEN.get(id(mask)) if remember else None
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    band = _read_band(mask)
    if remember:
        if len(_SEEN) >= _MAX_SEEN:
            _SEEN.clear()
        _SEEN[id(mask)] = (weakref.ref(mask), mask._version, band)
    return band
