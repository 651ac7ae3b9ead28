"""The tensors as the kernels read them: where they may be, 4-D views, descriptor-friendly layouts, float32's
TF32 parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashattn_triton import _launcher
from flashattn_triton._configs import block_d
from flashattn_triton._validation import as_4d

MAX_HEAD_DIM = 256  # the Triton kernels' largest head dim




def check_head_dim(q: torch.Tensor) -> None:
    """The Triton path's limit on the head dim (after check_inputs has passed)."""
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} (q.shape[-1]) is not supported by the Triton kernels "
                         f"(1..{MAX_HEAD_DIM}); use FlashAttentionTorch for larger head dims")


def check_device(q: torch.Tensor) -> None:
    """Errors for a device the Triton kernels cannot run on (CPU only in the interpreter)."""
    if q.device.type == "cuda":
        return
    if q.device.type != "cpu" or not _launcher.interpret_requested():
        raise RuntimeError(f"FlashAttentionTriton got q on {q.device}; its kernels need CUDA tensors. On "
                           "this device use flashattn_triton.flash_attention(...) or "
                           "FlashAttentionTorch.apply(...), or set TRITON_INTERPRET=1 before the first "
                           "call to run the Triton kernels in Triton's (slow) CPU interpreter")
    if not _launcher.interpreted():
        _launcher.kernels()  # (without Triton, its error says how to install it)
        raise RuntimeError("TRITON_INTERPRET=1 was set after flashattn_triton's Triton kernels were built "
                           "for the GPU, so they cannot run on CPU tensors in this process; set it before "
                           "the first call (or use FlashAttentionTorch)")
    if q.dtype == torch.bfloat16:  # its dot products come out wrong there (seen with Triton 3.9)
        raise TypeError("bfloat16 is not supported by Triton's CPU interpreter (TRITON_INTERPRET=1), whose "
                        "bfloat16 dot products are wrong; use float32 or float16 there, or unset "
                        "TRITON_INTERPRET to run the PyTorch path")


def output_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor like x, laid out as SDPA lays out attention's output and gradients (ATen's
    ``alloc_with_matching_layout``): dense, dims in x's order in memory (by x's strides; ties keep their
    order), d innermost. So a model's ``proj(x).view(B, T, H, d).transpose(1, 2)`` (fused or not) gets (B, T,
    H, d) memory, and its transpose back is a view. The fake implementations call it too, so real and fake
    strides agree."""
    inner = x.dim() - 1
    order = sorted(range(inner), key=x.stride, reverse=True)  # (sorted is stable, also reversed)
    return torch.empty_permuted(x.shape, (*order, inner), dtype=x.dtype, device=x.device)


def in_output_layout(result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """result, a contiguous output or gradient shaped like x, in output_like(x)'s layout: itself where they
    agree, else copied (for the PyTorch path)."""
    if x.is_contiguous() and result.is_contiguous():
        return result
    out = output_like(x)
    return result if out.stride() == result.stride() else out.copy_(result)


def _addressable(x4: torch.Tensor, host: bool) -> bool:
    """Whether the kernels can address (Z, H, T, d) x4 as it is: a host-built descriptor (TMA) takes any
    strides 16-byte aligned with unit stride along d, a kernel-built one a contiguous tensor."""
    if x4.data_ptr() % 16:
        return False
    if not host:
        return x4.is_contiguous()
    size = x4.element_size()
    return x4.stride(-1) == 1 and all(
        n == 1 or (stride > 0 and stride * size % 16 == 0)
        for n, stride in zip(x4.shape[:-1], x4.stride()[:-1], strict=True)
    )


def kernel_output(out: torch.Tensor, head_dim: int, host: bool) -> torch.Tensor:
    """The (Z, H, T, head_dim) tensor the kernels write `out` through: a view of out where they can address
    it, else a contiguous one that copy_back copies into out."""
    shape = (1, *out.shape) if out.dim() == 3 else (out.shape[:-3].numel(), *out.shape[-3:])
    if out.shape[-1] == head_dim:
        try:
            x4 = out.view(shape)
        except RuntimeError:  # leading dims that no view merges (a permuted 5-D layout)
            x4 = None
        if x4 is not None and _addressable(x4, host):
            return x4
    return torch.empty((*shape[:-1], head_dim), dtype=out.dtype, device=out.device)


def copy_back(out: torch.Tensor, x4: torch.Tensor) -> torch.Tensor:
    """out, holding what the kernels wrote into x4 (kernel_output's): copied where x4 is not its view."""
    if x4.data_ptr() != out.data_ptr():
        out.copy_(x4[..., : out.shape[-1]].reshape(out.shape))
    return out


def padded_head_dim(head_dim: int, element_size: int) -> int:
    """Rows of a tensor descriptor must span a multiple of 16 bytes: d rounded up to that."""
    step = 16 // element_size
    return -(-head_dim // step) * step


def input_precision(dtype: torch.dtype) -> str:
    # float32 keeps float32 accuracy (3 TF32 products) unless the user allowed TF32 for matmuls.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def host_descriptors(device: torch.device) -> bool:
    """Whether the host builds the tensor descriptors (once per address; a kernel-built one costs every
    program a write and a fence): on Hopper and later, and for the interpreter."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= 9


def is_kernel_view(x: torch.Tensor, head_dim: int) -> bool:
    """Whether x is already what kernel_view makes of it (the common case)."""
    return x.dim() == 4 and x.shape[-1] == head_dim and x.is_contiguous() and x.data_ptr() % 16 == 0


def kernel_view(x: torch.Tensor, head_dim: int, host: bool) -> torch.Tensor:
    """x as (Z, H, T, head_dim) the kernels can address: zero-padded along d, copied only where a descriptor
    cannot describe it."""
    if is_kernel_view(x, head_dim):
        return x
    x4 = as_4d(x)
    if x4.shape[-1] < head_dim:
        x4 = F.pad(x4, (0, head_dim - x4.shape[-1]))
    return x4 if _addressable(x4, host) else x4.clone(memory_format=torch.contiguous_format)


class TF32Split:
    """The TF32 parts of float32 (Z, H, T, d) inputs of one layout, as the tf32x3 kernels read them: (2Z, H,
    T, d), x with its 13 low mantissa bits cleared then the remainders (transposed: (2Z, H, d, T), rows padded
    to 16 bytes), in one allocation and one launch of _kernels.tf32_parts."""

    ROWS = 32

    def __init__(self, x4: torch.Tensor, transposed: bool):
        batch, heads, seqlen, head_dim = x4.shape
        if transposed:
            row = -(-seqlen // 4) * 4
            self.shape = (2 * batch, heads, head_dim, seqlen)
            self.strides = (heads * head_dim * row, head_dim * row, row, 1)
            part_strides = (batch * self.strides[0], *self.strides[:2], 1, row)  # as (2, Z, H, T, d)
        else:
            self.shape = (2 * batch, heads, seqlen, head_dim)
            self.strides = (heads * seqlen * head_dim, seqlen * head_dim, head_dim, 1)
            part_strides = (batch * self.strides[0], *self.strides)
        stride_xz, stride_xh, stride_xt = x4.stride()[:3]
        stride_pp, stride_pz, stride_ph, stride_pt, stride_pd = part_strides
        self.args = dict(heads=heads, seqlen=seqlen, head_dim=head_dim, stride_xz=stride_xz,
                         stride_xh=stride_xh, stride_xt=stride_xt, stride_pp=stride_pp, stride_pz=stride_pz,
                         stride_ph=stride_ph, stride_pt=stride_pt, stride_pd=stride_pd, BLOCK_T=self.ROWS,
                         BLOCK_D=block_d(head_dim))  # fmt: skip
        grid = (-(-seqlen // self.ROWS) * batch * heads,)
        self.launch = _launcher.Launcher(_launcher.kernels().tf32_parts, grid)

    def __call__(self, x4: torch.Tensor) -> torch.Tensor:
        parts = torch.empty_strided(self.shape, self.strides, dtype=x4.dtype, device=x4.device)
        if parts.numel():
            self.launch({"X": x4, "Parts": parts, **self.args})
        return parts


def tf32_parts(x4: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x4's TF32 parts (see TF32Split)."""
    return TF32Split(x4, transposed)(x4)
