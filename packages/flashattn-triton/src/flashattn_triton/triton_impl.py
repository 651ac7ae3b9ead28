"""FlashAttention-2 with Triton kernels: launchers and the autograd Function.

Triton is imported on first use, so ``import flashattn_triton`` works without it. The kernels run on
CUDA tensors; with ``TRITON_INTERPRET=1`` in the environment before they are first used, Triton's
interpreter runs them on CPU tensors instead (slowly: for testing).
"""

from __future__ import annotations

import contextlib
import functools
import os
from types import ModuleType
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flashattn_triton._configs import BackwardConfig, ForwardConfig, backward_config, forward_config, smaller
from flashattn_triton._validation import check_inputs

MAX_HEAD_DIM = 256
_TRUE = ("1", "true", "on", "yes")


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.cache
def _kernels() -> ModuleType:
    from flashattn_triton import _kernels as kernels

    return kernels


def _interpreted() -> bool:
    """Whether the kernels were built for the interpreter (decided when they were first imported)."""
    return type(_kernels().attn_fwd).__name__ == "InterpretedFunction"


def check_triton_inputs(q: torch.Tensor) -> None:
    """Errors for what only the Triton path cannot do (after check_inputs has passed)."""
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {head_dim} (q.shape[-1]) is not supported by the Triton kernels "
            f"(1..{MAX_HEAD_DIM}); use FlashAttentionTorch for larger head dims"
        )
    if q.device.type == "cuda":
        return
    if q.device.type != "cpu" or not interpret_requested():
        raise RuntimeError(
            f"FlashAttentionTriton got q on {q.device}; its kernels need CUDA tensors. On this device use "
            "flashattn_triton.flash_attention(...) or FlashAttentionTorch.apply(...), or set "
            "TRITON_INTERPRET=1 before the first call to run the Triton kernels in Triton's (slow) CPU "
            "interpreter"
        )
    if not _interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after flashattn_triton's Triton kernels were built for the GPU, so "
            "they cannot run on CPU tensors in this process; set it before the first call (or use "
            "FlashAttentionTorch)"
        )


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """(..., T, d) as (Z, H, T, d): a view for 3-D and 4-D tensors of any strides."""
    return x.unsqueeze(0) if x.dim() == 3 else x.reshape(-1, *x.shape[-3:])


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _input_precision(dtype: torch.dtype) -> str:
    # float32 keeps float32 accuracy (3 TF32 products) unless the user allowed TF32 for matmuls.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


_fitted: dict[Any, ForwardConfig | BackwardConfig] = {}


def _launch(
    kernel: Any, grid: Any, config: ForwardConfig | BackwardConfig, key: Any, *args: Any, **constexprs: Any
) -> None:
    """Launch with `config` (or the config that fit last time for `key`), stepping down on OutOfResources."""
    from triton.runtime.errors import OutOfResources

    config = _fitted.get(key, config)
    while True:
        try:
            kernel[grid(config)](*args, **constexprs, **_kernel_args(config))
            _fitted[key] = config
            return
        except OutOfResources:
            next_config = smaller(config)
            if next_config is None:
                raise
            config = next_config


def _kernel_args(config: ForwardConfig | BackwardConfig) -> dict[str, int]:
    if isinstance(config, ForwardConfig):
        blocks = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
    else:
        blocks = {
            "BLOCK_M1": config.block_m1,
            "BLOCK_N1": config.block_n1,
            "BLOCK_M2": config.block_m2,
            "BLOCK_N2": config.block_n2,
            "ATOMIC_DQ": config.atomic_dq,
        }
    return {**blocks, "num_warps": config.num_warps, "num_stages": config.num_stages}


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    config: ForwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) from the Triton forward kernel; O is contiguous, L float32 of shape q.shape[:-1]."""
    kernels = _kernels()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    q4, k4, v4, o4 = (_as_4d(t) for t in (q, k, v, out))
    batch, heads, seqlen_q, head_dim = q4.shape
    block_d = _block_d(head_dim)
    config = config or forward_config(block_d, q.element_size(), is_causal, _interpreted())
    key = ("fwd", q.device, block_d, q.dtype, is_causal, config)

    def grid(c: ForwardConfig) -> tuple[int]:
        return (-(-seqlen_q // c.block_m) * batch * heads,)

    with _device_guard(q):
        _launch(
            kernels.attn_fwd,
            grid,
            config,
            key,
            q4,
            k4,
            v4,
            o4,
            lse,
            *q4.stride(),
            *k4.stride(),
            *v4.stride(),
            *o4.stride(),
            heads,
            seqlen_q,
            k4.shape[2],
            scale * kernels.LOG2E,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            CAUSAL=is_causal,
            INPUT_PRECISION=_input_precision(q.dtype),
        )
    return out, lse


def triton_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    is_causal: bool,
    scale: float,
    config: BackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) from the Triton backward: D = rowsum(dO * O), then dK/dV and dQ in one launch."""
    kernels = _kernels()
    grad_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if grad_k.numel() == 0:
        return grad_q, grad_k, grad_v
    if grad_q.numel() == 0:  # no query sees any key
        return grad_q, grad_k.zero_(), grad_v.zero_()
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (_as_4d(t) for t in (q, k, v, out, grad_out, grad_q, grad_k, grad_v))
    batch, heads, seqlen_q, head_dim = q4.shape
    seqlen_k = k4.shape[2]
    block_d = _block_d(head_dim)
    delta = torch.empty_like(lse)
    config = config or backward_config(block_d, q.element_size(), is_causal, _interpreted())
    key = ("bwd", q.device, block_d, q.dtype, is_causal, config)
    preprocess_rows = 64

    def grid(c: BackwardConfig) -> tuple[int]:
        tiles = -(-seqlen_k // c.block_n1)
        return ((tiles if c.atomic_dq else max(tiles, -(-seqlen_q // c.block_m2))) * batch * heads,)

    with _device_guard(q):
        kernels.attn_bwd_preprocess[(batch * heads, -(-seqlen_q // preprocess_rows))](
            o4,
            do4,
            delta,
            *o4.stride(),
            *do4.stride(),
            heads,
            seqlen_q,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=preprocess_rows,
        )
        # The float32 dQ sum of the atomic variant, padded to whole tiles of any size up to 128 rows
        # (a smaller config may be stepped down to) so that its updates need no masks.
        dq_acc_rows = -(-seqlen_q // 128) * 128
        dq_acc = (
            torch.zeros(batch * heads, dq_acc_rows, block_d, dtype=torch.float32, device=q.device)
            if config.atomic_dq
            else dq4
        )
        _launch(
            kernels.attn_bwd,
            grid,
            config,
            key,
            q4,
            k4,
            v4,
            do4,
            lse,
            delta,
            dq4,
            dk4,
            dv4,
            dq_acc,
            *q4.stride(),
            *k4.stride(),
            *v4.stride(),
            *do4.stride(),
            *dq4.stride(),
            *dk4.stride(),
            *dv4.stride(),
            heads,
            seqlen_q,
            seqlen_k,
            dq_acc_rows,
            scale * kernels.LOG2E,
            scale,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            CAUSAL=is_causal,
            INPUT_PRECISION=_input_precision(q.dtype),
        )
    if config.atomic_dq:
        dq4.copy_((dq_acc[:, :seqlen_q, :head_dim] * scale).view(dq4.shape))
    return grad_q, grad_k, grad_v


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 forward and backward as Triton kernels: ``FlashAttentionTriton.apply(q, k, v)``.

    q: (..., Tq, d), k and v: (..., Tk, d) CUDA tensors with the same leading dims and dtype (float16,
    bfloat16 or float32), head dim up to 256. Saves Q, K, V, O and L (float32, shape q.shape[:-1]).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        scale = check_inputs(q, k, v, is_causal, scale)
        check_triton_inputs(q)
        out, lse = triton_forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = triton_backward(q, k, v, out, lse, grad_out, ctx.is_causal, ctx.scale)
        return grad_q, grad_k, grad_v, None, None

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
