"""GPU time of every forward or backward candidate (the Triton-language kernel's, then the Gluon kernel's,
one program a tile and persistent) next to SDPA's, on issue 20's problems and the compiled xl model's: at
d = 128 grouped-query attention 32:4 at T = 4096, causal and not, and 16 heads without groups, causal; at
d = 64, 16 heads at T = 16384, causal and with a causal sliding window of 1024 (SDPA takes no window: there
the first candidate's results are the reference), and xl's attention at T = 2048 and 4096 (25 heads, causal,
(B, T, H, d) memory as the model's views are). bf16.

    PYTHONPATH=packages/flashattn-triton/src python lab/flashattn-triton/scripts/gluon_candidates.py
    PYTHONPATH=packages/flashattn-triton/src python lab/flashattn-triton/scripts/gluon_candidates.py \
        --pass fwd --problems xl-2048,mha-16-d64-window-1024

The candidates are _configs.candidates(problem), the list the launcher tunes among; each is timed as the
tuner times it (_launcher.gpu_milliseconds: GPU time a call, the best of --rounds), the whole call (the
backward's: D's preprocess, the kernel, the dQ conversion, the group sums of dK and dV), and its results
compared with SDPA's. A pool of processes first compiles every candidate on a small problem of the same
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

from flashattn_triton import _configs, _dispatch
from flashattn_triton._configs import Problem, describe
from flashattn_triton._inputs import input_precision
from flashattn_triton._launcher import gpu_milliseconds
from flashattn_triton.triton_impl import triton_backward, triton_forward

# name: (batch, query heads, K/V heads, T, causal, head dim, a causal window's left size or None, memory)
PROBLEMS = {
    "gqa-32:4-causal": (1, 32, 4, 4096, True, 128, None, "bhtd"),
    "gqa-32:4-full": (1, 32, 4, 4096, False, 128, None, "bhtd"),
    "mha-16-causal": (1, 16, 16, 4096, True, 128, None, "bhtd"),
    "mha-16-d64-causal": (1, 16, 16, 16384, True, 64, None, "bhtd"),
    "mha-16-d64-window-1024": (1, 16, 16, 16384, True, 64, 1024, "bhtd"),
    "xl-2048": (4, 25, 25, 2048, True, 64, None, "bthd"),
    "xl-4096": (2, 25, 25, 4096, True, 64, None, "bthd"),
}
DTYPE = torch.bfloat16
# SDPA's own choice first (the one issue 20 compares with), then each backend that takes the problem
SDPA_BACKENDS = {"default": None, "cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION"}  # fmt: skip


def inputs(batch: int, heads: int, kv_heads: int, seqlen: int, head_dim: int, layout: str) -> tuple:
    """q, k, v and a gradient of the output, (B, H, T, d) tensors in that memory or (layout "bthd") in
    (B, T, H, d) memory."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    made = []
    for h in (heads, kv_heads, kv_heads, heads):
        shape = (batch, h, seqlen, head_dim) if layout == "bhtd" else (batch, seqlen, h, head_dim)
        t = torch.randn(shape, device="cuda", dtype=DTYPE, generator=generator)
        made.append(t if layout == "bhtd" else t.transpose(1, 2))
    return tuple(made)


def window_of(left: int | None) -> tuple[int, int] | None:
    return None if left is None else (left, 0)


def candidates(pass_name: str, tensors: tuple, is_causal: bool, left: int | None) -> list:
    """The candidates the launcher tunes among for this pass of the problem of `tensors` (inputs'
    (q, k, v, grad_out)), as triton_impl plans it."""
    q, k, v, grad_out = tensors
    (batch, heads, seqlen, head_dim), kv_heads = q.shape, k.shape[1]
    band = _configs.band_of(window_of(left), is_causal)
    taken = (q, k, v) if pass_name == "fwd" else (q, k, v, grad_out, grad_out)
    window = _dispatch.window_of(window_of(left), is_causal)
    hopper = _dispatch.choose(_dispatch.describe(pass_name, q, k, taken, window=window)) == _dispatch.GLUON
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    span, group = _configs.band_span(band, seqlen, seqlen), heads // kv_heads
    problem = Problem(pass_name, batch * heads, seqlen, seqlen, head_dim, DTYPE, is_causal,
                      input_precision(DTYPE), sm_count, hopper=hopper, band_span=span, group=group)
    return _configs.candidates(problem)


def problem_candidates(pass_name: str, name: str) -> list:
    batch, heads, kv_heads, seqlen, is_causal, head_dim, left, layout = PROBLEMS[name]
    return candidates(pass_name, inputs(batch, heads, kv_heads, seqlen, head_dim, layout), is_causal, left)


def compile_job(job: tuple) -> tuple[tuple, str]:
    """One candidate once on a small problem with the same specializations (the large-problem path, the
    group's size 1 or not, causal or not, the memory layout); a backward after a forward of the default."""
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"
    _configs.SMALL_PROBLEM_WORK = 0
    pass_name, name, config = job
    _, heads, kv_heads, _, is_causal, head_dim, left, layout = PROBLEMS[name]
    window = None if left is None else (64, 0)  # (a window narrower than the small problem: its edge steps)
    try:
        q, k, v, grad_out = inputs(1, heads, kv_heads, 256, head_dim, layout)
        forward = config if pass_name == "fwd" else None
        out, lse = triton_forward(q, k, v, is_causal, head_dim**-0.5, forward, window=window)
        if pass_name == "bwd":
            triton_backward(q, k, v, out, lse, grad_out, is_causal, head_dim**-0.5, config, window=window)
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as exc:  # reported; the others go on
        return job, f"{type(exc).__name__}: {str(exc)[:200]}"


def sdpa_pass(pass_name: str, backend: str | None, q, k, v, grad_out, is_causal: bool):
    """A callable running SDPA's pass with one backend (None: SDPA's choice), and its results (the
    output, or the gradients); None where it refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().requires_grad_(pass_name == "bwd") for t in (q, k, v)]

    def forward():
        with contextlib.nullcontext() if backend is None else sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True)

    try:
        if pass_name == "fwd":
            return forward, (forward(),)
        out = forward()
        grads = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    except RuntimeError:
        return None, None
    return (lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)), grads


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def time_problem(pass_name: str, name: str, failed: dict, rounds: int, rep: float) -> None:
    """Print SDPA's GPU time for the pass per backend, then each candidate's, its speed against the first
    SDPA backend and its results' largest relative error against SDPA's."""
    batch, heads, kv_heads, seqlen, is_causal, head_dim, left, layout = PROBLEMS[name]
    scale, window = head_dim**-0.5, window_of(left)
    q, k, v, grad_out = tensors = inputs(batch, heads, kv_heads, seqlen, head_dim, layout)
    print(f"\n{name}: q ({batch}, {heads}, {seqlen}, {head_dim}) in {layout} memory, k/v {kv_heads} heads, "
          f"bf16, {'causal' if is_causal else 'not causal'}{f', window {window}' if window else ''}; "
          f"{pass_name} GPU ms (best of {rounds})")  # fmt: skip
    reference, sdpa_ms = None, {}
    for label, backend in SDPA_BACKENDS.items() if window is None else ():
        run, results = sdpa_pass(pass_name, backend, q, k, v, grad_out, is_causal)
        if run is not None:
            sdpa_ms[label] = min(gpu_milliseconds(run, rep) for _ in range(rounds))
            reference = reference or results
            print(f"  {'sdpa ' + label:32s} {sdpa_ms[label]:7.3f}")
    versus = next(iter(sdpa_ms), None)
    if pass_name == "bwd":  # (the forward's default config: every backward candidate starts from it)
        out, lse = triton_forward(q, k, v, is_causal, scale, window=window)
    times = {}
    for config in candidates(pass_name, tensors, is_causal, left):
        if (pass_name, name, config) in failed:
            continue
        if pass_name == "fwd":
            run = functools.partial(triton_forward, q, k, v, is_causal, scale, config, window=window)
        else:
            run = functools.partial(triton_backward, q, k, v, out, lse, grad_out, is_causal, scale, config,
                                    window=window)  # fmt: skip
        results = run()[:1] if pass_name == "fwd" else run()
        reference = reference or results
        times[config] = min(gpu_milliseconds(run, rep) for _ in range(rounds))
        errors = [relative_error(g, r) for g, r in zip(results, reference, strict=True)]
        speed = f"{sdpa_ms[versus] / times[config]:.3f}x sdpa {versus}" if versus else ""
        print(f"  {describe(config):32s} {times[config]:7.3f}  {speed}  err {max(errors):.1e}", flush=True)
    if times:
        fastest = min(times, key=times.get)
        print(f"  fastest: {describe(fastest)} {times[fastest]:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pass", dest="passes", default="bwd", help="fwd, bwd or fwd,bwd")
    parser.add_argument("--problems", default=",".join(PROBLEMS), help=f"from {', '.join(PROBLEMS)}")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each candidate; the best is kept")
    parser.add_argument("--rep", type=float, default=40.0, help="GPU milliseconds a timing queues")
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"  # each candidate is named; the forward runs the default
    names = [n for n in args.problems.split(",") if n]
    passes = [p for p in args.passes.split(",") if p]
    if unknown := [n for n in names if n not in PROBLEMS] + [p for p in passes if p not in ("fwd", "bwd")]:
        parser.error(f"unknown problems or passes: {', '.join(unknown)}")

    start = time.time()
    jobs = [(p, name, c) for p in passes for name in names for c in problem_candidates(p, name)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(args.workers, len(jobs)), mp_context=context) as pool:
        failed = {job: status for job, status in pool.map(compile_job, jobs) if status != "ok"}
    print(f"compiled {len(jobs)} candidates in {time.time() - start:.0f} s; {len(failed)} failed", flush=True)
    for (pass_name, name, config), status in failed.items():
        print(f"  failed: {pass_name} {name} {describe(config)}: {status}")

    for pass_name in passes:
        for name in names:
            time_problem(pass_name, name, failed, args.rounds, args.rep)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
