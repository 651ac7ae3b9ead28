"""The Triton kernels and the PyTorch path on a CUDA GPU: every dtype, head dim and mask, larger shapes."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import flashattn_triton
from flashattn_triton import (
    FlashAttentionTorch,
    FlashAttentionTriton,
    _configs,
    _hopper,
    _inputs,
    _launcher,
    flash_attention,
    ops,
    triton_impl,
)
from flashattn_triton._configs import BackwardConfig, ForwardConfig
from flashattn_triton._tuning import TUNING
from flashattn_triton.torch_impl import _backward_key_tile, _CompiledOnCuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [16, 32, 64, 96, 128, 256]
SHAPES = [
    ((2, 3), 300, 300),
    ((1,), 1024, 1024),
    ((2, 2), 129, 700),
    ((3,), 700, 129),
    ((1, 2, 2), 64, 64),
    ((2,), 1, 33),
    ((1, 2), 2048, 2048),
]
LAYOUTS = ["contiguous", "transposed", "padded"]
CASES = [
    (dtype, head_dim, is_causal, *SHAPES[i % len(SHAPES)], LAYOUTS[i % len(LAYOUTS)])
    for i, (dtype, head_dim, is_causal) in enumerate(itertools.product(DTYPES, HEAD_DIMS, [False, True]))
]


def case_id(case) -> str:
    dtype, head_dim, is_causal, lead, seqlen_q, seqlen_k, layout = case
    mask = "causal" if is_causal else "full"
    return f"{str(dtype)[6:]}-d{head_dim}-{mask}-{lead}-{seqlen_q}x{seqlen_k}-{layout}"


@pytest.fixture(autouse=True)
def float32_matmuls_in_full_precision_and_default_configs(monkeypatch, full_float32_precision):
    """Full float32 precision, each kernel's first candidate config unless a test asks for tuning
    (test_every_candidate covers the others; tuning them all in every test would only cost time), and
    no launch plans from earlier tests."""
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(triton_impl, "_plans", {})


def poison_allocator() -> None:
    """Fill the caching allocator's free memory with NaN, so anything a kernel fails to write shows."""
    block = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
    del block


@pytest.mark.parametrize("path", ["small", "small-kernel-built", "large"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_matches_float64_reference(problem, case, path, monkeypatch):
    """Every case on the small-problem path (as these are), with descriptors from the host and, as on GPUs
    before Hopper, from the kernels; and on the large-problem path."""
    if path == "small-kernel-built":
        monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    if path == "large":
        monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    dtype, head_dim, is_causal, lead, seqlen_q, seqlen_k, layout = case
    p = problem(lead, seqlen_q, seqlen_k, head_dim, dtype, is_causal, device="cuda", layout=layout)
    q, k, v = p.inputs()
    poison_allocator()
    out = FlashAttentionTriton.apply(q, k, v, is_causal=is_causal)
    (lse,) = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    out.backward(p.grad_out)
    p.check(out, q, k, v, lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_causal_sequence(problem, dtype):
    p = problem((1, 4), 4096, 4096, 128, dtype, True, device="cuda", scale=0.1)
    q, k, v = p.inputs()
    out = FlashAttentionTriton.apply(q, k, v, True, 0.1)
    out.backward(p.grad_out)
    p.check(out, q, k, v)


def test_float32_with_tf32_allowed(problem):
    """With TF32 matmuls allowed the kernels take TF32 products: float16's 10-bit mantissa and bounds."""
    torch.set_float32_matmul_precision("high")
    p = problem((2, 2), 500, 500, 64, torch.float32, True, device="cuda")
    q, k, v = p.inputs()
    out = FlashAttentionTriton.apply(q, k, v, True)
    out.backward(p.grad_out)
    p.assert_close({"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}, torch.float16)


def test_flash_attention_runs_triton_on_cuda(problem, monkeypatch):
    def no_torch_path(*args, **kwargs):
        raise AssertionError("the PyTorch path ran on CUDA")

    monkeypatch.setattr(ops.torch_impl, "attention_forward", no_torch_path)
    monkeypatch.setattr(ops.torch_impl, "attention_backward", no_torch_path)
    p = problem((2, 4), 257, 257, 64, torch.bfloat16, True, device="cuda")
    q, k, v = p.inputs()
    out = flash_attention(q, k, v, is_causal=True)
    out.backward(p.grad_out)
    p.check(out, q, k, v)


def test_flash_attention_under_autocast_takes_bfloat16():
    q, k, v = (torch.randn(2, 128, 64, device="cuda") for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flash_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_path_on_cuda_with_compiled_backward(problem, dtype):
    from flashattn_triton.torch_impl import _backward_step

    p = problem((2, 3), 333, 200, 64, dtype, True, device="cuda")
    q, k, v = p.inputs()
    out = FlashAttentionTorch.apply(q, k, v, is_causal=True)
    out.backward(p.grad_out)
    p.check(out, q, k, v)
    assert not _backward_step.failed, "torch.compile failed on this machine: the backward ran eagerly"


def test_compile_failure_falls_back_to_eager_once(monkeypatch, problem):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    step = _CompiledOnCuda(_backward_key_tile)
    x = torch.randn(1, 1, 1, 4, 16, device="cuda")  # (B, Hkv, group, T, d)
    lse, delta = torch.zeros(1, 1, 1, 4, device="cuda"), torch.zeros(1, 1, 1, 4, device="cuda")
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        first = step(x, x, x, x, x, x, lse, delta, 0.25, None, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = step(x, x, x, x, x, x, lse, delta, 0.25, None, None, None)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


def test_config_too_big_for_shared_memory_steps_down(problem, monkeypatch):
    steps = []
    monkeypatch.setattr(triton_impl, "smaller", lambda c: steps.append(c) or _configs.smaller(c))
    p = problem((1, 2), 512, 512, 128, torch.bfloat16, True, device="cuda")
    huge = ForwardConfig(256, 256, 8, 4)
    out, lse = triton_impl.triton_forward(p.q, p.k, p.v, True, 128**-0.5, config=huge)
    p.assert_close({"out": out, "lse": lse})
    assert steps and steps[0] == huge


EVERY_CANDIDATE = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64), (torch.float32, 128),
                   (torch.bfloat16, 256)]


@pytest.mark.parametrize(("dtype", "head_dim"), EVERY_CANDIDATE)
def test_every_candidate(problem, dtype, head_dim):
    """Every config the tuner may pick computes the same function (ragged, causal, Tq != Tk)."""
    p = problem((2, 3), 333, 290, head_dim, dtype, True, device="cuda")
    size = torch.empty((), dtype=dtype).element_size()
    scale = head_dim**-0.5
    forward = _configs.forward_candidates(head_dim, size, False)
    for config in _configs.with_split_key_tiles(forward, 1, 1 << 20, 1, 1):  # and each with split key tiles
        out, lse = triton_impl.triton_forward(p.q, p.k, p.v, True, scale, config)
        p.assert_close({"out": out, "lse": lse})
    for config in _configs.backward_candidates(head_dim, size, False):
        grads = triton_impl.triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, True, scale, config)
        p.assert_close({"dq": grads[0], "dk": grads[1], "dv": grads[2]})


@pytest.mark.parametrize("splits", [2, 3, 16])
def test_split_key_tiles_on_one_head(problem, splits):
    """The split forward at B·H = 1, where Triton specializes the head count as a constant."""
    p = problem((1,), 1000, 1000, 64, torch.bfloat16, True, device="cuda")
    config = ForwardConfig(64, 64, 4, 3, kv_splits=splits)
    out, lse = triton_impl.triton_forward(p.q, p.k, p.v, True, 64**-0.5, config)
    p.assert_close({"out": out, "lse": lse})


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a candidate that fails while tuning warns
@pytest.mark.parametrize("lead", [(1, 3), (1, 1)], ids=["heads-3", "heads-1"])
def test_autotuning_picks_a_candidate_and_stays_exact(problem, monkeypatch, lead):
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(TUNING, "chosen", {})
    seqlen = 1000 if lead[1] > 1 else 4096  # one head: short of programs, so split key tiles are offered
    p = problem(lead, seqlen, seqlen, 64, torch.bfloat16, True, device="cuda")
    q, k, v = p.inputs()
    out = FlashAttentionTriton.apply(q, k, v, True)
    out.backward(p.grad_out)
    p.check(out, q, k, v)
    chosen = {key[1][0]: config for key, config in TUNING.chosen.items()}  # (device, size key)
    forward = _configs.forward_candidates(64, 2, False)
    assert chosen["fwd"] in _configs.with_split_key_tiles(forward, 1 << 20, 1 << 20, 1, 1 << 20)
    assert chosen["bwd"] in _configs.backward_candidates(64, 2, False)


def test_tuning_times_the_gpu_not_the_host():
    """A call of two ~µs launches with 1 ms of host work between them (as a split forward has its partials
    and second launch between its launches): gpu_milliseconds counts the kernels alone, so configs are
    ranked by what they cost the GPU, not by the host's share of a call. The best of three, against half the
    host's share: under pytest -n 16 the other workers load the host and share the GPU (runs read 0.22 and
    0.24 ms); a timing that counted the host would read >= 1 ms every time."""
    import time

    x = torch.ones(1024, device="cuda")

    def host_bound() -> None:
        x.mul_(1.0)
        time.sleep(1e-3)
        x.mul_(1.0)

    assert min(_launcher.gpu_milliseconds(host_bound, 4) for _ in range(3)) < 0.5


def test_tuning_times_the_gpu_when_the_host_slows_down():
    """Fast calls while gpu_milliseconds sizes its sleep, then 0.3 ms of host work a call (a busy moment):
    the queue behind the sleep drains, and it queues again behind a longer one, so the time is still the
    kernel's (with one queue it was the host's, ~0.3 ms)."""
    import time

    x = torch.ones(1024, device="cuda")
    calls = 0

    def slowing_host() -> None:
        nonlocal calls
        calls += 1
        if calls > 2:  # (the first call compiles, the second sizes the sleep)
            time.sleep(3e-4)
        x.mul_(1.0)

    assert _launcher.gpu_milliseconds(slowing_host, 4) < 0.1


BACKWARD_VARIANTS = [
    BackwardConfig(32, 128, 8, 2, atomic_dq=True),
    BackwardConfig(64, 64, 4, 2, atomic_dq=True),
    BackwardConfig(64, 32, 4, 2),
    BackwardConfig(16, 64, 4, 3),
]


@pytest.mark.parametrize("config", BACKWARD_VARIANTS, ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float16, 128)])
def test_backward_variants(problem, config, dtype, head_dim):
    """dQ by atomics, and steps wider than the program's own tiles, on ragged causal problems."""
    p = problem((2, 3), 333, 290, head_dim, dtype, True, device="cuda")
    out, lse = triton_impl.triton_forward(p.q, p.k, p.v, True, head_dim**-0.5)
    grads = triton_impl.triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, True, head_dim**-0.5, config)
    p.assert_close({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})


FLOAT32_VARIANTS = [  # transposed gradients, one launch and two (decisions.md#fp32-split-backward)
    (BackwardConfig(32, 64, 4, 1, transposed_grads=True), 128),
    (BackwardConfig(32, 64, 4, 1, transposed_grads=True, split=True), 128),
    (BackwardConfig(32, 64, 4, 3, transposed_grads=True), 64),
    (BackwardConfig(32, 64, 4, 3, transposed_grads=True, split=True), 64),
]


@pytest.mark.parametrize(("config", "head_dim"), FLOAT32_VARIANTS, ids=str)
@pytest.mark.parametrize("host", [False, True], ids=["kernel-descriptors", "host-descriptors"])
def test_float32_transposed_backward(problem, monkeypatch, config, head_dim, host):
    """float32 at full accuracy with dKᵀ, dVᵀ, dQᵀ accumulated, on ragged causal problems, with the
    32-row steps that are no candidates (the 16-row ones at d = 128 are, and test_every_candidate runs
    them)."""
    if host:
        monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    p = problem((2, 3), 333, 290, head_dim, torch.float32, True, device="cuda")
    out, lse = triton_impl.triton_forward(p.q, p.k, p.v, True, head_dim**-0.5)
    grads = triton_impl.triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, True, head_dim**-0.5, config)
    p.assert_close({"dq": grads[0], "dk": grads[1], "dv": grads[2]})


needs_hopper_gluon = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _hopper.available()),
    reason="the Gluon backward needs an sm_90 GPU and a Triton with Gluon for Hopper",
)


@needs_hopper_gluon
@pytest.mark.parametrize(("dtype", "lead", "seqlen", "head_dim", "is_causal"), [
    (torch.bfloat16, (2, 3), 256, 64, True),
    (torch.bfloat16, (1, 2), 384, 64, False),
    (torch.float16, (3,), 512, 64, True),
    (torch.bfloat16, (2,), 256, 32, True),
    (torch.bfloat16, (1, 2), 256, 16, False),
    (torch.bfloat16, (2, 3), 384, 128, True),
    (torch.float16, (1, 2), 256, 128, False),
])  # fmt: skip
def test_hopper_backward(problem, monkeypatch, hopper_configs, dtype, lead, seqlen, head_dim, is_causal):
    """The Gluon kernel (named explicitly: problems this small would otherwise take the small path), each
    candidate of its head dim, the persistent ones also in few programs of several work items each."""
    monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    p = problem(lead, seqlen, seqlen, head_dim, dtype, is_causal, device="cuda", scale=0.1)
    out, lse = triton_impl.triton_forward(p.q, p.k, p.v, is_causal, 0.1)
    for config in hopper_configs("bwd", head_dim):
        poison_allocator()
        grads = triton_impl.triton_backward(p.q, p.k, p.v, out, lse, p.grad_out, is_causal, 0.1, config)
        p.assert_close({"dq": grads[0], "dk": grads[1], "dv": grads[2]})


@needs_hopper_gluon
@pytest.mark.parametrize(("dtype", "lead", "seqlen", "head_dim", "is_causal"), [
    (torch.bfloat16, (2, 3), 256, 64, True),
    (torch.bfloat16, (1, 2), 384, 128, False),
    (torch.float16, (3,), 512, 64, True),
    (torch.bfloat16, (2,), 640, 128, True),
])  # fmt: skip
def test_hopper_forward(problem, monkeypatch, hopper_configs, dtype, lead, seqlen, head_dim, is_causal):
    """Each candidate of the Gluon forward (named explicitly, as test_hopper_backward's), the persistent
    ones also in few programs of several work items each."""
    monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    p = problem(lead, seqlen, seqlen, head_dim, dtype, is_causal, device="cuda", scale=0.1)
    for config in hopper_configs("fwd", head_dim):
        poison_allocator()
        out, lse = triton_impl.triton_forward(p.q, p.k, p.v, is_causal, 0.1, config)
        p.assert_close({"out": out, "lse": lse})


@needs_hopper_gluon
def test_tuner_offers_the_hopper_kernels_only_where_they_apply(problem, monkeypatch):
    """Candidates for 16-bit problems with T a multiple of 128, a head dim each compiles for (forward 64,
    128; backward 16, 32, 64, 128), inputs in (B, H, T, d) or (B, T, H, d) memory, grouped-query attention or
    not, causal windows, rows of a wider tensor; never for others (ragged lengths, head dims padded for
    the kernels, windows that see ahead)."""
    monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    offered = {}
    problems = [("d=64", 256, "contiguous", 64, None), ("d=128", 256, "contiguous", 128, None),
                ("d=32", 256, "contiguous", 32, None), ("ragged", 250, "contiguous", 64, None),
                ("transposed", 256, "transposed", 64, None), ("d=48", 256, "contiguous", 48, None),
                ("gqa", 256, "contiguous", 64, None), ("causal-window", 256, "contiguous", 64, (64, 0)),
                ("window-ahead", 256, "contiguous", 64, (64, 32)), ("padded", 256, "padded", 64, None)]
    for name, seqlen, layout, head_dim, window in problems:
        is_causal = window is None or window[1] == 0
        p = problem((1, 2), seqlen, seqlen, head_dim, torch.bfloat16, is_causal, device="cuda", layout=layout)
        k, v = (p.k[:, :1], p.v[:, :1]) if name == "gqa" else (p.k, p.v)  # one K/V head for both
        out, lse = triton_impl.triton_forward(p.q, k, v, is_causal, 0.125, window=window)
        triton_impl.triton_backward(p.q, k, v, out, lse, p.grad_out, is_causal, 0.125, window=window)
        plans = triton_impl._plans.items()
        offered[name] = {key[0]: any(c.hopper for c in plan.candidates) for key, plan in plans}
        triton_impl._plans.clear()
    no, both = {"fwd": False, "bwd": False}, {"fwd": True, "bwd": True}
    assert offered == {"d=64": both, "d=128": both,
                       "d=32": {"fwd": False, "bwd": True}, "ragged": no, "transposed": both, "d=48": no,
                       "gqa": both, "causal-window": both, "window-ahead": no, "padded": both}


def test_tuner_offers_split_key_tiles_only_to_small_problems_short_of_programs():
    """Split key tiles are candidates for a small problem whose query tiles are too few for the GPU and
    whose chains of key tiles are long; not with many heads, short sequences, or above the small-problem
    size."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    few = max(1, sm_count * 64 // 4096)  # heads of fewer than two programs an SM at T = 4096
    short = _configs.SPLIT_MIN_KEY_TILES * 64 // 2  # half the shortest chain split, in key tiles of 64
    offered = {}
    for name, heads, seqlen in (("few heads", few, 4096), ("many heads", 8 * few, 4096), ("short", 1, short),
                                ("large", 1, 65536)):  # fmt: skip
        q = torch.randn(1, heads, seqlen, 64, device="cuda", dtype=torch.bfloat16)
        triton_impl.triton_forward(q, q, q, True, 0.125)
        ((key, plan),) = triton_impl._plans.items()
        offered[name] = any(c.kv_splits > 1 for c in plan.candidates)
        triton_impl._plans.clear()
    assert offered == {"few heads": True, "many heads": False, "short": False, "large": False}


def test_repeated_layouts_launch_directly_and_stay_exact(problem, monkeypatch):
    """A layout's first call goes through Triton's JIT (2 kernels: forward, backward; a problem this small
    computes D in the backward kernel, with no preprocess launch), its later calls launch the compiled
    kernels directly; a layout that differs only in what the JIT specializes on (T % 16, a base address
    off 16 bytes) gets a plan of its own and stays exact."""
    kernels = _launcher.kernels()
    jit_runs = []
    for fn in (kernels.attn_fwd, kernels.attn_bwd_preprocess, kernels.attn_bwd):
        monkeypatch.setattr(fn, "run", lambda *a, _run=fn.run, **kw: jit_runs.append(1) or _run(*a, **kw))

    def misaligned(t: torch.Tensor) -> torch.Tensor:  # same values, 2 bytes past a 16-byte boundary
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        return storage[1:].view(t.shape).copy_(t).detach().requires_grad_()

    runs_per_call = []
    for seqlen, shift in [(1024, False), (1024, False), (1000, False), (1000, False), (1000, True)]:
        p = problem((1, 2), seqlen, seqlen, 64, torch.bfloat16, True, device="cuda")
        q, k, v = p.inputs()
        if shift:
            q, k, v = (misaligned(t) for t in (q, k, v))
            assert q.data_ptr() % 16 != 0
        out = FlashAttentionTriton.apply(q, k, v, True)
        out.backward(p.grad_out)
        p.check(out, q, k, v)
        runs_per_call.append(len(jit_runs))
        jit_runs.clear()
    assert runs_per_call == [2, 0, 2, 0, 2]


def test_later_launches_bypass_tritons_runner_and_launch_hooks_still_see_them(problem, monkeypatch):
    """After a layout's first call its kernels go straight to Triton's C launcher (no launch metadata
    built, decisions.md#direct-launch), unless a launch hook is set (a profiler's): then every launch goes
    through Triton's runner and the hook sees it. Exact either way."""
    import triton
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel

    if not _launcher._direct_launch_supported():
        pytest.skip(f"direct launches are checked against Triton 3.6's launcher, not {triton.__version__}")
    metadata_built = []
    original = CompiledKernel.launch_metadata
    monkeypatch.setattr(CompiledKernel, "launch_metadata",
                        lambda self, *a: metadata_built.append(self.name) or original(self, *a))  # fmt: skip
    p = problem((1, 2), 1000, 1000, 64, torch.bfloat16, True, device="cuda")
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    built_per_call = []
    for hooked in (False, False, True, False):
        if hooked:
            knobs.runtime.launch_enter_hook.add(hook)
        try:
            q, k, v = p.inputs()
            out = FlashAttentionTriton.apply(q, k, v, True)
            out.backward(p.grad_out)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        p.check(out, q, k, v)
        built_per_call.append(len(metadata_built))
        metadata_built.clear()
    assert seen == ["attn_fwd", "attn_bwd"]
    assert built_per_call == [2, 0, 2, 0]  # the JIT's first launches, direct, the runner's, direct


def test_launches_follow_the_current_stream(problem):
    """A forward and backward on a side stream run there (the direct launches read the current stream
    each call): same results as on the default stream, with the side stream's work awaited only."""
    p = problem((2, 2), 700, 700, 64, torch.bfloat16, True, device="cuda")
    torch.cuda.synchronize()  # the problem's tensors are ready for any stream
    results = []
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, side):
        with torch.cuda.stream(stream):
            q, k, v = p.inputs()
            out = FlashAttentionTriton.apply(q, k, v, True)
            out.backward(p.grad_out)
        stream.synchronize()
        results.append((out, q.grad, k.grad, v.grad))
    for later in results[1:]:
        for got, want in zip(later, results[0], strict=True):
            assert torch.equal(got, want)


def test_a_thread_without_a_cuda_context_runs_a_backward(problem):
    """torch sets autograd's device thread to its GPU without making a CUDA context current there; where a
    small problem's backward is that thread's first CUDA work, its host-built descriptors and launches
    need one (they raised "invalid device context"). A fresh thread has none: the backward there equals
    the main thread's."""
    import ctypes
    import threading

    p = problem((1, 1), 1024, 1024, 64, torch.bfloat16, True, device="cuda")
    q, k, v = p.inputs()
    out, lse = triton_impl.triton_forward(q, k, v, True, None)
    triton_impl.triton_backward(q, k, v, out, lse, p.grad_out, True, 0.125)  # its blocks, freed, are reused
    want = triton_impl.triton_backward(q, k, v, out, lse, p.grad_out, True, 0.125)
    torch.cuda.synchronize()
    seen = {}

    def backward_in_a_new_thread():
        context = ctypes.c_void_p()
        _launcher._libcuda().cuCtxGetCurrent(ctypes.byref(context))
        seen["context"] = context.value
        try:
            seen["grads"] = triton_impl.triton_backward(q, k, v, out, lse, p.grad_out, True, 0.125)
            torch.cuda.synchronize()
        except RuntimeError as exc:
            seen["error"] = exc

    thread = threading.Thread(target=backward_in_a_new_thread)
    thread.start()
    thread.join()
    assert seen["context"] is None  # the thread started without one
    assert "error" not in seen, seen.get("error")
    for got, expected in zip(seen["grads"], want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_tf32_parts_on_the_gpu(transposed, assert_tf32_parts):
    """The float32 split (one kernel) on a ragged, strided problem: exact parts, TF32 high parts."""
    x4 = torch.randn(2, 333, 3, 40, device="cuda").mul(torch.logspace(-20, 20, 40, device="cuda"))
    x4 = x4.transpose(1, 2)
    parts = _inputs.tf32_parts(x4, transposed)
    assert_tf32_parts(parts.transpose(-1, -2) if transposed else parts, x4)


@pytest.mark.parametrize("split", [False, True], ids=["default", "split-kv"])
def test_no_device_memory_outlives_a_call(problem, monkeypatch, tmp_path, split):
    """Scratch (kernel-built descriptors) and split-kv partials are the call's own: once its results are
    dropped, the allocator holds what it held before. (A buffer kept past a call, made during a warm-up of
    torch.compile's CUDA graph trees, would be a tensor of the graph's pool not tracked as an output.)"""
    monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    if split:  # tuned afresh among the splits
        monkeypatch.setenv("FLASHATTN_TRITON_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(TUNING, "chosen", {})
        _split_key_tiles_only(monkeypatch)
    p = problem((1, 1), 1024, 1024, 64, torch.bfloat16, True, device="cuda")
    q, k, v = p.inputs()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = FlashAttentionTriton.apply(q, k, v, True)
    out.backward(p.grad_out)
    del out
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_side_descriptors(problem, monkeypatch, dtype):
    """The path of GPUs older than Hopper, here on Hopper: the kernels build their descriptors (TMA in
    scratch memory from triton.set_allocator) from pointers to contiguous copies."""
    monkeypatch.setattr(_inputs, "host_descriptors", lambda device: False)
    p = problem((2, 2), 300, 200, 64, dtype, True, device="cuda", layout="transposed")
    q, k, v = p.inputs()
    out = FlashAttentionTriton.apply(q, k, v, True)
    out.backward(p.grad_out)
    p.check(out, q, k, v)


@pytest.mark.parametrize("is_causal", [False, True])
def test_memory_stays_far_below_t_squared_at_32k(is_causal):
    seqlen = 32768
    q, k, v = (
        torch.randn(1, seqlen, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = FlashAttentionTriton.apply(q, k, v, is_causal)
    forward_peak = torch.cuda.max_memory_allocated() - before
    out.backward(torch.ones_like(out))
    total_peak = torch.cuda.max_memory_allocated() - before
    assert forward_peak < seqlen * seqlen / 64, f"forward peak {forward_peak / 2**20:.1f} MiB"
    assert total_peak < seqlen * seqlen / 16, f"forward+backward peak {total_peak / 2**20:.1f} MiB"
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_saved_tensors_and_keyword_apply():
    q, k, v = (
        torch.randn(3, 100, 32, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)
    )
    out = FlashAttentionTriton.apply(q, k, v, is_causal=True)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5
    (lse,) = [t for t in saved if t.shape == q.shape[:-1]]
    assert lse.dtype == torch.float32


def test_no_queries_give_zero_key_gradients():
    q = torch.randn(2, 0, 32, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, 9, 32, device="cuda", requires_grad=True) for _ in range(2))
    out = FlashAttentionTriton.apply(q, k, v)
    out.sum().backward()
    assert out.shape == q.shape and not k.grad.any() and not v.grad.any()


def test_mixed_devices_are_refused():
    q = torch.randn(2, 8, 16, device="cuda")
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        FlashAttentionTriton.apply(q, q.cpu(), q)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_float32_infinities_spoil_only_the_rows_that_see_them(check_infinities, where, is_causal):
    check_infinities("cuda", where, is_causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["small", "large"])
def test_gradients_through_lse_and_out(check_gradients_through_lse, monkeypatch, path, dtype):
    if path == "large":
        monkeypatch.setattr(_configs, "SMALL_PROBLEM_WORK", 0)
    check_gradients_through_lse("cuda", 300, dtype)


# --- the custom ops under torch.compile, CUDA graphs and opcheck ---------------------------------------

OPTIONS = (None, 0.0, None, 0.125, -1, 0, 0, None, None, 0, 0)  # attn_fwd's arguments after v: causal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_on_cuda(dtype):
    q, k, v = (torch.randn(2, 3, 200, 64, device="cuda", dtype=dtype) for _ in range(3))
    torch.library.opcheck(ops.attn_fwd, (q, k, v, *OPTIONS))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(ops.attn_fwd, (*leaves, *OPTIONS))
    out, lse = ops.attn_fwd(q, k, v, *OPTIONS)
    torch.library.opcheck(ops.attn_bwd, (torch.randn_like(out), None, q, k, v, out, lse, *OPTIONS, False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True], ids=["transposed", "fused-qkv"])
def test_outputs_and_gradients_in_the_inputs_layouts(in_place_outputs, dtype, fused):
    """q, k, v as a model passes them ((B, T, H, d) memory, or thirds of one fused projection): O, dQ, dK,
    dV in packed (B, T, H, d) memory as SDPA's, written in place where the host builds the descriptors
    (Hopper), with SDPA's values; opcheck's fake and real strides agree."""
    in_place = in_place_outputs
    batch, heads, seqlen, head_dim = 2, 4, 256, 64
    x = torch.randn(batch, seqlen, 3, heads, head_dim, device="cuda", dtype=dtype)
    if fused:
        q, k, v = x.permute(2, 0, 3, 1, 4)
    else:
        q, k, v = (x[:, :, i].contiguous().transpose(1, 2) for i in range(3))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, is_causal=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    packed = torch.empty(batch, seqlen, heads, head_dim).transpose(1, 2).stride()
    assert [t.stride() for t in (out, *grads)] == [packed] * 4
    assert in_place and all(in_place) == _inputs.host_descriptors(q.device)
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-3  # (a misplaced row is off by O(1))
    for got, expected in zip((out, *grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    torch.library.opcheck(ops.attn_fwd, (*leaves, *OPTIONS))
    op_out, lse = ops.attn_fwd(q, k, v, *OPTIONS)
    torch.library.opcheck(ops.attn_bwd, (grad_out, None, q, k, v, op_out, lse, *OPTIONS, False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_calls_skip_the_dispatcher_with_the_ops_results(dtype):
    """flash_attention in eager mode runs the ops' implementations under a plain autograd Function (host
    time): bitwise the results and gradients of the op; a dispatch mode still sees the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.use_deterministic_algorithms(True)  # no atomic dQ: bitwise repeatable gradients
    try:
        leaves = [torch.randn(2, 3, 200, 64, device="cuda", dtype=dtype, requires_grad=True)
                  for _ in range(3)]  # fmt: skip
        grad_out = torch.randn_like(leaves[0])
        out = flash_attention(*leaves, is_causal=True, scale=0.125)
        assert type(out.grad_fn.next_functions[0][0]).__name__ == "_EagerAttentionBackward"  # under a view
        grads = torch.autograd.grad(out, leaves, grad_out)
        op_out, _ = ops.attn_fwd(*leaves, *OPTIONS)
        assert torch.equal(out, op_out)
        for got, want in zip(grads, torch.autograd.grad(op_out, leaves, grad_out), strict=True):
            assert torch.equal(got, want)
    finally:
        torch.use_deterministic_algorithms(False)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        flash_attention(*leaves, is_causal=True)
    assert ops.attn_fwd in seen.ops


def _block(blocks, attention):
    torch.manual_seed(0)
    return blocks.Block(attention, d_model=128, heads=2).cuda()


def test_compiled_block_with_inductor_has_no_graph_break_and_matches_sdpa(blocks):
    block = _block(blocks, flash_attention)
    sdpa_block = _block(blocks, torch.nn.functional.scaled_dot_product_attention)
    sdpa_block.load_state_dict(block.state_dict())
    x = torch.randn(2, 256, 128, device="cuda", requires_grad=True)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    got, got_grads = blocks.step(torch.compile(block, fullgraph=True), x)
    want, want_grads = blocks.step(sdpa_block, x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)


def test_one_inductor_graph_serves_every_length(blocks):
    block = _block(blocks, flash_attention)
    torch._dynamo.reset()
    backend = blocks.CountingBackend("inductor")
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for seqlen in (100, 257, 512, 1000):
        x = torch.randn(2, seqlen, 128, device="cuda", requires_grad=True)
        got, got_grads = blocks.step(compiled, x)
        want, want_grads = blocks.step(block, x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(backend.compilations) == 1


def _split_key_tiles_only(monkeypatch) -> None:
    """Forward candidates with split key tiles only, where a problem has them (small ones on a GPU)."""
    every = triton_impl.candidates
    monkeypatch.setattr(triton_impl, "candidates", lambda problem: [
        c for c in every(problem) if getattr(c, "kv_splits", 1) > 1] or every(problem))  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["default", "split-kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_overhead_captures_forward_and_backward(blocks, monkeypatch, dtype, split):
    """split-kv: the forward's partials, which a capture must take from its own graph's pool (CUDA graph
    trees rewind their pool and would hand a buffer kept past the capture to other tensors)."""
    if split:
        _split_key_tiles_only(monkeypatch)
    torch._dynamo.utils.counters.clear()
    block = _block(blocks, flash_attention).to(dtype)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up runs, then the recording, then replays
        x = torch.randn(*((1, 1024) if split else (2, 256)), 128, device="cuda", dtype=dtype,
                        requires_grad=True)  # fmt: skip
        got, got_grads = blocks.step(compiled, x)
        got, got_grads = got.clone(), [g.clone() for g in got_grads]
        want, want_grads = blocks.step(block, x)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(got_grads[-1], want_grads[-1], atol=tolerance, rtol=tolerance)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"CUDA graphs were skipped: {dict(torch._dynamo.utils.counters['inductor'])}"


@pytest.mark.parametrize("configs", ["tuned", "split-kv"])
@pytest.mark.parametrize("which", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("entry", ["flash_attention", "FlashAttentionTriton"])
def test_each_pass_captures_on_its_own_through_each_entry_point(monkeypatch, tmp_path, entry, which, configs):
    """benchmarks.flash --cuda-graphs's cells: (1, 1, 1024, 64) bfloat16 causal, tuned (or only the
    forward's split key tiles, which that problem's tuning may pick), each pass captured on its own after
    warm-ups on a side stream, the bwd pass's forward made before the capture on the capture stream."""
    monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "1")
    if configs == "split-kv":  # tuned afresh among the splits
        monkeypatch.setenv("FLASHATTN_TRITON_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(TUNING, "chosen", {})
        _split_key_tiles_only(monkeypatch)
    if entry == "flash_attention":
        attention = lambda q, k, v: flash_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        attention = lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True)  # noqa: E731
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q, k, v = (torch.randn(1, 1, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        grad_out = torch.randn_like(q)
        out = attention(q, k, v)
        runs = {
            "fwd": lambda: (attention(q, k, v),),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
            "fwd+bwd": lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), grad_out),
        }
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for _ in range(3):
                runs[which]()
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            results = runs[which]()
        with torch.no_grad():
            grad_out.copy_(torch.randn_like(grad_out))
            for result in results:
                result.zero_()
        graph.replay()
    torch.cuda.synchronize()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    want.backward(grad_out)
    wanted = (want,) if which == "fwd" else tuple(leaf.grad for leaf in leaves)
    for got, expected in zip(results, wanted, strict=True):
        torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)


def test_flash_attention_varlen_captures_in_a_cuda_graph():
    """Packed sequences: their lengths are checked on the host eagerly, not in a capture (a sync there)."""
    lengths = [100, 3, 257]
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    cu_seqlens = torch.tensor([0, 100, 103, 360], dtype=torch.int32, device="cuda")

    def step():
        out = flashattn_triton.flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 257, 257,
                                                      is_causal=True)  # fmt: skip
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    # Detached: a live warm-up graph keeps its AccumulateGrad nodes on the default stream, and the
    # captured backward would make that stream wait on the capture, which CUDA refuses.
    expected = [t.detach() for t in step()]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("lead", "seqlen", "tune"), [((1, 1), 512, False), ((4, 16), 4096, True)],
                         ids=["small", "large-tuned"])
def test_torch_cuda_graph_captures_forward_and_backward(monkeypatch, lead, seqlen, tune):
    if tune:  # tuned during the warm-up; the capture then launches the chosen kernels
        monkeypatch.setenv("FLASHATTN_TRITON_AUTOTUNE", "1")
    shape = (*lead, seqlen, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            flash_attention(q, k, v, is_causal=True).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(q, k, v, is_causal=True)
        out.backward(grad_out)
    for _ in range(2):  # new inputs in place, then replay
        with torch.no_grad():
            for t in (q, k, v, grad_out):
                t.copy_(torch.randn_like(t))
        graph.replay()
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        want = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        want.backward(grad_out)
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
        for got, leaf in zip((q.grad, k.grad, v.grad), leaves, strict=True):
            torch.testing.assert_close(got, leaf.grad, atol=5e-2, rtol=5e-2)
