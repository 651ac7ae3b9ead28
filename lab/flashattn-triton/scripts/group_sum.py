"""GPU time of grouped-query attention's sums of dK and dV over each group (the end of the backward): the
two torch.sum reductions the backward ran before, against one launch of _kernels.group_sum (_plan.GroupSum)
at its default tile rows and at half and twice as many, into contiguous sums and into a model's (B, T, H, d)
memory. bf16, issue 20's problems; each result compared bitwise with torch.sum's, and both with the float64
sum rounded once (float32 sums in another order may round an ulp apart).

    PYTHONPATH=packages/flashattn-triton/src python lab/flashattn-triton/scripts/group_sum.py

Times are _launcher.gpu_milliseconds's (GPU time a call, host time excluded), TB/s the bytes read and
written (every per-head gradient once, every sum once) over that time.
"""

from __future__ import annotations

import torch

from flashattn_triton._configs import block_d
from flashattn_triton._launcher import gpu_milliseconds
from flashattn_triton.triton_impl import GroupSum

PROBLEMS = [(1, 32, 4, 4096, 128), (2, 32, 8, 4096, 64)]  # (batch, query heads, K/V heads, T, d)
DTYPE = torch.bfloat16


def time_problem(batch: int, heads: int, kv_heads: int, seqlen: int, head_dim: int) -> None:
    print(f"(B, Hq, T, d) = {(batch, heads, seqlen, head_dim)} -> {kv_heads} K/V heads, {DTYPE}")
    shape = (batch, heads, seqlen, head_dim)
    per_head = tuple(torch.randn(shape, device="cuda", dtype=DTYPE) for _ in "kv")
    moved = 2 * batch * (heads + kv_heads) * seqlen * head_dim * per_head[0].element_size()
    want = tuple(t.unflatten(1, (kv_heads, -1)).sum(2) for t in per_head)
    # The float64 sum rounded once: torch.sum's float32 order and ours may round a sum apart by an ulp.
    exact = tuple(t.double().unflatten(1, (kv_heads, -1)).sum(2).to(DTYPE) for t in per_head)

    def ulps_off(sums: tuple[torch.Tensor, ...]) -> str:
        """Elements off the exactly rounded sum, and by how many ulps at most."""
        off = [(s.float() - e.float()).abs() / e.float().abs().clamp_min(1e-30)
               for s, e in zip(sums, exact, strict=True)]  # fmt: skip
        count = sum(int((o > 0).sum()) for o in off)
        worst = max(float(o.max()) for o in off) / torch.finfo(DTYPE).eps
        return f"{count} off exact, <= {worst:.1f} ulp"

    def report(name: str, ms: float, accuracy: str) -> None:
        print(f"  {name:<28} {ms * 1e3:7.1f} us  {moved / ms / 1e9:5.2f} TB/s  {accuracy}")

    def torch_sums(sums: tuple[torch.Tensor, ...]) -> None:
        for gradients, out in zip(per_head, sums, strict=True):
            torch.sum(gradients.unflatten(1, (kv_heads, -1)), 2, out=out)

    sums = tuple(torch.empty_like(t) for t in want)
    report("torch.sum x2", gpu_milliseconds(lambda: torch_sums(sums), 100), ulps_off(sums))
    default_rows = GroupSum.default_rows(heads // kv_heads, block_d(head_dim))
    for layout in ("bhtd", "bthd"):
        for rows in (default_rows // 2, default_rows, default_rows * 2):
            sums = tuple(torch.empty_like(t) for t in want)
            if layout == "bthd":
                sums = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in sums)
            group_sum = GroupSum(per_head[0], sums, block_d(head_dim), rows)
            ms = gpu_milliseconds(lambda g=group_sum, s=sums: g(per_head, s), 100)
            same = all(torch.equal(got, w) for got, w in zip(sums, want, strict=True))
            bits = "torch.sum's bits, " if same else ""
            report(f"group_sum {layout} {rows} rows", ms, bits + ulps_off(sums))


def main() -> None:
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for problem in PROBLEMS:
        time_problem(*problem)


if __name__ == "__main__":
    main()
