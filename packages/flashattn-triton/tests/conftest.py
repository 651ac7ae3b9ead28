"""Shared helpers: random attention problems, their float64 reference and the error bounds."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_triton
from flashattn_triton import _configs, _inputs, reference_attention, reference_logsumexp, triton_impl

# Floors of the (relative Frobenius error, max error relative to max |reference|) allowed per dtype for
# O, L and each gradient; typical: float32 ~5e-7, float16 ~1e-3, bfloat16 ~1e-2 (max-norm, d = 128).
# A bug (a key tile missed, a mask off by one) costs at least ~1/Tk, far above these.
BOUNDS = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 6e-3),
    torch.bfloat16: (2.5e-2, 3e-2),
}
# Ill-conditioned problems (a peaked softmax makes dS = P (dP - D) a small difference of large terms)
# lose accuracy in any implementation, FlashAttention's P = exp(S - L) a little more than a softmax;
# the bound then grows to this many times the error of naive attention in the input dtype.
BASELINE_FACTOR = 10.0
NAMES = ["out", "lse", "dq", "dk", "dv"]


@dataclasses.dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    is_causal: bool
    scale: float | None
    reference: dict[str, torch.Tensor]  # float64, from the dtype-rounded inputs, by NAMES
    baseline: dict[str, tuple[float, float]]  # errors of naive attention in the input dtype

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh leaf copies of q, k, v that keep their strides, with requires_grad."""
        return tuple(_same_layout(t) for t in (self.q, self.k, self.v))

    def check(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              lse: torch.Tensor | None = None) -> None:
        """out (and lse) from the forward, q/k/v after out.backward(grad_out): all within bounds."""
        assert out.shape == self.q.shape and out.dtype == self.q.dtype
        got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.shape == self.q.shape[:-1]
            got["lse"] = lse
        self.assert_close(got)

    def assert_close(self, got: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """Each tensor of got (named as in NAMES) against the reference; dtype's bounds (default q's)."""
        assert_close([(name, value, self.reference[name]) for name, value in got.items()],
                     dtype or self.q.dtype, self.baseline)


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t).requires_grad_()


def relative_errors(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> tuple[float, float]:
    """(|got - want| / |want|, max|got - want| / max|want|), with |want| taken as at least ``floor`` per
    element. A reference that is exactly 0 up to rounding (dQ and dK with a single key) is measured against
    values of size 1, the scale of the inputs: rounding leaves a cancellation residue there, not a relative
    error."""
    diff = got.double() - want
    floor = 1.0 if want.abs().max().item() < 1e-6 else floor
    fro = diff.norm() / max(want.norm().item(), floor * want.numel() ** 0.5)
    worst = diff.abs().max() / max(want.abs().max().item(), floor)
    return fro.item(), worst.item()


def _error_floor(name: str) -> float:
    """An lse near 0 is a cancellation of its parts (the row max and the log of the row sum), which round
    relative to themselves: its error is measured against the scale of the scores, 1."""
    return 1.0 if name == "lse" else 0.0


def assert_close(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                 baseline: dict[str, tuple[float, float]] | None = None) -> None:
    """Every (name, got, float64 reference) within BOUNDS[dtype], or BASELINE_FACTOR x baseline[name]."""
    report = []
    for name, got, want in pairs:
        assert got is not None, f"{name} is missing"
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        fro, worst = relative_errors(got, want, floor=_error_floor(name))
        fro_bound, max_bound = BOUNDS[dtype]
        if baseline and name in baseline:
            fro_bound = max(fro_bound, BASELINE_FACTOR * baseline[name][0])
            max_bound = max(max_bound, BASELINE_FACTOR * baseline[name][1])
        report.append(f"{name}: {fro:.2e} / {worst:.2e}")
        assert fro <= fro_bound and worst <= max_bound, (
            f"{name} off for {dtype}: relative error {fro:.2e} (bound {fro_bound:.1e}), max-norm {worst:.2e} "
            f"(bound {max_bound:.1e}); all: {'; '.join(report)}")


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, layout: str, generator: torch.Generator
) -> torch.Tensor:
    """Normal random (..., T, d) in one of the layouts: contiguous, 'transposed' (T ahead of the
    leading dims in memory, like (B, T, H, d).transpose(1, 2)) or 'padded' (rows of a wider tensor)."""

    def randn(size: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(size, generator=generator, device=device).to(dtype)

    if layout == "contiguous":
        return randn(shape)
    if layout == "transposed":
        return randn((shape[-2], *shape[:-2], shape[-1])).movedim(0, -2)
    if layout == "padded":
        return randn((*shape[:-1], shape[-1] + 8))[..., : shape[-1]]
    raise ValueError(f"unknown layout {layout!r}")


def make_problem(
    lead: tuple[int, ...],
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    dtype: torch.dtype,
    is_causal: bool,
    device: str = "cpu",
    layout: str = "contiguous",
    scale: float | None = None,
    seed: int | None = None,
) -> Problem:
    """Fresh random inputs (seeded from `seed`, or at random) and the float64 reference for them."""
    generator = torch.Generator(device=device)
    generator.manual_seed(random.randrange(2**31) if seed is None else seed)
    q = random_tensor((*lead, seqlen_q, head_dim), dtype, device, layout, generator)
    k = random_tensor((*lead, seqlen_k, head_dim), dtype, device, layout, generator)
    v = random_tensor((*lead, seqlen_k, head_dim), dtype, device, layout, generator)
    grad_out = torch.randn((*lead, seqlen_q, head_dim), generator=generator, device=device).to(dtype)
    reference = _attention_and_gradients(q, k, v, grad_out, is_causal, scale, torch.float64)
    naive = _attention_and_gradients(q, k, v, grad_out, is_causal, scale, dtype)
    baseline = {name: relative_errors(naive[name], reference[name], _error_floor(name)) for name in NAMES}
    return Problem(q, k, v, grad_out, is_causal, scale, reference, baseline)


def _attention_and_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, is_causal: bool,
    scale: float | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Naive attention's O, L and gradients, computed in dtype."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, is_causal, scale)
    out.backward(grad_out.to(dtype))
    lse = reference_logsumexp(q.detach(), k.detach(), is_causal, scale)
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.fixture(autouse=True, scope="session")
def tuning_cache_of_the_session(tmp_path_factory):
    """Tuned choices go to a directory of this test session's, not to the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHATTN_TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("tuning-cache")))
        yield


@pytest.fixture
def matmul_precision():
    """torch.set_float32_matmul_precision for the rest of the test: the precision it started with comes back
    at its end."""
    previous = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(previous)


@pytest.fixture
def full_float32_precision(matmul_precision):
    """float32 matmuls in full precision for the test, whatever precision it started with."""
    matmul_precision("highest")


@pytest.fixture
def in_place_outputs(monkeypatch) -> list[bool]:
    """For each output or gradient the kernels write through _inputs.kernel_output, in call order: whether
    they write it in place (their tensor is a view of it) rather than into one copied back after."""
    in_place = []
    kernel_output = _inputs.kernel_output

    def recording(out, *args):
        x4 = kernel_output(out, *args)
        in_place.append(x4.data_ptr() == out.data_ptr())
        return x4

    monkeypatch.setattr(_inputs, "kernel_output", recording)
    return in_place


# SM counts a persistent Gluon kernel is also run with, so that a test problem's few work items make
# several a program: one program (every item in turn) and 5 (a last round that leaves programs out).
FEW_SMS = (1, 5)


@pytest.fixture
def hopper_configs(monkeypatch):
    """hopper_configs(pass_name, head_dim) yields the Gluon kernel's candidates for pass_name ("fwd" or
    "bwd") and head_dim, each persistent one again with plans made for FEW_SMS streaming multiprocessors
    (_sm_count patched, in a plan cache of its own), one at a time (through monkeypatch: undone after the
    test, however it ends)."""

    def configs(pass_name: str, head_dim: int):
        own_count, own_plans = triton_impl._sm_count, triton_impl._plans  # (the test's, when it asks)
        for config in _configs.hopper_candidates(pass_name, head_dim, per_kv_head=True):
            for sm_count in (None, *FEW_SMS) if config.persistent else (None,):
                few = (lambda device, n=sm_count: n) if sm_count is not None else None
                monkeypatch.setattr(triton_impl, "_sm_count", few or own_count)
                monkeypatch.setattr(triton_impl, "_plans", {} if few else own_plans)
                yield config

    return configs


@pytest.fixture
def problem():
    """make_problem(lead, seqlen_q, seqlen_k, head_dim, dtype, is_causal, device=, layout=, scale=)."""
    return make_problem




def _assert_tf32_parts(parts: torch.Tensor, x4: torch.Tensor) -> None:
    """parts (2Z, H, T, d) are x4 (Z, H, T, d) split exactly, their high halves exact in TF32."""
    high, low = parts[: x4.shape[0]], parts[x4.shape[0] :]
    assert not (high.contiguous().view(torch.int32) & 8191).any()  # 10 mantissa bits: exact in TF32
    assert torch.equal(high + low, x4)  # nothing lost


@pytest.fixture
def assert_tf32_parts():
    """_assert_tf32_parts(parts, x4)."""
    return _assert_tf32_parts


class Block(nn.Module):
    """A pre-norm Transformer block (nanoGPT's) with a pluggable attention function."""

    def __init__(self, attention, d_model: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.attention, self.heads = attention, heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seqlen, d_model = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seqlen, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seqlen, d_model)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


def _block_step(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The block's output and the gradients of its squared sum for its parameters and x."""
    out = block(x)
    grads = torch.autograd.grad(out.square().sum(), [*block.parameters(), x])
    return out, list(grads)


class CountingBackend:
    """A torch.compile backend (`backend`: aot_eager, or inductor) that records the compilations it serves:
    (frame, compile) ids, a restart of Dynamo's analysis of one frame counting once."""

    def __init__(self, backend: str = "aot_eager") -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.compilations: set[tuple[int, int]] = set()

    def __call__(self, graph_module, example_inputs):
        compile_id = torch._guards.CompileContext.current_compile_id()
        self.compilations.add((compile_id.frame_id, compile_id.frame_compile_id))
        return self.backend(graph_module, example_inputs)


@pytest.fixture
def blocks():
    """Block (a Transformer block taking an attention function), step(block, x) -> (out, gradients) and
    CountingBackend, for the compile tests."""
    return types.SimpleNamespace(Block=Block, step=_block_step, CountingBackend=CountingBackend)


def _check_infinities(device: str, where: str, is_causal: bool) -> None:
    """±inf in K or V at full float32 accuracy (TF32 parts): the rows that see that key are not finite, as
    SDPA's; every other row is right (the split once made inf - inf = NaN, which reached the whole head)."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 2, 130, 32, generator=generator, device=device) for _ in range(3))
    # Head 0 stays finite. In V, at key 0, which every row sees: a causal row that does not see an infinite
    # value of V can still meet it as 0 * inf in its diagonal tile's P V, as in FlashAttention's kernels.
    if where == "k":
        k[0, 1, 90, 3] = float("inf")
    else:
        v[0, 1, 0, 3] = float("inf")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        out = flashattn_triton.flash_attention(q, k, v, is_causal=is_causal)
    finally:
        torch.set_float32_matmul_precision(previous)
    # SDPA's float64 reference from its CPU flash kernel, which skips masked keys as the kernels do: on
    # CUDA float64 runs SDPA's math backend, which adds -inf to masked scores, and a masked +inf score
    # (a row before key 90 in K) then gives NaN there.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t.double().cpu() for t in (q, k, v)), is_causal=is_causal).to(device)  # fmt: skip
    spoiled = ~torch.isfinite(want).all(-1)
    # The rows that see an infinite key with a score of +inf, by definition (-inf gives that key weight 0).
    visible = torch.ones(130, 130, dtype=torch.bool, device=device)
    visible = visible.tril() if is_causal else visible
    scores = torch.where(visible, q.double() @ k.double().transpose(-2, -1), 0.0)
    assert where == "v" or torch.equal(spoiled, (scores == float("inf")).any(-1))
    assert spoiled.any() and not spoiled.all()
    assert torch.equal(~torch.isfinite(out).all(-1), spoiled)
    torch.testing.assert_close(out[~spoiled].double(), want[~spoiled], atol=1e-5, rtol=1e-5)


@pytest.fixture
def check_infinities():
    """_check_infinities(device, where ("k" or "v"), is_causal)."""
    return _check_infinities


def _check_gradients_through_lse(device: str, seqlen: int = 11, dtype: torch.dtype = torch.float32) -> None:
    """flash_attention's (out, lse) both in the loss: gradients as float64 autograd through SDPA and
    reference_logsumexp give them (the backward adds lse's gradient to dS)."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 3, seqlen, 16, dtype=torch.float64, device=device, generator=generator)
               for _ in range(3))  # fmt: skip
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    q, k, v = (t.detach().double() for t in leaves)  # the reference from the rounded inputs
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        out, lse = flashattn_triton.flash_attention(*leaves, is_causal=True, return_lse=True)
        got = torch.autograd.grad((out * 0.5).sum() + lse.square().sum(), leaves)
    finally:
        torch.set_float32_matmul_precision(previous)
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = torch.nn.functional.scaled_dot_product_attention(*references, is_causal=True)
    want_lse = reference_logsumexp(*references[:2], is_causal=True)
    want = torch.autograd.grad((want_out * 0.5).sum() + want_lse.square().sum(), references)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=tolerance, rtol=tolerance)


@pytest.fixture
def check_gradients_through_lse():
    """_check_gradients_through_lse(device, seqlen=11, dtype=torch.float32)."""
    return _check_gradients_through_lse


def _sdpa_gqa_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                      grad_lse: torch.Tensor, is_causal: bool, scale: float | None = None) -> dict:
    """SDPA with enable_gqa=True in float64 on the same data: out, lse and the gradients of q, k, v for
    <out, grad_out> + <lse, grad_lse> (lse from the scores against K repeated per query head), by NAMES."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale,
                                                           enable_gqa=True)  # fmt: skip
    keys = leaves[1].repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    lse = reference_logsumexp(leaves[0], keys, is_causal, scale)
    grads = torch.autograd.grad([out, lse], leaves, [grad_out.double(), grad_lse.double()])
    return dict(zip(NAMES, (out.detach(), lse.detach(), *grads), strict=True))


@pytest.fixture
def sdpa_gqa():
    """_sdpa_gqa_float64(q, k, v, grad_out, grad_lse, is_causal, scale=None) -> float64 results by NAMES."""
    return _sdpa_gqa_float64


@pytest.fixture
def triton_interpreter() -> None:
    """Skips unless Triton's interpreter can run the kernels: Triton >= 3.9, whose interpreter handles their
    tensor descriptors (3.6's fails: 'only 0-dimensional arrays can be converted to Python scalars')."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails on the kernels' tensor descriptors; "
                    "the interpreter tests need Triton >= 3.9 (CI has it)")


def _sdpa_math(*args, **kwargs) -> torch.Tensor:
    """SDPA's math backend: its CPU flash backend gives 0 for a row of NaN scores, its math backend NaN."""
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def _outputs_and_gradients(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           grad_out: torch.Tensor | None = None, **kwargs) -> list[torch.Tensor]:  # fmt: skip
    """[O, dQ, dK, dV] of attention(q, k, v, **kwargs), for dO = grad_out (default: a fixed ramp)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, **kwargs)
    if grad_out is None:
        grad_out = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def _assert_like_sdpa(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each of O, dQ, dK, dV: NaN and ±inf where SDPA's are, and close to it elsewhere."""
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@pytest.fixture
def like_sdpa() -> types.SimpleNamespace:
    """For non-finite inputs: results(attention, q, k, v, grad_out=None, **kwargs) -> [O, dQ, dK, dV];
    sdpa, SDPA's math backend (an attention); check(got, want), NaN and ±inf where want's are."""
    return types.SimpleNamespace(results=_outputs_and_gradients, sdpa=_sdpa_math, check=_assert_like_sdpa)
