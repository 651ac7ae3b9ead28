"""The attention operators ``torch.ops.flashattn_triton.attn_fwd`` and ``attn_bwd``: fake (meta)
implementations with symbolic shapes let ``torch.compile(fullgraph=True)``, dynamic shapes, ``torch.export``
and meta tensors see through them, and ``register_autograd`` ties them together. They are opaque custom
ops, not ``triton_op``s: their kernels run through a plan tuned at run time, Gluon kernels and direct C
launches (``triton_impl``, ``_launcher``), which Inductor cannot trace; it schedules them as extern kernels.

The contract
------------
``attn_fwd(q, k, v, attn_mask, dropout_p, rng_state, scale, window_left, window_right, diagonal_offset,
cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> (out, lse)``

- ``q (B, Hq, Tq, d)``, ``k, v (B, Hkv, Tk, d)``: one dtype (float16, bfloat16, float32) and device, any
  strides; ``Hq % Hkv == 0``, query head ``h`` reading K/V head ``h // (Hq // Hkv)``.
- Packed sequences: with ``cu_seqlens_q/k`` (int32, ``(batch + 1,)``, cumulative from 0) q is
  ``(total_q, Hq, d)`` and k, v ``(total_k, Hkv, d)``, sequence ``b`` the rows
  ``cu_seqlens[b]:cu_seqlens[b + 1]``; ``max_seqlen_q/k`` bound the lengths (0 when not packed).
- ``attn_mask``: None, bool (True = may attend) or float (added to the scaled scores), broadcastable to
  ``(B, Hq, Tq, Tk)``; it gets no gradient.
- ``dropout_p`` in [0, 1], p rounded to a multiple of 1/256 (_dropout); ``rng_state``: int64 ``(2,)``
  (Philox seed, offset) on q's device, None without dropout; the backward regenerates the mask from it.
- Band: query ``i`` sees key ``j`` iff ``i + diagonal_offset - window_left <= j <= i + diagonal_offset +
  window_right``, -1 unbounded. ``is_causal`` is ``window_right = 0``; offset 0 is top-left (SDPA),
  ``Tk - Tq`` bottom-right (flash-attn, ``causal_lower_right``). A row that sees no key gets out 0 and lse
  -inf; a NaN or +inf among the scores a row sees makes its out and lse NaN (scores a bool mask, the
  causal mask or a window removes are not read).
- ``out``: like q, laid out as SDPA lays it out (``_inputs.output_like``); ``lse``: float32, contiguous,
  ``q.shape[:-1]``, each row's log-sum-exp of its (masked) scaled scores.

``attn_bwd(grad_out, grad_lse, q, k, v, out, lse, <attn_fwd's arguments after v>, deterministic)
-> (dq, dk, dv)``, each in its input's layout. ``grad_lse`` (optional): the gradient of lse.
``deterministic``: bitwise repeatable gradients, from ``torch.are_deterministic_algorithms_enabled()``.

Every argument is supported on every backend; the dispatch table (_dispatch) picks the backend from the
description ``_route`` makes, a mask that only encodes a band running as that band (_masks). Eager calls
on CUDA skip the dispatcher (``eager_attention``: its wrapper and a second op cost a small problem's
kernel time several times over) through ``_EagerAttention``; calls under a ``torch.func`` transform or
forward-mode AD go through ``_TransformedAttention``. Where a graph of the gradients is built the
gradients come from ``_GradientsOnce``, which refuses a second differentiation; forward-mode AD raises
NotImplementedError, as SDPA's flash backend does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flashattn_triton import (
    _dispatch,
    _inputs,
    _launcher,
    _masks,
    _validation,
    feature_impl,
    torch_impl,
    triton_impl,
)
from flashattn_triton._validation import UNBOUNDED

_LIBRARY = torch.library.Library("flashattn_triton", "FRAGMENT")  # as custom_op's


def _operator(name: str, implementation: Callable, fake: Callable) -> torch._ops.OpOverload:
    """torch.ops.flashattn_triton.<name> with implementation's schema, fake as its fake (meta) implementation
    and implementation on every device: what torch.library.custom_op registers, less its torch._disable_dynamo
    wrapper, whose first call imports torch._dynamo (seconds of a first call). (The fake first: it is the Meta
    kernel only where none serves Meta yet.)"""
    _LIBRARY.define(name + torch.library.infer_schema(implementation, mutates_args=()))
    torch.library.register_fake(f"flashattn_triton::{name}", fake, lib=_LIBRARY)
    _LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    return getattr(torch.ops.flashattn_triton, name).default


_routes: dict[tuple, tuple[_dispatch.Description, str]] = {}  # by layout and options
_MAX_ROUTES = 4096


def recognise_mask(q: Tensor, k: Tensor, options: dict[str, Any]) -> dict[str, Any]:
    """options with a mask that only encodes a top-left band (_masks) replaced by that band."""
    mask = options["attn_mask"]
    band = (options["window_left"], options["window_right"], options["diagonal_offset"])
    if mask is None or options["cu_seqlens_q"] is not None or band != (UNBOUNDED, UNBOUNDED, 0):
        return options
    band = _masks.band_of_mask(mask, q.shape[-2], k.shape[-2], remember=getattr(_eager, "active", False))
    if band is None:
        return options
    return {**options, "attn_mask": None, "window_left": band[0], "window_right": band[1]}


def _route(pass_name: str, tensors: tuple[Tensor, ...], options: dict[str, Any],
           deterministic: bool = False) -> str:  # fmt: skip
    """The backend of a pass over tensors (q, k, v[, out, dO]), its Description worked out once per layout and
    options."""
    q, k = tensors[0], tensors[1]
    mask, cu_seqlens = options["attn_mask"], options["cu_seqlens_q"]
    window = (options["window_left"], options["window_right"])
    key = (pass_name, q.dtype, _inputs.input_precision(q.dtype), q.device, q.shape, k.shape,
           *(t.stride() for t in tensors), *(t.data_ptr() % 16 for t in tensors), mask is None, window,
           options["diagonal_offset"], options["dropout_p"] > 0.0, None if cu_seqlens is None else
           cu_seqlens.shape, options["max_seqlen_q"], options["max_seqlen_k"], deterministic)  # fmt: skip
    route = _routes.get(key)
    if route is None:
        varlen = None if cu_seqlens is None else (cu_seqlens.numel() - 1, options["max_seqlen_q"],
                                                  options["max_seqlen_k"])  # fmt: skip
        if len(_routes) >= _MAX_ROUTES:
            _routes.clear()
        description = _dispatch.describe(
            pass_name, q, k, tensors, mask=mask is not None, window=window,
            diagonal_offset=options["diagonal_offset"], dropout=options["dropout_p"] > 0.0, varlen=varlen,
            deterministic=deterministic)  # fmt: skip
        _dispatch.log(description)
        route = _routes[key] = (description, _dispatch.choose(description))
    _dispatch.record(route[0])
    return route[1]


def tuned_window(options: dict[str, Any]) -> tuple[int, int] | None:
    """The tuned kernels' window: (window_left, window_right) where they make a band, None where the problem
    is plain or causal."""
    left, right = options["window_left"], options["window_right"]
    return (left, right) if left != UNBOUNDED or right > 0 else None


def _packed_sequences(options: dict[str, Any]) -> triton_impl.Packed | None:
    """The tuned kernels' packed sequences of a "varlen" problem (None for a "tuned" one)."""
    if options["cu_seqlens_q"] is None:
        return None
    return triton_impl.Packed(options["cu_seqlens_q"], options["cu_seqlens_k"], options["max_seqlen_q"],
                              options["max_seqlen_k"])  # fmt: skip


def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                      rng_state: Tensor | None, scale: float, window_left: int, window_right: int,
                      diagonal_offset: int, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                      max_seqlen_q: int, max_seqlen_k: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, lse) of attention (the module docstring's contract), on the backend the dispatch table names."""
    options = {"attn_mask": attn_mask, "dropout_p": dropout_p, "rng_state": rng_state, "scale": scale,
               "window_left": window_left, "window_right": window_right, "diagonal_offset": diagonal_offset,
               "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
               "max_seqlen_k": max_seqlen_k}  # fmt: skip
    if cu_seqlens_q is not None:
        _validation.check_packed_rows(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = recognise_mask(q, k, options)
    window_right = options["window_right"]
    backend = _route("fwd", (q, k, v), options)
    if backend == _dispatch.TORCH:  # (PyTorch's results are contiguous: copied to q's layout if it differs)
        out, lse = torch_impl.attention_forward(q, k, v, **options)
        return _inputs.in_output_layout(out, q), lse
    if backend in (_dispatch.TUNED, _dispatch.GLUON):
        return triton_impl.triton_forward(q, k, v, window_right == 0, scale, window=tuned_window(options),
                                          dropout_p=dropout_p, rng_state=rng_state,
                                          packed=_packed_sequences(options))  # fmt: skip
    _inputs.check_device(q)  # (the dispatch table sent only head dims the kernels take)
    return feature_impl.feature_forward(q, k, v, **options)


def attention_backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                       out: Tensor, lse: Tensor, attn_mask: Tensor | None, dropout_p: float,
                       rng_state: Tensor | None, scale: float, window_left: int, window_right: int,
                       diagonal_offset: int, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                       max_seqlen_q: int, max_seqlen_k: int,
                       deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv) of attention, as the module docstring says."""
    options = {"attn_mask": attn_mask, "dropout_p": dropout_p, "rng_state": rng_state, "scale": scale,
               "window_left": window_left, "window_right": window_right, "diagonal_offset": diagonal_offset,
               "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
               "max_seqlen_k": max_seqlen_k, "grad_lse": grad_lse}  # fmt: skip
    if cu_seqlens_q is not None:
        _validation.check_packed_rows(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = recognise_mask(q, k, options)
    window_right = options["window_right"]
    backend = _route("bwd", (q, k, v, out, grad_out), options, deterministic)
    if backend == _dispatch.TORCH:
        grads = torch_impl.attention_backward(grad_out, q, k, v, out, lse, **options)
        return tuple(_inputs.in_output_layout(g, t) for g, t in zip(grads, (q, k, v), strict=True))
    if backend in (_dispatch.TUNED, _dispatch.GLUON):
        return triton_impl.triton_backward(q, k, v, out, lse, grad_out, window_right == 0, scale,
                                           grad_lse=grad_lse, deterministic=deterministic,
                                           share_allocation=False, window=tuned_window(options),
                                           dropout_p=dropout_p, rng_state=rng_state,
                                           packed=_packed_sequences(options))  # fmt: skip
    _inputs.check_device(q)  # (the dispatch table sent only head dims the kernels take)
    return feature_impl.feature_backward(grad_out, q, k, v, out, lse, **options)


def _attn_fwd_fake(q: Tensor, *options: Any) -> tuple[Tensor, Tensor]:
    return _inputs.output_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _attn_bwd_fake(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                   *options: Any) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _inputs.output_like(q), _inputs.output_like(k), _inputs.output_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *options = inputs
    out, lse = output
    # Tensor options (a mask, the dropout state, cu_seqlens) are saved as tensors are, the others kept.
    ctx.tensor_options = [i for i, o in enumerate(options) if isinstance(o, Tensor)]
    ctx.save_for_backward(q, k, v, out, lse, *(options[i] for i in ctx.tensor_options))
    ctx.options = [None if isinstance(o, Tensor) else o for o in options]
    # Unused outputs get no gradient (None) rather than zeros: lse's gradient is None unless used.
    ctx.set_materialize_grads(False)


def _gradients(ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None, backward: Callable) -> tuple:
    """The gradients of attn_fwd's inputs from what _setup_context saved, by backward (attn_bwd, or
    attention_backward)."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    options = list(ctx.options)
    for i, tensor in zip(ctx.tensor_options, tensors, strict=True):
        options[i] = tensor
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    deterministic = torch.are_deterministic_algorithms_enabled()
    grads = backward(grad_out, grad_lse, q, k, v, out, lse, *options, deterministic)
    return (*grads, *[None] * len(options))


def _no_forward_derivative(ctx: Any, *tangents: Any) -> None:
    raise NotImplementedError("flash_attention has no forward-mode derivative (torch.func.jvp, "
                              "torch.autograd.forward_ad), as scaled_dot_product_attention's flash backend "
                              "has none; for forward-mode AD use scaled_dot_product_attention under "
                              "torch.nn.attention.sdpa_kernel(SDPBackend.MATH)")


class _GradientsOnce(torch.autograd.Function):
    """attn_bwd where a graph of the gradients is built (create_graph=True, torch.func's transforms): the
    gradients join the graph and differentiating them again raises. attn_bwd alone would count as a constant
    (second derivatives silently wrong), and once_differentiable refuses them in plain autograd only."""

    generate_vmap_rule = True
    jvp = staticmethod(_no_forward_derivative)

    @staticmethod
    def forward(*inputs: Any) -> tuple[Tensor, Tensor, Tensor]:
        return attn_bwd(*inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass  # (its backward only refuses)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple:
        raise RuntimeError("flash_attention's gradients have no derivative: its backward kernels cannot be "
                           "differentiated again (a second backward after create_graph=True, "
                           "torch.func.grad of grad); for higher derivatives use "
                           "scaled_dot_product_attention under sdpa_kernel(SDPBackend.MATH)")


def _backward(ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple:
    """attn_fwd's backward through the ops: attn_bwd, or _GradientsOnce where a graph of the gradients is
    built."""
    return _gradients(ctx, grad_out, grad_lse, _GradientsOnce.apply if torch.is_grad_enabled() else attn_bwd)


attn_fwd = _operator("attn_fwd", attention_forward, _attn_fwd_fake)
attn_bwd = _operator("attn_bwd", attention_backward, _attn_bwd_fake)
torch.library.register_autograd("flashattn_triton::attn_fwd", _backward, setup_context=_setup_context,
                                lib=_LIBRARY)  # fmt: skip


_eager = threading.local()  # .active: inside _EagerAttention (masks read once per tensor: _masks)


class _EagerAttention(torch.autograd.Function):
    """attn_fwd and its autograd, without the dispatcher (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[Tensor, Tensor]:
        _eager.active = True
        try:
            output = attention_forward(*inputs)
        finally:
            _eager.active = False
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple:
        # Through the op only where a graph of the gradients is built (the dispatcher costs host time).
        backward = _GradientsOnce.apply if torch.is_grad_enabled() else attention_backward
        _eager.active = True
        try:
            return _gradients(ctx, grad_out, grad_lse, backward)
        finally:
            _eager.active = False


class _TransformedAttention(torch.autograd.Function):
    """attn_fwd with its autograd for torch.func's transforms and forward-mode AD, which register_autograd's
    does not serve. vmap runs the op per sample; forward-mode AD raises."""

    generate_vmap_rule = True
    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)
    jvp = staticmethod(_no_forward_derivative)

    @staticmethod
    def forward(*inputs: Any) -> tuple[Tensor, Tensor]:
        return attn_fwd(*inputs)


def eager_attention(*inputs: Any) -> tuple[Tensor, Tensor]:
    """attn_fwd(*inputs) with its autograd: without the dispatcher where plain_eager, through
    _TransformedAttention under a transform or forward-mode AD, else through the op."""
    if _launcher.transformed():
        return _TransformedAttention.apply(*inputs)
    if _launcher.plain_eager(inputs[0]):
        return _EagerAttention.apply(*inputs)
    return attn_fwd(*inputs)
