"""The Triton kernels under Triton's CPU interpreter, float32 (and float16) on small shapes.

Not collected on its own (TRITON_INTERPRET must be set before the kernels are first imported):
test_triton_interpreter.py runs this file in a pytest subprocess with TRITON_INTERPRET=1. The
interpreter computes bfloat16 dot products wrongly, so bfloat16 is left to the CUDA tests.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from flashattn_triton import (
    FlashAttentionTriton,
    _configs,
    _inputs,
    _launcher,
    feature_impl,
    flash_attention,
    ops,
    torch_impl,
    triton_impl,
)
from flashattn_triton._configs import INTERPRETER_FORWARD, BackwardConfig, ForwardConfig
from flashattn_triton._dropout import Dropout, draw_rng, effective_p
from flashattn_triton._inputs import tf32_parts
from flashattn_triton.triton_impl import triton_backward, triton_forward

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)



@pytest.fixture(autouse=True)
def no_plans_from_earlier_tests(monkeypatch):
    monkeypatch.setattr(triton_impl, "_plans", {})


CASES = [  # (leading dims, Tq, Tk, d, causal, layout, dtype)
    ((2, 3), 50, 37, 32, True, "contiguous", torch.float32),
    ((2,), 33, 70, 16, False, "transposed", torch.float32),
    ((1, 2), 64, 64, 64, True, "contiguous", torch.float32),
    ((3,), 17, 17, 96, False, "padded", torch.float32),
    ((2,), 40, 90, 128, True, "contiguous", torch.float32),
    ((1, 1), 1, 5, 16, True, "contiguous", torch.float32),
    ((2,), 70, 20, 32, True, "transposed", torch.float32),
    ((1,), 45, 45, 8, True, "contiguous", torch.float32),
    ((2, 2), 48, 48, 64, True, "contiguous", torch.float16),
    ((1,), 31, 63, 32, False, "padded", torch.float16),
    ((2,), 19, 23, 6, True, "contiguous", torch.float32),  # rows of 24 bytes: padded to 32
    ((1, 2), 30, 30, 12, False, "transposed", torch.float16),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-{'causal' if c[4] else 'full'}-{c[5]}-{str(c[6])[6:]}" for c in CASES
    ],
)
def test_triton_kernels_match_float64_reference(problem, case):
    lead, seqlen_q, seqlen_k, head_dim, is_causal, layout, dtype = case
    p = problem(lead, seqlen_q, seqlen_k, head_dim, dtype, is_causal, layout=layout)
    q, k, v = p.inputs()
    out = FlashAttentionTriton.apply(q, k, v, is_causal=is_causal)
    saved = out.grad_fn.saved_tensors
    (lse,) = [t for t in saved if t.shape == q.shape[:-1]]
    out.backward(p.grad_out)
    p.check(out, q, k, v, lse)


BACKWARD_CONFIGS = [
    BackwardConfig(32, 16, 4, 1),
    BackwardConfig(16, 32, 4, 1, atomic_dq=True),
]


@pytest.mark.parametrize("backward", BACKWARD_CONFIGS, ids=["wide-steps", "atomic-dq"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_other_tile_shapes(problem, is_causal, backward):
    """Query tiles narrower than key tiles in the forward, steps wider than tiles in the backward, and
    dQ added up atomically."""
    p = problem((2,), 75, 51, 32, torch.float32, is_causal, scale=0.2)
    out, lse = triton_forward(p.q, p.k, p.v, is_causal, 0.2, ForwardConfig(16, 32, 4, 1))
    grads = triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, is_causal, 0.2, backward)
    p.assert_close({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})


SPLIT_CASES = [  # (leading dims, Tq, Tk, d, causal, dtype, kv_splits)
    ((2,), 75, 51, 32, True, torch.float32, 2),
    ((1, 2), 96, 96, 64, True, torch.float32, 3),  # diagonal tiles after an unmasked split boundary
    ((2,), 40, 90, 16, False, torch.float32, 4),  # ragged keys in the last split only
    ((1,), 70, 20, 24, True, torch.float16, 5),  # more splits than key tiles: empty splits weigh 0
    ((3,), 33, 64, 96, False, torch.float16, 2),
]


@pytest.mark.parametrize(
    "case", SPLIT_CASES, ids=[f"{c[1]}x{c[2]}-d{c[3]}-{'causal' if c[4] else 'full'}-{str(c[5])[6:]}-{c[6]}"
                              for c in SPLIT_CASES]  # fmt: skip
)
def test_split_key_tiles_give_the_same_attention_and_gradients(problem, case):
    """The forward with its key tiles split among programs (each program's partial O and lse, then
    attn_fwd_combine): O and L as from one program per query tile, and a backward from that L exact."""
    lead, seqlen_q, seqlen_k, head_dim, is_causal, dtype, kv_splits = case
    p = problem(lead, seqlen_q, seqlen_k, head_dim, dtype, is_causal, scale=0.3)
    config = dataclasses.replace(INTERPRETER_FORWARD, kv_splits=kv_splits)
    out, lse = triton_forward(p.q, p.k, p.v, is_causal, 0.3, config)
    grads = triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, is_causal, 0.3)
    p.assert_close({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})
    (plan,) = [plan for key, plan in triton_impl._plans.items() if key[0] == "fwd"]
    assert type(plan.launch).__name__ == "LaunchPair"


LAYOUT_CASES = {  # name: (fused, head dim, forward config, backward config); None: the interpreter's default
    "default": (False, 16, None, None),
    "fused-qkv": (True, 16, None, None),
    "kv-splits-atomic-dq": (False, 16, ForwardConfig(16, 16, 4, 1, kv_splits=2),
                            BackwardConfig(16, 32, 4, 1, atomic_dq=True)),
    "split": (False, 16, None, BackwardConfig(32, 16, 4, 1, split=True, dq_block_m=16)),
    "padded-head-dim": (False, 6, ForwardConfig(16, 16, 4, 1, kv_splits=2), None),  # rows of 24 bytes
}


@pytest.mark.parametrize("descriptors", ["host", "kernel"])
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_outputs_and_gradients_in_the_inputs_layouts(problem, monkeypatch, case, descriptors,
                                                    in_place_outputs):
    """Inputs of (B, T, H, d) memory (or thirds of one fused projection) give O, dQ, dK, dV in packed
    (B, T, H, d) memory, as SDPA's: written in place through host-built descriptors (and by the split
    forward's combine, through strides), through a packed tensor copied back where the kernels build
    their own descriptors or pad the head dim."""
    fused, head_dim, forward, backward = LAYOUT_CASES[case]
    if descriptors == "kernel":
        monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    in_place = in_place_outputs
    p = problem((2, 3), 21, 21 if fused else 19, head_dim, torch.float32, True, scale=0.3)  # (one projection)
    packed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (p.q, p.k, p.v, p.grad_out)]
    q, k, v, grad_out = packed
    if fused:  # (B, T, 3, H, d) memory
        q, k, v = torch.stack([t.transpose(1, 2) for t in (q, k, v)], 2).permute(2, 0, 3, 1, 4)
    out, lse = triton_forward(q, k, v, True, 0.3, forward)
    grads = triton_backward(q, k, v, out, lse, grad_out, True, 0.3, backward)
    p.assert_close({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.stride() == sdpa.stride() == packed[0].stride()
    assert [g.stride() for g in grads] == [t.stride() for t in packed[:3]]
    assert len(in_place) == 4 and all(in_place) == (descriptors == "host" and head_dim == 16)


TRANSPOSED_CASES = [  # (leading dims, Tq, Tk, d, causal, dtype)
    ((2,), 70, 45, 128, True, torch.float32),
    ((1, 2), 33, 64, 96, False, torch.float32),
    ((2,), 50, 50, 64, True, torch.float32),
    ((2,), 37, 29, 32, True, torch.float16),
]
TRANSPOSED_CONFIGS = [
    BackwardConfig(16, 32, 4, 1, transposed_grads=True),
    BackwardConfig(32, 16, 4, 1, transposed_grads=True, split=True),
    BackwardConfig(16, 32, 4, 1, split=True),
    BackwardConfig(32, 32, 4, 1, transposed_grads=True, split=True, dq_block_m=16, dq_stages=2),
]


@pytest.mark.parametrize("backward", TRANSPOSED_CONFIGS,
                         ids=["transposed", "transposed-split", "split", "split-own-dq-steps"])  # fmt: skip
@pytest.mark.parametrize(
    "case", TRANSPOSED_CASES, ids=[f"{c[1]}x{c[2]}-d{c[3]}-{'causal' if c[4] else 'full'}-{str(c[5])[6:]}"
                                   for c in TRANSPOSED_CASES]  # fmt: skip
)
def test_transposed_gradients_and_split_launches(problem, case, backward):
    """dKᵀ, dVᵀ, dQᵀ accumulated in one loop per phase (float32's layout at full accuracy, where every
    shared-memory operand is K-major; other dtypes run it too), and dK/dV and dQ as two launches (the dQ
    launch with steps of its own too), on ragged problems up to d = 128."""
    lead, seqlen_q, seqlen_k, head_dim, is_causal, dtype = case
    p = problem(lead, seqlen_q, seqlen_k, head_dim, dtype, is_causal, scale=0.3)
    out, lse = triton_forward(p.q, p.k, p.v, is_causal, 0.3)
    grads = triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, is_causal, 0.3, backward)
    p.assert_close({"dq": grads[0], "dk": grads[1], "dv": grads[2]})


@pytest.mark.parametrize("small", [True, False], ids=["D-in-kernel", "D-preprocess"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_backward_computes_d_in_its_kernel_for_small_problems(problem, monkeypatch, small, dtype):
    """D = rowsum(dO * O) comes from the backward kernel itself for small problems (no preprocess launch)
    and from the preprocess above the threshold; float32 at full accuracy (TF32 parts) always takes the
    preprocess, float32 with TF32 allowed the kernel."""
    if not small:
        monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # plain TF32 products: float32 takes the in-kernel D too
    try:
        p = problem((2,), 45, 45, 32, dtype, True, scale=0.25)
        out, lse = triton_forward(p.q, p.k, p.v, True, 0.25)
        grads = triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, True, 0.25)
    finally:
        torch.set_float32_matmul_precision(previous)
    p.assert_close({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})
    (plan,) = [plan for key, plan in triton_impl._plans.items() if key[0] == "bwd"]
    assert (not plan.preprocess) == small


@pytest.mark.parametrize("clears", [True, False], ids=["clears-dq-sum", "d-only"])
def test_preprocess_makes_d_and_clears_the_atomic_dq_sum(clears):
    """attn_bwd_preprocess: D = rowsum(dO * O) of every row, and the float32 dQ sum of the atomic backward
    (padded past seqlen_q to whole tiles) zeroed everywhere, its rows past seqlen_q included."""
    batch, heads, seqlen, head_dim, block_d, rows, acc_rows = 2, 3, 70, 24, 32, 16, 128
    out, grad_out = (torch.randn(batch, heads, seqlen, head_dim) for _ in range(2))
    delta = torch.full((batch, heads, seqlen), float("nan"))
    dq_acc = torch.full((batch, heads, acc_rows, block_d), float("nan")) if clears else None
    kernels = _launcher.kernels()
    kernels.attn_bwd_preprocess[(batch * heads, acc_rows // rows)](
        out, grad_out, delta, dq_acc, *out.stride()[:3], *grad_out.stride()[:3], heads, seqlen, head_dim,
        acc_rows, block_d, rows)  # fmt: skip
    torch.testing.assert_close(delta, (out * grad_out).sum(-1))
    if clears:
        assert torch.equal(dq_acc, torch.zeros_like(dq_acc))


GROUP_SUM_CASES = {  # name: (batch, Hq, Hkv, T, d, block_d, tile_rows, dtype, layout of the sums)
    "group2-contiguous": (2, 4, 2, 37, 32, 32, None, torch.float32, "bhtd"),
    "group4-bthd-ragged-d": (2, 8, 2, 37, 20, 32, 16, torch.float32, "bthd"),
    "group3-fused-one-tile": (1, 6, 2, 5, 16, 16, None, torch.float32, "fused"),
    "group4-float16-bthd": (1, 4, 1, 23, 24, 32, 8, torch.float16, "bthd"),
    "group2-bthd-k-contiguous-v": (2, 6, 3, 29, 16, 16, 8, torch.float32, "bthd-k"),
}


@pytest.mark.parametrize("case", GROUP_SUM_CASES)
def test_group_sum_equals_torch_sum_over_each_group(case):
    """_kernels.group_sum (triton_impl.GroupSum): dK and dV of each query head summed over each group as
    torch.sum sums them, into sums laid out as a model's K and V: contiguous, (B, T, H, d) memory (K's only,
    or both), or views of a fused projection (B, T, Hq + 2 Hkv, d) whose other heads must stay untouched.
    T not a multiple of the tile rows, d below the block."""
    from flashattn_triton.triton_impl import GroupSum

    batch, q_heads, kv_heads, seqlen, head_dim, block_d, tile_rows, dtype, layout = GROUP_SUM_CASES[case]
    generator = torch.Generator().manual_seed(0)
    shape = (batch, q_heads, seqlen, head_dim)
    per_head = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    if layout == "fused":
        memory = torch.full((batch, seqlen, q_heads + 2 * kv_heads, head_dim), float("nan"), dtype=dtype)
        sums = memory[:, :, q_heads:].transpose(1, 2).split(kv_heads, 1)
    else:
        contiguous = torch.full((batch, kv_heads, seqlen, head_dim), float("nan"), dtype=dtype)
        bthd = contiguous.transpose(1, 2).contiguous().transpose(1, 2)
        sums = {"bhtd": (contiguous, contiguous.clone()), "bthd": (bthd, bthd.clone()),
                "bthd-k": (bthd, contiguous)}[layout]  # fmt: skip
    GroupSum(per_head[0], sums, block_d, tile_rows)(tuple(per_head), sums)
    for got, gradients in zip(sums, per_head, strict=True):
        want = gradients.unflatten(1, (kv_heads, -1)).sum(2)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if layout == "fused":
        assert memory[:, :, :q_heads].isnan().all()


def test_launchers_take_inputs_that_require_grad(problem):
    """Called outside autograd (tuning scripts, tools) on float32 inputs that require grad: the same
    results as on detached ones (the float32 path splits its inputs into TF32 parts first)."""
    p = problem((2,), 40, 40, 32, torch.float32, True)
    detached = (p.q, p.k, p.v)
    attached = tuple(t.clone().requires_grad_() for t in detached)
    results = []
    for q, k, v in (detached, attached):
        out, lse = triton_forward(q, k, v, True, 0.25)
        results.append((out, lse, *triton_backward(q, k, v, out, lse, p.grad_out, True, 0.25)))
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


def test_flash_attention_runs_the_triton_kernels_on_cpu_under_the_interpreter(problem, monkeypatch):
    def no_torch_path(*args, **kwargs):
        raise AssertionError("the PyTorch path ran under the interpreter")

    monkeypatch.setattr(ops.torch_impl, "attention_forward", no_torch_path)
    monkeypatch.setattr(ops.torch_impl, "attention_backward", no_torch_path)
    p = problem((2,), 20, 20, 16, torch.float32, True, scale=0.5)
    q, k, v = p.inputs()
    out = flash_attention(q, k, v, is_causal=True, scale=0.5)
    out.backward(p.grad_out)
    p.check(out, q, k, v)


def test_opcheck_of_the_triton_path():
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    options = (None, 0.0, None, 0.25, -1, 0, 0, None, None, 0, 0)
    torch.library.opcheck(ops.attn_fwd, (q, k, v, *options))
    out, lse = ops.attn_fwd(q, k, v, *options)
    torch.library.opcheck(ops.attn_bwd, (torch.randn_like(out), None, q, k, v, out, lse, *options, False))


def test_bfloat16_is_refused_with_a_clear_error():
    q = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16.*TRITON_INTERPRET"):
        flash_attention(q, q, q)


def test_device_side_descriptors(problem, monkeypatch):
    """The path of GPUs older than Hopper: the kernels build their descriptors from pointers."""
    monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    p = problem((2, 2), 40, 27, 24, torch.float32, True, layout="transposed")
    q, k, v = p.inputs()
    out = FlashAttentionTriton.apply(q, k, v, True)
    out.backward(p.grad_out)
    p.check(out, q, k, v)


def test_each_layout_gets_its_own_launch_plan(problem):
    """Plans are keyed by everything the JIT specializes on: a repeat reuses one, while another length,
    another stride order or a base address off 16 bytes each get their own; all stay exact."""
    p = problem((1, 2), 24, 24, 16, torch.float32, True)
    base = torch.empty(p.q.numel() + 1)
    misaligned = base[1:].view(p.q.shape).copy_(p.q)
    assert misaligned.data_ptr() % 16 != 0
    variants = [p.q, p.q.clone(), misaligned, p.q.transpose(1, 2).contiguous().transpose(1, 2)]
    for q, plans in zip(variants, [1, 1, 2, 3], strict=True):
        out, lse = triton_forward(q, p.k, p.v, True, 0.25)
        assert len(triton_impl._plans) == plans
        p.assert_close({"out": out, "lse": lse})
    triton_forward(p.q[:, :, :20], p.k, p.v, True, 0.25)
    assert len(triton_impl._plans) == 4


def test_a_layouts_later_calls_are_still_checked_where_they_differ(problem):
    """Inputs are checked when their layout's plan is made; the plan's key holds all that the checks
    read, so a later call that differs in any of it (a dtype, an int for is_causal, a bad scale) is
    checked again and refused, while a repeat of a good call runs."""
    p = problem((2,), 20, 20, 16, torch.float32, True)
    q, k, v = p.inputs()
    FlashAttentionTriton.apply(q, k, v, True)
    FlashAttentionTriton.apply(q, k, v, True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        FlashAttentionTriton.apply(q, k, v, 1)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        FlashAttentionTriton.apply(q, k, v, True, -1.0)
    with pytest.raises(TypeError, match="scale must be a Python float"):
        FlashAttentionTriton.apply(q, k, v, True, torch.tensor(0.5))
    with pytest.raises(TypeError, match="v.dtype is torch.float16"):
        FlashAttentionTriton.apply(q, k, v.half(), True)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        FlashAttentionTriton.apply(q, k.tolist(), v, True)


def test_gradients_taken_with_create_graph_refuse_a_second_differentiation(problem):
    """Under create_graph=True, with an incoming gradient that is itself differentiable (as in a gradient
    penalty), the backward's gradients are marked once-differentiable (its kernels have no derivative):
    differentiating them again raises instead of treating them as constants. The first gradients are
    the same either way."""
    p = problem((2,), 24, 24, 16, torch.float32, True)
    q, k, v = p.inputs()
    grad_out = p.grad_out.clone().requires_grad_()
    plain = torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad_out)
    graphed = torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad_out,
                                  create_graph=True)  # fmt: skip
    for got, want in zip(graphed, plain, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        graphed[0].sum().backward()


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_tf32_parts_are_exact_and_their_high_parts_are_tf32(transposed, assert_tf32_parts):
    x = torch.randn(2, 3, 17, 24, dtype=torch.float32) * torch.logspace(-20, 20, 24)
    x4 = x.transpose(1, 2)  # any strides
    parts = tf32_parts(x4, transposed)
    if transposed:  # (2Z, H, d, T), its rows padded to 16 bytes
        assert parts.shape == (4, 17, 24, 3) and parts.stride()[-2:] == (4, 1)
        parts = parts.transpose(-1, -2)
    assert parts.shape == (4, 17, 3, 24)
    assert_tf32_parts(parts, x4)
    assert (parts[x4.shape[0] :].abs() <= x4.abs() * 2.0**-10).all()


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_float32_infinities_spoil_only_the_rows_that_see_them(check_infinities, where, is_causal):
    check_infinities("cpu", where, is_causal)


def test_gradients_through_lse_and_out(check_gradients_through_lse):
    check_gradients_through_lse("cpu", seqlen=40)


def no_feature_kernels(monkeypatch) -> None:
    """Make the feature kernels fail the test if they run: the problem must take the tuned kernels."""

    def refuse(*args, **kwargs):
        raise AssertionError("the feature kernels ran")

    monkeypatch.setattr(feature_impl, "feature_forward", refuse)
    monkeypatch.setattr(feature_impl, "feature_backward", refuse)


# Bands (sliding windows): ((B, H), Tq, Tk, d, causal, window). Lengths are no multiple of the
# interpreter's tiles (32 x 16 forward, 16 x 32 backward), so that every edge meets ragged tiles.
BAND_CASES = [
    ((2, 1), 45, 45, 16, True, (0, 0)),  # the diagonal alone
    ((1, 2), 45, 45, 32, True, (1, 0)),
    ((2, 1), 77, 77, 16, True, (16, 0)),  # a key tile wide
    ((2, 1), 77, 77, 24, True, (33, -1)),  # (the right side is 0 under is_causal)
    ((1, 1), 50, 50, 16, True, (200, 0)),  # wider than the sequence: causal attention
    ((2, 1), 61, 61, 16, False, (9, 4)),
    ((1, 2), 61, 61, 16, False, (7, -1)),
    ((1, 2), 61, 61, 16, False, (-1, 5)),
    ((2, 1), 50, 20, 16, True, (5, 0)),  # Tq > Tk: rows from 25 on see no key
    ((2, 1), 20, 50, 16, False, (5, 3)),
]


BAND_NAMES = ("out", "lse", "dq", "dk", "dv")


def band_case_id(case: tuple) -> str:
    lead, seqlen_q, seqlen_k, head_dim, is_causal, window = case
    return f"{seqlen_q}x{seqlen_k}-d{head_dim}-{'causal' if is_causal else 'full'}-{window[0]}-{window[1]}"


def band_problem(case: tuple, seed: int = 0) -> tuple[torch.Tensor, ...]:
    lead, seqlen_q, seqlen_k, head_dim, _, _ = case
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(*lead, t, head_dim, generator=generator)
                         for t in (seqlen_q, seqlen_k, seqlen_k, seqlen_q))  # fmt: skip
    return q, k, v, grad_out


def band_reference(q, k, v, grad_out, is_causal: bool, window: tuple[int, int], scale: float) -> dict:
    """O, L and the gradients of the PyTorch path (checked against naive float64 attention in
    test_features.py) in float64, where query i sees the keys i - left .. i + right."""
    left, right = window
    options = {"scale": scale, "window_left": left, "window_right": 0 if is_causal else right,
               "diagonal_offset": 0}  # fmt: skip
    q, k, v, grad_out = (t.double() for t in (q, k, v, grad_out))
    out, lse = torch_impl.attention_forward(q, k, v, **options)
    grads = torch_impl.attention_backward(grad_out, q, k, v, out, lse, **options)
    return dict(zip(BAND_NAMES, (out, lse, *grads), strict=True))


def assert_band_close(got: dict, want: dict) -> None:
    """Each result within 1e-4 of the largest reference value; rows that see no key exactly O = 0 (and
    their dQ 0), L = -inf."""
    for name in BAND_NAMES:
        assert got[name].shape == want[name].shape, name
        unseen = want[name] == float("-inf")
        assert torch.equal(got[name] == float("-inf"), unseen), f"{name}: rows that see no key differ"
        g, w = got[name].double().masked_fill(unseen, 0), want[name].masked_fill(unseen, 0)
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        error = (g - w).abs().max().item() / max(w.abs().max().item(), 1.0)
        assert error <= 1e-4, f"{name}: max error {error:.2e} relative to max |reference|"


def run_band(case, forward=None, backward=None, scale=0.3) -> tuple[dict, dict]:
    """(the tuned kernels' results, the reference's) for a band case, with the given configs."""
    *_, is_causal, window = case
    q, k, v, grad_out = band_problem(case)
    out, lse = triton_forward(q, k, v, is_causal, scale, forward, window=window)
    grads = triton_backward(q, k, v, out, lse, grad_out, is_causal, scale, backward, window=window)
    got = dict(zip(BAND_NAMES, (out, lse, *grads), strict=True))
    return got, band_reference(q, k, v, grad_out, is_causal, window, scale)


@pytest.mark.parametrize("case", BAND_CASES, ids=[band_case_id(c) for c in BAND_CASES])
def test_bands_match_the_float64_pytorch_path(case):
    assert_band_close(*run_band(case))


BAND_CONFIG_CASES = [BAND_CASES[3], BAND_CASES[5], BAND_CASES[8]]
BAND_BACKWARDS = {
    "atomic-dq": BackwardConfig(16, 32, 4, 1, atomic_dq=True),
    "wide-steps": BackwardConfig(32, 16, 4, 1),
    "transposed": BackwardConfig(16, 32, 4, 1, transposed_grads=True),
    "split": BackwardConfig(16, 32, 4, 1, split=True),
    "transposed-split-own-dq-steps": BackwardConfig(32, 32, 4, 1, transposed_grads=True, split=True,
                                                    dq_block_m=16, dq_stages=2),  # fmt: skip
}


@pytest.mark.parametrize("backward", BAND_BACKWARDS.values(), ids=BAND_BACKWARDS.keys())
@pytest.mark.parametrize("case", BAND_CONFIG_CASES, ids=[band_case_id(c) for c in BAND_CONFIG_CASES])
def test_bands_in_every_backward_variant(case, backward):
    """dQ added up atomically or in its own phase, steps wider than tiles, transposed accumulators and the
    two launches of a split backward, each visiting only the band's tiles."""
    assert_band_close(*run_band(case, backward=backward))


@pytest.mark.parametrize("kv_splits", [3, 5])
@pytest.mark.parametrize("case", BAND_CONFIG_CASES, ids=[band_case_id(c) for c in BAND_CONFIG_CASES])
def test_bands_with_split_key_tiles(case, kv_splits):
    """The band's unmasked tiles shared among the splits, its edges in the last one: splits that see none
    of a row's keys weigh 0, and a row that no split sees gets O = 0 and L = -inf."""
    forward = ForwardConfig(16, 16, 4, 1, kv_splits=kv_splits)
    assert_band_close(*run_band(case, forward=forward))


@pytest.mark.parametrize(("is_causal", "window"), [(True, (10, 0)), (False, (4, 6))], ids=["causal", "both"])
def test_flash_attention_runs_bands_on_the_tuned_kernels(monkeypatch, is_causal, window):
    """flash_attention's window_size where Tq = Tk and the heads match: the tuned kernels (not the feature
    kernels), against SDPA with the band as a dense boolean mask, in float64 on the same inputs."""
    no_feature_kernels(monkeypatch)
    q, k, v, grad_out = band_problem(((2, 3), 45, 45, 16, is_causal, window), seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, is_causal=is_causal, window_size=window, return_lse=True)
    out.backward(grad_out)
    rows, cols = torch.arange(45)[:, None], torch.arange(45)[None, :]
    left, right = window
    visible = (cols >= rows - left) & (cols <= rows + (0 if is_causal else right))
    references = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*references, attn_mask=visible)
    want.backward(grad_out.double())
    scores = (references[0] @ references[1].transpose(-2, -1) / 4).masked_fill(~visible, float("-inf"))
    got = [out, lse, *(t.grad for t in leaves)]
    wanted = [want, scores.logsumexp(-1), *(t.grad for t in references)]
    for name, g, w in zip(BAND_NAMES, got, wanted, strict=True):
        torch.testing.assert_close(g.double(), w.detach(), atol=1e-5, rtol=1e-5, msg=name)


def test_opcheck_of_a_band():
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    options = (None, 0.0, None, 0.25, 5, 0, 0, None, None, 0, 0)
    torch.library.opcheck(ops.attn_fwd, (q, k, v, *options))
    out, lse = ops.attn_fwd(q, k, v, *options)
    torch.library.opcheck(ops.attn_bwd, (torch.randn_like(out), None, q, k, v, out, lse, *options, False))


def _dropout_results(implementation: str, q, k, v, grad_out, is_causal, rng, dropout_p=0.3, scale=0.3,
                     forward=None, backward=None, window=None) -> list[torch.Tensor]:  # fmt: skip
    """[out, lse, dq, dk, dv] of one path with dropout: "tuned" (the tuned kernels, with configs forward and
    backward), "features" (the feature kernels) or "torch" (the PyTorch path); window: a band's (left,
    right)."""
    if implementation == "tuned":
        drop = {"dropout_p": dropout_p, "rng_state": rng, "window": window}
        out, lse = triton_forward(q, k, v, is_causal, scale, forward, **drop)
        return [out, lse, *triton_backward(q, k, v, out, lse, grad_out, is_causal, scale, backward, **drop)]
    if implementation == "features":
        forward, backward = feature_impl.feature_forward, feature_impl.feature_backward
    else:
        forward, backward = torch_impl.attention_forward, torch_impl.attention_backward
    left, right = (-1, -1) if window is None else window
    options = {"dropout_p": dropout_p, "rng_state": rng, "scale": scale, "window_left": left,
               "window_right": 0 if is_causal else right}  # fmt: skip
    out, lse = forward(q, k, v, **options)
    return [out, lse, *backward(grad_out, q, k, v, out, lse, **options)]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], bound: float = 2e-5,
                 names: tuple[str, ...] = ("out", "lse", "dq", "dk", "dv")) -> None:  # fmt: skip
    for name, g, w in zip(names, got, want, strict=True):
        error = (g - w).abs().max().item() / max(w.abs().max().item(), 1.0)
        assert error <= bound, f"{name}: max error {error:.2e} relative to max |reference|"


DROPOUT_CASES = [  # (leading dims, Tq, Tk, d, causal)
    ((2, 3), 50, 37, 32, True),
    ((2, 1), 33, 70, 16, False),
]
DROPOUT_BACKWARDS = {
    "default": None,
    "atomic-dq": BackwardConfig(16, 32, 4, 1, atomic_dq=True),
    "one-launch": BackwardConfig(32, 16, 4, 1),
    "split": BackwardConfig(16, 32, 4, 1, split=True),
    "transposed": BackwardConfig(32, 16, 4, 1, transposed_grads=True),
}


@pytest.mark.parametrize("backward", DROPOUT_BACKWARDS)
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[f"{c[1]}x{c[2]}-d{c[3]}-{'causal' if c[4] else 'full'}"
                                                     for c in DROPOUT_CASES])  # fmt: skip
def test_dropout_in_the_tuned_kernels_matches_the_torch_path(problem, case, backward):
    """The tuned kernels with dropout, every backward variant, against the PyTorch path with the same
    (seed, offset): the same probabilities dropped, so the same outputs and gradients to float32 accuracy."""
    lead, seqlen_q, seqlen_k, head_dim, is_causal = case
    p = problem(lead, seqlen_q, seqlen_k, head_dim, torch.float32, is_causal)
    torch.manual_seed(0)
    rng = draw_rng(p.q.device)
    inputs = (p.q, p.k, p.v, p.grad_out, is_causal, rng)
    got = _dropout_results("tuned", *inputs, backward=DROPOUT_BACKWARDS[backward])
    _assert_same(got, _dropout_results("torch", *inputs))
    # Another (seed, offset) drops other probabilities: far outside the bound.
    other = _dropout_results("torch", *inputs[:-1], draw_rng(p.q.device))
    assert (got[0] - other[0]).abs().max() > 0.1


@pytest.mark.parametrize("backward", DROPOUT_BACKWARDS)
@pytest.mark.parametrize(("is_causal", "window"), [(True, (9, 0)), (False, (7, 20))], ids=["causal", "both"])
def test_dropout_in_a_band_matches_the_torch_path(problem, is_causal, window, backward):
    """A band and dropout together: the band's masks and the kept mask are independent (each probability's
    Philox counter depends on its row and key alone, not on the tiles the band visits), so every backward
    variant equals the PyTorch path with the same (seed, offset)."""
    p = problem((2, 2), 61, 61, 16, torch.float32, is_causal)
    rng = torch.tensor([987654321, 2**33 - 5])
    inputs = (p.q, p.k, p.v, p.grad_out, is_causal, rng)
    got = _dropout_results("tuned", *inputs, backward=DROPOUT_BACKWARDS[backward], window=window)
    _assert_same(got, _dropout_results("torch", *inputs, window=window))
    without_band = _dropout_results("torch", *inputs)  # the band matters here
    assert (got[0] - without_band[0]).abs().max() > 0.1


@pytest.mark.parametrize("backward", ["default", "atomic-dq"])
def test_dropout_with_d_in_the_backward_kernel(problem, backward):
    """float32 with TF32 allowed (not in parts), as 16-bit inputs run: a small problem's backward computes
    D = rowsum(dO * O) from the dropped O in its kernel, with dQ added up directly or atomically."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        p = problem((1, 2), 40, 50, 16, torch.float32, True)
        rng = draw_rng(p.q.device)
        inputs = (p.q, p.k, p.v, p.grad_out, True, rng)
        got = _dropout_results("tuned", *inputs, backward=DROPOUT_BACKWARDS[backward])
    finally:
        torch.set_float32_matmul_precision(previous)
    _assert_same(got, _dropout_results("torch", *inputs))
    (plan,) = [plan for key, plan in triton_impl._plans.items() if key[0] == "bwd"]
    assert plan.delta_from_o


@pytest.mark.parametrize("kv_splits", [2, 3])
def test_dropout_with_split_key_tiles(problem, kv_splits):
    """The forward's split form with dropout: each split's partial results drop their own keys' share, and
    the combine weighs them as without dropout."""
    p = problem((2, 1), 40, 90, 16, torch.float32, True)
    rng = torch.tensor([123456789, 2**40 + 3])
    config = dataclasses.replace(INTERPRETER_FORWARD, kv_splits=kv_splits)
    got = _dropout_results("tuned", p.q, p.k, p.v, p.grad_out, True, rng, forward=config)
    _assert_same(got, _dropout_results("torch", p.q, p.k, p.v, p.grad_out, True, rng))


@pytest.mark.parametrize("is_causal", [False, True])
def test_tuned_and_feature_kernels_drop_the_same_probabilities(is_causal):
    """With V the identity, O = P∘M / (1 - p) shows each kept probability: the tuned kernels, the feature
    kernels and Dropout.scale_tile (the PyTorch path's mask) keep exactly the same ones, on ragged tiles
    (Tk not a multiple of 16), and the results agree to float32 accuracy."""
    batch, heads, seqlen_q, seqlen_k, head_dim = 2, 2, 29, 30, 32
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seqlen_q, head_dim, generator=generator)
    k = torch.randn(batch, heads, seqlen_k, head_dim, generator=generator)
    v = torch.eye(seqlen_k, head_dim).expand(batch, heads, -1, -1).contiguous()
    grad_out = torch.randn(q.shape, generator=generator)
    rng = torch.tensor([2**61 + 5, 2**33 - 2])  # the counters cross 2**32
    tuned = _dropout_results("tuned", q, k, v, grad_out, is_causal, rng, dropout_p=0.4)
    features = _dropout_results("features", q, k, v, grad_out, is_causal, rng, dropout_p=0.4)
    mask = Dropout.dense(0.4, rng, heads, seqlen_q, seqlen_k).scale_tile(batch, heads, range(seqlen_q),
                                                                         range(seqlen_k))  # fmt: skip
    if is_causal:
        mask = mask.tril()
    for out in (tuned[0], features[0]):
        assert torch.equal(out[..., :seqlen_k] != 0, mask != 0)
    _assert_same(tuned, features)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_within_a_binomial_bound(dropout_p):
    """The tuned kernel's kept probabilities (read off O with V the identity) over 16384 of them: their
    fraction, and that of each of the 16 bytes of the Philox calls (keys j % 16), within 5 standard
    deviations of 1 - effective p; each kept one scaled by 1 / (1 - effective p)."""
    batch_heads, seqlen_q, seqlen_k = 4, 128, 32
    q = torch.zeros(1, batch_heads, seqlen_q, seqlen_k)  # equal scores: P = 1 / Tk, never 0
    v = torch.eye(seqlen_k).expand(1, batch_heads, -1, -1).contiguous()
    torch.manual_seed(1)
    out, _ = triton_forward(q, q[:, :, :seqlen_k], v, False, 1.0, dropout_p=dropout_p,
                            rng_state=draw_rng(q.device))  # fmt: skip
    dropped = effective_p(dropout_p)
    kept = out != 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / seqlen_k / (1 - dropped)))
    kept = kept.reshape(-1, 16).double()  # columns: the 16 bytes of each Philox call
    for sample in (kept, *kept.T):
        bound = 5 * (dropped * (1 - dropped) / sample.numel()) ** 0.5
        assert abs(sample.mean().item() - (1 - dropped)) <= bound, (sample.mean().item(), bound)


@pytest.mark.parametrize("backward", ["default", "atomic-dq", "transposed"])
def test_dropout_p_one_drops_everything_in_the_tuned_kernels(problem, backward, monkeypatch):
    """flash_attention(dropout_p=1) on the tuned kernels: output and gradients 0, as SDPA's; the log-sum-exp
    that of the softmax without dropout."""
    no_feature_kernels(monkeypatch)
    p = problem((2, 2), 30, 41, 16, torch.float32, True)
    q, k, v = p.inputs()
    out, lse = flash_attention(q, k, v, dropout_p=1.0, is_causal=True, scale=0.3, return_lse=True)
    out.backward(p.grad_out)
    for name, t in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), strict=True):
        assert not t.any(), name
    _, undropped = triton_forward(p.q, p.k, p.v, True, 0.3)
    torch.testing.assert_close(lse.detach(), undropped)
    drop = {"dropout_p": 1.0, "rng_state": draw_rng(p.q.device)}
    grads = triton_backward(p.q, p.k, p.v, out.detach(), lse.detach(), p.grad_out, True, 0.3,
                            DROPOUT_BACKWARDS[backward], **drop)  # fmt: skip
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        assert not g.any(), name


def test_flash_attention_with_dropout_runs_the_tuned_kernels(problem, monkeypatch):
    """flash_attention(dropout_p=...) without mask, band or GQA takes the tuned kernels (not the feature
    kernels), follows torch.manual_seed, and matches the PyTorch path drawn from the same seed."""
    no_feature_kernels(monkeypatch)
    p = problem((2, 2), 30, 30, 16, torch.float32, True)
    results = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        q, k, v = p.inputs()
        out = flash_attention(q, k, v, dropout_p=0.25, is_causal=True, scale=0.3)
        out.backward(p.grad_out)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for first, again in zip(results[0], results[1], strict=True):
        assert torch.equal(first, again)
    assert not torch.equal(results[0][0], results[2][0])
    torch.manual_seed(7)
    want = _dropout_results("torch", p.q, p.k, p.v, p.grad_out, True, draw_rng(p.q.device), 0.25)
    _assert_same(results[0], [want[0], *want[2:]], names=("out", "dq", "dk", "dv"))


GROUPED_CASES = {  # name: is_causal, window, dropout_p; grouped-query attention (6 query heads, 2 K/V heads)
    "causal-dropout": (True, None, 0.3),
    "full-dropout": (False, None, 0.3),
    "causal-band": (True, (9, 0), 0.0),
    "band": (False, (7, 20), 0.0),
    "causal-band-dropout": (True, (9, 0), 0.3),
    "band-dropout": (False, (7, 20), 0.3),
}


@pytest.mark.parametrize("backward", ["default", "atomic-dq", "split", "transposed"])
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_queries_with_a_band_or_dropout_match_the_torch_path(case, backward):
    """The K/V head a query head reads, a band's masks and dropout's kept mask are independent: grouped-query
    attention with a band, dropout or both equals the PyTorch path, whose dropout counters are those of the
    query heads (z, h) as the tuned kernels' are, in every backward variant."""
    is_causal, window, dropout_p = GROUPED_CASES[case]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 61, 16, generator=generator)
    k, v = (torch.randn(2, 2, 61, 16, generator=generator) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator)
    rng = torch.tensor([987654321, 2**33 - 5]) if dropout_p else None
    inputs = (q, k, v, grad_out, is_causal, rng, dropout_p)
    got = _dropout_results("tuned", *inputs, backward=DROPOUT_BACKWARDS[backward], window=window)
    _assert_same(got, _dropout_results("torch", *inputs, window=window))


def test_flash_attention_runs_grouped_queries_in_a_band_with_dropout_on_the_tuned_kernels(monkeypatch):
    """flash_attention with grouped query heads, a window and dropout where Tq = Tk: the tuned kernels (not
    the feature kernels), equal to the PyTorch path drawn from the same seed."""
    no_feature_kernels(monkeypatch)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 16, generator=generator)
    k, v = (torch.randn(2, 2, 40, 16, generator=generator) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    out = flash_attention(*leaves, dropout_p=0.25, window_size=(6, 11), scale=0.3, enable_gqa=True)
    out.backward(grad_out)
    torch.manual_seed(3)
    want = _dropout_results("torch", q, k, v, grad_out, False, draw_rng(q.device), 0.25, window=(6, 11))
    got = [out.detach(), *(t.grad for t in leaves)]
    _assert_same(got, [want[0], *want[2:]], names=("out", "dq", "dk", "dv"))
