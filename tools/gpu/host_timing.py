"""Host time of a call, shared by the tools/gpu scripts (each runs as `python3 tools/gpu/NAME.py`)."""

import time

import torch


def host_us(fn, calls: int = 300, warmup: int = 30) -> float:
    """Microseconds of host time a call, after a warm-up (no synchronization inside the loop)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6
