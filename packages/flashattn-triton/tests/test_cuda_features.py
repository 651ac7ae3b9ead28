"""flash_attention's features on a CUDA GPU, every dtype: the feature kernels (through the custom ops)
against the PyTorch path run in float64 on the same inputs (test_features.py checks that path against
naive float64 attention), forward and backward; grouped-query attention on the tuned kernels against SDPA's
enable_gqa in float64; dropout (in the feature kernels and in the tuned ones), determinism, routing and
CUDA graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from flashattn_triton import (
    _configs,
    _dispatch,
    _hopper,
    _inputs,
    feature_impl,
    flash_attention,
    flash_attention_varlen,
    torch_impl,
    triton_impl,
)
from flashattn_triton._dropout import Dropout, draw_rng
from flashattn_triton._validation import OpArguments, op_arguments, varlen_op_arguments

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("full_float32_precision"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max error relative to the largest reference value. A missed key tile or a mask off by one costs far more.
BOUNDS = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
NAMES = ("out", "lse", "dq", "dk", "dv")


def qkv(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(batch, q_heads, seqlen_q, head_dim), *[(batch, kv_heads, seqlen_k, head_dim)] * 2]
    q, k, v = (torch.randn(s, device="cuda", generator=generator).to(dtype) for s in shapes)
    return q, k, v, torch.randn(q.shape, device="cuda", generator=generator).to(dtype)


def float64_torch_path(args: OpArguments, grad_out: torch.Tensor) -> dict:
    options = args._asdict()
    q, k, v = (options.pop(name).double() for name in ("q", "k", "v"))
    if options["attn_mask"] is not None and options["attn_mask"].is_floating_point():
        options["attn_mask"] = options["attn_mask"].double()
    out, lse = torch_impl.attention_forward(q, k, v, **options)
    grads = torch_impl.attention_backward(grad_out.double(), q, k, v, out, lse, **options)
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


def feature_kernels(args: OpArguments, grad_out: torch.Tensor) -> dict:
    options = args._asdict()
    q, k, v = (options.pop(name) for name in ("q", "k", "v"))
    out, lse = feature_impl.feature_forward(q, k, v, **options)
    grads = feature_impl.feature_backward(grad_out, q, k, v, out, lse, **options)
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


def assert_close(got: dict, want: dict, dtype: torch.dtype, names: tuple[str, ...] = NAMES) -> None:
    """Each output's max error relative to its reference's max |value|; a gradient's relative to at least a
    tenth of the largest gradient's: dQ is exactly 0 where each query sees one key (dS = P (dP - D) = 0),
    and rounding leaves ~1e-6 there, which relative to itself would read as 100%."""
    gradients = [want[name].abs().max().item() for name in ("dq", "dk", "dv") if name in want]
    gradient_floor = 0.1 * max(gradients, default=0.0)
    for name in names:
        unseen = want[name] == float("-inf")
        assert torch.equal(got[name] == float("-inf"), unseen), f"{name}: rows that see no key differ"
        g, w = got[name].double().masked_fill(unseen, 0), want[name].masked_fill(unseen, 0)
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        floor = gradient_floor if name in ("dq", "dk", "dv") else 0.0
        error = (g - w).abs().max().item() / max(w.abs().max().item(), floor, 1e-6)
        assert error <= BOUNDS[dtype], f"{name} ({dtype}): max error {error:.2e} relative to max |reference|"


def _mask(shape, kind):
    generator = torch.Generator(device="cuda").manual_seed(1)
    if kind == "bool":
        mask = torch.rand(shape, device="cuda", generator=generator) > 0.3
        mask[..., :128] = False  # whole key tiles that every row drops
        return mask
    return torch.randn(shape, device="cuda", generator=generator)


CASES = {  # name: (batch, Hq, Hkv, Tq, Tk, d), op_arguments' keyword arguments
    "gqa-causal": ((2, 8, 2, 300, 300, 64), {"is_causal": True, "enable_gqa": True}),
    "gqa-d16": ((1, 4, 1, 257, 129, 16), {"enable_gqa": True}),
    "gqa-d96": ((1, 6, 3, 200, 333, 96), {"enable_gqa": True}),
    "gqa-d256": ((1, 2, 1, 130, 130, 256), {"enable_gqa": True, "is_causal": True}),
    "window-causal": ((1, 4, 4, 1030, 1030, 64), {"is_causal": True, "window_size": (100, -1)}),
    "window-both": ((2, 2, 1, 513, 700, 128), {"window_size": (37, 12), "enable_gqa": True}),
    "lower-right": ((2, 4, 4, 200, 700, 128), {"attn_mask": lambda: causal_lower_right(200, 700)}),
    "bool-mask": (
        (2, 4, 2, 300, 500, 64),
        {"attn_mask": lambda: _mask((2, 1, 300, 500), "bool"), "enable_gqa": True},
    ),
    "float-mask": ((2, 4, 4, 300, 500, 64), {"attn_mask": lambda: _mask((1, 4, 1, 500), "float")}),
    "dropout-mask": (
        (2, 4, 4, 257, 257, 64),
        {"attn_mask": lambda: _mask((257, 257), "float"), "dropout_p": 0.2},
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES)
def test_feature_kernels_match_float64(case, dtype):
    shape, options = CASES[case]
    q, k, v, grad_out = qkv(*shape, dtype)
    options = {name: value() if callable(value) else value for name, value in options.items()}
    mask = options.get("attn_mask")
    if type(mask) is torch.Tensor and mask.is_floating_point():  # (a CausalBias is a Tensor subclass)
        options["attn_mask"] = options["attn_mask"].to(dtype)
    torch.manual_seed(0)
    args = op_arguments(q, k, v, **options)
    assert_close(feature_kernels(args, grad_out), float64_torch_path(args, grad_out), dtype)


def inside_nan_guards(x: torch.Tensor, rows: int = 300) -> torch.Tensor:
    """x as the middle of a buffer with NaN rows on each side: reading past x's rows brings NaN in."""
    buffer = torch.full((x.shape[0] + 2 * rows, *x.shape[1:]), float("nan"), dtype=x.dtype, device=x.device)
    buffer[rows : rows + x.shape[0]] = x
    return buffer[rows : rows + x.shape[0]]


@pytest.mark.parametrize("options", [{"is_causal": True}, {"window_size": (20, 5)}, {"dropout_p": 0.1}],
                         ids=["causal", "window", "dropout"])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_varlen_matches_float64(dtype, options):
    lengths_q, lengths_k = [130, 1, 400, 0, 77], [130, 50, 310, 3, 77]
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lengths_q), 8, 64, device="cuda", generator=generator).to(dtype)
    k, v = (
        torch.randn(sum(lengths_k), 2, 64, device="cuda", generator=generator).to(dtype) for _ in range(2)
    )
    grad_out = torch.randn(q.shape, device="cuda", generator=generator).to(dtype)
    q, k, v, grad_out = (inside_nan_guards(t) for t in (q, k, v, grad_out))
    cumulative = lambda n: torch.tensor(
        [0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )  # noqa: E731
    args = varlen_op_arguments(q, k, v, cumulative(lengths_q), cumulative(lengths_k), 400, 310,
                               enable_gqa=True, **options)  # fmt: skip
    got = feature_kernels(args, grad_out)
    torch.cuda.synchronize()  # a fault is this case's, not the next test's
    assert_close(got, float64_torch_path(args, grad_out), dtype)


def recorded_routes(monkeypatch) -> list[str]:
    """The forwards that flash_attention's calls reach, "feature_forward" or "triton_forward", in order."""
    calls = []
    for module, name in ((feature_impl, "feature_forward"), (triton_impl, "triton_forward")):
        original = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw)
        )
    return calls


def test_features_route_to_the_feature_kernels_and_plain_problems_to_the_tuned_ones(monkeypatch):
    calls = recorded_routes(monkeypatch)
    q, k, v, _ = qkv(1, 4, 2, 128, 128, 64, torch.bfloat16)
    mask = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    mask[100, 7] = False  # (not a band: a causal mask alone runs as is_causal, the next test)
    flash_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # a mask: the feature kernels
    flash_attention(q[:, :, :100], k, v, enable_gqa=True, window_size=(16, 0))  # a band with Tq != Tk: too
    flash_attention(q, k, v, is_causal=True, enable_gqa=True, window_size=(32, 0))
    flash_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    flash_attention(q, k, v, is_causal=True, enable_gqa=True)  # grouped K/V heads read in place
    flash_attention(q, k, v, enable_gqa=True)
    flash_attention(q, k, v, dropout_p=0.1, enable_gqa=True, window_size=(16, 0))
    tuned, features = "triton_forward", "feature_forward"
    assert calls == [features, features, tuned, tuned, tuned, tuned, tuned]


@pytest.mark.parametrize("where", ["eager", "compiled"])
def test_a_causal_or_window_mask_runs_the_tuned_kernels_and_matches_sdpa(monkeypatch, where):
    """A mask that only encodes causality or a sliding window (bool, or float with -inf or the dtype's lowest
    value, as transformers builds it) runs the tuned kernels as that band, eager or compiled, and gives SDPA's
    output and gradients with the same mask."""
    calls = recorded_routes(monkeypatch)
    q, k, v, grad_out = qkv(2, 4, 4, 256, 256, 64, torch.bfloat16)
    rows, cols = torch.arange(256, device="cuda")[:, None], torch.arange(256, device="cuda")[None, :]
    window = (cols <= rows) & (cols > rows - 64)
    lowest = torch.finfo(torch.bfloat16).min
    masks = [(cols <= rows)[None, None].expand(2, 1, 256, 256), window,
             torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16).masked_fill(~window, lowest)]
    attend = flash_attention if where == "eager" else torch.compile(flash_attention, fullgraph=True)
    for mask in masks:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, attn_mask=mask)
        out.backward(grad_out)
        references = [t.clone().requires_grad_() for t in (q, k, v)]
        want = torch.nn.functional.scaled_dot_product_attention(*references, attn_mask=mask)
        want.backward(grad_out)
        for got, expected in zip((out, *[t.grad for t in leaves]), (want, *[t.grad for t in references]),
                                 strict=True):  # fmt: skip
            torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert calls == ["triton_forward"] * len(masks)


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_deterministic_backward_is_bitwise_repeatable(enable_gqa):
    q, k, v, grad_out = qkv(2, 8, 2 if enable_gqa else 8, 1024, 1024, 64, torch.bfloat16)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            flash_attention(*leaves, is_causal=True, enable_gqa=enable_gqa).backward(grad_out)
            grads.append([t.grad for t in leaves])
    finally:
        torch.use_deterministic_algorithms(False)
    for later in grads[1:]:
        for first, again in zip(grads[0], later, strict=True):
            assert torch.equal(first, again)


def test_dropout_follows_torch_manual_seed_on_cuda():
    q, k, v, grad_out = qkv(2, 4, 4, 300, 300, 64, torch.bfloat16)
    results = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, dropout_p=0.3)
        out.backward(grad_out)
        results.append([out, *[t.grad for t in leaves]])
    for first, again in zip(results[0], results[1], strict=True):
        assert torch.equal(first, again)
    assert not torch.equal(results[0][0], results[2][0])


@pytest.mark.parametrize("mask", [None, "float"], ids=["tuned-kernels", "feature-kernels"])
def test_dropout_p_one_drops_everything_on_cuda(mask):
    """dropout_p=1: output and gradients 0, as SDPA's (math semantics), on the tuned kernels and, with a
    mask, on the feature kernels; the log-sum-exp is the softmax's."""
    q, k, v, grad_out = qkv(2, 4, 4, 300, 300, 64, torch.bfloat16)
    attn_mask = None if mask is None else _mask((300, 300), mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, attn_mask, dropout_p=1.0, return_lse=True)
    out.backward(grad_out)
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), strict=True):
        assert not t.any(), name
    _, undropped = flash_attention(q, k, v, attn_mask, return_lse=True)
    torch.testing.assert_close(lse.detach(), undropped)


def captured(step):
    """(step's results run eagerly, its results from the replay of a CUDA graph that captured it). The
    warm-up runs on a side stream, as torch.cuda.graph asks, and keeps no autograd graph alive: an
    AccumulateGrad node made before the capture keeps the stream it was made on, and the captured
    backward would make that stream (the legacy default one) wait on the capturing stream, which CUDA
    refuses ("operation would make the legacy stream depend on a capturing blocking stream")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        expected = [t.detach().clone() for t in step()]  # also compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    graph.replay()
    torch.cuda.synchronize()
    return expected, results, graph


def test_feature_call_captured_in_a_cuda_graph_replays_exactly():
    q, k, v, grad_out = qkv(1, 4, 2, 512, 512, 64, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = flash_attention(*leaves, is_causal=True, enable_gqa=True, window_size=(64, 0))
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    expected, replayed, _ = captured(step)
    for got, want in zip(replayed, expected, strict=True):
        assert torch.equal(got, want)


def test_dropout_captured_in_a_cuda_graph_draws_new_masks_on_each_replay():
    """The (seed, offset) is drawn inside the graph from torch's graph-safe generator: each replay drops
    other probabilities, and its backward the same ones as its forward: with dO all ones, dV = P_d^T dO
    holds the column sums c of the dropped probabilities P_d, and the forward's O = P_d V sums to c V."""
    q, k, v, _ = qkv(1, 2, 2, 256, 256, 64, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ones = torch.ones_like(q)

    def step():
        out = flash_attention(*leaves, dropout_p=0.3)
        return (out, *torch.autograd.grad(out, leaves, ones))

    _, replayed, graph = captured(step)
    first = [t.clone() for t in replayed]
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first[0], replayed[0])
    for out, dv in ((first[0], first[3]), (replayed[0], replayed[3])):
        column_sums = dv[..., :1].transpose(-1, -2)  # (.., 1, Tk): every column of dV is the same here
        torch.testing.assert_close(out.sum(-2, keepdim=True), column_sums @ v, rtol=1e-3, atol=1e-3)


def test_flash_attention_varlen_on_cuda_equals_each_sequence_alone():
    lengths = [100, 3, 257]
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", generator=generator, dtype=torch.float16)
               for _ in range(3))  # fmt: skip
    cu_seqlens = torch.tensor([0, 100, 103, 360], dtype=torch.int32, device="cuda")
    out = flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 257, 257, is_causal=True)
    for start, end in ((0, 100), (100, 103), (103, 360)):
        alone = flash_attention(*(t[start:end].transpose(0, 1) for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[start:end], alone.transpose(0, 1), atol=2e-3, rtol=2e-3)


def lse_gradient(q: torch.Tensor) -> torch.Tensor:
    """A random gradient for flash_attention's lse (float32, q.shape[:-1])."""
    return torch.randn(q.shape[:-1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))


GQA_TUNED = {  # name: ((batch, Hq, Hkv, Tq, Tk, d), is_causal, layout): lengths ragged against every tile
    "causal-group4": ((2, 8, 2, 333, 333, 64), True, "bhtd"),
    "full-group4-tq<tk": ((2, 8, 2, 333, 400, 64), False, "bhtd"),
    "causal-group8-tq>tk": ((1, 8, 1, 400, 257, 128), True, "bhtd"),
    "full-group2-d96": ((1, 6, 3, 257, 520, 96), False, "bhtd"),
    # dK and dV summed into (B, T, H, d) memory: a model's transposed and fused projections
    "causal-group4-bthd-tq<tk": ((2, 8, 2, 333, 400, 64), True, "bthd"),
    "full-group8-fused-d128": ((2, 16, 2, 333, 333, 128), False, "fused"),
}


@pytest.mark.parametrize("path", ["small", "small-kernel-built", "large"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", GQA_TUNED)
def test_gqa_without_mask_or_band_on_the_tuned_kernels_matches_sdpa(monkeypatch, sdpa_gqa, case, dtype, path):
    """flash_attention's grouped-query attention, which the tuned kernels take (K/V heads read in place, dK
    and dV per query head summed over each group), with a gradient through lse too: on the small-problem
    path with descriptors from the host and, as on GPUs before Hopper, from the kernels; and on the
    large-problem path (atomic dQ candidates). Inputs contiguous or in a model's layouts (in_layout)."""
    no_feature_kernels(monkeypatch)
    monkeypatch.setattr(triton_impl, "_plans", {})
    if path == "small-kernel-built":
        monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    if path == "large":
        monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    shape, is_causal, layout = GQA_TUNED[case]
    q, k, v, grad_out = qkv(*shape, dtype)
    grad_lse = lse_gradient(q)
    leaves = [t.detach().requires_grad_() for t in in_layout(layout, q, k, v)]
    out, lse = flash_attention(*leaves, is_causal=is_causal, enable_gqa=True, return_lse=True)
    torch.autograd.backward([out, lse], [grad_out, grad_lse])
    got = dict(zip(NAMES, (out.detach(), lse, *[t.grad for t in leaves]), strict=True))
    assert_close(got, sdpa_gqa(q, k, v, grad_out, grad_lse, is_causal), dtype)


BAND_CASES = {  # name: (batch, heads, T, d), is_causal, window_size; the tuned kernels' bands (Tq = Tk)
    "causal-100": ((1, 4, 1030, 64), True, (100, 0)),
    "causal-0": ((2, 2, 300, 64), True, (0, 0)),
    "causal-1": ((2, 2, 257, 32), True, (1, 0)),
    "causal-128-d128": ((1, 4, 1100, 128), True, (128, -1)),
    "causal-wider-than-t": ((1, 2, 513, 128), True, (4000, 0)),
    "both-sides": ((2, 2, 513, 128), False, (37, 12)),
    "left-only": ((1, 3, 700, 32), False, (200, -1)),
    "right-only-d256": ((1, 2, 300, 256), False, (-1, 64)),
}


def no_feature_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the feature kernels ran")

    monkeypatch.setattr(feature_impl, "feature_forward", refuse)
    monkeypatch.setattr(feature_impl, "feature_backward", refuse)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", BAND_CASES)
def test_bands_on_the_tuned_kernels_match_float64(monkeypatch, case, dtype):
    """flash_attention's sliding windows where Tq = Tk and the heads match: the tuned kernels' band."""
    no_feature_kernels(monkeypatch)
    (batch, heads, seqlen, head_dim), is_causal, window = BAND_CASES[case]
    q, k, v, grad_out = qkv(batch, heads, heads, seqlen, seqlen, head_dim, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, is_causal=is_causal, window_size=window, return_lse=True)
    out.backward(grad_out)
    got = dict(zip(NAMES, (out.detach(), lse, *[t.grad for t in leaves]), strict=True))
    args = op_arguments(q, k, v, is_causal=is_causal, window_size=window)
    assert_close(got, float64_torch_path(args, grad_out), dtype)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float32, 128)],
                         ids=["bfloat16-d64", "float32-d128"])  # fmt: skip
def test_every_candidate_config_runs_a_band(dtype, head_dim):
    """Each forward candidate (and its split key tiles) and each backward candidate (atomic dQ, dQ phase,
    transposed, split launches) of the dtype, forced, on a causal window."""
    from flashattn_triton._configs import backward_candidates, forward_candidates

    q, k, v, grad_out = qkv(1, 4, 4, 1500, 1500, head_dim, dtype)
    scale, window = head_dim**-0.5, (300, 0)
    args = op_arguments(q, k, v, is_causal=True, window_size=window)
    want = float64_torch_path(args, grad_out)
    forwards = forward_candidates(head_dim, dtype.itemsize, False)
    forwards += [dataclasses.replace(c, kv_splits=4) for c in forwards]
    for forward in forwards:
        got_out, got_lse = triton_impl.triton_forward(q, k, v, True, scale, forward, window=window)
        for backward in backward_candidates(head_dim, dtype.itemsize, False):
            grads = triton_impl.triton_backward(q, k, v, got_out, got_lse, grad_out, True, scale, backward,
                                                window=window)  # fmt: skip
            got = dict(zip(NAMES, (got_out, got_lse, *grads), strict=True))
            assert_close(got, want, dtype)


def test_one_compiled_kernel_serves_every_window(monkeypatch):
    """The window reaches the kernels as runtime integers they do not specialize on: after the first
    window, others (a multiple of 16, and 1, which Triton would specialize) compile nothing."""
    from triton import knobs

    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "0")
    q, k, v, grad_out = qkv(1, 2, 2, 700, 700, 64, torch.bfloat16)
    compiled = []

    def run(window):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, is_causal=True, window_size=window).backward(grad_out)

    run((100, 0))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["fn"].name))
    for window in ((1024, 0), (1, 0), (47, 0)):
        run(window)
    torch.cuda.synchronize()
    assert not [name for name in compiled if name in ("attn_fwd", "attn_bwd")], compiled


def test_bands_route_to_the_tuned_kernels_only_where_they_apply(monkeypatch):
    calls = recorded_routes(monkeypatch)
    q, k, v, _ = qkv(1, 4, 4, 256, 256, 64, torch.bfloat16)
    flash_attention(q, k, v, is_causal=True, window_size=(64, 0))
    flash_attention(q, k, v, window_size=(64, 32))
    flash_attention(q, k[:, :2], v[:, :2], is_causal=True, window_size=(64, 0), enable_gqa=True)
    flash_attention(q[:, :, :100], k, v, window_size=(64, 32))  # Tq != Tk
    assert calls == ["triton_forward", "triton_forward", "triton_forward", "feature_forward"]


def in_layout(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, H, T, d) q, k, v as a model hands them over: 'bhtd' contiguous; 'bthd' views of (B, T, H, d)
    memory (proj(x).view(B, T, H, d).transpose(1, 2)); 'fused' views of one (B, T, Hq + 2 Hkv, d) projection
    (Tq = Tk); 'roped' as a model whose rotary embedding makes new q and k but leaves v a fused projection's
    view."""
    if layout == "bhtd":
        return q, k, v
    if layout == "roped":
        return q, k, in_layout("fused", q, k, v)[2]
    if layout == "bthd":
        return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    fused = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2)  # (B, T, Hq + 2 Hkv, d)
    return tuple(t.transpose(1, 2) for t in fused.split([q.shape[1], k.shape[1], v.shape[1]], dim=2))


GLUON_CASES = {  # name: (batch, Hq, Hkv, T, d), layout, is_causal, window_size
    "gqa4-causal-bthd": ((2, 8, 2, 384, 64), "bthd", True, None),
    "gqa2-full": ((1, 4, 2, 256, 64), "bhtd", False, None),
    "fused-qkv-causal": ((2, 4, 4, 256, 64), "fused", True, None),
    "fused-qkv-full-d128": ((1, 2, 2, 384, 128), "fused", False, None),
    "roped-causal": ((2, 4, 4, 256, 64), "roped", True, None),
    "roped-window-64": ((1, 4, 4, 512, 64), "roped", True, (64, 0)),
    "window-100": ((1, 4, 4, 1024, 64), "bhtd", True, (100, 0)),
    "window-0": ((2, 2, 2, 512, 64), "bhtd", True, (0, 0)),
    "window-192-gqa2-bthd": ((2, 4, 2, 768, 64), "bthd", True, (192, 0)),
    "window-1000-gqa4-d128": ((1, 8, 2, 1280, 128), "bthd", False, (1000, 0)),
    "gqa8-causal-d128": ((1, 8, 1, 512, 128), "bhtd", True, None),
    "gqa4-full-bthd-d128": ((2, 8, 2, 384, 128), "bthd", False, None),
    "roped-window-100-d128": ((1, 4, 4, 640, 128), "roped", True, (100, 0)),
    "window-wider-than-t-d32": ((1, 2, 2, 384, 32), "bhtd", True, (500, 0)),
}


needs_hopper_gluon = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _hopper.available()),
    reason="the Gluon kernels need an sm_90 GPU and a Triton with Gluon for Hopper",
)


@needs_hopper_gluon
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", GLUON_CASES)
def test_gluon_kernels_take_gqa_model_layouts_and_causal_windows(monkeypatch, hopper_configs, case, dtype):
    """The Gluon kernels, named (a config they refuse raises), on grouped-query attention, the (B, T, H, d)
    memory of a model's transposed and fused projections (outputs and gradients in place, in that layout)
    and causal sliding windows: float64's values; every forward and backward candidate, the persistent ones
    also in few programs of several work items each. The outputs' memory starts as NaN, so a tile a
    kernel fails to write shows."""
    monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    monkeypatch.setattr(triton_impl, "_plans", {})
    (batch, q_heads, kv_heads, seqlen, head_dim), layout, is_causal, window = GLUON_CASES[case]
    q, k, v, grad_out = qkv(batch, q_heads, kv_heads, seqlen, seqlen, head_dim, dtype)
    q, k, v = in_layout(layout, q, k, v)
    grad_out = grad_out.transpose(1, 2).contiguous().transpose(1, 2) if layout != "bhtd" else grad_out
    args = op_arguments(q, k, v, is_causal=is_causal, window_size=window, enable_gqa=True)
    want = float64_torch_path(args, grad_out)
    gluon = {pass_name: head_dim in _dispatch.GLUON_HEAD_DIMS[pass_name] for pass_name in ("fwd", "bwd")}
    for forward in hopper_configs("fwd", head_dim) if gluon["fwd"] else [None]:
        torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))  # (freed: the next allocations')
        out, lse = triton_impl.triton_forward(q, k, v, is_causal, args.scale, forward, window=window)
        assert out.stride() == _inputs.output_like(q).stride()
        assert_close({"out": out, "lse": lse}, want, dtype, names=("out", "lse"))
    for backward in hopper_configs("bwd", head_dim) if gluon["bwd"] else [None]:
        torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))
        grads = triton_impl.triton_backward(q, k, v, out, lse, grad_out, is_causal, args.scale, backward,
                                            window=window)  # fmt: skip
        assert [g.stride() for g in grads] == [_inputs.output_like(t).stride() for t in (q, k, v)]
        assert_close(dict(zip(NAMES, (out, lse, *grads), strict=True)), want, dtype)
        if forward is not None and backward is not None:
            offered = [plan.problem.hopper for plan in triton_impl._plans.values()]
            assert offered and all(offered)


TUNED_DROPOUT_CASES = {  # name: (batch, Hq, Hkv, Tq, Tk, d), is_causal, large-problem path, window_size
    "causal": ((2, 4, 4, 1000, 1000, 64), True, False, None),
    "full-ragged": ((1, 3, 3, 333, 517, 128), False, False, None),
    "causal-tq-gt-tk-d96": ((2, 2, 2, 700, 301, 96), True, False, None),
    "causal-large-path": ((2, 4, 4, 1030, 1030, 64), True, True, None),  # atomic dQ (16-bit), D preprocess
    "band-both-sides": ((2, 3, 3, 700, 700, 64), False, False, (100, 37)),  # a band's masks and dropout's
    "causal-band-large-path": ((2, 4, 4, 1030, 1030, 128), True, True, (200, 0)),
    "gqa-full-ragged": ((2, 8, 2, 333, 517, 64), False, False, None),  # counters of the query heads
    "gqa-causal-band-large-path": ((1, 8, 2, 1030, 1030, 64), True, True, (150, 0)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", TUNED_DROPOUT_CASES)
def test_dropout_in_the_tuned_kernels_matches_float64(case, dtype, monkeypatch):
    """flash_attention with dropout and no mask (with or without a band, grouped-query or not) runs the tuned
    kernels, whose outputs and gradients equal the float64 PyTorch path's with the same (seed, offset): the
    same probabilities dropped, the backward's mask the forward's."""
    shape, is_causal, large, window = TUNED_DROPOUT_CASES[case]
    if large:
        monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    monkeypatch.setattr(triton_impl, "_plans", {})
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "0")  # the default configs (every one: the next test)
    no_feature_kernels(monkeypatch)
    q, k, v, grad_out = qkv(*shape, dtype)
    grouped = q.shape[1] != k.shape[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    out, lse = flash_attention(*leaves, dropout_p=0.15, is_causal=is_causal, window_size=window,
                               enable_gqa=grouped, return_lse=True)  # fmt: skip
    out.backward(grad_out)
    torch.cuda.synchronize()  # a fault is this case's, not the next test's
    got = dict(zip(NAMES, (out.detach(), lse, *[t.grad for t in leaves]), strict=True))
    torch.manual_seed(0)  # the same draw of (seed, offset)
    args = op_arguments(q, k, v, dropout_p=0.15, is_causal=is_causal, window_size=window, enable_gqa=grouped)
    assert_close(got, float64_torch_path(args, grad_out), dtype)


EVERY_CANDIDATE = [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64), (torch.float32, 128),
                   (torch.bfloat16, 256)]


@pytest.mark.parametrize(("dtype", "head_dim"), EVERY_CANDIDATE, ids=str)
def test_every_tuned_config_with_dropout(dtype, head_dim):
    """Every config the tuner may pick for a dropout problem (split key tiles in the forward; atomic,
    one-launch, transposed and split backwards) drops the probabilities the PyTorch path drops."""
    q, k, v, grad_out = qkv(2, 3, 3, 333, 290, head_dim, dtype)
    rng = draw_rng(q.device)
    args = op_arguments(q, k, v, dropout_p=0.2, is_causal=True, scale=head_dim**-0.5)._replace(rng_state=rng)
    want = float64_torch_path(args, grad_out)
    drop = {"dropout_p": 0.2, "rng_state": rng}
    forward = _configs.forward_candidates(head_dim, q.element_size(), False)
    for config in _configs.with_split_key_tiles(forward, 1, 1 << 20, 1, 1):  # and each with split key tiles
        out, lse = triton_impl.triton_forward(q, k, v, True, head_dim**-0.5, config, **drop)
        assert_close({"out": out, "lse": lse}, want, dtype, ("out", "lse"))
    for config in _configs.backward_candidates(head_dim, q.element_size(), False):
        grads = triton_impl.triton_backward(q, k, v, out, lse, grad_out, True, head_dim**-0.5, config, **drop)
        torch.cuda.synchronize()
        assert_close(dict(zip(("dq", "dk", "dv"), grads, strict=True)), want, dtype, ("dq", "dk", "dv"))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_tuned_and_feature_kernels_drop_the_same_probabilities_on_cuda(dtype, is_causal):
    """With V the identity, O = P∘M / (1 - p) shows every kept probability: the tuned kernels, the feature
    kernels and Dropout.scale_tile (the PyTorch path's mask) keep exactly the same ones."""
    batch, heads, seqlen_q, seqlen_k, head_dim = 2, 3, 301, 123, 128
    q, k, _, _ = qkv(batch, heads, heads, seqlen_q, seqlen_k, head_dim, dtype)
    v = torch.eye(seqlen_k, head_dim, device="cuda", dtype=dtype).expand(batch, heads, -1, -1).contiguous()
    rng = torch.tensor([2**61 + 5, 2**33 - 2], device="cuda")  # the counters cross 2**32
    tuned, _ = triton_impl.triton_forward(q, k, v, is_causal, 0.1, dropout_p=0.4, rng_state=rng)
    features, _ = feature_impl.feature_forward(q, k, v, dropout_p=0.4, rng_state=rng, scale=0.1,
                                               window_right=0 if is_causal else -1)  # fmt: skip
    mask = Dropout.dense(0.4, rng, heads, seqlen_q, seqlen_k).scale_tile(batch, heads, range(seqlen_q),
                                                                         range(seqlen_k))  # fmt: skip
    if is_causal:
        mask = mask.tril()
    for out in (tuned, features):
        assert torch.equal(out[..., :seqlen_k] != 0, mask != 0)


# Rows of the candidate tables: 16-bit at d = 64 (atomic dQ) and 128, float32 at 64 (transposed gradients)
# and 128 (split launches).
CANDIDATE_ROWS = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 64),
                  (torch.float32, 128)]


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("dtype", "head_dim"), CANDIDATE_ROWS, ids=lambda x: str(x).removeprefix("torch."))
def test_gqa_on_every_tuned_candidate_matches_sdpa(sdpa_gqa, dtype, head_dim, is_causal):
    """Every config the tuner may pick for a grouped problem (atomic dQ, transposed gradients, split
    launches, split key tiles) computes the same function."""
    q, k, v, grad_out = qkv(2, 8, 2, 333, 290, head_dim, dtype)
    grad_lse = lse_gradient(q)
    want = sdpa_gqa(q, k, v, grad_out, grad_lse, is_causal)
    size = q.element_size()
    forward = _configs.forward_candidates(head_dim, size, False)
    for config in _configs.with_split_key_tiles(forward, 1, 1 << 20, 1, 1):  # and each with split key tiles
        out, lse = triton_impl.triton_forward(q, k, v, is_causal, None, config)
        torch.cuda.synchronize()  # a fault is this config's
        assert_close({**want, "out": out, "lse": lse}, want, dtype)
    for config in _configs.backward_candidates(head_dim, size, False):
        grads = triton_impl.triton_backward(q, k, v, out, lse, grad_out, is_causal, head_dim**-0.5, config,
                                            grad_lse=grad_lse)  # fmt: skip
        torch.cuda.synchronize()
        assert_close(dict(zip(NAMES, (out, lse, *grads), strict=True)), want, dtype)


def packed_problem(dtype, lengths_q, lengths_k, q_heads=8, kv_heads=2, head_dim=64, **options):
    """Packed q, k, v and dO between NaN guard rows, and their OpArguments (GQA allowed)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lengths_q), q_heads, head_dim, device="cuda", generator=generator).to(dtype)
    k, v = (torch.randn(sum(lengths_k), kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
            for _ in range(2))  # fmt: skip
    grad_out = torch.randn(q.shape, device="cuda", generator=generator).to(dtype)
    q, k, v, grad_out = (inside_nan_guards(t) for t in (q, k, v, grad_out))
    cumulative = lambda n: torch.tensor(  # noqa: E731
        [0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    args = varlen_op_arguments(q, k, v, cumulative(lengths_q), cumulative(lengths_k), max(lengths_q),
                               max(lengths_k), enable_gqa=True, **options)  # fmt: skip
    return args, grad_out


def tuned_varlen(args: OpArguments, grad_out: torch.Tensor, backward=None, deterministic=False) -> dict:
    packed = triton_impl.Packed(args.cu_seqlens_q, args.cu_seqlens_k, args.max_seqlen_q, args.max_seqlen_k)
    causal, options = args.window_right == 0, {"dropout_p": args.dropout_p, "rng_state": args.rng_state,
                                               "packed": packed}  # fmt: skip
    out, lse = triton_impl.triton_forward(args.q, args.k, args.v, causal, args.scale, **options)
    grads = triton_impl.triton_backward(args.q, args.k, args.v, out, lse, grad_out, causal, args.scale,
                                        backward, deterministic=deterministic, **options)  # fmt: skip
    return dict(zip(NAMES, (out, lse, *grads), strict=True))


VARLEN_BACKWARDS = {  # name: backward config at d = 64, 16-bit (None: the tuned choice)
    "tuned": None,
    "atomic-dq": _configs.BackwardConfig(64, 64, 4, 3, atomic_dq=True),
    "one-launch": _configs.BackwardConfig(32, 64, 4, 3),
    "split": _configs.BackwardConfig(32, 64, 4, 2, split=True, dq_block_m=16),
    "transposed-grads": _configs.BackwardConfig(32, 64, 4, 3, transposed_grads=True),
}


@pytest.mark.parametrize("backward", VARLEN_BACKWARDS)
@pytest.mark.parametrize("options", [{"is_causal": True}, {}, {"dropout_p": 0.1, "is_causal": True}],
                         ids=["causal", "full", "causal-dropout"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_varlen_tuned_kernels_match_float64(dtype, options, backward):
    """Packed sequences on the tuned kernels (VARLEN): short, empty, key-longer and query-longer sequences,
    one without keys (O 0, L -inf), GQA 4:1, each backward variant; inputs between NaN guard rows."""
    torch.manual_seed(0)
    args, grad_out = packed_problem(dtype, [130, 1, 400, 0, 77, 20], [130, 50, 310, 3, 77, 0], **options)
    got = tuned_varlen(args, grad_out, VARLEN_BACKWARDS[backward])
    torch.cuda.synchronize()  # a fault is this case's, not the next test's
    assert_close(got, float64_torch_path(args, grad_out), dtype)


def test_varlen_tuned_kernels_deterministic_backward_is_bitwise_repeatable():
    args, grad_out = packed_problem(torch.bfloat16, [700, 33, 1000], [700, 33, 1000], is_causal=True)
    first, second = (tuned_varlen(args, grad_out, deterministic=True) for _ in range(2))
    for name in NAMES:
        assert torch.equal(first[name], second[name]), name


def test_flash_attention_varlen_runs_the_tuned_kernels_on_cuda(monkeypatch):
    """No mask or window: flash_attention_varlen's forward and backward never reach the feature kernels."""

    def refuse(*args, **kwargs):
        raise AssertionError("the feature kernels ran")

    monkeypatch.setattr(feature_impl, "feature_forward", refuse)
    monkeypatch.setattr(feature_impl, "feature_backward", refuse)
    args, grad_out = packed_problem(torch.bfloat16, [513, 7, 1200], [513, 7, 1200], is_causal=True)
    tensors = [t.detach().clone().requires_grad_() for t in (args.q, args.k, args.v)]
    out = flash_attention_varlen(*tensors, args.cu_seqlens_q, args.cu_seqlens_k, 1200, 1200, is_causal=True,
                                 enable_gqa=True)  # fmt: skip
    out.backward(grad_out)
    got = {"out": out, "dq": tensors[0].grad, "dk": tensors[1].grad, "dv": tensors[2].grad}
    assert_close(got, float64_torch_path(args, grad_out), torch.bfloat16, ("out", "dq", "dk", "dv"))
