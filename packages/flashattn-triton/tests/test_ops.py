"""The custom ops on CPU: opcheck, torch.compile without graph breaks, dynamic lengths, export, meta tensors.

CPU compiles use the aot_eager backend: it runs the fake implementations and the autograd registration as
Inductor does, without a C++ toolchain (test_cuda.py compiles with Inductor).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flashattn_triton import flash_attention, ops, reference_logsumexp

UNBOUNDED = -1


def forward_args(q, k, v, is_causal, scale=0.25):
    """attn_fwd's arguments for plain (causal) attention."""
    return (q, k, v, None, 0.0, None, scale, UNBOUNDED, 0 if is_causal else UNBOUNDED, 0, None, None, 0, 0)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_forward_and_backward(is_causal):
    q, k, v = torch.randn(2, 3, 19, 16), torch.randn(2, 3, 23, 16), torch.randn(2, 3, 23, 16)
    torch.library.opcheck(ops.attn_fwd, forward_args(q, k, v, is_causal))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(ops.attn_fwd, forward_args(*leaves, is_causal))  # with its autograd
    out, lse = ops.attn_fwd(*forward_args(q, k, v, is_causal))
    grad_out = torch.randn_like(out)
    backward_args = (grad_out, None, q, k, v, out, lse, *forward_args(q, k, v, is_causal)[3:], False)
    torch.library.opcheck(ops.attn_bwd, backward_args)


def test_ops_match_sdpa_with_gradients():
    q, k, v = (torch.randn(2, 3, 37, 16, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_return_lse():
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 13, 16), torch.randn(2, 4, 13, 16)
    out, lse = flash_attention(q, k, v, is_causal=True, return_lse=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 9)
    torch.testing.assert_close(lse, reference_logsumexp(q, k, is_causal=True))


FEATURES = {  # attn_fwd's arguments that differ from forward_args', by position
    "mask": {3: torch.rand(1, 1, 5, 7) > 0.3},
    "float-mask": {3: torch.randn(5, 7)},
    "dropout": {4: 0.2, 5: torch.tensor([11, 0])},
    "window": {7: 2, 8: 1},
    "causal-lower-right": {9: 2},
    "gqa": {1: torch.randn(1, 1, 7, 16), 2: torch.randn(1, 1, 7, 16)},
}


@pytest.mark.parametrize("feature", FEATURES)
def test_opcheck_with_each_feature(feature):
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 7, 16)
    args = list(forward_args(q, k, k.clone(), True))
    for position, value in FEATURES[feature].items():
        args[position] = value
    torch.library.opcheck(ops.attn_fwd, args)
    out, lse = ops.attn_fwd(*args)
    backward_args = (torch.randn_like(out), torch.randn_like(lse), *args[:3], out, lse, *args[3:], True)
    torch.library.opcheck(ops.attn_bwd, backward_args)


def test_opcheck_packed_sequences():
    cu_seqlens_q, cu_seqlens_k = (
        torch.tensor([0, 3, 8], dtype=torch.int32),
        torch.tensor([0, 4, 6], dtype=torch.int32),
    )
    q, k, v = torch.randn(8, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    args = (q, k, v, None, 0.0, None, 0.25, UNBOUNDED, 0, 0, cu_seqlens_q, cu_seqlens_k, 5, 4)
    torch.library.opcheck(ops.attn_fwd, args)
    out, lse = ops.attn_fwd(*args)
    assert out.shape == q.shape and lse.shape == (8, 4)
    torch.library.opcheck(ops.attn_bwd, (torch.randn_like(out), None, q, k, v, out, lse, *args[3:], False))


def test_gradients_through_lse_and_out(check_gradients_through_lse):
    check_gradients_through_lse("cpu")


@pytest.mark.parametrize("shape", [(0, 4, 16), (2, 0, 16), (0, 2, 4, 16), (2, 2, 0, 16), (1, 2, 0, 3, 16)])
def test_empty_inputs_give_empty_outputs_and_gradients(shape):
    q = torch.randn(shape, requires_grad=True)
    k, v = (torch.randn((*shape[:-2], 5, 16), requires_grad=True) for _ in range(2))
    out = flash_attention(q, k, v, is_causal=True)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and not k.grad.any() and not v.grad.any()


def test_meta_tensors_in_give_meta_tensors_out():
    q, k, v = (torch.empty(2, 3, 40, 16, device="meta", requires_grad=True) for _ in range(3))
    out, lse = flash_attention(q, k, v, is_causal=True, return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (2, 3, 40)
    out.sum().backward()
    assert q.grad.device.type == "meta" and q.grad.shape == q.shape and v.grad.shape == v.shape


def test_compiled_block_has_no_graph_break_and_matches_eager(blocks):
    torch.manual_seed(0)
    block = blocks.Block(flash_attention)
    x = torch.randn(2, 24, 32, requires_grad=True)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, got_grads = blocks.step(compiled, x)
    sdpa_block = blocks.Block(F.scaled_dot_product_attention)
    sdpa_block.load_state_dict(block.state_dict())
    want, want_grads = blocks.step(sdpa_block, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_one_graph_serves_every_sequence_length(blocks, how):
    torch.manual_seed(0)
    block = blocks.Block(flash_attention)
    backend = blocks.CountingBackend()
    dynamic = True if how == "dynamic=True" else None
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=dynamic)
    for seqlen in (9, 17, 30, 64, 100):
        x = torch.randn(2, seqlen, 32, requires_grad=True)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 1)
        got, got_grads = blocks.step(compiled, x)
        want, want_grads = blocks.step(block, x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_grads[-1], want_grads[-1], atol=1e-5, rtol=1e-5)
    assert len(backend.compilations) == 1


def test_export_with_a_dynamic_sequence_length(blocks):
    torch.manual_seed(0)
    block = blocks.Block(flash_attention)
    seqlen = torch.export.Dim("seqlen", min=2, max=1024)
    exported = torch.export.export(block, (torch.randn(2, 16, 32),), dynamic_shapes=({1: seqlen},))
    assert any(node.target is torch.ops.flashattn_triton.attn_fwd.default for node in exported.graph.nodes)
    for length in (5, 33):
        x = torch.randn(2, length, 32)
        torch.testing.assert_close(exported.module()(x), block(x), atol=1e-5, rtol=1e-5)


def test_autocast_inside_a_compiled_function_casts_without_a_graph_break():
    def loss(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = flash_attention(q, k, v, is_causal=True)
        assert out.dtype == torch.bfloat16
        return out.float().square().sum()

    q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
    explanation = torch._dynamo.explain(loss)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_first_call_imports_neither_dynamo_nor_sympy():
    """Importing and first calling flash_attention, forward and backward, stays off torch.compile's
    modules: torch._dynamo's import (sympy, torch.fx's symbolic shapes, the FSDP custom ops...) took
    seconds of a fresh process's first call on a GPU box."""
    code = ("import sys, torch, flashattn_triton\n"
            "q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))\n"
            "flashattn_triton.flash_attention(q, k, v, is_causal=True).sum().backward()\n"
            "print([m for m in ('torch._dynamo', 'sympy') if m in sys.modules])")  # fmt: skip
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def _layout(shape, layout):
    """A random (B, H, T, d) tensor: contiguous, a (B, T, H, d) tensor's transpose (what a model's
    ``proj(x).view(B, T, H, d).transpose(1, 2)`` passes), a fused qkv projection's third (not dense: what
    benchmarks.model passes) or not dense along d (every other d of a wider tensor)."""
    batch, heads, seqlen, head_dim = shape
    if layout == "contiguous":
        return torch.randn(shape)
    if layout == "transposed":
        return torch.randn(batch, seqlen, heads, head_dim).transpose(1, 2)
    if layout == "fused":
        return torch.randn(batch, seqlen, 3, heads, head_dim).permute(2, 0, 3, 1, 4)[0]
    return torch.randn(batch, heads, seqlen, 2 * head_dim)[..., ::2]


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused", "not-dense"])
def test_outputs_and_gradients_take_sdpa_layouts(layout):
    """Outputs and gradients dense in their inputs' order of dims, as SDPA allocates them: the input's
    strides where it is dense, (B, T, H, d) memory for a fused projection's view, contiguous where d is
    strided. SDPA's output agrees on every layout; its gradients where they are (B, T, H, d) memory,
    which its CPU backward returns whatever its inputs."""
    torch.manual_seed(0)
    shape = (2, 3, 11, 8)
    q, k, v = (_layout(shape, layout).requires_grad_() for _ in range(3))
    out = flash_attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    contiguous, transposed = torch.empty(shape).stride(), _layout(shape, "transposed").stride()
    packed = {"contiguous": contiguous, "not-dense": contiguous, "transposed": transposed,
              "fused": transposed}
    assert out.stride() == want.stride() == packed[layout]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert got.stride() == packed[layout]
        if layout in ("transposed", "fused"):
            assert got.stride() == expected.stride()


def test_opcheck_with_transposed_inputs():
    """Fake and real strides agree (opcheck compares them) where the outputs follow transposed inputs."""
    q, k, v = (_layout((2, 3, 13, 16), "transposed") for _ in range(3))
    torch.library.opcheck(ops.attn_fwd, forward_args(q, k, v, True))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(ops.attn_fwd, forward_args(*leaves, True))
    out, lse = ops.attn_fwd(*forward_args(q, k, v, True))
    assert out.stride() == q.stride()
    grad_out = torch.randn(2, 13, 3, 16).transpose(1, 2)  # as autograd brings it from out.transpose(1, 2)
    torch.library.opcheck(ops.attn_bwd, (grad_out, None, q, k, v, out, lse, *forward_args(q, k, v, True)[3:],
                                         False))  # fmt: skip


class _Attention(torch.nn.Module):
    """Attention on views of projections: q, k, v of their own (dense (B, T, H, d) memory) or thirds of one
    fused projection (benchmarks.model's, not dense)."""

    def __init__(self, attention, fused: bool, d_model: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.attention, self.heads, self.fused = attention, heads, fused
        width, count = (3 * d_model, 1) if fused else (d_model, 3)
        self.projections = torch.nn.ModuleList(torch.nn.Linear(d_model, width) for _ in range(count))
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, seqlen, d_model = x.shape
        if self.fused:
            q, k, v = self.projections[0](x).view(batch, seqlen, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (p(x).view(batch, seqlen, self.heads, -1).transpose(1, 2) for p in self.projections)
        y = self.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seqlen, d_model)
        return self.proj(y)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_compiled_transposes_are_views_as_with_sdpa(fused):
    """Compiled (fullgraph), the model's transpose back of the output is a view (no aten.clone in the
    forward graph), and the graphs copy as often as SDPA's (separate projections: never, also for dQ, dK,
    dV; fused: once, stacking the gradients back into the projection's), with SDPA's results."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def run(attention):
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        torch.manual_seed(0)
        model = _Attention(attention, fused)
        x = torch.randn(2, 12, 32, requires_grad=True)
        backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
        assert len(graphs) == 2
        clones = [sum(node.target is torch.ops.aten.clone.default for node in g.graph.nodes) for g in graphs]
        return out, grads, clones

    out, grads, clones = run(flash_attention)
    want, want_grads, want_clones = run(F.scaled_dot_product_attention)
    assert clones == want_clones and clones[0] == 0
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
