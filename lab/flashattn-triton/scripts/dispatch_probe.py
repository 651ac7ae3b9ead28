"""Issue 40's measurements on one GPU, each printed as one JSON line (run from the repository root with the
packages on PYTHONPATH):

    python lab/flashattn-triton/scripts/dispatch_probe.py cold 4x8x2048x64   # a fresh process's first call
    python lab/flashattn-triton/scripts/dispatch_probe.py host                # per-call host time vs SDPA
    python lab/flashattn-triton/scripts/dispatch_probe.py routes              # the Llama-style model's routes
    python lab/flashattn-triton/scripts/dispatch_probe.py hf                  # transformers' Llama's routes
    python lab/flashattn-triton/scripts/dispatch_probe.py why_cold 4x8x2048x64   # cProfile of a first call
    python lab/flashattn-triton/scripts/dispatch_probe.py why_host     # cProfile of small calls, and floors

cold: import, first forward and first backward (bf16, causal, (B, H, T, d) contiguous), each synchronized,
then a second call; run it with empty TRITON_CACHE_DIR and FLASHATTN_TRITON_CACHE_DIR for a fresh machine.
host: the mean time of a call in a loop of calls with no synchronization (the host's time where the GPU
keeps up), flash_attention against scaled_dot_product_attention, forward and forward+backward.
routes: explain() for the Llama layout, and the backend each pass of the Llama-style model ran eagerly
(the descriptions the real op saw), with is_causal and with a materialized causal mask (compiled: run
benchmarks.e2e --compile with FLASHATTN_TRITON_LOG_ROUTES=1).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def cold(shape: str) -> None:
    torch.ones(1, device="cuda").sum().item()  # CUDA's context, before the clock starts
    start = time.perf_counter()
    import flashattn_triton

    imported = time.perf_counter() - start
    batch, heads, seqlen, head_dim = map(int, shape.split("x"))
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    times, compiled = [], []
    cache = Path(os.environ.get("TRITON_CACHE_DIR", "/nonexistent"))

    def new_files(before: set[str]) -> list[str]:  # what Triton compiled (rather than loaded) since before
        now = {f"{p.parent.name[:6]}/{p.name}" for p in cache.glob("*/*") if not p.name.startswith("__grp__")}
        return sorted(name for name in now - before if name.endswith((".json", ".so")))

    for _ in range(2):
        before = set(new_files(set()))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = flashattn_triton.flash_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        forward = time.perf_counter() - start
        after_forward = set(new_files(set()))
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        times.append((forward, time.perf_counter() - start - forward))
        compiled.append((new_files(before), new_files(after_forward)))
    explained = flashattn_triton.explain(q, k, v, is_causal=True)
    print(json.dumps({"shape": shape, "import s": round(imported, 3),
                      "first forward s": round(times[0][0], 3), "first backward s": round(times[0][1], 3),
                      "first call s": round(sum(times[0]), 3),
                      "second call ms": round(sum(times[1]) * 1e3, 3),
                      "backend": f"{explained.forward.backend}/{explained.backward.backend}",
                      "compiled by the first forward": compiled[0][0],
                      "compiled by the first backward": compiled[0][1]}))


def _per_call(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def _host_times(attend, q, k, v, grad) -> tuple[float, float]:
    """attend's host time a forward (no autograd) and a forward+backward call, us."""
    with torch.no_grad():
        forward = _per_call(lambda: attend(q, k, v, is_causal=True))
    both = _per_call(lambda: torch.autograd.backward(attend(q, k, v, is_causal=True), grad), 1000)
    return round(forward, 1), round(both, 1)


def host() -> None:
    import flashattn_triton

    for shape in ((1, 1, 128, 64), (1, 8, 1024, 64)):
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        row = {"shape": shape}
        for name, attend in (("flash", flashattn_triton.flash_attention),
                             ("sdpa", F.scaled_dot_product_attention)):  # fmt: skip
            row[f"{name} fwd us"], row[f"{name} fwd+bwd us"] = _host_times(attend, q, k, v, grad)
        row["fwd x sdpa"] = round(row["flash fwd us"] / row["sdpa fwd us"], 3)
        row["fwd+bwd x sdpa"] = round(row["flash fwd+bwd us"] / row["sdpa fwd+bwd us"], 3)
        print(json.dumps(row))


def routes() -> None:
    import flashattn_triton
    from benchmarks.model import MODEL_SIZES, TransformerLM, model_config, random_batch
    from flashattn_triton import _dispatch

    cfg = MODEL_SIZES["llama-8L"]
    b, t, heads, kv_heads, d = 4, 2048, cfg.num_heads, cfg.kv_heads, cfg.d_model // cfg.num_heads
    x = torch.randn(b, t, cfg.d_model, device="cuda", dtype=torch.bfloat16)
    q = x.view(b, t, heads, d).transpose(1, 2).requires_grad_()
    k = x[..., : kv_heads * d].contiguous().view(b, t, kv_heads, d).transpose(1, 2).requires_grad_()
    explained = flashattn_triton.explain(q, k, k, is_causal=True, enable_gqa=True)
    print(f"explain, Llama layout, is_causal, GQA 16:4:\n{explained}")
    mask = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()[None, None].expand(b, 1, t, t)
    explained = flashattn_triton.explain(q, k, k, attn_mask=mask, enable_gqa=True)
    print(f"explain, same with a materialized causal mask:\n{explained}")
    cfg = model_config("llama-8L", t)
    for attention in ("flash", "flash-mask"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = TransformerLM(cfg, attention=attention)
        tokens = random_batch(cfg, b, t, "cuda")
        with _dispatch.recording() as seen, torch.autocast("cuda", torch.bfloat16):
            model(tokens).float().logsumexp(-1).mean().backward()
        ran = sorted({f"{d.pass_name}: {_dispatch.choose(d)} mask={d.mask} window={d.window} "
                      f"layouts={'/'.join(d.layouts)}" for d in seen})  # fmt: skip
        print(json.dumps({"attention": attention, "eager passes": len(seen), "routes": ran}))
        del model


def hf() -> None:
    """A 2-layer transformers Llama (hidden 2048, 16 / 4 heads of d = 128) with flash_attention registered
    as its attention (AttentionInterface, transformers' SDPA mask): each pass's route, eager and compiled."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    import flashattn_triton
    from flashattn_triton import _dispatch

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        is_causal = attention_mask is None and query.shape[2] > 1
        out = flashattn_triton.flash_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                               is_causal=is_causal, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None

    AttentionInterface.register("triton_fa2_attention", attention)  # (a name with "flash" means a hub kernel)
    AttentionMaskInterface.register("triton_fa2_attention", sdpa_mask)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                         attn_implementation="triton_fa2_attention")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, 32000, (4, 2048), device="cuda")
    for compiled in (False, True):
        run = torch.compile(model) if compiled else model
        for _ in range(2):
            with _dispatch.recording() as seen:
                run(input_ids=tokens, labels=tokens).loss.backward()
        ran = sorted({f"{d.pass_name}: {_dispatch.choose(d)} mask={d.mask} window={d.window} "
                      f"layouts={'/'.join(d.layouts)}" for d in seen})  # fmt: skip
        print(json.dumps({"transformers": True, "compiled": compiled, "passes": len(seen), "routes": ran}))


def _top(profile, sort: str, lines: int) -> None:
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(profile, stream=text).strip_dirs().sort_stats(sort).print_stats(lines)
    print(text.getvalue()[-6000:])


def why_cold(shape: str) -> None:
    """Where a fresh process's first forward and first backward spend their time (cProfile, cumulative)."""
    import cProfile

    torch.ones(1, device="cuda").sum().item()
    import flashattn_triton

    batch, heads, seqlen, head_dim = map(int, shape.split("x"))
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    for name in ("forward", "backward"):
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        if name == "forward":
            out = flashattn_triton.flash_attention(q, k, v, is_causal=True)
        else:
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        profile.disable()
        print(f"== first {name}: {time.perf_counter() - start:.3f} s")
        _top(profile, "cumulative", 35)


def why_host() -> None:
    """cProfile of small forward calls, and the floors: an empty autograd.Function, a one-element Triton
    kernel launched by kernel[grid], SDPA."""
    import cProfile

    import triton
    import triton.language as tl

    import flashattn_triton

    @triton.jit
    def _add_one(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)

    class _Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    x = torch.zeros(1, device="cuda")
    floors = {"empty autograd.Function us": _per_call(lambda: _Empty.apply(q)),
              "triton kernel[grid] us": _per_call(lambda: _add_one[(1,)](x)),
              "sdpa fwd us": _per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
              "flash fwd us": _per_call(lambda: flashattn_triton.flash_attention(q, k, v, is_causal=True))}
    print(json.dumps({k: round(t, 1) for k, t in floors.items()}))
    with torch.no_grad():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(1000):
            flashattn_triton.flash_attention(q, k, v, is_causal=True)
        profile.disable()
    print("== 1000 forward calls, (1, 1, 128, 64), no grad")
    _top(profile, "tottime", 30)


if __name__ == "__main__":
    {"cold": lambda: cold(sys.argv[2]), "host": host, "routes": routes, "hf": hf,
     "why_cold": lambda: why_cold(sys.argv[2]), "why_host": why_host}[sys.argv[1]]()
