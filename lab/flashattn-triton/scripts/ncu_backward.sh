#!/usr/bin/env bash
# Nsight Compute on one backward kernel of (16, 16384, 64) bf16 causal: where its warps stall
# (decisions.md#bwd-latency-variants). Tuning off: the default Triton-language config is the one profiled.
#   OUT=/some/dir bash lab/flashattn-triton/scripts/ncu_backward.sh
set -uo pipefail
export PYTHONPATH=$PWD/packages/flashattn-triton/src PYTHONUNBUFFERED=1 FLASHATTN_TRITON_AUTOTUNE=0
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
cat > "$OUT/run_bwd.py" <<'PY'
import torch
from flashattn_triton import flash_attention
shape = (1, 16, 16384, 64)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
for _ in range(3):
    flash_attention(q, k, v, is_causal=True).backward(grad)
torch.cuda.synchronize()
PY
timeout 400 ncu --kernel-name attn_bwd --launch-skip 1 --launch-count 1 --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SpeedOfLight --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 "$OUT/run_bwd.py" > "$OUT/ncu_bwd.txt" 2>&1
echo "ncu rc=$?"
grep -E "issue_stalled" "$OUT/ncu_bwd.txt" | sort -k3 -n -r | head -12
grep -E "Warp Cycles|Issued|Eligible|Active Warps|Occupancy|Registers|Shared Memory|Duration|Throughput|Pipe|Block Limit" "$OUT/ncu_bwd.txt" | head -80
