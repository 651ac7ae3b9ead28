"""The feature kernels (_feature_kernels through feature_impl) under Triton's CPU interpreter, against the
PyTorch path (itself checked against float64 references in test_features.py), forward and backward; and
grouped-query attention on the tuned kernels (triton_impl), against SDPA's enable_gqa in float64.

Not collected on its own (TRITON_INTERPRET must be set before the kernels are first imported):
test_features_interpreter.py runs this file in a pytest subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from flashattn_triton import _inputs, feature_impl, flash_attention, torch_impl
from flashattn_triton._configs import BackwardConfig, ForwardConfig
from flashattn_triton._validation import OpArguments, op_arguments, varlen_op_arguments

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_features_interpreter.py (TRITON_INTERPRET=1)", allow_module_level=True)

NAMES = ("out", "lse", "dq", "dk", "dv")


def run(forward, backward, args: OpArguments, grad_out: torch.Tensor, grad_lse=None) -> dict:
    options = args._asdict()
    q, k, v = (options.pop(name) for name in ("q", "k", "v"))
    out, lse = forward(q, k, v, **options)
    grads = backward(grad_out, q, k, v, out, lse, grad_lse=grad_lse, **options)
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


def assert_close_to(got: dict, want: dict, bound: float) -> None:
    """Each of NAMES within bound of want's, as max error relative to want's largest value (or 1)."""
    for name in NAMES:
        assert got[name].shape == want[name].shape, name
        unseen = want[name] == float("-inf")  # lse of rows that see no key
        assert torch.equal(got[name] == float("-inf"), unseen), name
        g, w = got[name].double().masked_fill(unseen, 0), want[name].double().masked_fill(unseen, 0)
        error = (g - w).abs().max().item() / max(w.abs().max().item(), 1.0)
        assert error <= bound, f"{name}: max error {error:.2e} relative to max |reference|"


def assert_matches_torch_path(args: OpArguments, grad_out: torch.Tensor, grad_lse=None, bound=2e-5) -> dict:
    """The feature kernels' results (returned) against the PyTorch path's."""
    got = run(feature_impl.feature_forward, feature_impl.feature_backward, args, grad_out, grad_lse)
    want = run(torch_impl.attention_forward, torch_impl.attention_backward, args, grad_out, grad_lse)
    for name in NAMES:
        assert got[name].dtype == want[name].dtype, name
    assert_close_to(got, want, bound)
    return got


def assert_in_input_layouts(got: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """O and dQ with q's strides, dK with k's, dV with v's (SDPA's layouts for dense inputs)."""
    strides = [got[name].stride() for name in ("out", "dq", "dk", "dv")]
    assert strides == [t.stride() for t in (q, q, k, v)]


def qkv(batch=2, q_heads=4, kv_heads=2, seqlen_q=37, seqlen_k=45, head_dim=16, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    shapes = [(batch, q_heads, seqlen_q, head_dim), *[(batch, kv_heads, seqlen_k, head_dim)] * 2]
    q, k, v = (torch.randn(s, generator=generator).to(dtype) for s in shapes)
    return q, k, v, torch.randn(q.shape, generator=generator).to(dtype)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (3, 1), (2, 2)])
def test_gqa(q_heads, kv_heads):
    q, k, v, grad_out = qkv(q_heads=q_heads, kv_heads=kv_heads)
    assert_matches_torch_path(op_arguments(q, k, v, enable_gqa=True), grad_out)


@pytest.mark.parametrize("window", [(7, -1), (3, 5), (-1, 0), (0, 0), (20, 2)], ids=str)
def test_bands(window):
    q, k, v, grad_out = qkv()
    assert_matches_torch_path(op_arguments(q, k, v, enable_gqa=True, window_size=window), grad_out)


@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(20, 50), (50, 20)])
def test_causal_lower_right_and_a_window(seqlen_q, seqlen_k):
    q, k, v, grad_out = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    bias = causal_lower_right(seqlen_q, seqlen_k)
    assert_matches_torch_path(op_arguments(q, k, v, bias, enable_gqa=True), grad_out)
    assert_matches_torch_path(op_arguments(q, k, v, bias, enable_gqa=True, window_size=(5, -1)), grad_out)


@pytest.mark.parametrize("shape", [(2, 1, 37, 45), (37, 45), (1, 4, 1, 45), (2, 4, 37, 1)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_masks(shape, kind):
    q, k, v, grad_out = qkv()
    generator = torch.Generator().manual_seed(1)
    if kind == "bool":
        mask = torch.rand(shape, generator=generator) > 0.4
        if shape[-1] > 1:
            mask[..., :16] = False  # a whole key tile that every row drops: skipped
    else:
        dropped = torch.rand(shape, generator=generator) < 0.2
        mask = torch.randn(shape, generator=generator).masked_fill(dropped, float("-inf"))
    assert_matches_torch_path(op_arguments(q, k, v, mask, enable_gqa=True), grad_out)


def test_dropout_with_a_mask_and_a_gradient_through_lse():
    q, k, v, grad_out = qkv()
    torch.manual_seed(0)
    args = op_arguments(q, k, v, torch.randn(37, 45), dropout_p=0.3, enable_gqa=True)
    assert_matches_torch_path(args, grad_out, torch.randn(q.shape[:-1]))


def test_dropout_p_one_drops_everything_in_the_feature_kernels():
    """dropout_p=1 with a mask: output and gradients 0 (as SDPA's), the log-sum-exp the softmax's."""
    q, k, v, grad_out = qkv()
    args = op_arguments(q, k, v, torch.randn(37, 45), dropout_p=1.0, enable_gqa=True)
    got = run(feature_impl.feature_forward, feature_impl.feature_backward, args, grad_out)
    for name in ("out", "dq", "dk", "dv"):
        assert not got[name].any(), name
    undropped = run(torch_impl.attention_forward, torch_impl.attention_backward, args._replace(dropout_p=0.0),
                    grad_out)  # fmt: skip
    torch.testing.assert_close(got["lse"], undropped["lse"])


def test_transposed_layouts_and_float16():
    q, k, v, grad_out = qkv(dtype=torch.float16)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # (B, T, H, d) memory
    got = assert_matches_torch_path(op_arguments(q, k, v, enable_gqa=True, is_causal=True), grad_out,
                                    bound=4e-3)  # fmt: skip
    assert_in_input_layouts(got, q, k, v)


def test_varlen_with_gqa_causal_and_dropout():
    lengths_q, lengths_k = [13, 1, 40, 0, 22], [13, 5, 31, 3, 22]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), 4, 16, generator=generator)
    k, v = (torch.randn(sum(lengths_k), 2, 16, generator=generator) for _ in range(2))
    cumulative = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    grad_out = torch.randn(q.shape, generator=generator)
    for options in ({"is_causal": True}, {"window_size": (4, 2)}, {"dropout_p": 0.2}):
        args = varlen_op_arguments(q, k, v, cu_q, cu_k, 40, 31, enable_gqa=True, **options)
        assert_matches_torch_path(args, grad_out)


def test_flash_attention_routes_features_to_the_feature_kernels(monkeypatch):
    launched = []
    original = feature_impl.feature_forward
    monkeypatch.setattr(
        feature_impl, "feature_forward", lambda *a, **kw: launched.append(1) or original(*a, **kw)
    )
    q, k, v, grad_out = qkv()
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*tensors, enable_gqa=True, window_size=(6, 0))
    out.backward(grad_out)
    assert launched
    want = run(torch_impl.attention_forward, torch_impl.attention_backward,
               op_arguments(q, k, v, enable_gqa=True, window_size=(6, 0)), grad_out)  # fmt: skip
    for name, got in (
        ("out", out),
        ("dq", tensors[0].grad),
        ("dk", tensors[1].grad),
        ("dv", tensors[2].grad),
    ):
        torch.testing.assert_close(got, want[name], atol=1e-5, rtol=1e-5)


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v, grad_out = qkv(q_heads=2, kv_heads=2)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            tensors = [t.clone().requires_grad_() for t in (q, k, v)]
            flash_attention(*tensors, is_causal=True).backward(grad_out)
            grads.append([t.grad for t in tensors])
    finally:
        torch.use_deterministic_algorithms(False)
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_gqa_without_mask_or_band_runs_the_tuned_kernels(monkeypatch, sdpa_gqa, is_causal):
    from flashattn_triton import triton_impl

    def no_feature_kernels(*args, **kwargs):
        raise AssertionError("the feature kernels ran")

    monkeypatch.setattr(feature_impl, "feature_forward", no_feature_kernels)
    monkeypatch.setattr(feature_impl, "feature_backward", no_feature_kernels)
    launched = []
    original = triton_impl.triton_backward
    monkeypatch.setattr(
        triton_impl, "triton_backward", lambda *a, **kw: launched.append(1) or original(*a, **kw)
    )
    q, k, v, grad_out = qkv(q_heads=6, kv_heads=2)
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*tensors, is_causal=is_causal, enable_gqa=True, return_lse=True)
    grad_lse = torch.randn(lse.shape)
    torch.autograd.backward([out, lse], [grad_out, grad_lse])
    assert launched
    got = {"out": out, "lse": lse, "dq": tensors[0].grad, "dk": tensors[1].grad, "dv": tensors[2].grad}
    assert_close_to(got, sdpa_gqa(q, k, v, grad_out, grad_lse, is_causal), 2e-5)


GQA_CASES = {  # name: (is_causal, Tq, Tk, Hq, Hkv, dtype, layout); lengths not multiples of the tiles
    "causal-group2": (True, 37, 37, 4, 2, torch.float32, "contiguous"),
    "full-group4-tq<tk": (False, 29, 45, 8, 2, torch.float32, "contiguous"),
    "causal-group4-tq>tk-transposed": (True, 45, 29, 4, 1, torch.float32, "transposed"),
    "full-group2-tq>tk-float16": (False, 41, 23, 6, 3, torch.float16, "contiguous"),
}
GQA_CONFIGS = {  # name: (forward config, backward config); None: the interpreter's default
    "default": (None, None),
    "kv-splits-atomic-dq": (ForwardConfig(32, 16, 4, 1, kv_splits=2),
                            BackwardConfig(16, 32, 4, 1, atomic_dq=True)),
    "split": (None, BackwardConfig(32, 16, 4, 1, split=True, dq_block_m=16)),
    "transposed-grads": (None, BackwardConfig(16, 32, 4, 1, transposed_grads=True)),
}


def _gqa_tuned_kernels(sdpa_gqa, case: str, configs: str) -> None:
    """triton_forward and triton_backward (with a gradient of L) on grouped K/V heads, against SDPA."""
    from flashattn_triton import triton_impl

    is_causal, seqlen_q, seqlen_k, q_heads, kv_heads, dtype, layout = GQA_CASES[case]
    forward, backward = GQA_CONFIGS[configs]
    q, k, v, grad_out = qkv(2, q_heads, kv_heads, seqlen_q, seqlen_k, 16, dtype)
    if layout == "transposed":  # (B, T, H, d) in memory
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    grad_lse = torch.randn(q.shape[:-1], generator=torch.Generator().manual_seed(1))
    out, lse = triton_impl.triton_forward(q, k, v, is_causal, 0.3, forward)
    grads = triton_impl.triton_backward(q, k, v, out, lse, grad_out, is_causal, 0.3, backward,
                                        grad_lse=grad_lse)  # fmt: skip
    got = dict(zip(NAMES, (out, lse, *grads), strict=True))
    assert_close_to(got, sdpa_gqa(q, k, v, grad_out, grad_lse, is_causal, 0.3),
                    2e-5 if dtype == torch.float32 else 4e-3)  # fmt: skip
    assert_in_input_layouts(got, q, k, v)


@pytest.mark.parametrize("configs", GQA_CONFIGS)
@pytest.mark.parametrize("case", GQA_CASES)
def test_gqa_tuned_kernels_match_sdpa(sdpa_gqa, case, configs):
    _gqa_tuned_kernels(sdpa_gqa, case, configs)


@pytest.mark.parametrize("configs", GQA_CONFIGS)
def test_gqa_tuned_kernels_with_device_side_descriptors(monkeypatch, sdpa_gqa, configs):
    """GPUs before Hopper: the kernels describe K and V (of fewer heads) from pointers themselves."""
    from flashattn_triton import triton_impl

    monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    monkeypatch.setattr(triton_impl, "_plans", {})  # not the host-described plans of the tests before
    _gqa_tuned_kernels(sdpa_gqa, "full-group4-tq<tk", configs)
    _gqa_tuned_kernels(sdpa_gqa, "causal-group4-tq>tk-transposed", configs)  # packed, then copied back


def test_flash_attention_triton_keeps_refusing_fewer_key_heads():
    """FlashAttentionTriton (the assignment's Function) takes K and V with q's heads only, also after
    triton_forward made a plan for the same grouped inputs."""
    from flashattn_triton import FlashAttentionTriton, triton_impl

    q, k, v, _ = qkv(1, 4, 2, 20, 20)
    triton_impl.triton_forward(q, k, v, True, None)
    with pytest.raises(ValueError, match="batch/head dims"):
        FlashAttentionTriton.apply(q, k, v, True)
    three_heads = k[:, :1].expand(1, 3, 20, 16)
    with pytest.raises(ValueError, match="must divide the number of heads"):
        triton_impl.triton_forward(q, three_heads, three_heads, True, None)


def _inside_guards(x: torch.Tensor, rows: int = 40) -> torch.Tensor:
    """x as the middle of a buffer with `rows` NaN rows on each side: a kernel that reads past x's rows
    brings NaN into its results."""
    buffer = torch.full((x.shape[0] + 2 * rows, *x.shape[1:]), float("nan"), dtype=x.dtype)
    buffer[rows : rows + x.shape[0]] = x
    return buffer[rows : rows + x.shape[0]]


@pytest.fixture
def bounds_checked_launches(monkeypatch):
    """Every load and store of a feature-kernel launch, on its active lanes, must address one of the
    launch's tensors (the interpreter does not fault where a GPU would: it reads whatever lies there)."""
    import numpy as np
    from triton.runtime import interpreter

    tensors: list[tuple[int, int]] = []

    def check(ptrs, mask, access):
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in tensors:
            inside |= (addresses >= start) & (addresses < end)
        assert inside.all(), f"a {access} outside the launch's tensors at {int(addresses[~inside][0]):#x}"

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def checked_load(self, ptrs, mask, *args):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *args)

    def checked_store(self, ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args)

    launch = feature_impl._launch

    def recording_launch(kernel, grid, blocks, *args, **constants):
        tensors[:] = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                      for t in args if isinstance(t, torch.Tensor) and t.is_contiguous()]  # fmt: skip
        return launch(kernel, grid, blocks, *args, **constants)

    monkeypatch.setattr(builder, "create_masked_load", checked_load)
    monkeypatch.setattr(builder, "create_masked_store", checked_store)
    monkeypatch.setattr(feature_impl, "_launch", recording_launch)
    tiles = feature_impl.Blocks(32, 16, 1, 1)  # query tiles longer than most of the sequences
    monkeypatch.setattr(feature_impl, "_blocks", lambda *a: feature_impl.Launches(tiles, tiles, tiles))


def test_varlen_stays_inside_its_tensors(bounds_checked_launches):
    """Short, empty and key-longer sequences, a query sequence longer than its keys, GQA, a band and
    dropout, tiles larger than most sequences; inputs between NaN guard rows."""
    lengths_q, lengths_k = [13, 1, 40, 0, 22, 5], [13, 30, 31, 3, 22, 1]
    generator = torch.Generator().manual_seed(0)
    q = _inside_guards(torch.randn(sum(lengths_q), 4, 16, generator=generator))
    k, v = (_inside_guards(torch.randn(sum(lengths_k), 2, 16, generator=generator)) for _ in range(2))
    cumulative = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    grad_out = _inside_guards(torch.randn(q.shape, generator=generator))
    for options in ({"is_causal": True}, {"window_size": (4, 2), "dropout_p": 0.2}):
        args = varlen_op_arguments(q, k, v, cumulative(lengths_q), cumulative(lengths_k), 40, 31,
                                   enable_gqa=True, **options)  # fmt: skip
        assert_matches_torch_path(args, grad_out)
