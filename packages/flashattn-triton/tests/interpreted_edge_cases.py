"""Edge cases of issue 43 on the Triton kernels under Triton's CPU interpreter (float32), against SDPA on
the same data.

Not collected on its own (TRITON_INTERPRET must be set before the kernels are first imported):
test_triton_interpreter.py runs this file in a pytest subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashattn_triton import flash_attention, ops, triton_impl

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
    options = {"attn_mask": None, "window_left": -1, "window_right": 0 if is_causal else -1,
               "diagonal_offset": 0, "cu_seqlens_q": None}  # fmt: skip
    assert ops._path(q, k, options) == "tuned"
    got = like_sdpa.results(flash_attention, q, k, v, is_causal=is_causal)
    want = like_sdpa.results(like_sdpa.sdpa, q, k, v, is_causal=is_causal)
    assert not want[0].isnan().all()  # (a case where rows differ)
    like_sdpa.check(got, want)
