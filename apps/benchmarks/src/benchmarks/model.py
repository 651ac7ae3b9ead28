"""The reference Transformer LM of the experiments (CS336 "basics" architecture) and its sizes.

Pre-norm blocks: x + MHA(RMSNorm(x)) then x + SwiGLU(RMSNorm(x)); RoPE on queries and keys;
no biases; untied embedding and LM head. The attention function is pluggable by name, and so is
the activation-checkpointing policy (``torch.utils.checkpoint``, non-reentrant):

- ``none``: every activation is kept for the backward;
- ``blocks``: every block is checkpointed (only its input is kept; it is recomputed in the backward);
- ``every-k``: blocks 0, k, 2k, ... are checkpointed, the others keep their activations;
- ``sqrt``: the blocks form segments of ceil(sqrt(L)) consecutive blocks, one checkpoint each
  (Chen et al., 2016: O(sqrt(L)) block activations held at any time);
- ``attention``: selective recomputation (Korthikanti et al., 2022): only the attention core
  (scores, softmax, weighted sum: the activations that grow with T^2) is recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10_000
    context_length: int = 256
    rope_theta: float = 10_000.0
    # Grouped-query attention: K/V heads (0: num_heads). With them the attention is laid out as
    # HuggingFace's Llama lays it out: separate q, k, v projections viewed (B, T, H, d) and transposed.
    num_kv_heads: int = 0

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"head dim {self.d_model // self.num_heads} must be even for RoPE")


# The five sizes of the assignment, "tiny" for machines without a GPU, and two beyond the assignment.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    # Larger than one 141 GB H200 in fp32 with AdamW (16 bytes a parameter): for sharded training (issue 45).
    "13B": ModelConfig(d_model=5120, d_ff=13824, num_layers=40, num_heads=40),
    # A Llama-style model (issue 40): 16 query heads, 4 K/V heads of d = 128, HuggingFace's layout.
    "llama-8L": ModelConfig(d_model=2048, d_ff=5632, num_layers=8, num_heads=16, num_kv_heads=4),
}
ASSIGNMENT_SIZES = ["small", "medium", "large", "xl", "2.7B"]


def model_config(size: str, context_length: int = 256, vocab_size: int = 10_000) -> ModelConfig:
    """The config of a named size at a given context length."""
    if size not in MODEL_SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(MODEL_SIZES)}")
    return replace(MODEL_SIZES[size], context_length=context_length, vocab_size=vocab_size)


# --- attention functions: (q, k, v) of shape (B, H, T, d) -> (B, H, T, d), causal -----------------
# Naive attention is split into its three steps so profilers can annotate each one by name.

def attention_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def attention_softmax(scores: torch.Tensor) -> torch.Tensor:
    t_q, t_k = scores.shape[-2:]
    future = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def attention_weighted_sum(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return probs @ v


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head repeated for its query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return attention_weighted_sum(attention_softmax(attention_scores(q, k)), v)


def causal_mask(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The (B, 1, Tq, Tk) bool causal mask, as transformers materializes it while torch.compile traces."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril()
    return mask[None, None].expand(q.shape[0], 1, t_q, t_k)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def sdpa_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q, k),
                                          enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flashattn_triton import flash_attention as flash

    return flash(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def flash_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flashattn_triton import flash_attention as flash

    return flash(q, k, v, attn_mask=causal_mask(q, k), enable_gqa=k.shape[1] != q.shape[1])


# Grouped-query attention (fewer K/V heads) goes through each function's enable_gqa. The "-mask" variants
# pass the causal mask as a tensor, as transformers does under torch.compile.
ATTENTION: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "sdpa-mask": sdpa_masked_attention,
    "flash-mask": flash_masked_attention,
}


# --- layers ----------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for stability, return in the input dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("cos", torch.empty(max_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill the tables (again after ``to_empty()``, which leaves buffers uninitialised)."""
        device = self.cos.device
        inv_freq = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                  / self.head_dim)
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32, device=device), inv_freq)
        self.cos.copy_(angles.cos())  # (T, d/2)
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rotate each (even, odd) pair of features by its position's angle.
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str) -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}")
        self.num_heads, self.kv_heads = cfg.num_heads, cfg.kv_heads
        head_dim = cfg.d_model // cfg.num_heads
        if cfg.num_kv_heads:  # HuggingFace's Llama layout
            self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            self.k_proj = nn.Linear(cfg.d_model, self.kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(cfg.d_model, self.kv_heads * head_dim, bias=False)
        else:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = RotaryEmbedding(cfg.d_model // cfg.num_heads, cfg.context_length, cfg.rope_theta)
        self.attend = ATTENTION[attention]
        self.recompute_core = False  # set by the "attention" checkpoint policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.projections(x)
        q, k = self.rope(q), self.rope(k)
        if self.recompute_core:
            # v made contiguous: a view would keep the whole qkv projection alive as the checkpoint's input.
            y = torch.utils.checkpoint.checkpoint(self.attend, q, k, v.contiguous(), use_reentrant=False)
        else:
            y = self.attend(q, k, v)  # (B, H, T, d_head)
        return self.out(y.transpose(1, 2).reshape(b, t, d))

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, d), k and v (B, Hkv, T, d): views of the projections, fused (one (B, T, 3, H, d)
        permuted) or HuggingFace's (each (B, T, H, d) transposed)."""
        b, t, d = x.shape
        head_dim = d // self.num_heads
        if self.kv_heads == self.num_heads and hasattr(self, "qkv"):
            return self.qkv(x).view(b, t, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        return tuple(proj(x).view(b, t, -1, head_dim).transpose(1, 2)
                     for proj in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, attention)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


CHECKPOINT_POLICIES = ["none", "blocks", "every-k", "sqrt", "attention"]


def checkpoint_segments(policy: str, num_layers: int, every: int = 2) -> list[tuple[int, int, bool]]:
    """The blocks as (start, stop, recompute) runs: each run with recompute=True is one checkpoint."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoint={policy!r} is not one of {', '.join(CHECKPOINT_POLICIES)}")
    if every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {every}")
    if policy == "sqrt":
        size = math.ceil(math.sqrt(num_layers))
        return [(i, min(i + size, num_layers), True) for i in range(0, num_layers, size)]
    recompute = {"blocks": lambda i: True, "every-k": lambda i: i % every == 0}.get(policy, lambda i: False)
    return [(i, i + 1, recompute(i)) for i in range(num_layers)]


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str = "naive", checkpoint: str = "none",
                 checkpoint_every: int = 2) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, attention) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.segments = checkpoint_segments(checkpoint, cfg.num_layers, checkpoint_every)
        for block in self.blocks:
            block.attn.recompute_core = checkpoint == "attention"
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise every parameter and buffer: at construction, and once more after ``to_empty()`` of a
        model built on the meta device and sharded there (FSDP2's deferred init), which leaves them
        uninitialised."""
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > self.cfg.context_length:
            raise ValueError(f"tokens: sequence length {tokens.shape[-1]} exceeds "
                             f"context_length={self.cfg.context_length}")
        x = self.embedding(tokens)
        for start, stop, recompute in self.segments:
            blocks = self.blocks[start:stop]
            if recompute:
                x = torch.utils.checkpoint.checkpoint(_run_blocks, blocks, x, use_reentrant=False)
            else:
                x = _run_blocks(blocks, x)
        return self.lm_head(self.final_norm(x))


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.trunc_normal_(module.weight, std=0.02, a=-0.06, b=0.06)
    elif isinstance(module, (RMSNorm, RotaryEmbedding)):
        module.reset_parameters()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops(cfg: ModelConfig, batch_size: int, context_length: int) -> float:
    """Matrix-multiply FLOPs of one forward pass (2 per multiply-add), causal attention counted in full."""
    tokens = batch_size * context_length
    kv_width = cfg.kv_heads * (cfg.d_model // cfg.num_heads)
    per_layer = 2 * tokens * (2 * cfg.d_model**2 + 2 * cfg.d_model * kv_width + 3 * cfg.d_model * cfg.d_ff)
    per_layer += 2 * 2 * tokens * context_length * cfg.d_model  # QK^T and PV
    return cfg.num_layers * per_layer + 2 * tokens * cfg.d_model * cfg.vocab_size


def random_batch(cfg: ModelConfig, batch_size: int, context_length: int, device: torch.device | str,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Random token ids: benchmarks need no data set."""
    return torch.randint(0, cfg.vocab_size, (batch_size, context_length), device=device, generator=generator)
