"""The dispatch table on CPU: which backend the layouts of real models get on a described sm_90 GPU, eagerly
and under torch.compile (the description the real op saw, recorded), and masks that only encode a band."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashattn_triton
from flashattn_triton import _configs, _dispatch, _masks, ops
from flashattn_triton._dispatch import FEATURES, GLUON, TUNED

SM90 = (9, 0)
B, T, HIDDEN, HEADS, KV_HEADS, D = 2, 256, 512, 8, 2, 64


def transformers_qkv(x: torch.Tensor, proj: nn.ModuleDict) -> tuple[torch.Tensor, ...]:
    """Llama's attention in transformers: separate projections viewed (B, T, H, d) and transposed."""
    shape = (*x.shape[:2], -1, D)
    return tuple(proj[name](x).view(shape).transpose(1, 2) for name in ("q", "k", "v"))


def timm_qkv(x: torch.Tensor, proj: nn.ModuleDict) -> tuple[torch.Tensor, ...]:
    """timm's ViT attention: a fused projection reshaped (B, N, 3, H, d), permuted, unbound."""
    return proj["qkv"](x).reshape(*x.shape[:2], 3, HEADS, D).permute(2, 0, 3, 1, 4).unbind(0)


def nanogpt_qkv(x: torch.Tensor, proj: nn.ModuleDict) -> tuple[torch.Tensor, ...]:
    """nanoGPT's CausalSelfAttention: a fused projection split, each part viewed and transposed."""
    q, k, v = proj["qkv"](x).split(HIDDEN, dim=2)
    return tuple(t.view(*x.shape[:2], HEADS, D).transpose(1, 2) for t in (q, k, v))


MODELS = {"transformers": (transformers_qkv, True), "timm": (timm_qkv, False),
          "nanogpt": (nanogpt_qkv, False)}  # fmt: skip


@pytest.fixture(autouse=True)
def nothing_small(monkeypatch):
    """Problems this small take the tuned kernels' small-problem path on a GPU; here, where they stand for
    a model's, no problem counts as small (and no route is remembered from another test)."""
    monkeypatch.setattr(_configs, "SMALL_PROBLEM_TILES", 0)
    monkeypatch.setattr(ops, "_routes", {})


def projections() -> nn.ModuleDict:
    torch.manual_seed(0)
    kv = KV_HEADS * D
    return nn.ModuleDict({"q": nn.Linear(HIDDEN, HIDDEN), "k": nn.Linear(HIDDEN, kv),
                          "v": nn.Linear(HIDDEN, kv),
                          "qkv": nn.Linear(HIDDEN, 3 * HIDDEN)}).to(torch.bfloat16)  # fmt: skip


def on_sm90(description: _dispatch.Description) -> _dispatch.Description:
    """A description the op recorded on this CPU, as it would be on an sm_90 GPU with Triton and Gluon."""
    return dataclasses.replace(description, capability=SM90, triton=True, gluon=True)


@pytest.mark.parametrize("model", MODELS)
def test_model_layouts_run_the_gluon_kernels_on_sm90(model):
    """The (B, H, T, d) views transformers, timm and nanoGPT make of their projections run the Gluon kernels,
    forward and backward, with no copy (their layouts are described, not copied), GQA included."""
    make_qkv, grouped = MODELS[model]
    x = torch.randn(B, T, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make_qkv(x, projections())
    assert not q.is_contiguous()  # (a view: a copy would have been SDPA-free too)
    explained = flashattn_triton.explain(q, k, v, is_causal=True, enable_gqa=grouped, device_capability=SM90)
    assert (explained.forward.backend, explained.backward.backend) == (GLUON, GLUON), str(explained)
    assert explained.forward.config.hopper and explained.backward.config.hopper


def test_explain_says_why_each_faster_backend_was_not_taken():
    q, k, v = (torch.randn(1, 2, 200, 64, dtype=torch.bfloat16) for _ in range(3))
    window = flashattn_triton.explain(q, k, v, window_size=(16, 16), device_capability=SM90)
    assert window.forward.backend == TUNED and window.backward is None
    assert "not equal multiples of 128" in window.forward.not_taken[GLUON]
    masked = flashattn_triton.explain(q, k, v, attn_mask=torch.randn(200, 200) > 0, device_capability=SM90)
    assert masked.forward.backend == FEATURES and set(masked.forward.not_taken) == {GLUON, TUNED}
    here = flashattn_triton.explain(q, k, v, is_causal=True)  # this CPU, no interpreter: PyTorch
    assert here.forward.backend == _dispatch.TORCH and "Triton cannot run" in here.forward.not_taken[FEATURES]
    assert "gluon-sm90" in str(window)


def test_the_table_is_a_pure_function_of_the_description():
    """Every support condition is in the table: change one field of a Gluon problem, the answer names it."""
    gluon = _dispatch.Description("bwd", SM90, True, True, torch.bfloat16, 128, 2048, 2048, ("bthd",) * 5,
                                  window=(-1, 0), group=4)  # fmt: skip
    assert _dispatch.choose(gluon) == GLUON
    changes = {"capability": (8, 0), "gluon": False, "dtype": torch.float32, "head_dim": 96,
               "seqlen_k": 1024, "layouts": ("strided",) * 5, "small": True, "dropout": True,
               "deterministic": True}  # fmt: skip
    for field, value in changes.items():
        changed = dataclasses.replace(gluon, **{field: value})
        assert _dispatch.choose(changed) == TUNED and _dispatch.why_not(GLUON, changed), field
    assert _dispatch.choose(dataclasses.replace(gluon, mask="tensor")) == FEATURES
    bottom_right = dataclasses.replace(gluon, window=(-1, 0), diagonal_offset=5, seqlen_k=2053)
    assert _dispatch.choose(bottom_right) == FEATURES
    assert _dispatch.choose(dataclasses.replace(gluon, triton=False)) == _dispatch.TORCH
    assert _dispatch.choose(dataclasses.replace(gluon, window=(256, 0))) == GLUON


def causal_masks(seqlen: int) -> dict[str, torch.Tensor]:
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    lowest = torch.finfo(torch.bfloat16).min
    return {"bool": causal[None, None].expand(B, 1, -1, -1),
            "float-lowest": torch.zeros(B, 1, seqlen, seqlen, dtype=torch.bfloat16).masked_fill(~causal,
                                                                                                 lowest),
            "float-inf": torch.zeros(seqlen, seqlen).masked_fill(~causal, float("-inf"))}  # fmt: skip


@pytest.mark.parametrize("kind", ["bool", "float-lowest", "float-inf"])
def test_a_materialized_causal_mask_runs_as_is_causal(kind):
    """transformers materializes the causal mask while torch.compile traces: it runs as is_causal would, and
    gives what SDPA gives with that mask."""
    mask = causal_masks(T)[kind]
    q, k, v = (torch.randn(B, HEADS, T, D, dtype=torch.bfloat16) for _ in range(3))
    explained = flashattn_triton.explain(q, k, v, attn_mask=mask, device_capability=SM90)
    assert explained.forward.backend == GLUON, str(explained)
    got = flashattn_triton.flash_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float() if
                                          mask.dtype != torch.bool else mask)  # fmt: skip
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_band_masks_are_read_as_their_band_and_others_are_not():
    rows, cols = torch.arange(300)[:, None], torch.arange(300)[None, :]
    assert _masks.band_of_mask((cols <= rows) & (cols > rows - 64), 300, 300) == (63, 0)
    assert _masks.band_of_mask((cols - rows).abs() <= 5, 300, 300) == (5, 5)
    assert _masks.band_of_mask(torch.ones(300, 300, dtype=torch.bool), 300, 300) == (-1, -1)
    holed = (cols <= rows).clone()
    holed[150, 3] = False
    assert _masks.band_of_mask(holed, 300, 300) is None
    per_batch = torch.stack([cols <= rows, cols <= rows + 1])[:, None]
    assert _masks.band_of_mask(per_batch, 300, 300) is None
    padded = torch.zeros(300, 300).masked_fill(cols > rows, float("-inf"))
    padded[:, 0] = -1.0  # an additive bias, not a mask
    assert _masks.band_of_mask(padded, 300, 300) is None
    assert _masks.band_of_mask(cols <= rows - 1, 300, 300) is None  # row 0 sees nothing: not run as a band


def compiled_routes(model: str, backend: str, masked: bool) -> list[_dispatch.Description]:
    """The descriptions the real op saw running a compiled attention of `model`'s layout, forward and
    backward (a mask built inside the compiled function, as transformers builds one while traced)."""
    make_qkv, grouped = MODELS[model]
    proj = projections()

    def attend(x: torch.Tensor) -> torch.Tensor:
        q, k, v = make_qkv(x, proj)
        if masked:
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
            out = flashattn_triton.flash_attention(q, k, v, attn_mask=causal[None, None], enable_gqa=grouped)
        else:
            out = flashattn_triton.flash_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return out.transpose(1, 2).reshape(x.shape)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    x = torch.randn(B, T, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with _dispatch.recording() as seen:
        compiled(x).sum().backward()
    return list(seen)


@pytest.mark.parametrize("model", MODELS)
def test_compiled_model_layouts_run_the_gluon_kernels_on_sm90(model):
    """Under torch.compile the real op sees the layouts it sees eagerly: on sm_90 both passes run Gluon."""
    seen = compiled_routes(model, "aot_eager", masked=False)
    assert [d.pass_name for d in seen] == ["fwd", "bwd"]
    assert all(_dispatch.choose(on_sm90(d)) == GLUON for d in seen), seen


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on CPU needs a C++ compiler")
def test_inductor_strides_and_a_traced_causal_mask_run_the_gluon_kernels_on_sm90():
    """Inductor picks the op's input strides and the mask is materialized inside the graph (transformers'
    case): the real op recognises the mask as causal and the layouts as Gluon's."""
    seen = compiled_routes("transformers", "inductor", masked=True)
    assert [d.pass_name for d in seen] == ["fwd", "bwd"]
    assert all(d.mask == "none" and d.causal for d in seen), seen
    assert all(_dispatch.choose(on_sm90(d)) == GLUON for d in seen), seen


def test_tune_asks_for_tuning_only_while_it_runs_and_answers_as_explain():
    """tune() runs the problem's forward and backward with tuning asked for (here on the PyTorch path, which
    has nothing to tune), then leaves calls untuned again and answers what explain() answers."""
    from flashattn_triton import _tuning

    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    seen = []
    original = flashattn_triton.functional.flash_attention

    def spy(*args, **kwargs):
        seen.append(_tuning.autotune_enabled())
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flashattn_triton.functional, "flash_attention", spy)
        tuned = flashattn_triton.tune(q, k, v, is_causal=True)
    assert seen == [True] and not _tuning._requested
    assert tuned == flashattn_triton.explain(q, k, v, is_causal=True, grad=True)


def test_a_route_is_remembered_per_float32_precision(monkeypatch):
    """Packed float32 sequences at full accuracy (tf32x3) are the feature kernels', with TF32 the tuned
    kernels': a remembered route must follow torch.set_float32_matmul_precision between calls."""
    monkeypatch.setattr(_dispatch, "machine", lambda device: (SM90, True, True))
    q, k, v = (torch.randn(300, 2, 64) for _ in range(3))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    options = {"attn_mask": None, "dropout_p": 0.0, "rng_state": None, "scale": 0.125, "window_left": -1,
               "window_right": 0, "diagonal_offset": 0, "cu_seqlens_q": cu, "cu_seqlens_k": cu,
               "max_seqlen_q": 200, "max_seqlen_k": 200}  # fmt: skip
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert ops._route("fwd", (q, k, v), options) == TUNED
        torch.set_float32_matmul_precision("highest")
        assert ops._route("fwd", (q, k, v), options) == FEATURES
    finally:
        torch.set_float32_matmul_precision(previous)
