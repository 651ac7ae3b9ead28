"""flash_attention's features against the best PyTorch has for each, in one run: `python -m benchmarks.flash
--feature gqa|window|varlen|mask|dropout` (several comma-separated).

Each feature times flashattn_triton and its baseline on the same inputs, forward and backward
(triton.testing.do_bench medians on CUDA, wall clock on CPU; with --cuda-graphs, of each pass's CUDA graph
replays, without the host's per-call work), and prints the baseline's time over ours ("x baseline": above
1 is faster; a pass whose capture failed reads "capture failed" there):

  gqa      (B, 32, 4096, 128) queries over 4 K/V heads (8:1), causal SDPA with enable_gqa=True (each)
           and not causal
  window   (1, 16, 16384, 64), causal, a window of 1024 keys          FlexAttention (compiled), sliding-window
                                                                      block mask; and our full causal
  varlen   16 heads of 64, random lengths summing to 16384, causal    FlexAttention (compiled) over the packed
                                                                      sequence with a document mask
  mask     (2, 16, 4096, 64), an additive float mask (1, 1, T, T)     SDPA's memory-efficient backend
  dropout  (2, 16, 4096, 64), dropout 0.1, causal                     SDPA's flash backend
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from benchmarks.common import as_cell, median_time

FEATURES = ["gqa", "window", "varlen", "mask", "dropout"]
GQA_SEQ = 4096
WINDOW, WINDOW_SEQ = 1024, 16384
VARLEN_TOTAL = 16384
MASK_SEQ = DROPOUT_SEQ = 4096
DROPOUT_P = 0.1


@dataclass
class Case:
    """One timed implementation of a feature: fn() runs its forward on `inputs` (leaves with grad)."""

    feature: str
    impl: str
    fn: Callable[[], torch.Tensor]
    inputs: list[torch.Tensor]
    baseline: bool = False
    pair: str = ""  # compared with the baseline of the same feature and pair


def _leaves(*shapes: tuple[int, ...], dev: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator(device=dev).manual_seed(0)
    return [torch.randn(s, device=dev, dtype=dtype, generator=generator).requires_grad_() for s in shapes]


def _flex(mask_mod, seqlen: int, dev: torch.device):
    """FlexAttention compiled, with the block mask of mask_mod over (seqlen, seqlen)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=dev)
    # The backward is timed again and again from one forward (retain_graph=True), which a compiled
    # backward that donates its saved buffers refuses; read when the first call compiles.
    torch._functorch.config.donated_buffer = False
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _sdpa(backend: str | None, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


def cases(feature: str, dev: torch.device, dtype: torch.dtype, batch: int) -> list[Case]:
    from flashattn_triton import flash_attention, flash_attention_varlen

    if feature == "gqa":
        q, k, v = _leaves((batch, 32, GQA_SEQ, 128), *[(batch, 4, GQA_SEQ, 128)] * 2, dev=dev, dtype=dtype)
        rows = []
        for causal in (True, False):
            pair = "causal" if causal else "not causal"
            sdpa = _sdpa(None, is_causal=causal, enable_gqa=True)
            rows += [
                Case(
                    feature,
                    f"flash_attention {pair}",
                    lambda c=causal: flash_attention(q, k, v, is_causal=c, enable_gqa=True),
                    [q, k, v],
                    pair=pair,
                ),
                Case(feature, f"sdpa enable_gqa {pair}", lambda f=sdpa: f(q, k, v), [q, k, v], True, pair),
            ]
        return rows
    if feature == "window":
        q, k, v = _leaves(*[(1, 16, WINDOW_SEQ, 64)] * 3, dev=dev, dtype=dtype)
        flex = _flex(lambda b, h, i, j: (i >= j) & (i - j <= WINDOW), WINDOW_SEQ, dev)
        return [
            Case(
                feature,
                f"flash_attention window {WINDOW}",
                lambda: flash_attention(q, k, v, is_causal=True, window_size=(WINDOW, 0)),
                [q, k, v],
            ),
            Case(feature, "flex_attention window", lambda: flex(q, k, v), [q, k, v], baseline=True),
            Case(
                feature,
                "flash_attention full causal",
                lambda: flash_attention(q, k, v, is_causal=True),
                [q, k, v],
            ),
        ]
    if feature == "varlen":
        rng = random.Random(0)
        cuts = sorted(rng.sample(range(1, VARLEN_TOTAL), 15))
        bounds = [0, *cuts, VARLEN_TOTAL]
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=dev)
        longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        q, k, v = _leaves(*[(VARLEN_TOTAL, 16, 64)] * 3, dev=dev, dtype=dtype)
        document = torch.repeat_interleave(
            torch.arange(len(bounds) - 1, device=dev),
            torch.tensor([b - a for a, b in zip(bounds, bounds[1:], strict=False)], device=dev),
        )
        flex = _flex(lambda b, h, i, j: (document[i] == document[j]) & (i >= j), VARLEN_TOTAL, dev)
        as_batch = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731  (total, H, d) -> (1, H, total, d)
        return [
            Case(
                feature,
                "flash_attention_varlen",
                lambda: flash_attention_varlen(
                    q, k, v, cu_seqlens, cu_seqlens, longest, longest, is_causal=True
                ),
                [q, k, v],
            ),
            Case(
                feature,
                "flex_attention document mask",
                lambda: flex(as_batch(q), as_batch(k), as_batch(v)),
                [q, k, v],
                baseline=True,
            ),
        ]
    if feature == "mask":
        q, k, v = _leaves(*[(2, 16, MASK_SEQ, 64)] * 3, dev=dev, dtype=dtype)
        generator = torch.Generator(device=dev).manual_seed(1)
        mask = torch.randn(1, 1, MASK_SEQ, MASK_SEQ, device=dev, generator=generator).to(dtype)
        sdpa = _sdpa("EFFICIENT_ATTENTION", attn_mask=mask)
        return [
            Case(feature, "flash_attention additive mask", lambda: flash_attention(q, k, v, mask), [q, k, v]),
            Case(feature, "sdpa efficient", lambda: sdpa(q, k, v), [q, k, v], baseline=True),
        ]
    if feature == "dropout":
        q, k, v = _leaves(*[(2, 16, DROPOUT_SEQ, 64)] * 3, dev=dev, dtype=dtype)
        sdpa = _sdpa("FLASH_ATTENTION", dropout_p=DROPOUT_P, is_causal=True)
        return [
            Case(
                feature,
                f"flash_attention dropout {DROPOUT_P}",
                lambda: flash_attention(q, k, v, dropout_p=DROPOUT_P, is_causal=True),
                [q, k, v],
            ),
            Case(feature, "sdpa flash", lambda: sdpa(q, k, v), [q, k, v], baseline=True),
        ]
    raise ValueError(f"unknown feature {feature!r}; choose from {', '.join(FEATURES)}")


def warm_case(case: Case) -> None:
    """One forward and backward: compiles, tunes and fills caches before any case of the feature is
    timed, so that no timing shares the host with a compile (a compiled baseline's first call starts the
    compiler's worker processes) or the GPU with a tuner."""
    out = case.fn()
    torch.autograd.grad(out, case.inputs, torch.randn_like(out))


def time_case(case: Case, timer: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """Median ms of the forward and of the backward (through autograd, its graph kept between repeats)."""
    out = case.fn()
    grad_out = torch.randn_like(out)
    return {
        "fwd ms": timer(case.fn),
        "bwd ms": timer(lambda: torch.autograd.grad(out, case.inputs, grad_out, retain_graph=True)),
    }


def run_features(
    features: list[str],
    dev: torch.device,
    dtype: torch.dtype,
    batch: int,
    timer: Callable[[Callable[[], object]], float],
    repeats: int = 1,
) -> pd.DataFrame:
    """One row per implementation of each feature, with 'x baseline' columns: the feature's baseline time
    over the row's. Each case is timed `repeats` times, in rounds over the feature's cases (so that a slow
    spell of the host or the GPU hits every implementation alike), and keeps the medians."""
    rows = []
    for feature in features:
        feature_cases = cases(feature, dev, dtype, batch)
        for case in feature_cases:
            warm_case(case)
        rounds = [[time_case(case, timer) for case in feature_cases] for _ in range(repeats)]
        timed = [(case, {which: median_time([r[i][which] for r in rounds]) for which in rounds[0][i]})
                 for i, case in enumerate(feature_cases)]  # fmt: skip
        for case, times in timed:
            base = next(t for c, t in timed if c.baseline and c.pair == case.pair)
            row = {"feature": feature, "impl": case.impl, **{k: as_cell(v, 4) for k, v in times.items()}}
            for which in ("fwd", "bwd"):
                row[f"{which} x baseline"] = as_cell(_ratio(base[f"{which} ms"], times[f"{which} ms"]), 3)
            rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def _ratio(numerator: float | str, denominator: float | str) -> float | str:
    """numerator / denominator, or the reason (a string) one of them has no time."""
    for value in (numerator, denominator):
        if isinstance(value, str):
            return value
    return numerator / denominator


def window_speedup(df: pd.DataFrame) -> str | None:
    """How many times faster the windowed pass ran than full causal attention (the issue's >= 6x)."""
    rows = df[df["feature"] == "window"].set_index("impl")
    full = [i for i in rows.index if i.endswith("full causal")]
    window = [i for i in rows.index if i.startswith("flash_attention window")]
    if not full or not window:
        return None
    speedups = {
        w: _ratio(rows.loc[full[0], f"{w} ms"], rows.loc[window[0], f"{w} ms"]) for w in ("fwd", "bwd")
    }
    parts = [f"{w} {x}" if isinstance(x, str) else f"{w} {x:.2f}x" for w, x in speedups.items()]
    return f"window {WINDOW} vs full causal at T={WINDOW_SEQ}: " + ", ".join(parts)
