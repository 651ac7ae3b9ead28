"""flash_attention: the drop-in for scaled_dot_product_attention, through the custom ops of ops.py."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from flashattn_triton import _configs, _dispatch, _inputs, _tuning, ops, triton_impl
from flashattn_triton._dispatch import Explanation, uses_triton
from flashattn_triton._validation import check_dropout, op_arguments, varlen_op_arguments

__all__ = ["Explained", "explain", "flash_attention", "flash_attention_varlen", "uses_triton"]


def _autocast_available(device_type: str) -> bool:
    """Whether ``device_type`` has autocast (meta does not). While compiling every device type but meta counts
    as having it: Dynamo skips ``torch.amp.is_autocast_available`` and would break the graph (torch 2.11)."""
    if torch.compiler.is_compiling():
        return device_type != "meta"
    return torch.amp.is_autocast_available(device_type)


def _autocast_inputs(tensors: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]] | None:
    """Where autocast is on for the first tensor's device: (that device type, the tensors with the floating
    ones cast to the autocast dtype), for the caller to run with autocast off, as SDPA does; else None."""
    device_type = tensors[0].device.type if isinstance(tensors[0], torch.Tensor) else "cpu"
    if not (_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return device_type, tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                              for t in tensors)  # fmt: skip


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, *, window_size: tuple[int, int] | None = None,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T + mask) v as scaled_dot_product_attention computes it, by FlashAttention-2.

    SDPA's positional order and semantics. query: (..., Hq, Tq, d); key, value: (..., Hkv, Tk, d); float16,
    bfloat16 or float32 (3-D inputs: (heads, T, d)). Causal masking is top-left (query i sees keys j <= i);
    scale defaults to 1/sqrt(d). window_size=(left, right), -1 unbounded: query i sees keys i - left .. i +
    right. return_lse=True returns (out, lse), lse float32 (..., Hq, Tq). Runs through the custom ops
    torch.ops.flashattn_triton.attn_fwd/attn_bwd (so it compiles, exports and captures into CUDA graphs) on
    the backend the dispatch table picks (``explain`` says which). Under torch.autocast the inputs are cast
    first, as SDPA's are."""
    autocast = _autocast_inputs((query, key, value))
    if autocast is not None:
        device_type, (query, key, value) = autocast
        with torch.autocast(device_type, enabled=False):
            return flash_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   window_size=window_size, return_lse=return_lse)  # fmt: skip
    args = op_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    out, lse = ops.eager_attention(*args)
    out = out.view(query.shape)
    return (out, lse.view(query.shape[:-1])) if return_lse else out


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           window_size: tuple[int, int] | None = None,
                           enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
    """Attention over packed sequences in flash-attn's layout: q (total_q, Hq, d), k and v (total_k, Hkv, d),
    sequence b the rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, (batch + 1,), from 0; max_seqlen_q/_k the
    longest). Returns (total_q, Hq, d), each sequence's rows those of flash_attention of it alone (is_causal
    and window_size top-left within it), with no padding."""
    autocast = _autocast_inputs((q, k, v))
    if autocast is not None:
        device_type, (q, k, v) = autocast
        with torch.autocast(device_type, enabled=False):
            return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                          window_size=window_size, enable_gqa=enable_gqa)  # fmt: skip
    args = varlen_op_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               is_causal, scale, window_size, enable_gqa)  # fmt: skip
    out, _ = ops.eager_attention(*args)
    return out


class Explained(NamedTuple):
    """explain()'s answer: the forward's Explanation and, where the inputs require grad (or grad=True), the
    backward's. Each has .backend, .config and .not_taken (for each faster backend, why not)."""

    forward: Explanation
    backward: Explanation | None

    def __str__(self) -> str:
        return "\n".join(str(e) for e in (self.forward, self.backward) if e is not None)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
            enable_gqa: bool = False, *, window_size: tuple[int, int] | None = None, grad: bool | None = None,
            device_capability: tuple[int, int] | None = None) -> Explained:
    """Which backend and config flash_attention with the same arguments would run, eager or compiled, and why
    not each faster backend, computing nothing. grad: explain the backward too (default: whether an input
    requires grad). device_capability: explain for a CUDA device of this capability (e.g. (9, 0): H100/H200),
    the tensors (CPU, meta) standing for inputs of their shapes and strides."""
    args = op_arguments(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, window_size)
    dropout = check_dropout(dropout_p) > 0.0
    if grad is None:
        grad = any(t.requires_grad for t in (query, key, value))
    options = ops.recognise_mask(args.q, args.k, args._asdict())
    capability = False if device_capability is None else tuple(device_capability)
    out = _inputs.output_like(args.q)
    passes = (("fwd", (args.q, args.k, args.v)), ("bwd", (args.q, args.k, args.v, out, out)))
    explained = []
    for pass_name, tensors in passes[: 1 + grad]:
        explained.append(_explain_pass(pass_name, tensors, options, dropout, capability))
    return Explained(explained[0], explained[1] if grad else None)


def _explain_pass(pass_name: str, tensors: tuple[torch.Tensor, ...], options: dict[str, Any], dropout: bool,
                  capability: tuple[int, int] | bool) -> Explanation:  # fmt: skip
    q, k = tensors[:2]
    window = (options["window_left"], options["window_right"])
    deterministic = pass_name == "bwd" and torch.are_deterministic_algorithms_enabled()
    description = _dispatch.describe(pass_name, q, k, tensors, mask=options["attn_mask"] is not None,
                                     window=window, diagonal_offset=options["diagonal_offset"],
                                     dropout=dropout, deterministic=deterministic,
                                     capability=capability)  # fmt: skip
    if _dispatch.choose(description) not in (_dispatch.GLUON, _dispatch.TUNED):
        return _dispatch.explain_description(description)
    is_causal = window[1] == 0
    band = ops.tuned_window(options)
    _, problem = triton_impl.describe_problem(pass_name, q, tensors, is_causal, band, 0.5 * dropout,
                                              deterministic, None, capability)  # fmt: skip
    candidates = _configs.candidates(problem)
    config = _tuning.TUNING.known(candidates, problem, q.device, None if capability is False else capability)
    config = config or _tuning.default_config(candidates, problem)
    backend = _dispatch.GLUON if config.hopper else _dispatch.TUNED
    explanation = _dispatch.explain_description(description, config)
    if backend == explanation.backend:
        return explanation
    not_taken = {**explanation.not_taken, _dispatch.GLUON: "the tuned choice of this class is not Gluon"}
    return explanation._replace(backend=backend, not_taken=not_taken)


def tune(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False, *, window_size: tuple[int, int] | None = None) -> Explained:
    """Tune the configs of flash_attention(query, key, value, ...)'s problem class on this machine now (every
    candidate timed on the GPU) and keep the choices on disk (_tuning); returns explain()'s answer after."""
    leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    _tuning._requested = True
    try:
        triton_impl._plans.clear()
        _tuning.TUNING.chosen.clear()
        out = flash_attention(*leaves, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                              window_size=window_size)
        out.backward(torch.randn_like(out))
    finally:
        _tuning._requested = False
        triton_impl._plans.clear()
    return explain(*leaves, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size=window_size)
