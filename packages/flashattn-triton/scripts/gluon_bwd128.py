"""GPU time of every backward candidate (the Triton-language kernel's, then the Gluon kernel's, one
program a key tile and persistent) next to SDPA's backward, on issue 20's problems: at d = 128 grouped-query
attention 32:4 at T = 4096, causal and not, and 16 heads without groups, causal; at d = 64, 16 heads at
T = 16384, causal and with a causal sliding window of 1024 (bf16, one batch element; SDPA takes no window:
there the first candidate's gradients are the reference).

    PYTHONPATH=packages/flashattn-triton/src python packages/flashattn-triton/scripts/gluon_bwd128.py
    PYTHONPATH=packages/flashattn-triton/src python packages/flashattn-triton/scripts/gluon_bwd128.py \
        --problems mha-16-d64-causal,mha-16-d64-window-1024

The candidates are _planning.candidates(problem), the list the launcher tunes among; each is timed as the
tuner times it (_launcher.gpu_milliseconds: GPU time a call, the best of --rounds), the whole backward call
(D's preprocess, the kernel, the dQ conversion, the group sums of dK and dV), and its gradients compared
with SDPA's. A pool of processes first compiles every candidate on a small problem of the same
specialization (Triton's disk cache then serves the timed ones).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import time

import torch
import torch.nn.functional as F

from flashattn_triton import _hopper, _planning
from flashattn_triton._inputs import input_precision
from flashattn_triton._launcher import gpu_milliseconds
from flashattn_triton._planning import Problem, describe
from flashattn_triton.triton_impl import triton_backward, triton_forward

# name: (query heads, K/V heads, T, causal, head dim, a causal window's left size or None); batch 1, bf16
PROBLEMS = {
    "gqa-32:4-causal": (32, 4, 4096, True, 128, None),
    "gqa-32:4-full": (32, 4, 4096, False, 128, None),
    "mha-16-causal": (16, 16, 4096, True, 128, None),
    "mha-16-d64-causal": (16, 16, 16384, True, 64, None),
    "mha-16-d64-window-1024": (16, 16, 16384, True, 64, 1024),
}
DTYPE = torch.bfloat16
# SDPA's own choice first (the one issue 20 compares with), then each backend that takes the problem
SDPA_BACKENDS = {"default": None, "cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION"}  # fmt: skip


def inputs(heads: int, kv_heads: int, seqlen: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, heads, seqlen, head_dim), (1, kv_heads, seqlen, head_dim), (1, kv_heads, seqlen, head_dim),
              (1, heads, seqlen, head_dim)]  # fmt: skip
    return tuple(torch.randn(s, device="cuda", dtype=DTYPE, generator=generator) for s in shapes)


def window_of(left: int | None) -> tuple[int, int] | None:
    return None if left is None else (left, 0)


def candidates(heads: int, kv_heads: int, seqlen: int, is_causal: bool, head_dim: int,
               left: int | None) -> list:  # fmt: skip
    """The backward candidates the launcher tunes among for this problem (as triton_impl plans it)."""
    q, k, v, grad_out = (torch.empty(1, h, seqlen, head_dim, device="cuda", dtype=DTYPE)
                         for h in (heads, kv_heads, kv_heads, heads))  # fmt: skip
    band = _planning.band_of(window_of(left), is_causal)
    hopper = _hopper.supports("bwd", q, (q, k, v, grad_out, grad_out), head_dim, band)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    problem = Problem("bwd", heads, seqlen, seqlen, head_dim, DTYPE, is_causal, input_precision(DTYPE),
                      sm_count, hopper=hopper, band_span=_planning.band_span(band, seqlen, seqlen),
                      group=heads // kv_heads)  # fmt: skip
    return _planning.candidates(problem)


def compile_job(job: tuple) -> tuple[tuple, str]:
    """One candidate's backward once on a small problem with the same specializations (the large-problem
    path, the group's size 1 or not, causal or not)."""
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"
    _planning.SMALL_PROBLEM_WORK = 0
    name, config = job
    heads, kv_heads, _, is_causal, head_dim, left = PROBLEMS[name]
    window = None if left is None else (64, 0)  # (a window narrower than the small problem: its edge steps)
    try:
        q, k, v, grad_out = inputs(heads, kv_heads, 256, head_dim)
        out, lse = triton_forward(q, k, v, is_causal, head_dim**-0.5, window=window)
        triton_backward(q, k, v, out, lse, grad_out, is_causal, head_dim**-0.5, config, window=window)
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as exc:  # reported; the others go on
        return job, f"{type(exc).__name__}: {str(exc)[:200]}"


def sdpa_backward(backend: str | None, q, k, v, grad_out, is_causal: bool):
    """A callable running SDPA's backward with one backend (None: SDPA's choice), and its gradients; None
    where it refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    chosen = contextlib.nullcontext() if backend is None else sdpa_kernel(getattr(SDPBackend, backend))
    try:
        with chosen:
            out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    except RuntimeError:
        return None, None
    return (lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)), grads


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def time_problem(name: str, failed: dict, rounds: int, rep: float) -> None:
    """Print SDPA's backward GPU time per backend, then each candidate's, its speed against the first SDPA
    backend and its gradients' largest relative error against SDPA's."""
    heads, kv_heads, seqlen, is_causal, head_dim, left = PROBLEMS[name]
    scale, window = head_dim**-0.5, window_of(left)
    q, k, v, grad_out = inputs(heads, kv_heads, seqlen, head_dim)
    print(f"\n{name}: q (1, {heads}, {seqlen}, {head_dim}), k/v {kv_heads} heads, bf16, "
          f"{'causal' if is_causal else 'not causal'}{f', window {window}' if window else ''}; "
          f"backward GPU ms (best of {rounds})")  # fmt: skip
    reference, sdpa_ms = None, {}
    for label, backend in SDPA_BACKENDS.items() if window is None else ():
        run, grads = sdpa_backward(backend, q, k, v, grad_out, is_causal)
        if run is not None:
            sdpa_ms[label] = min(gpu_milliseconds(run, rep) for _ in range(rounds))
            reference = reference or grads
            print(f"  {'sdpa ' + label:32s} {sdpa_ms[label]:7.3f}")
    versus = next(iter(sdpa_ms), None)
    out, lse = triton_forward(q, k, v, is_causal, scale, window=window)
    times = {}
    for config in candidates(*PROBLEMS[name]):
        if (name, config) in failed:
            continue
        run = functools.partial(triton_backward, q, k, v, out, lse, grad_out, is_causal, scale, config,
                                window=window)  # fmt: skip
        grads = run()
        reference = reference or grads
        times[config] = min(gpu_milliseconds(run, rep) for _ in range(rounds))
        errors = [relative_error(g, r) for g, r in zip(grads, reference, strict=True)]
        speed = f"{sdpa_ms[versus] / times[config]:.3f}x sdpa {versus}" if versus else ""
        print(f"  {describe(config):32s} {times[config]:7.3f}  {speed}  err {max(errors):.1e}", flush=True)
    if times:
        fastest = min(times, key=times.get)
        print(f"  fastest: {describe(fastest)} {times[fastest]:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=",".join(PROBLEMS), help=f"from {', '.join(PROBLEMS)}")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each candidate; the best is kept")
    parser.add_argument("--rep", type=float, default=40.0, help="GPU milliseconds a timing queues")
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"  # each candidate is named; the forward runs the default
    names = [n for n in args.problems.split(",") if n]

    start = time.time()
    jobs = [(name, c) for name in names for c in candidates(*PROBLEMS[name])]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(args.workers, len(jobs)), mp_context=context) as pool:
        failed = {job: status for job, status in pool.map(compile_job, jobs) if status != "ok"}
    print(f"compiled {len(jobs)} candidates in {time.time() - start:.0f} s; {len(failed)} failed", flush=True)
    for (name, config), status in failed.items():
        print(f"  failed: {name} {describe(config)}: {status}")

    for name in names:
        time_problem(name, failed, args.rounds, args.rep)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
