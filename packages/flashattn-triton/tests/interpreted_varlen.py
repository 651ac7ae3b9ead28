"""Packed sequences (varlen) on the tuned kernels (triton_impl.triton_forward/backward with `packed`,
attn_fwd and attn_bwd under VARLEN) under Triton's CPU interpreter, float32 with TF32 products allowed
(full accuracy goes to the feature kernels), against the PyTorch path on the same data: O, L and every
gradient (with a gradient of L), for each backward variant.

Not collected on its own (TRITON_INTERPRET must be set before the kernels are first imported):
test_varlen_interpreter.py runs this file in a pytest subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashattn_triton import feature_impl, flash_attention_varlen, torch_impl, triton_impl
from flashattn_triton._configs import BackwardConfig, ForwardConfig
from flashattn_triton._inputs import output_like
from flashattn_triton._validation import varlen_op_arguments

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_varlen_interpreter.py (TRITON_INTERPRET=1)", allow_module_level=True)

NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture(autouse=True)
def tf32_allowed(monkeypatch, matmul_precision):
    """float32 with TF32 products (the tuned varlen path's float32; exact under the interpreter), and no
    plans of earlier tests."""
    matmul_precision("high")
    monkeypatch.setattr(triton_impl, "_plans", {})


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inside_guards(x: torch.Tensor, rows: int = 40) -> torch.Tensor:
    """x as the middle of a buffer with `rows` NaN rows on each side: a kernel that reads past x's rows
    brings NaN into its results."""
    buffer = torch.full((x.shape[0] + 2 * rows, *x.shape[1:]), float("nan"), dtype=x.dtype)
    buffer[rows : rows + x.shape[0]] = x
    return buffer[rows : rows + x.shape[0]]


def packed(lengths_q, lengths_k, q_heads=2, kv_heads=2, head_dim=16, dtype=torch.float32):
    """Packed q, k, v, dO and a gradient of L, between NaN guard rows."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), q_heads, head_dim, generator=generator)
    k, v = (torch.randn(sum(lengths_k), kv_heads, head_dim, generator=generator) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator)
    grad_lse = torch.randn(q.shape[:-1], generator=generator)
    return [_inside_guards(t.to(dtype)) for t in (q, k, v, grad_out)] + [grad_lse]


def torch_path(args, grad_out, grad_lse) -> dict:
    options = args._asdict()
    q, k, v = (options.pop(name) for name in ("q", "k", "v"))
    out, lse = torch_impl.attention_forward(q, k, v, **options)
    grads = torch_impl.attention_backward(grad_out, q, k, v, out, lse, grad_lse=grad_lse, **options)
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


def tuned_path(args, grad_out, grad_lse, forward=None, backward=None, deterministic=False) -> dict:
    packed = triton_impl.Packed(args.cu_seqlens_q, args.cu_seqlens_k, args.max_seqlen_q, args.max_seqlen_k)
    causal = args.window_right == 0
    options = {"dropout_p": args.dropout_p, "rng_state": args.rng_state, "packed": packed}
    out, lse = triton_impl.triton_forward(args.q, args.k, args.v, causal, args.scale, forward, **options)
    grads = triton_impl.triton_backward(args.q, args.k, args.v, out, lse, grad_out, causal, args.scale,
                                        backward, grad_lse=grad_lse, deterministic=deterministic,
                                        **options)  # fmt: skip
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


def assert_close_to(got: dict, want: dict, bound: float) -> None:
    """Each of NAMES within bound of want's, as max error relative to want's largest value (or 1); lse's
    -inf (rows that see no key) in the same places."""
    for name in NAMES:
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == want[name].dtype, name
        unseen = want[name] == float("-inf")
        assert torch.equal(got[name] == float("-inf"), unseen), name
        g, w = got[name].double().masked_fill(unseen, 0), want[name].double().masked_fill(unseen, 0)
        error = (g - w).abs().max().item() / max(w.abs().max().item(), 1.0)
        assert error <= bound, f"{name}: max error {error:.2e} relative to max |reference|"


CASES = {  # name: (lengths_q, lengths_k, causal, Hq, Hkv, dtype)
    "causal": ([1, 17, 40, 5], [1, 17, 40, 5], True, 2, 2, torch.float32),
    "full-tq!=tk": ([13, 1, 40, 0, 22], [13, 30, 7, 3, 1], False, 2, 2, torch.float32),
    "causal-tq!=tk-gqa": ([13, 1, 40, 0, 22], [13, 5, 31, 3, 22], True, 4, 2, torch.float32),
    "full-no-keys-gqa3": ([9, 20, 6], [0, 33, 4], False, 3, 1, torch.float32),
    "causal-float16": ([17, 40, 3], [17, 40, 3], True, 2, 2, torch.float16),
}
CONFIGS = {  # name: (forward config, backward config); None: the interpreter's default
    "default": (None, None),
    "atomic-dq": (ForwardConfig(32, 16, 4, 1), BackwardConfig(16, 32, 4, 1, atomic_dq=True)),
    "split": (ForwardConfig(16, 32, 4, 1), BackwardConfig(32, 16, 4, 1, split=True, dq_block_m=16)),
    "transposed-grads": (None, BackwardConfig(16, 32, 4, 1, transposed_grads=True)),
}


@pytest.mark.parametrize("configs", CONFIGS)
@pytest.mark.parametrize("case", CASES)
def test_varlen_tuned_kernels_match_the_torch_path(case, configs):
    lengths_q, lengths_k, causal, q_heads, kv_heads, dtype = CASES[case]
    q, k, v, grad_out, grad_lse = packed(lengths_q, lengths_k, q_heads, kv_heads, dtype=dtype)
    args = varlen_op_arguments(q, k, v, cumulative(lengths_q), cumulative(lengths_k), max(lengths_q),
                               max(lengths_k), is_causal=causal, scale=0.3, enable_gqa=True)  # fmt: skip
    got = tuned_path(args, grad_out, grad_lse, *CONFIGS[configs])
    assert_close_to(got, torch_path(args, grad_out, grad_lse), 2e-5 if dtype == torch.float32 else 4e-3)


def test_varlen_tuned_kernels_with_dropout_and_longer_max_seqlens():
    """Dropout's counters (Dropout.packed) with max_seqlen above the longest sequence: the counters' rows
    are max_seqlen_k keys long, the grid covers max_seqlen_q."""
    lengths_q, lengths_k = [13, 1, 40, 22], [13, 5, 31, 22]
    q, k, v, grad_out, grad_lse = packed(lengths_q, lengths_k, 4, 2)
    torch.manual_seed(0)
    for causal in (True, False):
        args = varlen_op_arguments(q, k, v, cumulative(lengths_q), cumulative(lengths_k), 45, 37,
                                   dropout_p=0.3, is_causal=causal, enable_gqa=True)  # fmt: skip
        want = torch_path(args, grad_out, grad_lse)
        assert_close_to(tuned_path(args, grad_out, grad_lse), want, 2e-5)
        atomic = BackwardConfig(16, 32, 4, 1, atomic_dq=True)
        assert_close_to(tuned_path(args, grad_out, grad_lse, backward=atomic), want, 2e-5)


def test_varlen_deterministic_backward_is_bitwise_repeatable():
    lengths = [7, 30, 18]
    q, k, v, grad_out, grad_lse = packed(lengths, lengths)
    args = varlen_op_arguments(q, k, v, cumulative(lengths), cumulative(lengths), 30, 30, is_causal=True)
    first, second = (tuned_path(args, grad_out, None, deterministic=True) for _ in range(2))
    for name in NAMES:
        assert torch.equal(first[name], second[name]), name


@pytest.fixture
def no_feature_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the feature kernels ran")

    monkeypatch.setattr(feature_impl, "feature_forward", refuse)
    monkeypatch.setattr(feature_impl, "feature_backward", refuse)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_flash_attention_varlen_runs_the_tuned_kernels(no_feature_kernels, is_causal):
    lengths_q, lengths_k = [1, 17, 40], [5, 17, 33]
    q, k, v, grad_out, _ = packed(lengths_q, lengths_k, 4, 2)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen(*tensors, cu_q, cu_k, 40, 33, is_causal=is_causal, enable_gqa=True)
    out.backward(grad_out)
    args = varlen_op_arguments(q, k, v, cu_q, cu_k, 40, 33, is_causal=is_causal, enable_gqa=True)
    want = torch_path(args, grad_out, None)
    got = {"out": out, "dq": tensors[0].grad, "dk": tensors[1].grad, "dv": tensors[2].grad}
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("route", ["window", "full-accuracy-float32"])
def test_flash_attention_varlen_leaves_the_rest_to_the_feature_kernels(monkeypatch, route):
    """A window, and float32 at full accuracy (tf32x3, whose parts the VARLEN path does not lay out), run
    the feature kernels."""
    launched = []
    original = feature_impl.feature_forward
    monkeypatch.setattr(
        feature_impl, "feature_forward", lambda *a, **kw: launched.append(1) or original(*a, **kw)
    )
    lengths = [3, 20]
    q, k, v, *_ = packed(lengths, lengths)
    varlen = (cumulative(lengths), cumulative(lengths), 20, 20)
    options = {"window_size": (4, 2)} if route == "window" else {"is_causal": True}
    if route == "full-accuracy-float32":
        torch.set_float32_matmul_precision("highest")
    out = flash_attention_varlen(q, k, v, *varlen, **options)
    assert launched
    want = torch_path(varlen_op_arguments(q, k, v, *varlen, **options), torch.zeros_like(q), None)
    torch.testing.assert_close(out, want["out"], atol=2e-5, rtol=2e-5)


def _in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values in another layout: a view of a fused (total, 3, H, d) qkv projection (dense neither), or
    heads outermost, (H, total, d) memory transposed to (total, H, d)."""
    if layout == "fused-qkv":
        return torch.stack([torch.zeros_like(x), x, torch.zeros_like(x)], 1)[:, 1]
    return x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16-padded-d"])
@pytest.mark.parametrize("layout", ["fused-qkv", "heads-outermost"])
def test_varlen_outputs_and_gradients_in_their_inputs_layouts(layout, dtype):
    """Out, dq, dk and dv dense in their inputs' order of dims (_inputs.output_like, which the fake
    implementations return too), with the PyTorch path's values: written in place or copied back (a head
    dim of 12 float16s is padded to 16 for the kernels), grouped-query dK and dV summed into theirs."""
    lengths_q, lengths_k = [13, 1, 40, 22], [13, 5, 31, 22]
    q, k, v, grad_out, grad_lse = packed(lengths_q, lengths_k, 4, 2, head_dim=12, dtype=dtype)
    q, k, v = (_in_layout(t, layout) for t in (q, k, v))
    args = varlen_op_arguments(q, k, v, cumulative(lengths_q), cumulative(lengths_k), 40, 31,
                               is_causal=True, scale=0.3, enable_gqa=True)  # fmt: skip
    got = tuned_path(args, grad_out, grad_lse, backward=BackwardConfig(16, 32, 4, 1, atomic_dq=True))
    for name, x in zip(("out", "dq", "dk", "dv"), (q, q, k, v), strict=True):
        assert got[name].stride() == output_like(x).stride(), name
    assert_close_to(got, torch_path(args, grad_out, grad_lse), 2e-5 if dtype == torch.float32 else 4e-3)
