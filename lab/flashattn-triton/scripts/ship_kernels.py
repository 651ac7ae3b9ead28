"""Build the compiled kernels flashattn_triton ships for one Triton and GPU kind (run on that GPU, from the
repository root, with the package on PYTHONPATH):

    python lab/flashattn-triton/scripts/ship_kernels.py [--workers 8]

Runs the forward and backward of the problem classes that the benchmarks and common models use (CLASSES),
each in a process of its own with one fresh Triton cache, with the configs a first call runs (no tuning),
then packs that cache into packages/flashattn-triton/src/flashattn_triton/kernels/
triton-<version>-sm<capability>.tar.gz, the kernels' group files naming their files relative to the cache
(_launcher.seed_triton_cache makes them absolute where it unpacks them). Run it again whenever a kernel's
source, a default config or the supported Triton changes: kernels of other hashes are never loaded.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# (batch, heads, kv_heads, T, d, causal), bfloat16: the cold-start classes, the Llama-style model (GQA 16:4,
# d = 128), the host-cost sizes, benchmarks.flash's big cells, and the non-causal forms.
CLASSES = [
    (4, 8, 8, 2048, 64, True), (2, 16, 16, 4096, 128, True), (1, 32, 32, 1024, 64, True),
    (4, 16, 4, 2048, 128, True), (4, 8, 8, 2048, 64, False), (2, 16, 16, 4096, 128, False),
    (1, 8, 8, 1024, 64, True), (1, 1, 1, 128, 64, True), (1, 16, 16, 16384, 64, True),
    (1, 1, 1, 65536, 128, True), (1, 64, 64, 4096, 128, True), (4, 32, 8, 2048, 128, True),
]
PACKAGE = Path(__file__).resolve().parents[3] / "packages/flashattn-triton/src/flashattn_triton"


def run_class(spec: str) -> None:
    import torch

    import flashattn_triton

    batch, heads, kv_heads, seqlen, head_dim, causal = json.loads(spec)
    q = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))  # fmt: skip
    out = flashattn_triton.flash_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


def pack(cache: Path, archive: Path) -> None:
    """cache's kernels as archive, group files naming their files relative to the cache."""
    from flashattn_triton._launcher import PORTABLE_ROOT

    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(cache.glob("*/*")):
            data = path.read_bytes()
            if path.name.startswith("__grp__"):
                data = data.replace((str(cache) + os.sep).encode(), PORTABLE_ROOT.encode())
            info = tarfile.TarInfo(f"{path.parent.name}/{path.name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="classes compiled at once")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_class(args.child)
        return
    import torch
    import triton

    capability = torch.cuda.get_device_capability()
    archive = PACKAGE / "kernels" / f"triton-{triton.__version__}-sm{capability[0]}{capability[1]}.tar.gz"
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "FLASHATTN_TRITON_CACHE_DIR": cache + "-tuning",
               "FLASHATTN_TRITON_SHIPPED_KERNELS": "0"}  # (only what these classes compile now)
        env.pop("FLASHATTN_TRITON_AUTOTUNE", None)

        def build(spec: tuple) -> str:
            result = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                    capture_output=True, text=True)  # fmt: skip
            return f"{spec}: {'ok' if result.returncode == 0 else result.stderr[-500:]}"

        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            for line in pool.map(build, CLASSES):
                print(line)
        pack(Path(cache), archive)
    print(f"wrote {archive} ({archive.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
