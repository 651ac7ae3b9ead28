"""Input checks shared by every backend, each error naming the argument at fault, and the normalization of
flash_attention's and flash_attention_varlen's arguments into the problem the ops compute (``OpArguments``;
ops states the contract: shapes, mask, dropout and the band, -1 unbounded).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from flashattn_triton import _launcher
from flashattn_triton._dropout import draw_rng

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
UNBOUNDED = -1


def _check_tensor(name: str, t: object, min_dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dims:
        raise ValueError(f"{name} must have at least {min_dims} dims {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype is {t.dtype}; supported: float16, bfloat16, float32")


def _check_like(names: tuple[str, str, str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """dtype, device and head dim of k and v against q, and v's keys against k's."""
    q_name, k_name, v_name = names
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype is {t.dtype} but {q_name}.dtype is {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {q_name} is on {q.device}; use one device")
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name}'s head dim {t.shape[-1]} differs from {q_name}'s {q.shape[-1]} "
                             f"({q_name} {tuple(q.shape)}, {name} {tuple(t.shape)})")


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(head_dim) for None, else a positive finite Python number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (torch.Tensor, bool)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


class AttentionFunction(torch.autograd.Function):
    """Base of the two attention Functions: ``apply(q, k, v, is_causal=False, scale=None)`` with defaults and
    types."""

    @classmethod
    def apply(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,  # type: ignore[override]
              scale: float | None = None) -> torch.Tensor:  # fmt: skip
        return super().apply(q, k, v, is_causal, scale)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                 enable_gqa: bool = False) -> float:
    """Check the Functions' q (..., Tq, d), k and v (..., Tk, d) with q's leading dims (with enable_gqa: (...,
    Hq, Tq, d) and (..., Hkv, Tk, d), Hkv dividing Hq); return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3, "(..., T, d)")
    _check_like(("q", "k", "v"), q, k, v)
    lead = -3 if enable_gqa else -2  # the dims that must be q's: before the heads under enable_gqa
    for name, t in (("k", k), ("v", v)):
        if t.shape[:lead] != q.shape[:lead]:
            raise ValueError(f"{name}'s batch/head dims {tuple(t.shape[:lead])} differ from q's "
                             f"{tuple(q.shape[:lead])} (q {tuple(q.shape)}, {name} {tuple(t.shape)}); they "
                             "must be equal")
    if enable_gqa:
        _check_heads(("q", "k", "v"), q, k, v, True, -3)
    _check_keys(("k", "v"), k, v)
    if q.shape[-1] == 0:
        raise ValueError(f"head dim 0 is not supported (q of shape {tuple(q.shape)})")
    _check_flag("is_causal", is_causal)
    return check_scale(scale, q.shape[-1])


def _check_keys(names: tuple[str, str], k: torch.Tensor, v: torch.Tensor, dim: int = -2) -> None:
    k_name, v_name = names
    if v.shape[dim] != k.shape[dim]:
        raise ValueError(f"{v_name} has {v.shape[dim]} keys but {k_name} has {k.shape[dim]} "
                         f"({k_name} {tuple(k.shape)}, {v_name} {tuple(v.shape)})")
    if k.shape[dim] == 0:
        shape = tuple(k.shape)
        raise ValueError(f"{k_name} and {v_name} need at least one key, got {k_name} of shape {shape}")


def check_dropout(dropout_p: object) -> float:
    if isinstance(dropout_p, (torch.Tensor, bool)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a Python float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    return float(dropout_p)


def check_window(window_size: object) -> tuple[int, int]:
    """(left, right) of window_size (None: (-1, -1), unbounded both ways)."""
    if window_size is None:
        return UNBOUNDED, UNBOUNDED
    if not isinstance(window_size, Sequence) or len(window_size) != 2 or not all(
            isinstance(w, int) and not isinstance(w, bool) for w in window_size):  # fmt: skip
        raise TypeError(f"window_size must be None or a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(f"window_size={tuple(window_size)}: each side is a number of keys >= 0, or -1 for "
                         "unbounded")
    return left, right


@dataclasses.dataclass(frozen=True)
class Band:
    """Query i sees key j iff i + offset - left <= j <= i + offset + right (-1: that side unbounded)."""

    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    diagonal_offset: int = 0

    @property
    def bounded(self) -> bool:
        return self.window_left != UNBOUNDED or self.window_right != UNBOUNDED


def _band(window_size: object, causal: bool, offset: int) -> Band:
    left, right = check_window(window_size)
    return Band(left, 0 if causal else right, offset if causal else 0)


class OpArguments(NamedTuple):
    """flash_attention's (or flash_attention_varlen's) arguments in the ops' order: views of the inputs as (B,
    H, T, d) (or packed (total, H, d) with cu_seqlens), the mask as 4 dims, the dropout's (seed, offset), the
    scale and the band."""

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
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def _rng_state(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    return draw_rng(device) if dropout_p > 0.0 else None


def as_4d(x: torch.Tensor) -> torch.Tensor:
    """(..., H, T, d) as (B, H, T, d), B the product of the leading dims: a view where the strides allow."""
    return x.reshape(x.shape[:-3].numel(), *x.shape[-3:])  # (not -1: a 0-length dim leaves it undefined)


def _check_heads(names: tuple[str, str, str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 enable_gqa: bool, head_dim: int) -> None:  # fmt: skip
    """Equal head counts at dim head_dim, or with enable_gqa Hkv dividing Hq."""
    q_name, k_name, v_name = names
    q_heads, k_heads, v_heads = q.shape[head_dim], k.shape[head_dim], v.shape[head_dim]
    if k_heads != v_heads:
        raise ValueError(f"{k_name} has {k_heads} heads but {v_name} has {v_heads}; they must be equal")
    if q_heads == k_heads:
        return
    if not enable_gqa:
        raise ValueError(f"{q_name} has {q_heads} heads but {k_name} and {v_name} have {k_heads}: different "
                         "head counts need enable_gqa=True (grouped-query attention)")
    if k_heads == 0 or q_heads % k_heads:
        raise ValueError(f"Number of heads in {k_name} and {v_name} ({k_heads}) must divide the number of "
                         f"heads in {q_name} ({q_heads}) for grouped-query attention")


def _causal_bias(attn_mask: object) -> tuple[int, int, bool] | None:
    """(seq_len_q, seq_len_kv, lower_right) of a CausalBias, else None: looked up among the imported modules,
    since importing its module imports torch._dynamo (seconds of a first call)."""
    bias = sys.modules.get("torch.nn.attention.bias")
    if bias is None or not isinstance(attn_mask, bias.CausalBias):
        return None
    return attn_mask.seq_len_q, attn_mask.seq_len_kv, attn_mask.variant == bias.CausalVariant.LOWER_RIGHT


def _check_mask(mask: object, q: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """attn_mask as 4 dims broadcastable to (B, Hq, Tq, Tk), size-1 dims kept where no merging needs them."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None, a torch.Tensor or a CausalBias, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"attn_mask.dtype is {mask.dtype}: expected attn_mask dtype to be bool or float "
                        f"(query's dtype {q.dtype}, or float32)")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("attn_mask requires grad, but flash_attention computes no gradient for the mask; "
                         "detach it (or use scaled_dot_product_attention for a learned bias)")
    if mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device} but query is on {q.device}; use one device")
    target = (*q.shape[:-1], seqlen_k)
    if mask.dim() > len(target) or any(
        m not in (1, t) for m, t in zip(reversed(mask.shape), reversed(target), strict=False)
    ):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (..., Hq, Tq, Tk) = "
                         f"{target}")
    mask = mask.reshape((1,) * (len(target) - mask.dim()) + tuple(mask.shape))
    if len(target) == 3:
        return mask.unsqueeze(0)
    lead = mask.shape[:-3]
    if len(lead) > 1 and any(n != 1 for n in lead):  # merging the batch dims needs them whole
        mask = mask.expand(*target[:-3], *mask.shape[-3:])
    return mask.reshape(mask.shape[:-3].numel(), *mask.shape[-3:])


def op_arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: object = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, window_size: object = None) -> OpArguments:
    """flash_attention's arguments, checked, as the problem its ops compute (3-D inputs: a batch of one);
    draws the dropout's (seed, offset) when dropout_p > 0."""
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value), strict=True):
        _check_tensor(name, t, 3, "(..., T, d)")
    _check_like(names, query, key, value)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != query.dim() or t.shape[:-3] != query.shape[:-3]:
            raise ValueError(f"{name}'s batch dims {tuple(t.shape[:-3])} differ from query's "
                             f"{tuple(query.shape[:-3])} (query {tuple(query.shape)}, {name} "
                             f"{tuple(t.shape)}); they must be equal")
    _check_flag("enable_gqa", enable_gqa)
    _check_heads(names, query, key, value, enable_gqa, -3)
    _check_keys(("key", "value"), key, value)
    if query.shape[-1] == 0:
        raise ValueError(f"head dim 0 is not supported (query of shape {tuple(query.shape)})")
    _check_flag("is_causal", is_causal)
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    causal = _causal_bias(attn_mask)
    if causal is not None:
        if is_causal:
            raise ValueError("attn_mask (a CausalBias) and is_causal=True were both given; give one of them")
        bias_q, bias_k, lower_right = causal
        if (bias_q, bias_k) != (seqlen_q, seqlen_k):
            raise ValueError(f"attn_mask is a CausalBias for (Tq, Tk) = ({bias_q}, {bias_k}) but query and "
                             f"key have ({seqlen_q}, {seqlen_k})")
        band, mask = _band(window_size, True, seqlen_k - seqlen_q if lower_right else 0), None
    else:
        if attn_mask is not None and is_causal:
            raise ValueError("attn_mask and is_causal=True were both given: _scaled_dot_product_attention: "
                             "Explicit attn_mask should not be set when is_causal=True")
        band = _band(window_size, is_causal, 0)
        mask = None if attn_mask is None else _check_mask(attn_mask, query, seqlen_k)
    dropout_p = check_dropout(dropout_p)
    return OpArguments(
        as_4d(query), as_4d(key), as_4d(value), mask, dropout_p, _rng_state(dropout_p, query.device),
        check_scale(scale, query.shape[-1]), band.window_left, band.window_right, band.diagonal_offset,
    )  # fmt: skip


def _check_cu_seqlens(name: str, cu: object, total: int, total_name: str, max_name: str,
                      max_seqlen: int, device: torch.device) -> None:  # fmt: skip
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}.dtype is {cu.dtype}; it must be torch.int32 (cumulative sequence lengths)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; they must be on one device")
    if torch.compiler.is_compiling() or cu.device.type == "meta" or (
            cu.is_cuda and torch.cuda.is_current_stream_capturing()):  # fmt: skip
        return  # the values are data: the ops check them where they run (check_packed_rows)
    # Reading a CUDA tensor's values waits for the GPU, which every layer's call would pay: here, where a
    # wrong value gets its clearest error, they are read once per sizes checked and version, and the ops
    # check them on the GPU on every call (check_packed_rows). A CPU tensor's are read on every call.
    key = (id(cu), total, max_seqlen)
    entry = _CHECKED_CU_SEQLENS.get(key)
    if cu.is_cuda and entry is not None and entry[0]() is cu and entry[1] == cu._version:
        return
    _check_cu_seqlens_values(name, cu_seqlens_values(cu), total, total_name, max_name, max_seqlen)
    if cu.is_cuda:
        if len(_CHECKED_CU_SEQLENS) >= _MAX_CHECKED:
            _CHECKED_CU_SEQLENS.clear()
        _CHECKED_CU_SEQLENS[key] = (weakref.ref(cu), cu._version)


def _check_cu_seqlens_values(name: str, values: list[int], total: int, total_name: str, max_name: str,
                             max_seqlen: int) -> None:  # fmt: skip
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    if values[0] != 0 or min(lengths) < 0:
        raise ValueError(f"{name} must start at 0 and be non-decreasing (cumulative lengths), got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} ends at {values[-1]} but {total_name} has {total} rows; they must agree")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is below the longest sequence in {name}, {max(lengths)}")


# CUDA cu_seqlens whose values passed, by (id(), total, max_seqlen): a weak reference and the version then.
_CHECKED_CU_SEQLENS: dict[tuple[int, int, int], tuple[weakref.ref, int]] = {}
_MAX_CHECKED = 64


def cu_seqlens_values(cu: torch.Tensor) -> list[int]:
    """cu's values on the host (for a CUDA tensor, after the GPU has reached it)."""
    return cu.tolist()


def check_packed_rows(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> None:  # fmt: skip
    """The ops' check of packed sequences' bounds on every call, before a kernel indexes rows by them: each
    cu_seqlens starts at 0, does not decrease, ends at its tensor's rows, and holds no sequence above its
    max_seqlen. On the host for CPU tensors, elsewhere on the device with no wait (_launcher.assert_async)."""
    for name, cu, x, total_name, max_name, max_seqlen in (
        ("cu_seqlens_q", cu_seqlens_q, q, "q", "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k, "k", "max_seqlen_k", max_seqlen_k),
    ):
        if cu.device.type == "cpu":
            _check_cu_seqlens_values(name, cu.tolist(), x.shape[0], total_name, max_name, max_seqlen)
        elif cu.device.type != "meta":
            message = (f"{name} must start at 0, be non-decreasing, end at {total_name}'s rows "
                       f"({x.shape[0]}) and hold no sequence longer than {max_name}={max_seqlen}")
            _launcher.assert_async(packed_rows_valid(cu, x.shape[0], max_seqlen), message)


def packed_rows_valid(cu: torch.Tensor, total: int, max_seqlen: int) -> torch.Tensor:
    """Whether cu is valid (check_packed_rows), as a bool tensor computed on cu's device."""
    lengths = cu.diff()
    valid = (cu[0] == 0) & (cu[-1] == total) & (lengths.amin() >= 0)
    return valid & (lengths.amax() <= max_seqlen)


def varlen_op_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                        window_size: object = None, enable_gqa: bool = False) -> OpArguments:
    """flash_attention_varlen's arguments, checked (sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1])."""
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v), strict=True):
        _check_tensor(name, t, 3, "(total, heads, d)")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total, heads, d), got shape {tuple(t.shape)}")
    _check_like(names, q, k, v)
    _check_flag("enable_gqa", enable_gqa)
    _check_heads(names, q, k, v, enable_gqa, -2)
    if v.shape[0] != k.shape[0]:
        shapes = f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(f"v has {v.shape[0]} rows but k has {k.shape[0]} ({shapes})")
    if q.shape[-1] == 0:
        raise ValueError(f"head dim 0 is not supported (q of shape {tuple(q.shape)})")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", "max_seqlen_q", max_seqlen_q, q.device)
    if isinstance(cu_seqlens_k, torch.Tensor) and cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q holds {cu_seqlens_q.numel() - 1} sequences but cu_seqlens_k "
                         f"{cu_seqlens_k.numel() - 1}; they must be equal")
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k", "max_seqlen_k", max_seqlen_k, q.device)
    _check_flag("is_causal", is_causal)
    dropout_p = check_dropout(dropout_p)
    band = _band(window_size, is_causal, 0)
    return OpArguments(
        q, k, v, None, dropout_p, _rng_state(dropout_p, q.device), check_scale(scale, q.shape[-1]),
        band.window_left, band.window_right, band.diagonal_offset, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k,
    )  # fmt: skip
