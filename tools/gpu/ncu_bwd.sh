#!/usr/bin/env bash
# Nsight Compute on one backward kernel of (16, 16384, 64) bf16 causal: where its warps stall.
#   OUT=/some/dir bash tools/gpu/ncu_bwd.sh
set -uo pipefail
export PYTHONPATH=$PWD/packages/flashattn-triton/src PYTHONUNBUFFERED=1 FLASHATTN_TRITON_AUTOTUNE=0
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
cat > "$OUT/run_bwd.py" <<'PY'
import torch
from flashattn_triton.triton_impl import triton_backward, triton_forward
q, k, v, do = (torch.randn(1, 16, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = triton_forward(q, k, v, True, 0.125)
for _ in range(3):
    triton_backward(q, k, v, out, lse, do, True, 0.125)
torch.cuda.synchronize()
PY
timeout 400 ncu --kernel-name attn_bwd --launch-skip 1 --launch-count 1 --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SpeedOfLight --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 "$OUT/run_bwd.py" > "$OUT/ncu_bwd.txt" 2>&1
echo "ncu rc=$?"
grep -E "issue_stalled" "$OUT/ncu_bwd.txt" | sort -k3 -n -r | head -12
grep -E "Warp Cycles|Issued|Eligible|Active Warps|Occupancy|Registers|Shared Memory|Duration|Throughput|Pipe|Block Limit" "$OUT/ncu_bwd.txt" | head -80
