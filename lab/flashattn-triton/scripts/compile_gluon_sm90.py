"""Compile the Gluon kernels (_hopper_kernels) for sm_90 without a GPU and print what the compiler made of
each config: the registers of the launch and those setmaxnreg sets (per partition), shared memory, SASS lines,
wgmma (HGMMA) instructions and how many of them are waited for (where ptxas serializes them, all),
local-memory loads and stores (LDL/STL), ptxas's spilled bytes and its notes that it serialized the wgmmas
(C7512: too few registers; C7514: another instruction reads an accumulator in flight).

Needs torch (CPU is enough) and triton 3.6 (the GPU machine's version) with its bundled ptxas and
cuobjdump; a stand-in driver answers for an sm_90 device. The arguments are _hopper's for (2, 4, 512, d)
bf16 inputs.

    PYTHONPATH=src python scripts/compile_gluon_sm90.py bwd:32/128/8/4 bwd:64/128/8/4 --dims 64,128
    PYTHONPATH=src python scripts/compile_gluon_sm90.py bwd:32/128/8/2 --full --kv-heads 1 --layout bthd
    PYTHONPATH=src python scripts/compile_gluon_sm90.py bwd:64/128/8/4 --dims 64 --persistent
    PYTHONPATH=src python scripts/compile_gluon_sm90.py fwd:128/128/4/2 --window 200 --keep /tmp/sm90
    PYTHONPATH=src python scripts/compile_gluon_sm90.py fwd:128/128/4/2 --persistent
    PYTHONPATH=src python scripts/compile_gluon_sm90.py bwd:64/128/8/2 --dims 128 --full --per-kv-head

A config is PASS:BLOCK_M/BLOCK_N/WARPS/STAGES: the backward's query rows a step, keys a program, warps a
consumer partition (BLOCK_N / 16: one partition; BLOCK_N / 32: two) and ring stages; the forward's query rows
a program (two consumers of half), keys a step, warps a consumer and stages."""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
BATCH, HEADS, SEQLEN = 2, 4, 512
SM_COUNT = 132  # an H100's: persistent programs of several work items


class Sm90Driver:
    """What the JIT asks its driver while compiling, answered for device 0, an sm_90 GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self) -> None:
        return None

    def is_active(self) -> bool:
        return True


def tensor(heads: int, head_dim: int, layout: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A (B, heads, T, d) tensor in (B, H, T, d) memory, or in (B, T, H, d) memory (layout "bthd")."""
    if layout == "bhtd":
        return torch.zeros(BATCH, heads, SEQLEN, head_dim, dtype=dtype)
    return torch.zeros(BATCH, SEQLEN, heads, head_dim, dtype=dtype).transpose(1, 2)


def kernel_args(pass_name: str, numbers: list[int], head_dim: int, args: argparse.Namespace) -> dict:
    from flashattn_triton import _hopper

    block_m, block_n, warps, stages = numbers
    q, k, v, out = (tensor(h, head_dim, args.layout) for h in (HEADS, args.kv_heads, args.kv_heads, HEADS))
    lse = torch.zeros(BATCH, HEADS, SEQLEN)
    mask_args = {"BAND": args.window is not None, "window_left": args.window or 0}
    if pass_name == "fwd":
        made = _hopper.forward_args(q, k, v, out, lse, block_m, block_n, stages, not args.full, 0.1,
                                    mask_args, SM_COUNT if args.persistent else None)  # fmt: skip
    else:
        dkv_heads = args.kv_heads if args.per_kv_head else HEADS
        dk, dv = tensor(dkv_heads, head_dim, args.layout), tensor(dkv_heads, head_dim, args.layout)
        dq_sum = torch.zeros(BATCH, HEADS, SEQLEN, head_dim)
        made = _hopper.backward_args(q, k, v, out, dk, dv, dq_sum, lse, torch.zeros_like(lse), block_m,
                                     block_n, stages, not args.full, 0.1, mask_args,
                                     SM_COUNT if args.persistent else None, args.per_kv_head,
                                     block_n // (16 * warps))  # fmt: skip
    return {name: x.descriptor() if hasattr(x, "descriptor") else x for name, x in made.items()}


def report(compiled, keep: Path | None, stem: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin.write_bytes(compiled.asm["cubin"])
        ptx.write_text(compiled.asm["ptx"])
        usage, sass = (subprocess.run([BIN / "cuobjdump", flag, cubin], capture_output=True, text=True).stdout
                       for flag in ("-res-usage", "-sass"))  # fmt: skip
        ptxas = subprocess.run([BIN / "ptxas", "--gpu-name", "sm_90a", "-v", ptx, "-o",
                                Path(tmp) / "p.cubin"], capture_output=True, text=True).stderr  # fmt: skip
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{stem}.ptx").write_text(compiled.asm["ptx"])
        (keep / f"{stem}.sass").write_text(sass)
    registers = re.search(r"REG:(\d+)", usage).group(1)
    setmaxnreg = re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass)
    setmaxnreg = sorted({int(x, 16) for x in setmaxnreg})
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas).groups()
    ldl, stl = (len(re.findall(rf"\b{op}\b", sass)) for op in ("LDL", "STL"))
    # A chain of wgmmas waits once, after its last (the one on scoreboard gsb0); where ptxas serializes them,
    # every one carries gsb0, and ptxas says why (C7512: too few registers; C7514: another instruction
    # reads an accumulator in flight).
    hgmma = re.findall(r"HGMMA\.[^;]*;", sass)
    waited = sum("gsb0" in h for h in hgmma)
    serialized = re.findall(r"\((C75\d\d)\)[^\n]*wgmma\.mma_async instructions are serialized", ptxas)
    return (f"regs {registers} setmaxnreg {setmaxnreg} shared {compiled.metadata.shared} SASS "
            f"{len(sass.splitlines())} HGMMA {len(hgmma)} ({waited} waited) LDL {ldl} STL {stl} spilled "
            f"{stores}/{loads} B" + "".join(f", wgmma serialized ({n})" for n in serialized))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="PASS:BLOCK_M/BLOCK_N/WARPS/STAGES, PASS fwd or bwd")
    parser.add_argument("--dims", default="64,128", help="head dims")
    parser.add_argument("--full", action="store_true", help="not causal")
    parser.add_argument("--window", type=int, help="a causal sliding window's left size")
    parser.add_argument("--kv-heads", type=int, default=HEADS, help=f"K/V heads (of {HEADS} query heads)")
    parser.add_argument("--layout", choices=("bhtd", "bthd"), default="bhtd", help="the tensors' memory")
    parser.add_argument("--persistent", action="store_true",
                        help="persistent programs (several work items each)")
    parser.add_argument("--per-kv-head", action="store_true",
                        help="the backward's programs a K/V head's key tile (through its query heads)")
    parser.add_argument("--keep", type=Path, help="a directory for each build's PTX and SASS")
    args = parser.parse_args()
    driver.set_active(Sm90Driver())
    from flashattn_triton import _hopper

    for head_dim in (int(d) for d in args.dims.split(",")):
        for spec in args.configs:
            pass_name, _, fields = spec.partition(":")
            numbers = [int(x) for x in fields.split("/")]
            warps = numbers[2]
            try:
                compiled = _hopper.kernel(pass_name).warmup(**kernel_args(pass_name, numbers, head_dim, args),
                                                            grid=(1,), num_warps=warps)  # fmt: skip
                line = report(compiled, args.keep, re.sub(r"[^0-9a-z]+", "_", f"{spec}_d{head_dim}"))
            except Exception as error:  # reported; the other configs go on
                line = f"failed: {type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
            print(f"{spec} d={head_dim}: {line}", flush=True)


if __name__ == "__main__":
    main()
