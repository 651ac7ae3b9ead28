"""Time candidate block configs of the Triton kernels on this GPU, next to SDPA's flash and cuDNN backends.

    PYTHONPATH=packages/flashattn-triton/src python packages/flashattn-triton/scripts/tune.py --out tune.csv

Every candidate is compiled first by a pool of worker processes (Triton's on-disk cache then serves
the timing process), then timed with triton.testing.do_bench (median), and its output checked
against SDPA's. Prints, per (pass, shape), the best config and the speedup over each SDPA backend;
the chosen configs go into src/flashattn_triton/_configs.py by hand, with the numbers in PERF.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import time
from dataclasses import astuple

import torch
import torch.nn.functional as F

from flashattn_triton._configs import BackwardConfig as B
from flashattn_triton._configs import ForwardConfig as Fw
from flashattn_triton.triton_impl import _block_d, triton_backward, triton_forward

# The first candidate of each list is the current default of _configs.py.
FORWARD = {
    (64, 2): [Fw(128, 64, 4, 3), Fw(128, 64, 8, 3), Fw(128, 128, 8, 3), Fw(128, 128, 4, 3), Fw(64, 64, 4, 3),
              Fw(64, 128, 4, 3), Fw(128, 32, 4, 4), Fw(128, 64, 4, 4)],
    (128, 2): [Fw(128, 64, 8, 3), Fw(128, 128, 8, 2), Fw(128, 64, 4, 3), Fw(64, 64, 4, 3), Fw(64, 128, 4, 2),
               Fw(128, 32, 4, 3), Fw(128, 64, 8, 4), Fw(64, 64, 4, 4)],
    (64, 4): [Fw(64, 32, 4, 2), Fw(128, 32, 8, 2), Fw(64, 32, 8, 2), Fw(64, 64, 8, 2), Fw(64, 16, 4, 3)],
    (128, 4): [Fw(64, 32, 8, 2), Fw(64, 32, 4, 2), Fw(128, 32, 8, 2), Fw(64, 16, 4, 2), Fw(64, 16, 8, 2)],
}
BACKWARD = {
    (64, 2): [B(32, 128, 4, 3), B(32, 128, 8, 3), B(64, 128, 8, 2), B(64, 128, 8, 3), B(32, 64, 4, 3),
              B(16, 64, 4, 4), B(32, 128, 4, 4), B(32, 128, 8, 3, True), B(64, 128, 8, 2, True),
              B(32, 64, 4, 3, True)],
    (128, 2): [B(32, 128, 8, 2), B(64, 128, 8, 2), B(32, 128, 8, 3), B(32, 64, 4, 3), B(16, 64, 4, 3),
               B(64, 64, 8, 2), B(32, 128, 8, 2, True), B(32, 64, 4, 3, True)],
    (64, 4): [B(32, 128, 8, 2), B(32, 64, 8, 2), B(16, 64, 8, 2), B(16, 32, 4, 2), B(32, 128, 8, 2, True)],
    (128, 4): [B(16, 64, 8, 1), B(32, 64, 8, 1), B(16, 32, 8, 2), B(16, 32, 4, 2), B(16, 64, 8, 1, True)],
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def candidates(which: str, head_dim: int, dtype: torch.dtype) -> list:
    table = FORWARD if which == "fwd" else BACKWARD
    return table[(max(64, _block_d(head_dim)), torch.empty((), dtype=dtype).element_size())]


def problem(batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(1, batch_heads, seq, head_dim, device="cuda", dtype=dtype, generator=generator)
        for _ in range(4)
    ]


def run_once(which: str, config, batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype, causal: bool):
    q, k, v, grad_out = problem(batch_heads, seq, head_dim, dtype)
    scale = head_dim**-0.5
    if which == "fwd":
        return lambda: triton_forward(q, k, v, causal, scale, config)
    out, lse = triton_forward(q, k, v, causal, scale)
    return lambda: triton_backward(q, k, v, out, lse, grad_out, causal, scale, config)


def compile_job(job: tuple) -> tuple[tuple, str]:
    """Compile (and run once) one candidate on a small problem with the same specializations."""
    which, config, heads, head_dim, dtype_name, causal = job
    try:
        run_once(which, config, heads, 256, head_dim, DTYPES[dtype_name], causal)()
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as exc:  # OutOfResources, compiler errors: the candidate is out
        return job, f"{type(exc).__name__}: {str(exc)[:120]}"


def time_sdpa(q, k, v, grad_out, causal: bool, rep: float):
    """{(backend, pass): ms} for the SDPA backends that take these inputs, and the last one's output."""
    from triton.testing import do_bench

    times, reference = {}, None
    for backend in ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]:
        try:
            out = sdpa_reference(backend, q, k, v, causal)
        except RuntimeError:
            continue
        times[(backend, "fwd")] = do_bench(
            lambda b=backend: sdpa_reference(b, q, k, v, causal), warmup=5, rep=rep, return_mode="median"
        )
        times[(backend, "bwd")] = do_bench(
            lambda out=out: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
            warmup=5,
            rep=rep,
            return_mode="median",
        )
        reference = out.detach()
    return times, reference


def sdpa_reference(backend: str, q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default="1x1024x64,1x4096x64,1x16384x64,1x65536x64,16x16384x64,"
        "1x1024x128,1x4096x128,1x16384x128,1x65536x128,64x4096x128,"
        "1x1024x16,1x16384x16,1x1024x32,1x16384x32",
        help="BATCH*HEADSxTxD list, timed in bfloat16",
    )
    parser.add_argument("--fp32-shapes", default="1x4096x64,1x16384x64,1x4096x128,1x16384x128")
    parser.add_argument("--passes", default="fwd,bwd")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--rep", type=float, default=25.0)
    parser.add_argument("--out", default="tune.csv")
    args = parser.parse_args()
    from triton.testing import do_bench

    causal = True
    shapes = [(*map(int, s.split("x")), "bfloat16") for s in args.shapes.split(",") if s]
    shapes += [(*map(int, s.split("x")), "float32") for s in args.fp32_shapes.split(",") if s]
    passes = args.passes.split(",")
    jobs = sorted(
        {
            (which, config, 1 if bh == 1 else 16, d, dtype, causal)
            for bh, _, d, dtype in shapes
            for which in passes
            for config in candidates(which, d, DTYPES[dtype])
        },
        key=str,
    )
    start = time.time()
    failed = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        for job, status in pool.map(compile_job, jobs):
            if status != "ok":
                failed[job] = status
    print(f"compiled {len(jobs)} candidates in {time.time() - start:.0f} s; {len(failed)} failed", flush=True)
    for job, status in failed.items():
        print("  failed:", job[0], job[1], f"d={job[3]}", job[4], status)

    rows = []
    for bh, seq, d, dtype_name in shapes:
        dtype = DTYPES[dtype_name]
        q, k, v, grad_out = problem(bh, seq, d, dtype)
        for t in (q, k, v):
            t.requires_grad_()
        flops_fwd = 4.0 * bh * seq * seq * d / 2
        sdpa, reference = time_sdpa(q, k, v, grad_out, causal, args.rep)
        ref_grads = None
        for which in passes:
            flops = flops_fwd * (1.0 if which == "fwd" else 2.5)
            for config in candidates(which, d, dtype):
                if (which, config, 1 if bh == 1 else 16, d, dtype_name, causal) in failed:
                    continue
                try:
                    fn = run_once(which, config, bh, seq, d, dtype, causal)
                    result = fn()
                    ms = do_bench(fn, warmup=5, rep=args.rep, return_mode="median")
                except Exception as exc:
                    print(
                        "  error", which, config, bh, seq, d, dtype_name, type(exc).__name__, str(exc)[:100]
                    )
                    continue
                if which == "fwd":
                    err = ((result[0].float() - reference.float()).norm() / reference.float().norm()).item()
                else:
                    if ref_grads is None:
                        ref_grads = torch.autograd.grad(reference_out(q, k, v, causal), (q, k, v), grad_out)
                    err = max(
                        ((g.float() - r.float()).norm() / r.float().norm()).item()
                        for g, r in zip(result, ref_grads, strict=True)
                    )
                row = {
                    "pass": which,
                    "batch_heads": bh,
                    "T": seq,
                    "d": d,
                    "dtype": dtype_name,
                    "config": "/".join(str(int(x)) for x in astuple(config)),
                    "ms": round(ms, 4),
                    "TFLOP/s": round(flops / ms / 1e9, 1),
                    "rel_err": f"{err:.1e}",
                }
                for backend, label in [
                    ("FLASH_ATTENTION", "flash"),
                    ("CUDNN_ATTENTION", "cudnn"),
                    ("EFFICIENT_ATTENTION", "efficient"),
                ]:
                    if (backend, which) in sdpa:
                        row[f"x {label}"] = round(sdpa[(backend, which)] / ms, 3)
                rows.append(row)
                print(row, flush=True)
        del q, k, v, grad_out
        torch.cuda.empty_cache()

    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False)
    groups = df.groupby(["pass", "batch_heads", "T", "d", "dtype"], sort=False)
    best = df.loc[groups["ms"].idxmin()].reset_index(drop=True)
    best["default ms"] = groups["ms"].first().to_numpy()  # the first candidate is the current default
    print(best.to_string(index=False))


def reference_out(q, k, v, causal):
    return sdpa_reference(
        "FLASH_ATTENTION" if q.dtype != torch.float32 else "EFFICIENT_ATTENTION", q, k, v, causal
    )


if __name__ == "__main__":
    main()
