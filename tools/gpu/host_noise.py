"""How much the host-bound cells of benchmarks.flash move between repeats: each small shape timed
ROUNDS times per implementation, the implementations interleaved, exactly as benchmarks.flash times
them (do_bench median, warm-up 5 ms, 25 ms); the last round with Python's garbage collector off.

    PYTHONPATH=packages/flashattn-triton/src:apps/benchmarks/src python3 tools/gpu/host_noise.py
"""

import gc
import sys

import pandas as pd
import torch

from benchmarks.flash import Shape, attention_fn, make_timer, measure

SHAPES = [(1, 1024, 64), (1, 2048, 16), (1, 4096, 32), (1, 8192, 128)]
IMPLS = ["triton", "sdpa-flash", "sdpa-cudnn"]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3

dev = torch.device("cuda")
timer = make_timer(dev, 5.0, 25.0)
rows = []
for round_index in range(ROUNDS + 1):
    collector = round_index < ROUNDS
    if not collector:
        gc.collect()
        gc.disable()
    for batch_heads, seq, head_dim in SHAPES:
        for impl in IMPLS:
            times = measure(attention_fn(impl, dev), Shape(batch_heads, seq, head_dim, "bfloat16"), True,
                            ["fwd", "bwd"], dev, timer)  # fmt: skip
            rows.append({"shape": f"{batch_heads}x{seq}x{head_dim}", "impl": impl,
                         "round": round_index if collector else "gc off", **times})  # fmt: skip
gc.enable()
df = pd.DataFrame(rows)
for which in ("fwd", "bwd"):
    table = df.pivot_table(index=["shape", "impl"], columns="round", values=which, aggfunc="first")
    print(f"== {which} ms by round (interleaved; last column: garbage collector off)")
    print(table.round(4).to_string())
