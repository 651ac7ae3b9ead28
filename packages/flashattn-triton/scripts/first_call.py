"""How long a fresh process waits for its first flash_attention result: with an empty tuning cache, then
with the cache the first process filled (each in a process of its own, sharing one cache directory).

    PYTHONPATH=packages/flashattn-triton/src python packages/flashattn-triton/scripts/first_call.py

Each process first starts CUDA (torch's context, not timed), then times its first forward+backward
(bfloat16, causal, synchronized), then a second one. Triton's own kernel cache (~/.triton/cache) is
warm in every process after the first: that is what a user's second run sees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = ["4x8x2048x64", "2x16x4096x128"]


def child(shape: str) -> None:
    """One process's measurement, printed as JSON."""
    import torch

    torch.ones(1, device="cuda").sum().item()  # CUDA's context, before the clock starts
    start = time.perf_counter()
    import flashattn_triton

    imported = time.perf_counter() - start
    batch, heads, seqlen, head_dim = map(int, shape.split("x"))
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        flashattn_triton.flash_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(json.dumps({"import s": imported, "first call s": times[0], "second call ms": times[1] * 1e3}))


def measure(shape: str, cache: str) -> dict[str, float]:
    env = {**os.environ, "FLASHATTN_TRITON_CACHE_DIR": cache}
    result = subprocess.run([sys.executable, __file__, "--child", shape], env=env, capture_output=True,
                            text=True, check=True)  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="BxHxTxD list")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    with tempfile.TemporaryDirectory() as cache:
        for shape in args.shapes.split(","):
            cold = measure(shape, cache)
            warm = measure(shape, cache)
            print(f"{shape} bf16 causal fwd+bwd: first call {cold['first call s']:.2f} s with an empty "
                  f"tuning cache, {warm['first call s']:.2f} s with a warm one (import "
                  f"{warm['import s']:.2f} s); second call {warm['second call ms']:.2f} ms")


if __name__ == "__main__":
    main()
