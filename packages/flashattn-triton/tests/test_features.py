"""flash_attention's features on the PyTorch path against float64 references: grouped-query attention,
bool/float/CausalBias masks (broadcast), windows, dropout, packed sequences, the public log-sum-exp, each
alone and combined, gradients included; and the errors for bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from flashattn_triton import _validation, flash_attention, flash_attention_varlen, torch_impl
from flashattn_triton._dropout import Dropout, draw_rng, effective_p, kept_scale, philox, threshold
from flashattn_triton._validation import OpArguments, op_arguments, varlen_op_arguments

pytestmark = pytest.mark.usefixtures("full_float32_precision")


def randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator)


def reference(q, k, v, grad_out, *, attn_mask=None, window_left=-1, window_right=-1, diagonal_offset=0,
              scale=None, dropout_scale=None, grad_lse=None):  # fmt: skip
    """Naive float64 attention, its lse and gradients: k and v repeated over each group of query heads, the
    band and mask applied to the full score matrix, rows that see no key giving 0, dropout as a given
    (B, Hq, Tq, Tk) scale."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    keys, values = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ keys.transpose(-1, -2) * scale
    i = torch.arange(q.shape[-2]).view(-1, 1) + diagonal_offset
    j = torch.arange(k.shape[-2])
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if window_right != -1:
        visible &= j <= i + window_right
    if window_left != -1:
        visible &= j >= i - window_left
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask.double()
    scores = scores.masked_fill(~visible, float("-inf"))
    seen = (scores > float("-inf")).any(-1, keepdim=True)
    scores = torch.where(seen, scores, 0.0)
    lse = torch.where(seen[..., 0], torch.logsumexp(scores, -1), float("-inf"))
    p = torch.softmax(scores, -1) * seen
    if dropout_scale is not None:
        p = p * dropout_scale.double()
    out = p @ values
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(seen[..., 0], lse, 0.0) * grad_lse.double()).sum()
    loss.backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def torch_path(args: OpArguments, grad_out: torch.Tensor, grad_lse: torch.Tensor | None = None):
    """The PyTorch path's forward and backward of op_arguments' problem, named as reference()'s."""
    options = args._asdict()
    q, k, v = (options.pop(name) for name in ("q", "k", "v"))
    out, lse = torch_impl.attention_forward(q, k, v, **options)
    dq, dk, dv = torch_impl.attention_backward(grad_out, q, k, v, out, lse, grad_lse=grad_lse, **options)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# Max error relative to max |reference|. float32's bound leaves room for CPUs that round more than this one:
# one CI run gave 3.7e-5 on GQA's out, not reproduced here (2.4e-7, with every earlier test run first). A
# missed key or a mask off by one costs 1e-2 and more; TF32 products (a leaked matmul precision) 5e-4.
BOUNDS = {torch.float32: 1e-4, torch.float16: 4e-3}


def assert_close(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
    """Every (name, got, float64 reference): same shape, finite, max error within BOUNDS[dtype] of the
    reference's largest value (of 1, the inputs' scale, where the reference is 0 up to rounding: dQ where
    each row sees one key). A bug (a key missed, a mask off by one) costs far more."""
    for name, got, want in pairs:
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        largest = want.abs().max().item()
        error = (got.double() - want).abs().max().item() / (largest if largest > 1e-6 else 1.0)
        assert error <= BOUNDS[dtype], f"{name}: max error {error:.2e} relative to max |reference|"


def check(got: dict, want: dict) -> None:
    assert_close([(name, got[name], want[name]) for name in want], torch.float32)


def inputs(batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = randn(batch, q_heads, seqlen_q, head_dim, generator=generator)
    k = randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    v = randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    grad_out = randn(batch, q_heads, seqlen_q, head_dim, generator=generator)
    return q, k, v, grad_out


def finite_lse(result: dict) -> dict:
    """result with its lse's -inf (rows that see no key) as 0 on both sides: assert_close wants finite."""
    return {**result, "lse": torch.where(result["lse"] == float("-inf"), 0.0, result["lse"])}


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(6, 2), (4, 1), (3, 3)])
def test_grouped_query_attention(q_heads, kv_heads):
    q, k, v, grad_out = inputs(2, q_heads, kv_heads, 37, 45, 16)
    got = torch_path(op_arguments(q, k, v, enable_gqa=True), grad_out)
    want = reference(q, k, v, grad_out)
    check(got, want)
    # The reference's grouping is SDPA's enable_gqa: both in float64.
    sdpa = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    torch.testing.assert_close(want["out"], sdpa)


WINDOWS = [(3, -1), (-1, 2), (0, 0), (5, 5), (20, 0), (0, -1), (100, 100)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(70, 70), (33, 90), (90, 33)])
def test_windows(window, seqlen_q, seqlen_k):
    q, k, v, grad_out = inputs(1, 2, 2, seqlen_q, seqlen_k, 16)
    args = op_arguments(q, k, v, window_size=window)
    got = torch_path(args, grad_out)
    want = reference(q, k, v, grad_out, window_left=window[0], window_right=window[1])
    check(finite_lse(got), finite_lse(want))


def test_small_key_tiles_skip_tiles_outside_the_band():
    q, k, v, grad_out = inputs(2, 2, 1, 90, 70, 16)
    args = op_arguments(q, k, v, window_size=(7, 3), enable_gqa=True)
    options = {**args._asdict(), "tile_k": 8}
    q4, k4, v4 = (options.pop(name) for name in ("q", "k", "v"))
    out, lse = torch_impl.attention_forward(q4, k4, v4, **options)
    grads = torch_impl.attention_backward(grad_out, q4, k4, v4, out, lse, **options)
    got = dict(zip(["out", "lse", "dq", "dk", "dv"], (out, lse, *grads), strict=True))
    check(finite_lse(got), finite_lse(reference(q, k, v, grad_out, window_left=7, window_right=3)))


@pytest.mark.parametrize("make_bias", [causal_lower_right, causal_upper_left])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(20, 50), (50, 20), (31, 31)])
def test_causal_bias(make_bias, seqlen_q, seqlen_k):
    q, k, v, grad_out = inputs(2, 2, 2, seqlen_q, seqlen_k, 16)
    bias = make_bias(seqlen_q, seqlen_k)
    args = op_arguments(q, k, v, bias)
    lower_right = make_bias is causal_lower_right
    assert (args.window_right, args.diagonal_offset) == (0, seqlen_k - seqlen_q if lower_right else 0)
    got = torch_path(args, grad_out)
    want = reference(q, k, v, grad_out, window_right=0, diagonal_offset=args.diagonal_offset)
    check(finite_lse(got), finite_lse(want))
    # The reference's alignment is the CausalBias's in SDPA: both in float64.
    sdpa = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias)
    torch.testing.assert_close(want["out"], sdpa)


def test_causal_window_is_aligned_like_its_causal_mask():
    """window_size with causal_lower_right: the band ends on the bottom-right diagonal."""
    q, k, v, grad_out = inputs(1, 2, 2, 20, 50, 16)
    args = op_arguments(q, k, v, causal_lower_right(20, 50), window_size=(6, 4))
    assert (args.window_left, args.window_right, args.diagonal_offset) == (6, 0, 30)
    check(torch_path(args, grad_out), reference(q, k, v, grad_out, window_left=6, window_right=0,
                                                diagonal_offset=30))  # fmt: skip


MASK_SHAPES = [(1, 1, 29, 41), (29, 41), (2, 1, 29, 41), (1, 3, 1, 41), (2, 3, 29, 1), (2, 3, 29, 41), (41,)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_masks(shape, kind):
    q, k, v, grad_out = inputs(2, 3, 3, 29, 41, 16)
    generator = torch.Generator().manual_seed(1)
    if kind == "bool":
        mask = torch.rand(shape, generator=generator) > 0.3
    else:
        dropped = torch.rand(shape, generator=generator) < 0.2
        mask = torch.randn(shape, generator=generator).masked_fill(dropped, float("-inf"))
    got = torch_path(op_arguments(q, k, v, mask), grad_out)
    want = reference(q, k, v, grad_out, attn_mask=mask)
    check(finite_lse(got), finite_lse(want))
    if mask.dim() >= 2:  # SDPA takes masks of 2 dims or more
        sdpa_mask = mask if kind == "bool" else mask.double()
        sdpa = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=sdpa_mask)
        torch.testing.assert_close(want["out"], sdpa.nan_to_num())  # the reference's broadcast is SDPA's


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    q, k, v, grad_out = inputs(1, 2, 2, 8, 12, 16)
    mask = torch.ones(8, 12, dtype=torch.bool)
    mask[3] = False
    got = torch_path(op_arguments(q, k, v, mask), grad_out)
    assert (got["out"][:, :, 3] == 0).all() and (got["lse"][:, :, 3] == float("-inf")).all()
    assert torch.isfinite(got["dq"]).all() and (got["dq"][:, :, 3] == 0).all()
    check(finite_lse(got), finite_lse(reference(q, k, v, grad_out, attn_mask=mask)))


def test_mask_of_the_query_dtype_and_float32():
    q, k, v, grad_out = inputs(1, 2, 2, 10, 12, 16)
    mask = torch.randn(10, 12)
    half = [t.half() for t in (q, k, v)]
    for m in (mask.half(), mask):
        args = op_arguments(*half, m)
        out, _ = torch_impl.attention_forward(
            args.q, args.k, args.v, attn_mask=args.attn_mask, scale=args.scale
        )
        want = reference(*half, grad_out, attn_mask=m)["out"]
        assert_close([("out", out, want)], torch.float16)


def dropout_scale(args: OpArguments) -> torch.Tensor:
    """The full (B, Hq, Tq, Tk) dropout scale of args' problem, as the kernels and the torch path draw it."""
    batch, heads, seqlen_q, _ = args.q.shape
    seqlen_k = args.k.shape[2]
    dropout = Dropout.dense(args.dropout_p, args.rng_state, heads, seqlen_q, seqlen_k)
    return dropout.scale_tile(batch, heads, range(seqlen_q), range(seqlen_k))


def test_dropout_matches_reference_with_the_same_mask():
    q, k, v, grad_out = inputs(2, 2, 2, 50, 70, 16)
    torch.manual_seed(0)
    args = op_arguments(q, k, v, dropout_p=0.3)
    scale = dropout_scale(args)
    assert abs((scale == 0).double().mean().item() - effective_p(0.3)) < 0.02
    check(torch_path(args, grad_out), reference(q, k, v, grad_out, dropout_scale=scale))


def test_dropout_follows_torch_manual_seed():
    q, k, v, grad_out = inputs(1, 2, 2, 30, 30, 16)
    results = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        results.append(torch_path(op_arguments(q, k, v, dropout_p=0.2), grad_out))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    assert not torch.equal(results[0]["out"], results[2]["out"])


def test_philox_is_tritons_randint4x():
    """Known values of Triton's tl.randint4x(seed, offset) (Philox4x32-10, seed 1234, offsets 0..3 and
    2**32 + 7: its four outputs each), which the kernels draw: the PyTorch path must drop the same
    probabilities."""
    counters = torch.tensor([0, 1, 2, 3, 2**32 + 7])
    got = torch.stack(philox(torch.tensor(1234), counters), -1)
    assert got.tolist() == PHILOX4X_1234


PHILOX4X_1234 = [  # from tl.randint4x, Triton 3.9
    [546353992, 3665621163, 1140953199, 3419031310],
    [2666454581, 482218876, 4196888723, 343858512],
    [1070188760, 4228315704, 3424062247, 2300394257],
    [3055983166, 599211371, 1926069095, 3900454750],
    [1425943112, 3396949509, 1492197842, 3855575411],
]


def test_p_is_rounded_to_256ths_and_the_scale_keeps_the_expectation():
    """p drops bytes below round(p * 256): the nearest multiple of 1/256, at least 1/256 and at most 255/256
    for 0 < p < 1 (never no dropout, never all), exactly 0 and 1 at the ends; kept ones are scaled by
    1 / (1 - effective p), so the expected scale of a probability is 1."""
    for dropout_p in (1e-4, 0.01, 0.1, 0.3, 0.5, 0.9, 0.999, 1 - 1e-9):
        nearest = min(range(1, 256), key=lambda t: abs(t / 256 - dropout_p))
        assert threshold(dropout_p) == nearest and effective_p(dropout_p) == nearest / 256
        assert (1 - effective_p(dropout_p)) * kept_scale(dropout_p) == pytest.approx(1.0, rel=1e-15)
    assert (threshold(0.0), kept_scale(0.0)) == (0, 1.0)
    assert (threshold(1.0), kept_scale(1.0)) == (256, 0.0)  # every byte is below 256


def test_sixteen_adjacent_keys_share_one_philox_call():
    """Key j of a row takes byte j % 16 of the call at offset + row * ceil(Tk / 16) + j // 16 (rows padded
    to whole calls), the call's four 32-bit outputs laid out little-endian in order; whatever tile of keys
    asks, every ragged tile of a row reads the same bytes."""
    rng = torch.tensor([1234, 5])
    dropout = Dropout.dense(0.5, rng, heads=2, seqlen_q=3, seqlen_k=40)
    assert (dropout.stride_b, dropout.stride_h, dropout.stride_i) == (18, 9, 3)
    whole = dropout.scale_tile(2, 2, range(3), range(40))
    outputs = torch.stack(philox(rng[0], torch.arange(36) + 5), -1)  # (calls, 4) uint32 values in int64
    little_endian = outputs.contiguous().view(torch.uint8).view(36, 4, 8)[..., :4]  # each int64's low bytes
    random_bytes = little_endian.reshape(2, 2, 3, 48)[..., :40].long()
    assert torch.equal(whole, (random_bytes >= 128).float() * 2.0)
    for start, stop in ((0, 3), (3, 40), (15, 17), (16, 32), (20, 39)):
        tile = dropout.scale_tile(2, 2, range(1, 3), range(start, stop))
        assert torch.equal(tile, whole[:, :, 1:, start:stop])


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_within_a_binomial_bound(dropout_p):
    """Over 2 x 4 x 128 x 257 probabilities, the kept fraction and that of each byte of the Philox calls
    (keys j % 16) lie within 5 standard deviations of 1 - effective p, and the mean scale within as many
    of 1 (the expectation dropout keeps)."""
    torch.manual_seed(0)
    dropout = Dropout.dense(dropout_p, draw_rng(torch.device("cpu")), 4, 128, 257)
    scale = dropout.scale_tile(2, 4, range(128), range(257))
    kept, dropped = scale != 0, effective_p(dropout_p)
    for sample in (kept, *(kept[..., j::16] for j in range(16))):
        bound = 5 * (dropped * (1 - dropped) / sample.numel()) ** 0.5
        assert abs(sample.double().mean().item() - (1 - dropped)) <= bound
    bound = 5 * (dropped / (1 - dropped) / scale.numel()) ** 0.5  # the scale's variance: p / (1 - p)
    assert abs(scale.double().mean().item() - 1.0) <= bound


def test_dropout_p_one_drops_everything_as_sdpa_does():
    """dropout_p=1: output and gradients 0, as SDPA's; the log-sum-exp is the softmax's, as without
    dropout."""
    q, k, v, grad_out = inputs(2, 2, 2, 20, 35, 16)
    results = []
    for attention, options in ((flash_attention, {"return_lse": True}), (F.scaled_dot_product_attention, {})):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        result = attention(*leaves, dropout_p=1.0, is_causal=True, **options)
        out = result[0] if isinstance(result, tuple) else result
        out.backward(grad_out)
        results.append((result, [out.detach(), *(t.grad for t in leaves)]))
    (_, lse), got = results[0]
    for g, w in zip(got, results[1][1], strict=True):
        assert torch.equal(g, w) and not w.any()
    _, undropped = flash_attention(q, k, v, is_causal=True, return_lse=True)
    torch.testing.assert_close(lse.detach(), undropped)


def test_draw_rng_uses_the_default_generator():
    torch.manual_seed(3)
    first = draw_rng(torch.device("cpu"))
    torch.manual_seed(3)
    assert torch.equal(first, draw_rng(torch.device("cpu")))
    assert first.dtype == torch.int64 and first.shape == (2,)


def test_mask_and_dropout_together():
    q, k, v, grad_out = inputs(2, 4, 2, 33, 47, 16)
    mask = torch.randn(2, 1, 33, 47)
    torch.manual_seed(1)
    args = op_arguments(q, k, v, mask, dropout_p=0.25, enable_gqa=True)
    want = reference(q, k, v, grad_out, attn_mask=mask, dropout_scale=dropout_scale(args))
    check(torch_path(args, grad_out), want)


def test_gqa_window_and_causal_together():
    q, k, v, grad_out = inputs(2, 8, 2, 75, 75, 16)
    args = op_arguments(q, k, v, is_causal=True, enable_gqa=True, window_size=(9, -1))
    assert (args.window_left, args.window_right, args.diagonal_offset) == (9, 0, 0)
    check(torch_path(args, grad_out), reference(q, k, v, grad_out, window_left=9, window_right=0))


def test_gradient_through_lse():
    q, k, v, grad_out = inputs(1, 4, 2, 20, 26, 16)
    grad_lse = torch.randn(1, 4, 20)
    args = op_arguments(q, k, v, is_causal=True, enable_gqa=True)
    check(
        torch_path(args, grad_out, grad_lse), reference(q, k, v, grad_out, window_right=0, grad_lse=grad_lse)
    )


def test_three_dim_inputs_are_heads():
    q, k, v, grad_out = inputs(1, 4, 2, 20, 26, 16)
    args = op_arguments(q[0], k[0], v[0], enable_gqa=True)
    assert args.q.shape == (1, 4, 20, 16) and args.k.shape == (1, 2, 26, 16)
    check(torch_path(args, grad_out), reference(q, k, v, grad_out))


def test_more_leading_dims_and_a_mask_over_them():
    q, k, v, grad_out = inputs(6, 2, 2, 12, 14, 16)
    shape = lambda t: t.reshape(2, 3, *t.shape[1:])  # noqa: E731
    mask = torch.rand(2, 1, 1, 12, 14) > 0.2
    args = op_arguments(shape(q), shape(k), shape(v), mask)
    assert args.attn_mask.shape == (6, 1, 12, 14)
    full_mask = mask.expand(2, 3, 1, 12, 14).reshape(6, 1, 12, 14)
    check(
        finite_lse(torch_path(args, grad_out)), finite_lse(reference(q, k, v, grad_out, attn_mask=full_mask))
    )


def packed(lengths_q, lengths_k, q_heads, kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = randn(total_q, q_heads, head_dim, generator=generator)
    k = randn(total_k, kv_heads, head_dim, generator=generator)
    v = randn(total_k, kv_heads, head_dim, generator=generator)
    grad_out = randn(total_q, q_heads, head_dim, generator=generator)
    cumulative = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, grad_out, cumulative(lengths_q), cumulative(lengths_k)


@pytest.mark.parametrize(("is_causal", "window"), [(False, None), (True, None), (False, (4, 2))])
def test_varlen_equals_each_sequence_alone(is_causal, window):
    lengths_q, lengths_k = [13, 1, 40, 0, 22], [13, 5, 31, 3, 22]
    q, k, v, grad_out, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16)
    args = varlen_op_arguments(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=is_causal,
                               window_size=window, enable_gqa=True)  # fmt: skip
    got = torch_path(args, grad_out)
    assert got["out"].shape == q.shape and got["lse"].shape == q.shape[:-1]
    band = {"window_left": args.window_left, "window_right": args.window_right}
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        as_4d = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
        want = reference(as_4d(q[rows]), as_4d(k[keys]), as_4d(v[keys]), as_4d(grad_out[rows]), **band)
        mine = {name: as_4d(got[name][rows if name in ("out", "lse", "dq") else keys])
                for name in ("out", "dq", "dk", "dv")}  # fmt: skip
        mine["lse"] = got["lse"][rows].transpose(0, 1).unsqueeze(0)
        check(finite_lse(mine), finite_lse(want))


def test_varlen_dropout_follows_the_seed():
    q, k, v, grad_out, cu_q, cu_k = packed([10, 20], [15, 20], 2, 2, 16)
    results = []
    for _ in range(2):
        torch.manual_seed(9)
        results.append(torch_path(varlen_op_arguments(q, k, v, cu_q, cu_k, 20, 20, dropout_p=0.5), grad_out))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    no_dropout = torch_path(varlen_op_arguments(q, k, v, cu_q, cu_k, 20, 20), grad_out)
    assert not torch.allclose(results[0]["out"], no_dropout["out"])


def _qkv(q_heads=4, kv_heads=4, seqlen_q=8, seqlen_k=8):
    return inputs(2, q_heads, kv_heads, seqlen_q, seqlen_k, 16)[:3]


BAD_INPUTS = [
    ("attn_mask of shape \\(3, 9\\) does not broadcast", lambda: (_qkv(), {"attn_mask": torch.ones(3, 9)})),
    ("attn_mask.dtype is torch.int32", lambda: (_qkv(), {"attn_mask": torch.ones(8, 8, dtype=torch.int32)})),
    (
        "attn_mask.dtype is torch.float64",
        lambda: (_qkv(), {"attn_mask": torch.ones(8, 8, dtype=torch.float64)}),
    ),
    ("attn_mask and is_causal=True", lambda: (_qkv(), {"attn_mask": torch.ones(8, 8), "is_causal": True})),
    ("attn_mask is a CausalBias for", lambda: (_qkv(), {"attn_mask": causal_lower_right(8, 9)})),
    ("window_size=\\(-2, 0\\)", lambda: (_qkv(), {"window_size": (-2, 0)})),
    ("window_size must be None or a pair", lambda: (_qkv(), {"window_size": (1, 2, 3)})),
    ("window_size must be None or a pair", lambda: (_qkv(), {"window_size": 4})),
    ("need enable_gqa=True", lambda: (_qkv(4, 2), {})),
    ("must divide the number of heads in query", lambda: (_qkv(6, 4), {"enable_gqa": True})),
    ("dropout_p must be in \\[0, 1\\], got 1.5", lambda: (_qkv(), {"dropout_p": 1.5})),
    ("dropout_p must be in \\[0, 1\\], got -0.1", lambda: (_qkv(), {"dropout_p": -0.1})),
    ("attn_mask requires grad", lambda: (_qkv(), {"attn_mask": torch.zeros(8, 8, requires_grad=True)})),
    ("dropout_p must be a Python float", lambda: (_qkv(), {"dropout_p": torch.tensor(0.1)})),
    ("enable_gqa must be a bool", lambda: (_qkv(), {"enable_gqa": 1})),
    (
        "key's batch dims",
        lambda: ((torch.randn(2, 2, 4, 8), torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)), {}),
    ),
    ("query.dtype is torch.float64", lambda: (tuple(t.double() for t in _qkv()), {})),
]


@pytest.mark.parametrize(("message", "make"), BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_input_names_the_argument(message, make):
    tensors, kwargs = make()
    with pytest.raises((ValueError, TypeError), match=message):
        op_arguments(*tensors, **kwargs)


def _packed_args(**change):
    q, k, v, _, cu_q, cu_k = packed([3, 5], [4, 4], 2, 2, 16)
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5,
            "max_seqlen_k": 4}  # fmt: skip
    return {**args, **change}


BAD_VARLEN = [
    ("cu_seqlens_q.dtype is torch.int64", {"cu_seqlens_q": torch.tensor([0, 3, 8])}),
    (
        "cu_seqlens_k must start at 0 and be non-decreasing",
        {"cu_seqlens_k": torch.tensor([0, 6, 4, 8][:3], dtype=torch.int32)},
    ),
    ("cu_seqlens_q ends at 7 but q has 8 rows", {"cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32)}),
    (
        "cu_seqlens_q must have shape \\(batch \\+ 1,\\)",
        {"cu_seqlens_q": torch.tensor([0], dtype=torch.int32)},
    ),
    ("max_seqlen_q=4 is below the longest sequence", {"max_seqlen_q": 4}),
    ("q must have 3 dims", {"q": torch.randn(1, 8, 2, 16)}),
    (
        "cu_seqlens_q holds 2 sequences but cu_seqlens_k 1",
        {"cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)},
    ),
]


@pytest.mark.parametrize(("message", "change"), BAD_VARLEN, ids=[m for m, _ in BAD_VARLEN])
def test_bad_varlen_input_names_the_argument(message, change):
    with pytest.raises((ValueError, TypeError), match=message):
        varlen_op_arguments(**_packed_args(**change))


def test_cu_seqlens_values_on_cpu_are_checked_on_every_call(monkeypatch):
    """Reading a CPU cu_seqlens costs no wait (only a CUDA one's values are read once per version): an
    unchanged tensor is read on every call, and a change that bumps no version is refused."""
    reads = []
    monkeypatch.setattr(_validation, "cu_seqlens_values", lambda cu: reads.append(cu) or cu.tolist())
    args = _packed_args()
    for _ in range(3):
        varlen_op_arguments(**args)
    assert len(reads) == 6  # cu_seqlens_q and cu_seqlens_k, each call
    args["cu_seqlens_k"].data[1] = 9
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0 and be non-decreasing"):
        varlen_op_arguments(**args)


def public_gradients(out: torch.Tensor, leaves, grad_out: torch.Tensor) -> dict:
    grads = torch.autograd.grad(out, leaves, grad_out)
    return dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *grads), strict=True))


def leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def test_flash_attention_takes_every_feature_through_its_op():
    q, k, v, grad_out = inputs(2, 4, 2, 33, 47, 16)
    mask = torch.randn(2, 1, 33, 47)
    torch.manual_seed(4)
    out, lse = flash_attention(
        *leaves(q, k, v), mask, 0.2, enable_gqa=True, window_size=(10, 3), return_lse=True
    )
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    torch.manual_seed(4)
    args = op_arguments(q, k, v, mask, 0.2, enable_gqa=True, window_size=(10, 3))
    want = reference(q, k, v, grad_out, attn_mask=mask, window_left=10, window_right=3,
                     dropout_scale=dropout_scale(args))  # fmt: skip
    torch.manual_seed(4)
    inputs_ = leaves(q, k, v)
    out = flash_attention(*inputs_, mask, 0.2, enable_gqa=True, window_size=(10, 3))
    check(public_gradients(out, inputs_, grad_out), {n: want[n] for n in ("out", "dq", "dk", "dv")})


def test_flash_attention_matches_sdpa_for_gqa_and_masks():
    q, k, v, grad_out = inputs(2, 6, 2, 30, 40, 16)
    mask = torch.rand(2, 1, 30, 40) > 0.3
    ours, theirs = leaves(q, k, v), leaves(q, k, v)
    got = public_gradients(flash_attention(*ours, mask, enable_gqa=True), ours, grad_out)
    want = public_gradients(F.scaled_dot_product_attention(*theirs, mask, enable_gqa=True), theirs, grad_out)
    assert_close([(name, got[name], want[name].double()) for name in got], torch.float32)


def test_flash_attention_dropout_is_reproducible_with_manual_seed():
    q, k, v, grad_out = inputs(1, 2, 2, 20, 20, 16)
    results = []
    for _ in range(2):
        torch.manual_seed(7)
        tensors = leaves(q, k, v)
        results.append(public_gradients(flash_attention(*tensors, dropout_p=0.5), tensors, grad_out))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_flash_attention_varlen_through_its_op():
    lengths_q, lengths_k = [9, 30, 4], [12, 25, 4]
    q, k, v, grad_out, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 1, 16)
    tensors = leaves(q, k, v)
    out = flash_attention_varlen(*tensors, cu_q, cu_k, 30, 25, is_causal=True, enable_gqa=True)
    got = public_gradients(out, tensors, grad_out)
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = leaves(q[rows], k[keys], v[keys])
        want_out = flash_attention(*(t.transpose(0, 1) for t in alone), is_causal=True, enable_gqa=True)
        want = public_gradients(want_out.transpose(0, 1), alone, grad_out[rows])
        for name, part in (("out", rows), ("dq", rows), ("dk", keys), ("dv", keys)):
            torch.testing.assert_close(got[name][part], want[name], atol=1e-5, rtol=1e-5)


def test_compiled_with_features_has_no_graph_break():
    q, k, v, _ = inputs(2, 4, 2, 24, 24, 16)
    mask = torch.randn(24, 24)

    def attend(q, k, v):
        return flash_attention(q, k, v, mask, enable_gqa=True, window_size=(5, 0)).sum()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(attend)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))
    torch._dynamo.reset()
