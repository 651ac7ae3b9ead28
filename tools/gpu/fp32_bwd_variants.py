"""float32's backward (3xTF32) variants on one GPU: each checked against a float64 reference and timed
next to SDPA's memory-efficient backend, on causal problems (PERF.md v19, v20).

    PYTHONPATH=packages/flashattn-triton/src python3 tools/gpu/fp32_bwd_variants.py
    ... --shapes 1x4096x128,1x16384x128,1x16384x64 --rep 60 --only t16-3,t16-3-split

A pool first compiles every variant and runs it once on a small problem (checked too); then the variants
are timed in processes apart: one for each variant with 16-row steps (float32 backward steps of 16 rows
faulted with Triton 3.6 once, PERF.md "Known fault"; a fault then costs only its own row) and one for
the others of a head dim. Times are medians of triton.testing.do_bench over triton_backward (D's
preprocess and the TF32 split of the inputs included); "ran" names the config that ran where the
launcher stepped down from the one asked for (shared memory). About 2 minutes on an H100.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

import torch

from flashattn_triton import triton_impl
from flashattn_triton._configs import BackwardConfig as B
from flashattn_triton.reference import reference_attention

# name -> (config, head dims it runs at). "t": transposed gradients (every shared-memory operand
# K-major), "split": dK/dV and dQ as two launches; the natural ones are _configs' current candidates.
VARIANTS = {
    "natural-32/64/4/1": (B(32, 64, 4, 1), (128, 64)),
    "t16-3": (B(16, 64, 4, 3, transposed_grads=True), (128, 64)),
    "t16-2": (B(16, 64, 4, 2, transposed_grads=True), (128,)),
    "t16-3-split": (B(16, 64, 4, 3, transposed_grads=True, split=True), (128,)),
    "t16-2-split": (B(16, 64, 4, 2, transposed_grads=True, split=True), (128,)),
    "t32-1": (B(32, 64, 4, 1, transposed_grads=True), (128,)),
    "t32-1-split": (B(32, 64, 4, 1, transposed_grads=True, split=True), (128,)),
    # dK/dV in 32-row steps (S and dP read the resident K and V half as often), dQ in 16-row steps at 3 stages
    "t32-2-split-dq16-3": (
        B(32, 64, 4, 2, transposed_grads=True, split=True, dq_block_m=16, dq_stages=3),
        (128,),
    ),
    "t32-1-split-dq16-3": (
        B(32, 64, 4, 1, transposed_grads=True, split=True, dq_block_m=16, dq_stages=3),
        (128,),
    ),
    "t16-3-split-dq32-1": (
        B(16, 64, 4, 3, transposed_grads=True, split=True, dq_block_m=32, dq_stages=1),
        (128,),
    ),
    "natural-32/128/8/2": (B(32, 128, 8, 2), (64,)),
    "natural-32/64/4/2": (B(32, 64, 4, 2), (64,)),
    "t32-3": (B(32, 64, 4, 3, transposed_grads=True), (64,)),
    "t32-2": (B(32, 64, 4, 2, transposed_grads=True), (64,)),
    "t32/128/8/2": (B(32, 128, 8, 2, transposed_grads=True), (64,)),
    "t32-3-split": (B(32, 64, 4, 3, transposed_grads=True, split=True), (64,)),
}
CURRENT = {128: "natural-32/64/4/1", 64: "natural-32/128/8/2"}  # the untuned defaults of _configs


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def make_inputs(bh: int, seq: int, d: int, device: str = "cuda") -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seq * 1000 + d)
    return [torch.randn(1, bh, seq, d, device=device, generator=generator) for _ in range(4)]


def reference_grads(q, k, v, grad_out) -> list[torch.Tensor]:
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, True, q.shape[-1] ** -0.5)
    return list(torch.autograd.grad(out, (q, k, v), grad_out.double()))


def backward_runner(config: B, q, k, v, grad_out):
    scale = q.shape[-1] ** -0.5
    out, lse = triton_impl.triton_forward(q, k, v, True, scale)
    return lambda: triton_impl.triton_backward(q, k, v, out, lse, grad_out, True, scale, config)


def ran_config(config: B) -> str:
    """The config that ran for the latest backward plan asked for `config` ('' if it was that one)."""
    for key, plan in triton_impl._plans.items():
        if key[0] == "bwd" and config in key and plan.config != config:
            return triton_impl._describe(plan.config)
    return ""


def compile_job(job: tuple[str, int, bool]) -> tuple[tuple[str, int, bool], str]:
    """Build one variant for the small- or large-problem path (descriptors built by the kernel or by the
    host) and check it on a small problem."""
    name, d, large = job
    if large:
        triton_impl.SMALL_PROBLEM_WORK = 0
    try:
        q, k, v, grad_out = make_inputs(2, 200, d)
        grads = backward_runner(VARIANTS[name][0], q, k, v, grad_out)()
        torch.cuda.synchronize()
        err = max(rel(g, r) for g, r in zip(grads, reference_grads(q, k, v, grad_out), strict=True))
        return job, f"ok {err:.1e}"
    except Exception as exc:  # a fault, or a build this Triton refuses: reported, not timed
        return job, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def worker(names: list[str], files: list[str], rep: float) -> None:
    """Time the variants on the saved problems; one JSON line each."""
    from triton.testing import do_bench

    for path in files:
        data = torch.load(path)
        q, k, v, grad_out = (t.cuda() for t in data["inputs"])
        for name in names:
            config = VARIANTS[name][0]
            row = {"variant": name, "shape": data["shape"]}
            try:
                fn = backward_runner(config, q, k, v, grad_out)
                grads = fn()
                row["err"] = max(rel(g, r.cuda()) for g, r in zip(grads, data["reference"], strict=True))
                row["ms"] = do_bench(fn, warmup=10, rep=rep, return_mode="median")
                row["ran"] = ran_config(config)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                print(json.dumps(row), flush=True)
                return  # the CUDA context may be gone
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x4096x128,1x16384x128,1x16384x64", help="BATCH*HEADSxTxD,...")
    parser.add_argument("--rep", type=float, default=60.0, help="do_bench measuring time, ms")
    parser.add_argument("--only", default="", help="variant names, comma-separated (default: all)")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["FLASHATTN_TRITON_AUTOTUNE"] = "0"  # the forward takes its default; each backward is named
    if args.worker:
        worker(args.worker.split(","), args.files, args.rep)
        return

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    dims = {d for _, _, d in shapes}
    jobs = [(n, d) for n in names for d in VARIANTS[n][1] if d in dims]
    paths = {(d, bh * seq * seq * d >= triton_impl.SMALL_PROBLEM_WORK) for bh, seq, d in shapes}
    builds = [(n, d, large) for n, d in jobs for large in (False, True) if (d, large) in paths]
    start = time.time()
    context = multiprocessing.get_context("spawn")
    # A fresh process per job (Python >= 3.11): a fault leaves a process's CUDA context unusable.
    fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context, **fresh) as pool:
        built = dict(pool.map(compile_job, builds))
    print(f"compiled {len(builds)} builds in {time.time() - start:.0f} s; checked on a small problem:")
    for (name, d, large), text in built.items():
        print(f"  {name} d={d} {'large' if large else 'small'}-problem path: {text}")
    status = {}  # (name, d) -> the first failure of its builds, else "ok"
    for (name, d, _), text in built.items():
        status[(name, d)] = status.get((name, d), "ok") if text.startswith("ok") else text

    results: dict[tuple[str, tuple], dict] = {}
    sdpa: dict[tuple, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[int, list[str]] = {}
        for shape in shapes:
            q, k, v, grad_out = make_inputs(*shape)
            reference = reference_grads(q, k, v, grad_out)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)

            def sdpa_backward(o=out, x=leaves, g=grad_out):
                return torch.autograd.grad(o, x, g, retain_graph=True)

            grads = sdpa_backward()
            ms = do_bench(sdpa_backward, warmup=10, rep=args.rep, return_mode="median")
            sdpa[shape] = (ms, max(rel(g, r) for g, r in zip(grads, reference, strict=True)))
            path = os.path.join(tmp, "x".join(map(str, shape)) + ".pt")
            torch.save({"shape": shape, "inputs": [t.cpu() for t in (q, k, v, grad_out)],
                        "reference": [r.cpu() for r in reference]}, path)  # fmt: skip
            files.setdefault(shape[2], []).append(path)
            del q, k, v, grad_out, reference, leaves, out, grads
            torch.cuda.empty_cache()
        # One process per variant with 16-row steps (see above), one for the others of a head dim.
        groups: dict[tuple[int, str], list[str]] = {}
        for name, d in jobs:
            if status[(name, d)] == "ok":
                config = VARIANTS[name][0]
                alone = min(config.block_m, config.dq_block_m or config.block_m) == 16
                groups.setdefault((d, name if alone else ""), []).append(name)
        for (d, _), group in groups.items():
            command = [sys.executable, __file__, "--worker", ",".join(group), "--rep", str(args.rep),
                       "--files", *files[d]]  # fmt: skip
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=150)
                lines, log = [line for line in done.stdout.splitlines() if line.startswith("{")], done.stderr
            except subprocess.TimeoutExpired as timeout:
                lines, log = [], f"timed out after {timeout.timeout} s"
            for row in map(json.loads, lines):
                results[(row["variant"], tuple(row["shape"]))] = row
            if len(lines) < len(group) * len(files[d]):
                print(f"  {','.join(group)} d={d}: results missing: {log.strip()[-300:]}")

    cells = {"efficient (SDPA)": {s: f"{ms:7.3f}        {err:.0e}" for s, (ms, err) in sdpa.items()}}
    for name, d in jobs:
        row = cells.setdefault(name, {})
        for shape in (s for s in shapes if s[2] == d):
            r, text = results.get((name, shape)), status[(name, d)]
            if r is None:
                row[shape] = "-" if text == "ok" else text[:28]
            elif "error" in r:
                row[shape] = r["error"][:28]
            else:
                default = "*" if CURRENT[d] == name else " "
                ran = f" ran {r['ran']}" if r["ran"] else ""
                row[shape] = f"{r['ms']:7.3f}{default} {sdpa[shape][0] / r['ms']:5.2f}x {r['err']:.0e}{ran}"
    print("\nfloat32 causal backward (BATCH*HEADS x T x d): ms (* the current untuned default), x SDPA's")
    print("memory-efficient time over ours, max relative error of dQ, dK, dV against float64")
    print(" | ".join(["variant".ljust(20)] + ["x".join(map(str, s)).ljust(30) for s in shapes]))
    for name, row in cells.items():
        print(" | ".join([name.ljust(20)] + [row.get(s, "").ljust(30) for s in shapes]))
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
