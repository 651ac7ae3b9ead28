"""Which backend computes a problem: one description of it (``Description``) and one table from it to a
backend (``_REQUIREMENTS``), fastest first: ``gluon-sm90`` (_hopper), ``tuned-triton`` (triton_impl),
``feature-triton`` (feature_impl: masks, bottom-right bands, what the tuned kernels do not take) and
``pytorch`` (torch_impl, wherever Triton cannot run).

Every call reaches the kernels through here, eager, compiled, exported or captured: the ops describe their
inputs (``describe``) and run what ``choose`` names. ``choose`` is a pure function of the Description, so the
choice for any machine can be asked anywhere (``explain(..., device_capability=(9, 0))`` on a CPU). Each
backend's conditions are listed once, as (condition, why not) pairs; a problem runs on the first backend whose
conditions all hold, and ``explain`` reports the first failing condition of each faster one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from flashattn_triton import _hopper, _launcher
from flashattn_triton._configs import describe as describe_config
from flashattn_triton._configs import is_small_problem
from flashattn_triton._inputs import MAX_HEAD_DIM, input_precision, padded_head_dim
from flashattn_triton._launcher import env_flag
from flashattn_triton._validation import UNBOUNDED, as_4d

GLUON, TUNED, FEATURES, TORCH = "gluon-sm90", "tuned-triton", "feature-triton", "pytorch"
BACKENDS = (GLUON, TUNED, FEATURES, TORCH)  # fastest first
# Head dims each Gluon kernel compiles for without spills.
GLUON_HEAD_DIMS = {"fwd": (64, 128), "bwd": (16, 32, 64, 128)}
GLUON_ROWS = 128  # the Gluon kernels' tile: Tq = Tk a multiple of it

# Layout classes of a (B, H, T, d) tensor, as the Gluon kernels' descriptors see its memory.
HEADS_OUTSIDE_ROWS = "bhtd"  # (B, H, T, d) memory: contiguous, or any whole-head stride
HEADS_IN_ROWS = "bthd"  # (B, T, H, d) memory: a model's transposed projection, or a fused projection's part
STRIDED = "strided"  # unit stride along d, heads some other way (descriptors cannot walk it whole)
OTHER = "other"  # d not innermost, or unaligned for TMA


@dataclasses.dataclass(frozen=True)
class Description:
    """One pass of one attention problem, as far as choosing its backend goes. capability: (major, minor),
    None off CUDA; triton: Triton can run on the device; gluon: this Triton ships Gluon for Hopper
    (FLASHATTN_TRITON_GLUON not 0); layouts: each tensor's class; mask: "none" or "tensor" (a band's mask is
    described as the band); window: (left, right), -1 unbounded; diagonal_offset: 0 top-left, Tk - Tq
    bottom-right; group: query heads per K/V head; small: _configs.is_small_problem."""

    pass_name: str
    capability: tuple[int, int] | None
    triton: bool
    gluon: bool
    dtype: torch.dtype
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    layouts: tuple[str, ...]
    mask: str = "none"
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    diagonal_offset: int = 0
    group: int = 1
    dropout: bool = False
    varlen: bool = False
    deterministic: bool = False
    full_float32: bool = False  # float32 at full accuracy (tf32x3), not TF32
    small: bool = False

    @property
    def causal(self) -> bool:
        return self.window == (UNBOUNDED, 0) and self.diagonal_offset == 0

    @property
    def plain_or_causal(self) -> bool:
        return self.window == (UNBOUNDED, UNBOUNDED) or self.causal


def _tuned_band(d: Description) -> bool:
    """Plain or top-left causal attention, or a top-left band with Tq = Tk (packed: plain or causal only)."""
    if d.plain_or_causal:
        return True
    return not d.varlen and d.diagonal_offset == 0 and d.seqlen_q == d.seqlen_k


Requirement = tuple[Callable[[Description], bool], Callable[[Description], str]]

# The table: each backend's conditions, in the order they are checked, each with why it fails.
_REQUIREMENTS: dict[str, tuple[Requirement, ...]] = {
    FEATURES: (
        (lambda d: d.triton, lambda d: "Triton cannot run on this device (CUDA with Triton, or CPU under "
                                       "TRITON_INTERPRET=1)"),
        (lambda d: d.head_dim <= MAX_HEAD_DIM, lambda d: f"head dim {d.head_dim} > {MAX_HEAD_DIM}"),
    ),
    TUNED: (
        (lambda d: d.mask == "none", lambda d: "an attention mask that is not a causal or band mask"),
        (_tuned_band, lambda d: f"window {d.window} with diagonal offset {d.diagonal_offset} (bottom-right, "
                                f"Tq != Tk, or on packed sequences)"),
        (lambda d: not (d.varlen and d.full_float32), lambda d: "packed float32 sequences at full accuracy "
                                                                  "(tf32x3)"),
    ),
    GLUON: (
        (lambda d: d.capability == (9, 0), lambda d: f"device capability {d.capability}, not sm_90"),
        (lambda d: d.gluon, lambda d: "this Triton ships no Gluon for Hopper (or FLASHATTN_TRITON_GLUON=0)"),
        (lambda d: d.dtype in (torch.float16, torch.bfloat16), lambda d: f"{d.dtype}, not 16-bit"),
        (lambda d: d.head_dim in GLUON_HEAD_DIMS[d.pass_name],
         lambda d: f"head dim {d.head_dim} not in {GLUON_HEAD_DIMS[d.pass_name]}"),
        (lambda d: d.seqlen_q == d.seqlen_k and d.seqlen_q % GLUON_ROWS == 0,
         lambda d: f"(Tq, Tk) = ({d.seqlen_q}, {d.seqlen_k}), not equal multiples of {GLUON_ROWS}"),
        (lambda d: d.window[1] in (0, UNBOUNDED) and (d.window[0] == UNBOUNDED or d.window[1] == 0),
         lambda d: f"window {d.window}: only a causal one (right = 0)"),
        (lambda d: all(x in (HEADS_OUTSIDE_ROWS, HEADS_IN_ROWS) for x in d.layouts),
         lambda d: f"layouts {d.layouts}: each must be (B, H, T, d) or (B, T, H, d) memory, 16-byte aligned"),
        (lambda d: not d.small, lambda d: "a small problem (host-bound: the tuned kernels' small path)"),
        (lambda d: not d.dropout, lambda d: "dropout"),
        (lambda d: not d.varlen, lambda d: "packed sequences"),
        (lambda d: not (d.deterministic and d.pass_name == "bwd"), lambda d: "a deterministic backward "
                                                                              "(its dQ is atomic)"),
    ),
}
# A backend needs its own conditions and those of the slower Triton backends after it.
_INHERITS = {GLUON: (FEATURES, TUNED, GLUON), TUNED: (FEATURES, TUNED), FEATURES: (FEATURES,), TORCH: ()}


def why_not(backend: str, d: Description) -> str | None:
    """Why `backend` cannot run d (the first condition that fails), or None where it can."""
    for part in _INHERITS[backend]:
        for holds, reason in _REQUIREMENTS[part]:
            if not holds(d):
                return reason(d)
    return None


@functools.lru_cache(maxsize=4096)
def choose(d: Description) -> str:
    """The backend that runs d: the fastest whose conditions hold."""
    return next(b for b in BACKENDS if why_not(b, d) is None)


class Explanation(NamedTuple):
    """explain()'s answer for one pass: the backend, its config (None where it has none), and why not each
    faster backend."""

    pass_name: str
    backend: str
    config: Any
    not_taken: dict[str, str]

    def __str__(self) -> str:
        config = "" if self.config is None else f" config {describe_config(self.config)}"
        lines = [f"{self.pass_name}: {self.backend}{config}"]
        lines += [f"  not {b}: {why}" for b, why in self.not_taken.items()]
        return "\n".join(lines)


def explain_description(d: Description, config: Any = None) -> Explanation:
    backend = choose(d)
    faster = BACKENDS[: BACKENDS.index(backend)]
    return Explanation(d.pass_name, backend, config, {b: why_not(b, d) or "" for b in faster})


def layout_class(t: torch.Tensor) -> str:
    """t's layout class (the constants above), t a (B, H, T, d) tensor or packed (total, H, d)."""
    t = as_4d(t)
    layout = _hopper.head_layout(t)
    if layout is None:
        return STRIDED if t.stride(-1) == 1 else OTHER
    return HEADS_IN_ROWS if layout[2] else HEADS_OUTSIDE_ROWS


def uses_triton(device: torch.device) -> bool:
    """Whether the ops run Triton kernels on `device`: on CUDA with Triton installed, on CPU under
    TRITON_INTERPRET=1."""
    if device.type == "cuda":
        if _launcher.triton_available():
            return True
        warnings.warn("triton is not installed: flash_attention runs its PyTorch path on CUDA",
                      RuntimeWarning, stacklevel=3)  # fmt: skip
        return False
    return device.type == "cpu" and _launcher.interpret_requested() and _launcher.triton_available()


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def machine(device: torch.device) -> tuple[tuple[int, int] | None, bool, bool]:
    """(capability, triton, gluon) of device, as Description holds them."""
    triton = uses_triton(device)
    if device.type != "cuda":
        return None, triton, False
    return _capability(device), triton, triton and _hopper.available()


def window_of(band: tuple[int, int] | None, is_causal: bool) -> tuple[int, int]:
    """triton_impl's (band, is_causal) as a Description's window."""
    if band is not None:
        return band
    return (UNBOUNDED, 0) if is_causal else (UNBOUNDED, UNBOUNDED)


def describe(pass_name: str, q: torch.Tensor, k: torch.Tensor, tensors: tuple[torch.Tensor, ...], *,
             mask: bool = False, window: tuple[int, int] = (UNBOUNDED, UNBOUNDED), diagonal_offset: int = 0,
             dropout: bool = False, varlen: tuple[int, int, int] | None = None, deterministic: bool = False,
             capability: tuple[int, int] | None | bool = False) -> Description:  # fmt: skip
    """The Description of a pass over q (B, Hq, Tq, d) and k (or packed (total, H, d) with varlen = (batch,
    max_seqlen_q, max_seqlen_k)), tensors being all it reads (q, k, v[, out, dO]). capability: the device's
    unless given (then Triton and Gluon count as there)."""
    if capability is False:
        capability, triton, gluon = machine(q.device)
    else:
        triton, gluon = True, capability is not None
    head_dim = q.shape[-1]
    if varlen is None:
        batch_heads, seqlen_q, seqlen_k = q.shape[:-2].numel(), q.shape[-2], k.shape[-2]
        heads, kv_heads = q.shape[-3], k.shape[-3]
    else:
        (batch, seqlen_q, seqlen_k), heads, kv_heads = varlen, q.shape[1], k.shape[1]
        batch_heads = batch * heads
    small = is_small_problem(batch_heads, seqlen_q, seqlen_k, padded_head_dim(head_dim, q.element_size()))
    return Description(pass_name, capability, triton, gluon, q.dtype, head_dim, seqlen_q, seqlen_k,
                       tuple(layout_class(t) for t in tensors), "tensor" if mask else "none", window,
                       diagonal_offset, heads // max(kv_heads, 1), dropout, varlen is not None, deterministic,
                       input_precision(q.dtype) == "tf32x3", small)  # fmt: skip


_recorded: list[Description] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[Description]]:
    """``with recording() as seen:`` collects the Description of every pass the ops run, eager, compiled or
    captured."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def log(d: Description) -> None:
    """With FLASHATTN_TRITON_LOG_ROUTES=1, each new problem's route to stderr (the first call of a layout)."""
    if env_flag("FLASHATTN_TRITON_LOG_ROUTES", False):
        print(f"flashattn_triton route: {choose(d)} <- {d}", file=sys.stderr)


def record(d: Description) -> None:
    if _recorded is not None:
        _recorded.append(d)
