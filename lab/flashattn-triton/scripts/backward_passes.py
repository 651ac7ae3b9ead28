"""The backward's passes beside its kernel, against the bandwidth floor: D's preprocess (which also zeroes
the float32 dQ sum), the same as zero_() then a D-only pass, the dQ conversion, and a 256 MB copy, each in
GPU time a call (_launcher.gpu_milliseconds, the tuner's timer; median of 5); then the persistent window
schedule's balance, counted in steps.

    PYTHONPATH=packages/flashattn-triton/src python lab/flashattn-triton/scripts/backward_passes.py \
        [--heads 16] [--seqlen 16384] [--window 1024]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import triton

from flashattn_triton import _hopper, _launcher

HEAD_DIM, BLOCK_M, BLOCK_N = 64, 64, 128  # the persistent Gluon backward's steps at d = 64


def microseconds(fn: Callable[[], object]) -> float:
    return statistics.median(_launcher.gpu_milliseconds(fn, 20.0) for _ in range(5)) * 1e3


def passes(heads: int, seqlen: int) -> None:
    kernels = _launcher.kernels()
    generator = torch.Generator(device="cuda").manual_seed(0)
    out, grad_out = (torch.randn(1, heads, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                 generator=generator) for _ in range(2))  # fmt: skip
    delta = torch.empty(1, heads, seqlen, device="cuda")
    dq_sum = torch.empty(1, heads, seqlen, HEAD_DIM, device="cuda")
    dq = torch.empty_like(out)
    source = torch.empty(2**27, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)

    def preprocess(zeroes: bool) -> None:
        kernels.attn_bwd_preprocess[(heads, seqlen // 64)](
            out, grad_out, delta, dq_sum if zeroes else None, *out.stride()[:3], *grad_out.stride()[:3],
            heads, seqlen, HEAD_DIM, seqlen, BLOCK_D=HEAD_DIM, BLOCK_M=64,
        )  # fmt: skip

    copy_us = microseconds(lambda: target.copy_(source))
    bandwidth = 2 * source.nbytes / copy_us  # bytes a µs
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"(1, {heads}, {seqlen}, {HEAD_DIM}) bf16")  # fmt: skip
    print(f"  copy of {source.nbytes / 2**20:.0f} MB: {copy_us:.1f} us, {bandwidth / 1e6:.2f} TB/s moved")
    preprocess_bytes = 2 * out.nbytes + dq_sum.nbytes + delta.nbytes
    # (name, the pass, the bytes it must move or None)
    timed = [("preprocess (D, zeroed sum)", lambda: preprocess(True), preprocess_bytes),
             ("zero_() then D-only preprocess", lambda: (dq_sum.zero_(), preprocess(False)), None),
             ("dQ conversion", lambda: dq.copy_(dq_sum), dq_sum.nbytes + dq.nbytes)]  # fmt: skip
    for name, fn, moved in timed:
        floor = "" if moved is None else f"  (floor {moved / bandwidth:.1f} us)"
        print(f"  {name:32s} {microseconds(fn):7.1f} us{floor}")


def schedule(heads: int, seqlen: int, window: int, programs: int) -> None:
    """Steps of the busiest persistent program against the average: the backward's work schedule under a
    causal window (_hopper.work_schedule), each key tile's steps as _hopper.tile_steps counts them."""
    steps = _hopper.tile_steps("bwd", seqlen, BLOCK_M, BLOCK_N, True, window)
    programs = min(programs, len(steps) * heads)
    table = _hopper.work_schedule("bwd", steps, heads, programs, torch.device("cpu")).tolist()
    offsets, items = table[: programs + 1], table[programs + 1 :]
    load = [sum(steps[item // heads] for item in items[offsets[p] : offsets[p + 1]]) for p in range(programs)]
    print(f"  window {window}: {len(steps) * heads} items over {programs} programs: "
          f"busiest {max(load)} steps, average {sum(load) / programs:.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=16384, help="a multiple of 128")
    parser.add_argument("--window", type=int, default=1024, help="the causal window's left size")
    args = parser.parse_args()
    passes(args.heads, args.seqlen)
    schedule(args.heads, args.seqlen, args.window, torch.cuda.get_device_properties(0).multi_processor_count)


if __name__ == "__main__":
    main()
