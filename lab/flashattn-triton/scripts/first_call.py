"""How long a fresh process waits for its first flash_attention result: with an empty tuning cache, then
with the cache the first process filled (each in a process of its own, sharing one cache directory).

    PYTHONPATH=packages/flashattn-triton/src python packages/flashattn-triton/scripts/first_call.py

Each process first starts CUDA (torch's context, not timed), then times importing flashattn_triton, its
first forward and first backward (bfloat16, causal, each synchronized), then a second forward+backward.
Triton's own kernel cache (~/.triton/cache) is warm in every process after the first, and so is Python's
bytecode: the processes share a PYTHONPYCACHEPREFIX (and may write it, whatever PYTHONDONTWRITEBYTECODE
says), so that modules the first one compiled (torch's, where its install holds no .pyc) are not compiled
again, as in a normal install. That is what a user's second run sees.
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
    times = {}
    for call in ("first", "second"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = flashattn_triton.flash_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        forward = time.perf_counter() - start
        out.sum().backward()
        torch.cuda.synchronize()
        times[call] = (forward, time.perf_counter() - start - forward)
    print(json.dumps({"import s": imported, "first forward s": times["first"][0],
                      "first backward s": times["first"][1], "first call s": sum(times["first"]),
                      "second call ms": sum(times["second"]) * 1e3}))  # fmt: skip


def measure(shape: str, cache: str, pycache: str) -> dict[str, float]:
    env = {**os.environ, "FLASHATTN_TRITON_CACHE_DIR": cache, "PYTHONPYCACHEPREFIX": pycache}
    # A container may set PYTHONDONTWRITEBYTECODE, and then every process compiles Triton's and torch's
    # lazily imported modules from source again: not what a user's second run sees.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as pycache:
        for shape in args.shapes.split(","):
            cold = measure(shape, cache, pycache)
            warm = measure(shape, cache, pycache)
            print(f"{shape} bf16 causal fwd+bwd: first call {cold['first call s']:.2f} s with an empty "
                  f"tuning cache, {warm['first call s']:.2f} s with a warm one (import "
                  f"{warm['import s']:.2f} s, first forward {warm['first forward s']:.2f} s, first backward "
                  f"{warm['first backward s']:.2f} s); second call {warm['second call ms']:.2f} ms")


if __name__ == "__main__":
    main()
