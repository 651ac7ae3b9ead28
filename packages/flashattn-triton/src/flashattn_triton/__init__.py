"""FlashAttention-2 forward and backward in PyTorch and Triton, a drop-in for scaled_dot_product_attention."""

__version__ = "0.1.0"
