"""Where a small problem's GPU time goes: each pass's kernels, ours (every candidate config, or the
ones given) against SDPA's flash and cuDNN backends, timed by torch.profiler over iterations that each
start after a 256 MB L2 flush (as do_bench's) and, apart, with a warm L2. Prints, per (pass, shape,
implementation), the median of an iteration's kernel time (busy), of its first kernel's start to its last
kernel's end (span, which adds the GPU's idle time among the kernels), and each kernel's mean length (us).

    PYTHONPATH=packages/flashattn-triton/src:tools/gpu python3 tools/gpu/small_kernels.py \
        [--seq 1024,2048] [--dims 16,64] [--passes fwd,bwd] [--extra fwd:128/128/8/3,...]
        [--kernel-built-descriptors] [--splits 2,4,8,16 --split-min-key-tiles 1]

--kernel-built-descriptors has the kernels build their tensor descriptors (as on GPUs before Hopper);
--splits and --split-min-key-tiles change which split key tiles the forward's candidates offer
(_configs.KV_SPLITS, SPLIT_MIN_KEY_TILES). An empty Triton kernel on 16 programs is timed first, for the
launch's own length.
"""

import argparse
import statistics
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flashattn_triton import _configs, triton_impl
from flashattn_triton.triton_impl import _describe, triton_backward, triton_forward

sys.path.insert(0, "packages/flashattn-triton/scripts")
from tune import candidates, parse_extra  # noqa: E402

ITERATIONS = 25
FLUSH = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")


def kernel_times(fn, cold: bool) -> tuple[float, float, dict[str, float]]:
    """Medians of an iteration's busy time and span, and each kernel's mean length (us)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            if cold:
                FLUSH.zero_()
            else:
                torch.cuda._sleep(20_000)  # marks the iteration's start, and lets the host run ahead
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)  # fmt: skip
    iterations, lengths = [], defaultdict(list)
    for e in kernels:
        name = e.name
        marker = "fill" in name.lower() and e.time_range.elapsed_us() > 40 or "spin" in name.lower()
        if marker:
            iterations.append([])
        elif iterations:
            iterations[-1].append(e)
            lengths[name[:70]].append(e.time_range.elapsed_us())
    busy = [sum(e.time_range.elapsed_us() for e in it) for it in iterations if it]
    span = [it[-1].time_range.end - it[0].time_range.start for it in iterations if it]
    means = {name: statistics.mean(values) for name, values in lengths.items()}
    return statistics.median(busy), statistics.median(span), means


def report(label: str, fn) -> None:
    try:
        cold = kernel_times(fn, cold=True)
    except Exception as exc:  # a config this GPU or Triton refuses
        print(f"  {label:34s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return
    warm = kernel_times(fn, cold=False)
    kernels = ", ".join(f"{name} {us:.1f}" for name, us in cold[2].items())
    print(f"  {label:34s} cold busy {cold[0]:7.1f} span {cold[1]:7.1f} | warm busy {warm[0]:7.1f} "
          f"span {warm[1]:7.1f} | {kernels}", flush=True)  # fmt: skip


@triton.jit
def empty_kernel(X):
    pass


def compare(which: str, seq: int, head_dim: int, extra: dict, only_tuned: bool) -> None:
    """Every implementation of one pass on one problem (B·H = 1, bf16, causal)."""
    dtype = torch.bfloat16
    q, k, v, grad = (torch.randn(1, 1, seq, head_dim, device="cuda", dtype=dtype) for _ in range(4))
    scale = head_dim**-0.5
    out, lse = triton_forward(q, k, v, True, scale)
    triton_backward(q, k, v, out, lse, grad, True, scale)  # (tunes it)
    print(f"== {which} (1, {seq}, {head_dim}) bf16 causal, us", flush=True)
    tuned = next((c for key, c in triton_impl._chosen.items() if key[0] == which
                  and key[2] == triton_impl._block_d(head_dim) and key[6] == triton_impl._size_class(seq)),
                 None)  # fmt: skip
    for config in [tuned] if only_tuned else candidates(which, 1, seq, head_dim, dtype, extra):
        label = f"ours {_describe(config)}{' (tuned)' if config == tuned else ''}"
        if which == "fwd":
            report(label, lambda c=config: triton_forward(q, k, v, True, scale, c))
        else:
            report(label, lambda c=config: triton_backward(q, k, v, out, lse, grad, True, scale, c))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel(backend):
            sdpa_out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            if which == "fwd":
                report(
                    f"sdpa {backend.name.lower()}",
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                )
            else:
                report(
                    f"sdpa {backend.name.lower()}",
                    lambda o=sdpa_out: torch.autograd.grad(o, (qg, kg, vg), grad, retain_graph=True),
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--seq", default="512,1024,2048,4096")
    parser.add_argument("--dims", default="16,32,64,128")
    parser.add_argument("--passes", default="fwd,bwd")
    parser.add_argument("--extra", default="", help="more configs, as scripts/tune.py --extra")
    parser.add_argument("--only-tuned", action="store_true", help="ours: the tuner's choice only")
    parser.add_argument("--kernel-built-descriptors", action="store_true")
    parser.add_argument("--splits", help="_configs.KV_SPLITS, e.g. 2,4,8,16")
    parser.add_argument("--split-min-key-tiles", type=int, help="_configs.SPLIT_MIN_KEY_TILES")
    args = parser.parse_args()
    extra = parse_extra(args.extra)
    if args.kernel_built_descriptors:
        triton_impl._host_descriptors = lambda device: False
    if args.splits:
        _configs.KV_SPLITS = tuple(int(n) for n in args.splits.split(","))
    if args.split_min_key_tiles is not None:
        _configs.SPLIT_MIN_KEY_TILES = args.split_min_key_tiles
    x = torch.empty(1, device="cuda")
    print("== an empty kernel, 16 programs", flush=True)
    report("empty", lambda: empty_kernel[(16,)](x))
    for seq in map(int, args.seq.split(",")):
        for head_dim in map(int, args.dims.split(",")):
            for which in args.passes.split(","):
                compare(which, seq, head_dim, extra, args.only_tuned)


if __name__ == "__main__":
    main()
