"""Time every candidate config of the Triton kernels on this GPU, next to SDPA's flash and cuDNN backends.

    PYTHONPATH=packages/flashattn-triton/src python lab/flashattn-triton/scripts/tune.py --out tune.csv

The candidates are _configs.candidates(problem), the function the launcher tunes among at run time.
A pool of worker processes first compiles every candidate for the shapes' specializations (Triton's
on-disk cache then serves every later process: --precompile-only stops there, which spares a
benchmark run the sequential compiles of its first tuning). Then each candidate is timed with
triton.testing.do_bench (median) and its result checked against SDPA's; the table shows, per
(pass, shape), the best candidate and its speedup over each SDPA backend. With --dropout P every pass
drops probabilities (SDPA's too), the candidates are those of dropout problems, and results are checked
against the PyTorch path with the same (seed, offset) instead, which drops the same ones:

    python lab/flashattn-triton/scripts/tune.py --shapes 32x4096x64 --fp32-shapes "" --dropout 0.1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import time

import torch
import torch.nn.functional as F

from flashattn_triton import _configs, _dispatch, torch_impl
from flashattn_triton._configs import BackwardConfig, ForwardConfig, Problem, describe
from flashattn_triton._dropout import draw_rng
from flashattn_triton._inputs import input_precision, padded_head_dim
from flashattn_triton.triton_impl import triton_backward, triton_forward

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CAUSAL = True


def parse_extra(text: str) -> dict[str, list]:
    """'bwd:64/128/8/2/1,fwd:64/128/4/3' -> {"fwd": [ForwardConfig(...)], "bwd": [BackwardConfig(...)]}"""
    extra: dict[str, list] = {"fwd": [], "bwd": []}
    for item in filter(None, text.split(",")):
        which, _, numbers = item.partition(":")
        if which not in extra or not numbers:
            raise SystemExit(f"--extra: {item!r} is not fwd:M/N/WARPS/STAGES or bwd:M/N/WARPS/STAGES/ATOMIC")
        config_type = ForwardConfig if which == "fwd" else BackwardConfig
        extra[which].append(config_type(*(int(n) for n in numbers.split("/"))))
    return extra


def gluon_takes(which: str, q: torch.Tensor, dropout_p: float) -> bool:
    """Whether the dispatch table runs this causal problem on the Gluon kernels (so they are candidates)."""
    tensors = (q,) * (3 if which == "fwd" else 5)
    description = _dispatch.describe(which, q, q, tensors, window=(_dispatch.UNBOUNDED, 0),
                                     dropout=dropout_p > 0.0)  # fmt: skip
    return _dispatch.choose(description) == _dispatch.GLUON


def candidates(which: str, batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
               extra: dict[str, list], dropout_p: float) -> list:  # fmt: skip
    """The candidates the launcher tunes among for this problem (_configs.candidates, the same function),
    then the --extra ones not among them."""
    size = torch.empty((), dtype=dtype).element_size()
    padded = padded_head_dim(head_dim, size)
    q = torch.empty(1, batch_heads, seq, head_dim, device="cuda", dtype=dtype)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    problem = Problem(which, batch_heads, seq, seq, padded, dtype, CAUSAL, input_precision(dtype), sm_count,
                      hopper=gluon_takes(which, q, dropout_p),
                      dropout=dropout_p > 0.0)  # fmt: skip
    listed = _configs.candidates(problem)
    return listed + [c for c in extra[which] if c not in listed]


def inputs(batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, batch_heads, seq, head_dim, device="cuda", dtype=dtype, generator=generator)
            for _ in range(4)]  # fmt: skip


def dropout_rng() -> torch.Tensor:
    """The (seed, offset) of every dropout run here: the same masks for every candidate and the reference."""
    torch.manual_seed(0)
    return draw_rng(torch.device("cuda"))


def runner(which: str, config, batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
           dropout_p: float):  # fmt: skip
    q, k, v, grad_out = inputs(batch_heads, seq, head_dim, dtype)
    scale = head_dim**-0.5
    dropout = {"dropout_p": dropout_p, "rng_state": dropout_rng() if dropout_p else None}
    if which == "fwd":
        return lambda: triton_forward(q, k, v, CAUSAL, scale, config, **dropout)
    out, lse = triton_forward(q, k, v, CAUSAL, scale, **dropout)
    return lambda: triton_backward(q, k, v, out, lse, grad_out, CAUSAL, scale, config, **dropout)


def compile_job(job: tuple) -> tuple[tuple, str]:
    """Build (and run once) one candidate on a small problem with the same specializations; for a large
    problem's, with the host-built descriptors that large problems get."""
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"
    which, config, heads, head_dim, dtype_name, large, dropout_p = job
    if large:
        _configs.SMALL_PROBLEM_WORK = 0
    try:
        runner(which, config, heads, 256, head_dim, DTYPES[dtype_name], dropout_p)()
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as exc:  # too big for this GPU, or refused by this Triton: reported
        return job, f"{type(exc).__name__}: {str(exc)[:160]}"


def sdpa(backend: str, q, k, v, dropout_p: float):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=CAUSAL)


def time_sdpa(q, k, v, grad_out, rep: float, dropout_p: float):
    """{(label, pass): ms} for the SDPA backends that take these inputs, and one backend's O and grads
    (with dropout, the PyTorch path's with dropout_rng's masks)."""
    from triton.testing import do_bench

    times, reference = {}, None
    for backend, label in [("FLASH_ATTENTION", "flash"), ("CUDNN_ATTENTION", "cudnn"),
                           ("EFFICIENT_ATTENTION", "efficient")]:  # fmt: skip
        try:
            out = sdpa(backend, q, k, v, dropout_p)
        except RuntimeError:
            continue
        def forward(b=backend):
            return sdpa(b, q, k, v, dropout_p)

        def backward(o=out):
            return torch.autograd.grad(o, (q, k, v), grad_out, retain_graph=True)

        times[(label, "fwd")] = do_bench(forward, warmup=5, rep=rep, return_mode="median")
        times[(label, "bwd")] = do_bench(backward, warmup=5, rep=rep, return_mode="median")
        if reference is None and not dropout_p:
            reference = (out.detach(), torch.autograd.grad(out, (q, k, v), grad_out))
    if dropout_p:
        scale, rng = q.shape[-1] ** -0.5, dropout_rng()
        with torch.no_grad():
            out, lse = torch_impl.attention_forward(q, k, v, dropout_p=dropout_p, rng_state=rng, scale=scale,
                                                    window_right=0)  # (causal)
            grads = torch_impl.attention_backward(grad_out, q, k, v, out, lse, dropout_p=dropout_p,
                                                  rng_state=rng, scale=scale, window_right=0)  # fmt: skip
        reference = (out, grads)
    return times, reference


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="BATCH*HEADSxTxD list, bfloat16",
                        default="1x1024x64,1x4096x64,1x16384x64,1x65536x64,16x16384x64,1x1024x128,1x4096x128,"
                        "1x16384x128,1x65536x128,64x4096x128,1x1024x16,1x16384x16,1x1024x32,1x16384x32")
    parser.add_argument("--fp32-shapes", default="1x4096x64,1x16384x64,1x4096x128,1x16384x128")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--rep", type=float, default=25.0, help="do_bench measuring time per candidate, ms")
    parser.add_argument("--extra", default="",
                        help="more configs to time, e.g. bwd:64/128/8/2/1,fwd:64/128/4/3")  # fmt: skip
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every pass")
    parser.add_argument("--precompile-only", action="store_true")
    parser.add_argument("--out", default="tune.csv")
    args = parser.parse_args()
    extra = parse_extra(args.extra)
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"  # each candidate is timed here, by name
    from triton.testing import do_bench

    shapes = [(*map(int, s.split("x")), "bfloat16") for s in args.shapes.split(",") if s]
    shapes += [(*map(int, s.split("x")), "float32") for s in args.fp32_shapes.split(",") if s]

    def compile_key(which: str, config, bh: int, seq: int, d: int, dtype: str) -> tuple:
        large = not _configs.is_small_problem(bh, seq, seq, d)
        return which, config, 1 if bh == 1 else 16, d, dtype, large, args.dropout

    def runs(key: tuple) -> bool:  # the Gluon kernels take large problems only, split key tiles small ones
        large, config = key[5], key[1]
        return not config.hopper if not large else getattr(config, "kv_splits", 1) == 1

    jobs = {compile_key(which, config, *shape) for shape in shapes for which in ("fwd", "bwd")
            for config in candidates(which, *shape[:3], DTYPES[shape[3]], extra, args.dropout)}  # fmt: skip
    jobs = sorted(filter(runs, jobs), key=str)
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
    if args.precompile_only:
        return

    rows = []
    for bh, seq, d, dtype_name in shapes:
        dtype = DTYPES[dtype_name]
        q, k, v, grad_out = inputs(bh, seq, d, dtype)
        for t in (q, k, v):
            t.requires_grad_()
        sdpa_ms, (ref_out, ref_grads) = time_sdpa(q, k, v, grad_out, args.rep, args.dropout)
        for which in ("fwd", "bwd"):
            flops = 4.0 * bh * seq * seq * d / 2 * (1.0 if which == "fwd" else 2.5)
            for config in candidates(which, bh, seq, d, dtype, extra, args.dropout):
                key = compile_key(which, config, bh, seq, d, dtype_name)
                if key in failed or not runs(key):
                    continue
                fn = runner(which, config, bh, seq, d, dtype, args.dropout)
                result = fn()
                ms = do_bench(fn, warmup=5, rep=args.rep, return_mode="median")
                if which == "fwd":
                    err = relative_error(result[0], ref_out)
                else:
                    err = max(relative_error(g, r) for g, r in zip(result, ref_grads, strict=True))
                row = {"pass": which, "batch_heads": bh, "T": seq, "d": d, "dtype": dtype_name,
                       "config": describe(config), "ms": round(ms, 4),
                       "TFLOP/s": round(flops / ms / 1e9, 1), "err vs sdpa": f"{err:.1e}"}  # fmt: skip
                for label in ("flash", "cudnn", "efficient"):
                    if (label, which) in sdpa_ms:
                        row[f"x {label}"] = round(sdpa_ms[(label, which)] / ms, 3)
                rows.append(row)
                print(row, flush=True)
        del q, k, v, grad_out
        torch.cuda.empty_cache()

    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False)
    groups = df.groupby(["pass", "batch_heads", "T", "d", "dtype"], sort=False)
    best = df.loc[groups["ms"].idxmin()].reset_index(drop=True)
    best["default ms"] = groups["ms"].first().to_numpy()  # the first candidate is the untuned default
    print(best.to_string(index=False))


if __name__ == "__main__":
    main()
