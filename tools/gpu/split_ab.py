"""The forward with split key tiles (ForwardConfig.kv_splits) against one program per query tile, in one
process: each pass timed as benchmarks.flash times it (do_bench median with its L2 flush, us) and as host
time a call, the config the tuner chose, then where a split forward's host time goes (cProfile) and its
GPU timeline (torch.profiler).

    PYTHONPATH=packages/flashattn-triton/src:tools/gpu python3 tools/gpu/split_ab.py
"""

import cProfile
import pstats

import torch
from host_timing import cell_us, host_us

from flashattn_triton import FlashAttentionTriton, _configs, triton_impl

SHAPES = [(1024, 64, torch.bfloat16), (4096, 64, torch.bfloat16), (4096, 128, torch.bfloat16),
          (16384, 64, torch.bfloat16), (4096, 64, torch.float32)]  # fmt: skip
SPLITS = _configs.KV_SPLITS


def fresh(splits: tuple) -> None:
    _configs.KV_SPLITS = splits
    triton_impl._plans.clear()
    triton_impl._chosen.clear()


def chosen() -> str:
    return ", ".join(triton_impl._describe(c) for key, c in triton_impl._chosen.items() if key[0] == "fwd")


def compare() -> None:
    for seq, head_dim, dtype in SHAPES:
        q, k, v = (torch.randn(1, 1, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        grad = torch.randn_like(q)
        print(f"== (1, {seq}, {head_dim}) {str(dtype)[6:]} causal, us")
        print(f"{'forward':14s} {'fwd cell':>9s} {'fwd host':>9s} {'f+b cell':>9s} {'f+b host':>9s}  config")
        for round_index in range(2):
            for name, splits in (("one program", ()), ("split", SPLITS)):
                fresh(splits)
                FlashAttentionTriton.apply(q, k, v, True)  # tunes
                fwd = lambda: FlashAttentionTriton.apply(q, k, v, True)  # noqa: E731, B023
                both = lambda: torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), grad)  # noqa: E731, B023
                row = [cell_us(fwd), host_us(fwd, calls=200, warmup=20), cell_us(both),
                       host_us(both, calls=200, warmup=20)]  # fmt: skip
                numbers = " ".join(f"{x:9.1f}" for x in row)
                print(f"{name:14s} {numbers}  {chosen()}  round {round_index}")
    fresh(SPLITS)


def where_the_host_time_goes(seq: int = 1024, head_dim: int = 64) -> None:
    q, k, v = (torch.randn(1, 1, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    for name, splits in (("one program", ()), ("split", SPLITS)):
        fresh(splits)
        for _ in range(50):
            FlashAttentionTriton.apply(q, k, v, True)
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            FlashAttentionTriton.apply(q, k, v, True)
        profile.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, (1, {seq}, {head_dim}) bf16 forward, {name} ({chosen()}), 500 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                FlashAttentionTriton.apply(q, k, v, True)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))


if __name__ == "__main__":
    compare()
    where_the_host_time_goes()
