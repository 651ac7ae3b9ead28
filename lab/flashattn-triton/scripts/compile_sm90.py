"""Compile flashattn-triton's Triton-language kernels for sm_90 without a GPU and print what the compiler
made of each config: registers, stack (spills), shared memory, the wgmma (HGMMA) and mma.sync (HMMA)
instructions in the SASS, and its local-memory loads and stores (LDL/STL), in all and inside loops (the
ones paid on every step).

Needs only triton (the GPU machine's version, 3.6.0: `pip install triton==3.6.0` in a scratch venv) and
its bundled cuobjdump; the kernels module is loaded from its file, so torch is not needed. The arguments
are those of a large problem on Hopper (descriptors built by the host; --small: pointers, from which the
kernels build their descriptors, as on GPUs before Hopper), D from the preprocess, integers divisible by
16, causal unless --full. The signatures follow _kernels.py's arguments: a kernel that gains arguments
needs them added here.

    cd packages/flashattn-triton
    python scripts/compile_sm90.py bwd:32/64/4/1 bwd:16/64/4/3:transposed --dims 64,128
    python scripts/compile_sm90.py bwd:16/64/4/2:transposed,dkdv bwd:16/64/4/2:transposed,dq
    python scripts/compile_sm90.py fwd:64/32/4/2 --dtype float32 --keep out/sm90
    KERNELS_FILE=/tmp/old_kernels.py python scripts/compile_sm90.py bwd:32/64/4/1

A config is PASS:BLOCK_M/BLOCK_N/WARPS/STAGES[/ATOMIC_DQ][:FLAGS], FLAGS from transposed (the
backward's TRANSPOSED_GRADS), dkdv or dq (one PHASE of the split backward), split (the forward's
SPLIT_KV), band (BAND, a sliding window; CAUSAL off, as the launcher passes it), dropout (DROPOUT) and
group (grouped-query attention: group a runtime integer rather than the constant 1) and varlen (VARLEN,
packed sequences: pointers from which the kernels build each sequence's descriptors; the atomic dQ's sum
still a host-built descriptor, unless --small), comma-separated.
KERNELS_FILE compiles another version of _kernels.py (an experiment, an older commit's).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

KERNELS = Path(__file__).resolve().parents[3] / "packages/flashattn-triton/src/flashattn_triton/_kernels.py"
BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# The dropout arguments (unused, and compiled out, without the dropout flag): p = 0.1's threshold is an i32.
DROPOUT_ARGUMENTS = {"Rng": "*i64", "dropout_threshold": "i32", "dropout_scale": "fp32"}


def load_kernels(path: Path):
    spec = importlib.util.spec_from_file_location("flashattn_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def group_constexpr(flags: set) -> dict:
    """The kernels' group (query heads per K/V head): without the group flag 1, attention without groups,
    which Triton specializes as a constant (as it does any integer argument of 1); with it a runtime i32
    (the signature's default for a lowercase name)."""
    return {} if "group" in flags else {"group": 1}


def varlen_constexprs(flags: set) -> dict:
    """The kernels' packed-sequence arguments: None and VARLEN off without the varlen flag."""
    if "varlen" in flags:
        return {"VARLEN": True}
    return {"CuSeqlensQ": None, "CuSeqlensK": None, "VARLEN": False}


def desc(ty: str, rows: int, cols: int, small: bool = False) -> str:
    return f"*{ty}" if small else f"tensordesc<{ty}[1, 1, {rows}, {cols}]>"


def forward_source(kernels, ty: str, block_d: int, block_m: int, block_n: int, flags: set, causal: bool,
                   small: bool):  # fmt: skip
    precision = "tf32x3" if ty == "fp32" else "tf32"
    small = small or "varlen" in flags
    value = (block_d, block_n) if precision == "tf32x3" else (block_n, block_d)  # V transposed under tf32x3
    signature = {"Q": desc(ty, block_m, block_d, small), "K": desc(ty, block_n, block_d, small),
                 "V": desc(ty, *value, small), "Out": desc(ty, block_m, block_d, small), "L": "*fp32",
                 "Partials": "*fp32",
                 "batch": "i32", "heads": "i32", "seqlen_q": "i32", "seqlen_k": "i32", "head_dim": "i32",
                 "qk_scale": "fp32", "window_left": "i32", "window_right": "i32", "group": "i32",
                 "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", **DROPOUT_ARGUMENTS}  # fmt: skip
    split = "split" in flags
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
                  "CAUSAL": causal and "band" not in flags, "INPUT_PRECISION": precision, "SPLIT_KV": split,
                  "BAND": "band" in flags, "DROPOUT": "dropout" in flags,
                  **group_constexpr(flags), **varlen_constexprs(flags)}  # fmt: skip
    constexprs.update(dict.fromkeys(["Out" if split else "Partials"]))
    # A KERNELS_FILE from before SPLIT_KV, BAND or DROPOUT lacks them and their arguments.
    signature = {name: x for name, x in signature.items()
                 if name in kernels.attn_fwd.arg_names and name not in constexprs}  # fmt: skip
    constexprs = {name: x for name, x in constexprs.items() if name in kernels.attn_fwd.arg_names}
    return kernels.attn_fwd, signature, constexprs


def backward_source(kernels, ty: str, block_d: int, block_m: int, block_n: int, atomic: bool, flags: set,
                    causal: bool, small: bool):  # fmt: skip
    pointers = small or "varlen" in flags  # (packed sequences: the kernels describe each sequence's rows)
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
                  "CAUSAL": causal and "band" not in flags, "BAND": "band" in flags,
                  "ATOMIC_DQ": atomic, "DELTA_FROM_O": False,
                  "INPUT_PRECISION": "tf32x3" if ty == "fp32" else "tf32",
                  "TRANSPOSED_GRADS": "transposed" in flags,
                  "PHASE": "dkdv" if "dkdv" in flags else "dq" if "dq" in flags else "both",
                  "O_S": None, "O_T": None, "DROPOUT": "dropout" in flags,
                  **group_constexpr(flags), **varlen_constexprs(flags)}  # fmt: skip
    if not atomic:
        constexprs["DQ_ACC"] = None
    # A KERNELS_FILE from before TRANSPOSED_GRADS, PHASE, BAND and DROPOUT lacks them.
    constexprs = {name: x for name, x in constexprs.items() if name in kernels.attn_bwd.arg_names}
    signature = {}
    for name in kernels.attn_bwd.arg_names:
        if name in constexprs:
            continue
        if name in DROPOUT_ARGUMENTS:
            signature[name] = DROPOUT_ARGUMENTS[name]
        elif name in ("L", "Delta"):
            signature[name] = "*fp32"
        elif name in ("CuSeqlensQ", "CuSeqlensK"):
            signature[name] = "*i32"
        elif name in ("qk_scale", "scale"):
            signature[name] = "fp32"
        elif name == "DQ_ACC":
            signature[name] = desc("fp32", block_m, block_d, small)
        elif name.isupper():  # the inputs' tiles: BLOCK_M rows for the steps (_S), BLOCK_N for the own
            signature[name] = desc(ty, block_m if name.endswith("_S") else block_n, block_d, pointers)
        else:
            signature[name] = "i32"
    return kernels.attn_bwd, signature, constexprs


def loop_local_accesses(sass: str) -> tuple[int, int]:
    """LDL and STL inside loop bodies, between a predicated backward branch and its target (the
    unpredicated backward branches return from the out-of-line barrier waits at the end of the code)."""
    code = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            code.append((int(match.group(1), 16), match.group(2)))
    inside = set()
    for address, text in code:
        branch = re.match(r"@!?U?P\d\s+BRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            inside.update(a for a, _ in code if start <= a <= address)
    count = lambda op: sum(1 for a, t in code if a in inside and re.search(rf"\b{op}\b", t))
    return count("LDL"), count("STL")


def compile_one(kernels, spec: str, block_d: int, ty: str, causal: bool, small: bool,
                keep: Path | None) -> dict:  # fmt: skip
    pass_name, _, rest = spec.partition(":")
    fields, _, flag_text = rest.partition(":")
    values = fields.split("/")
    block_m, block_n, warps, stages = (int(x) for x in values[:4])
    flags = set(filter(None, flag_text.split(",")))
    if pass_name == "fwd":
        fn, signature, constexprs = forward_source(kernels, ty, block_d, block_m, block_n, flags, causal,
                                                   small)  # fmt: skip
    else:
        atomic = len(values) > 4 and values[4] == "1"
        fn, signature, constexprs = backward_source(kernels, ty, block_d, block_m, block_n, atomic, flags,
                                                    causal, small)  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    # As the JIT specializes a large problem: 16-aligned pointers, integers divisible by 16 (but the
    # window's, which the kernels do not specialize on, and a group's, a small integer).
    unspecialized = ("window_left", "window_right", "group")
    specialized = [name for name in fn.arg_names if signature[name].startswith("*")
                   or signature[name] == "i32" and name not in unspecialized]  # fmt: skip
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in specialized}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    start = time.time()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    except Exception as error:  # reported; the other configs go on
        message = str(error).strip().splitlines()
        return {"error": message[-1] if message else type(error).__name__}
    seconds = time.time() - start
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage, sass = (subprocess.run([BIN / "cuobjdump", flag, cubin], capture_output=True, text=True).stdout
                       for flag in ("-res-usage", "-sass"))  # fmt: skip
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^0-9a-z]+", "_", f"{spec}_d{block_d}_{ty}")
        for kind in ("ttgir", "ptx"):
            (keep / f"{stem}.{kind}").write_text(compiled.asm[kind])
        (keep / f"{stem}.sass").write_text(sass)
    lines = sass.splitlines()
    return {
        "regs": re.search(r"REG:(\d+)", usage).group(1),
        "stack": re.search(r"STACK:(\d+)", usage).group(1),
        "shared": compiled.metadata.shared,
        "hgmma": sum("HGMMA" in line for line in lines),
        "hmma": sum(" HMMA" in line for line in lines),
        "local": (sum(re.search(r"\bLDL\b", line) is not None for line in lines),
                  sum(re.search(r"\bSTL\b", line) is not None for line in lines)),  # fmt: skip
        "loop_local": loop_local_accesses(sass),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("configs", nargs="+", help="PASS:BLOCK_M/BLOCK_N/WARPS/STAGES[/ATOMIC_DQ][:FLAGS]")
    parser.add_argument("--dims", default="128", help="BLOCK_D values, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=sorted(TYPES))
    parser.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    parser.add_argument("--small", action="store_true", help="descriptors built in the kernels from pointers")
    parser.add_argument("--keep", type=Path, help="write each kernel's TTGIR, PTX and SASS here")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "compile_sm90_cache"))
    kernels = load_kernels(Path(os.environ.get("KERNELS_FILE", KERNELS)))
    path = "small-problem path" if args.small else "large-problem path"
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, {'full' if args.full else 'causal'}, {path}")
    print("| config | d | regs | stack B | shared B | HGMMA | HMMA | LDL / STL | in loops | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for block_d in (int(x) for x in args.dims.split(",")):
        for spec in args.configs:
            r = compile_one(kernels, spec, block_d, TYPES[args.dtype], not args.full, args.small, args.keep)
            if "error" in r:
                print(f"| {spec} | {block_d} | error: {r['error'][:150]} |", flush=True)
                continue
            print(f"| {spec} | {block_d} | {r['regs']} | {r['stack']} | {r['shared']} | {r['hgmma']} | "
                  f"{r['hmma']} | {r['local'][0]} / {r['local'][1]} | {r['loop_local'][0]} / "
                  f"{r['loop_local'][1]} | {r['seconds']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
