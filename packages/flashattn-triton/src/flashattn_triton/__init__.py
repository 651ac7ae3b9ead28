"""FlashAttention-2 forward and backward in PyTorch and Triton, a drop-in for scaled_dot_product_attention."""

from flashattn_triton.functional import Explained, explain, flash_attention, flash_attention_varlen, tune
from flashattn_triton.torch_impl import FlashAttentionTorch, reference_attention, reference_logsumexp
from flashattn_triton.triton_impl import FlashAttentionTriton

__version__ = "0.3.0"
__all__ = [
    "Explained",
    "FlashAttentionTorch",
    "FlashAttentionTriton",
    "explain",
    "flash_attention",
    "flash_attention_varlen",
    "reference_attention",
    "reference_logsumexp",
    "tune",
    "__version__",
]
