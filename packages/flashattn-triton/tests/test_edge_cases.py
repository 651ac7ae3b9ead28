"""Edge cases of issue 43 on the PyTorch path (CPU): non-finite inputs against SDPA on the same data."""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import _validation, flash_attention, flash_attention_varlen

NAN, INF = float("nan"), float("inf")


def _qkv(shape=(1, 2, 6, 8), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


def _with(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


q0, k0, v0 = _qkv()
# Overflowing scores at d = 1, where a score is one product: SDPA's math backend scales q and k by
# sqrt(scale) each, so a sum of several products could overflow in one of its terms and not in ours.
q1, k1, v1 = _qkv((1, 2, 8, 1), seed=2)
FLOAT_MASK = torch.zeros(6, 6)
ROW_4_SEES_NOTHING = _with(torch.ones(6, 6), (4, slice(None)), 0) > 0
NON_FINITE = {
    "nan in q": (_with(q0, (0, 1, 2, 3), NAN), k0, v0, {}),
    "nan in k": (q0, _with(k0, (0, 0, 4, 0), NAN), v0, {}),
    "+inf in q": (_with(q0, (0, 0, 1, 5), INF), k0, v0, {}),
    "-inf in k": (q0, _with(k0, (0, 1, 3, 2), -INF), v0, {}),
    "nan in a float mask row": (q0, k0, v0, {"attn_mask": _with(FLOAT_MASK, (2, 4), NAN)}),
    "+inf in a float mask row": (q0, k0, v0, {"attn_mask": _with(FLOAT_MASK, (3, 1), INF)}),
    "scores past float32 (q, k * 1e20)": (q1 * 1e20, k1 * 1e20, v1, {}),
    "scale=3e38": (q1, k1, v1, {"scale": 3e38}),
    # Rows that see no key get 0 in both (SDPA's softmax of an all -inf row is 0 since torch 2.5).
    "a fully -inf float mask row": (q0, k0, v0, {"attn_mask": _with(FLOAT_MASK, (1, slice(None)), -INF)}),
    "a fully False bool mask row": (q0, k0, v0, {"attn_mask": ROW_4_SEES_NOTHING}),
}


@pytest.mark.parametrize("case", list(NON_FINITE))
def test_non_finite_inputs_give_sdpas_nan_pattern(case, like_sdpa):
    """A NaN or +inf among a row's scores makes the row (and the gradients it reaches) NaN, as in SDPA;
    it read 0 before (the rule "a row that sees no key gets 0" took a NaN sum for no key)."""
    q, k, v, kwargs = NON_FINITE[case]
    got = like_sdpa.results(flash_attention, q, k, v, **kwargs)
    want = like_sdpa.results(like_sdpa.sdpa, q, k, v, **kwargs)
    if case.startswith(("nan", "+inf", "scores", "scale")):
        assert got[0].isnan().any()  # (the case is one: SDPA's output has NaN rows)
    like_sdpa.check(got, want)


def test_nan_in_one_packed_sequence_stays_in_it(like_sdpa):
    """A NaN in one packed sequence makes that sequence's rows NaN, as SDPA of that sequence alone, and
    leaves the other sequence as it was."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in _qkv((1, 2, 8, 8), seed=1))  # (total, H, d)
    q[4, 1, 0] = NAN  # the second sequence's second row
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)

    def packed(q, k, v):
        return flash_attention_varlen(q, k, v, cu, cu, 5, 5)

    grad_out = torch.linspace(-1.0, 1.0, q.numel()).view(q.shape)
    got = like_sdpa.results(packed, q, k, v, grad_out)
    want = [torch.empty_like(t) for t in got]
    for start, end in ((0, 3), (3, 8)):
        sequence = (t[start:end].transpose(0, 1) for t in (q, k, v, grad_out))
        pieces = like_sdpa.results(like_sdpa.sdpa, *sequence)
        for whole, piece in zip(want, pieces, strict=True):
            whole[start:end] = piece.transpose(0, 1)
    assert got[0][:3].isfinite().all() and got[0][3:].isnan().any()
    like_sdpa.check(got, want)


def _packed_qkv(total: int = 14):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(total, 2, 8, generator=generator) for _ in range(3)]


def test_cu_seqlens_changed_in_place_without_a_version_bump_is_refused():
    """cu_seqlens' values were checked once per tensor and version: a change through .data (or a reused
    buffer) bumps no version and went unchecked."""
    q, k, v = _packed_qkv()
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    flash_attention_varlen(q, k, v, cu, cu, 9, 9)
    cu.data[1] = 20
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and be non-decreasing"):
        flash_attention_varlen(q, k, v, cu, cu, 20, 20)


def test_invalid_cu_seqlens_under_torch_compile_is_refused():
    """Compiled, cu_seqlens' values are data, which flash_attention_varlen's checks cannot read: the op
    checks them where it runs (a cu_seqlens ending past the rows had the kernels write out of bounds)."""
    q, k, v = _packed_qkv()
    compiled = torch.compile(lambda q, k, v, cu: flash_attention_varlen(q, k, v, cu, cu, 15, 15),
                             backend="aot_eager", fullgraph=True)  # fmt: skip
    good = torch.tensor([0, 5, 14], dtype=torch.int32)
    torch.testing.assert_close(compiled(q, k, v, good), flash_attention_varlen(q, k, v, good, good, 15, 15))
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 20 but q has 14 rows"):
        compiled(q, k, v, torch.tensor([0, 5, 20], dtype=torch.int32))


@pytest.mark.parametrize(
    ("values", "total", "max_seqlen", "valid"),
    [([0, 5, 14], 14, 9, True), ([0, 0, 14], 14, 14, True), ([1, 5, 14], 14, 9, False),
     ([0, 6, 5, 14], 14, 9, False), ([0, 5, 20], 14, 15, False), ([0, 5, 13], 14, 9, False),
     ([0, 5, 14], 14, 8, False)],
)  # fmt: skip
def test_the_device_check_of_cu_seqlens_agrees_with_the_host_check(values, total, max_seqlen, valid):
    """packed_rows_valid, what the ops assert on the GPU, run here on CPU: the host check's verdict."""
    cu = torch.tensor(values, dtype=torch.int32)
    assert _validation.packed_rows_valid(cu, total, max_seqlen).item() is valid
    q = torch.empty(total, 1, 8)
    if valid:
        _validation.check_packed_rows(q, q, cu, cu, max_seqlen, max_seqlen)
    else:
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            _validation.check_packed_rows(q, q, cu, cu, max_seqlen, max_seqlen)


NO_SECOND_DERIVATIVE = "flash_attention's gradients have no derivative"
NO_FORWARD_DERIVATIVE = "flash_attention has no forward-mode derivative"


def _loss(attention):
    return lambda q, k, v: attention(q, k, v, is_causal=True).pow(2).sum()


def test_a_second_derivative_is_refused(like_sdpa):
    """Differentiating the gradients again raised nothing and gave second derivatives off by their whole
    size (attn_bwd counted as a constant); the first derivatives under create_graph=True are SDPA's."""
    q, k, v = (t.clone().requires_grad_() for t in _qkv())
    grads = torch.autograd.grad(_loss(flash_attention)(q, k, v), (q, k, v), create_graph=True)
    want = torch.autograd.grad(_loss(like_sdpa.sdpa)(q, k, v), (q, k, v))
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match=NO_SECOND_DERIVATIVE):
        torch.autograd.grad(grads[0].sum(), q)
    with pytest.raises(RuntimeError, match=NO_SECOND_DERIVATIVE):
        grads[1].sum().backward()
    with pytest.raises(RuntimeError, match=NO_SECOND_DERIVATIVE):
        torch.func.grad(lambda x: torch.func.grad(_loss(flash_attention))(x, k, v).sum())(q.detach())


def test_forward_mode_is_refused():
    """torch.func.jvp and forward_ad gave zero tangents (the op's autograd passed them by)."""
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=NO_FORWARD_DERIVATIVE):
        torch.func.jvp(lambda x: flash_attention(x, k, v), (q,), (torch.ones_like(q),))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match=NO_FORWARD_DERIVATIVE):
            flash_attention(dual, k, v)
        torch.testing.assert_close(flash_attention(q, k, v), flash_attention(q, k, v))  # (no tangent: runs)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # (vmap runs the ops per sample)
def test_torch_func_transforms_match_sdpa(like_sdpa):
    """torch.func.grad, vjp and jacrev failed ("must override the setup_context staticmethod")."""
    q, k, v = _qkv((1, 2, 5, 8))
    results = {}
    for name, attention in (("flash", flash_attention), ("sdpa", like_sdpa.sdpa)):
        loss = _loss(attention)
        results[name] = [
            *torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v),
            *torch.func.vjp(lambda x, a=attention: a(x, k, v), q)[1](torch.ones_like(q)),
            torch.func.jacrev(lambda x, a=attention: a(x, k, v))(q),
            torch.func.vmap(torch.func.grad(loss))(*(t.expand(3, *t.shape) for t in (q, k, v))),
        ]
    for got, want in zip(results["flash"], results["sdpa"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
