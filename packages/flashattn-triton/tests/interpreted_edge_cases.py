"""Edge cases of issue 43 on the Triton kernels under Triton's CPU interpreter (float32), against SDPA on
the same data.

Not collected on its own (TRITON_INTERPRET must be set before the kernels are first imported):
test_triton_interpreter.py runs this file in a pytest subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashattn_triton import flash_attention, flash_attention_varlen, ops, triton_impl
from flashattn_triton._dispatch import FEATURES, TUNED

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)


@pytest.fixture(autouse=True)
def no_plans_from_earlier_tests(monkeypatch):
    monkeypatch.setattr(triton_impl, "_plans", {})


INF = float("inf")
INFINITE = {  # (input that holds it, where, value, is_causal); q of integers (exactly TF32) for a K's
    "+inf in v": ("v", (0, 0, 7, 0), INF, False),
    "+inf in v, causal": ("v", (0, 0, 7, 0), INF, True),
    "-inf in v": ("v", (0, 1, 70, 5), -INF, False),
    "-inf in k": ("k", (0, 1, 9, 3), -INF, False),
}


@pytest.mark.parametrize("case", list(INFINITE))
def test_infinite_inputs_give_sdpas_pattern_at_full_float32(case, like_sdpa, full_float32_precision):
    """float32 at full accuracy runs three TF32 products, from each input's (high, low) parts. An inf kept
    in the high part met the other operand's low part, 0 wherever that one is exactly TF32 (P = 1 at a
    row's maximum), and made rows NaN where SDPA's are inf."""
    name, where, value, is_causal = INFINITE[case]
    generator = torch.Generator().manual_seed(0)
    inputs = dict(zip("qkv", (torch.randn(1, 2, 80, 16, generator=generator) for _ in range(3)), strict=True))
    inputs[name][where] = value
    if name == "k":
        inputs["q"] = inputs["q"].round()
    q, k, v = inputs.values()
    assert _backend(q, k, v, window_right=0 if is_causal else -1) == TUNED
    got = like_sdpa.results(flash_attention, q, k, v, is_causal=is_causal)
    want = like_sdpa.results(like_sdpa.sdpa, q, k, v, is_causal=is_causal)
    assert not want[0].isnan().all()  # (a case where rows differ)
    like_sdpa.check(got, want)


def _backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> str:
    """The backend the dispatch table picks for the forward of these tensors (no mask, no dropout)."""
    return ops._route("fwd", (q, k, v), {"attn_mask": None, "dropout_p": 0.0, "window_left": -1,
                                         "window_right": -1, "diagonal_offset": 0, "cu_seqlens_q": None,
                                         "cu_seqlens_k": None, "max_seqlen_q": 0, "max_seqlen_k": 0,
                                         **options})  # fmt: skip


def _qkv(*shape: int):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(shape or (1, 2, 40, 16), generator=generator) for _ in range(3)]


def test_strided_cu_seqlens_on_the_feature_kernels(full_float32_precision):
    """A strided cu_seqlens (every other entry of a table) was read as if contiguous by the feature kernels
    (packed float32 at full accuracy goes there): out was off by 4e35. Each sequence against SDPA alone."""
    q, k, v = _qkv(14, 2, 16)
    cu = torch.tensor([0, 0, 5, 5, 14, 14], dtype=torch.int32)[::2]
    assert _backend(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9) == FEATURES
    out = flash_attention_varlen(q, k, v, cu, cu, 9, 9)
    for start, end in ((0, 5), (5, 14)):
        sequence = (t[start:end].transpose(0, 1) for t in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(*sequence).transpose(0, 1)
        torch.testing.assert_close(out[start:end], want, atol=1e-5, rtol=1e-5)


def test_invalid_cu_seqlens_under_torch_compile_never_reaches_the_kernels(full_float32_precision):
    """Compiled, a cu_seqlens ending past the rows went unchecked and the kernels wrote out of bounds
    (``free(): invalid next size`` under the interpreter): the op refuses it before they run."""
    q, k, v = _qkv(14, 2, 16)
    compiled = torch.compile(lambda q, k, v, cu: flash_attention_varlen(q, k, v, cu, cu, 15, 15),
                             backend="aot_eager", fullgraph=True)  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 20 but q has 14 rows"):
        compiled(q, k, v, torch.tensor([0, 5, 20], dtype=torch.int32))


def test_second_derivatives_are_refused_and_torch_func_runs_on_the_kernels(like_sdpa, full_float32_precision):
    """On the kernels as on the PyTorch path: a second derivative raised nothing and was off by its whole
    size; torch.func.grad failed ("must override the setup_context staticmethod")."""
    q, k, v = _qkv()

    def loss(attention):
        return lambda q, k, v: attention(q, k, v, is_causal=True).pow(2).sum()

    got = torch.func.grad(loss(flash_attention), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(loss(like_sdpa.sdpa), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    leaf = q.clone().requires_grad_()
    (grad,) = torch.autograd.grad(loss(flash_attention)(leaf, k, v), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="flash_attention's gradients have no derivative"):
        torch.autograd.grad(grad.sum(), leaf)
