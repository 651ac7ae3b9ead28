#!/usr/bin/env bash
# flashattn-triton exploration on one H100: where a call's host time goes (cProfile), how much the
# host-bound cells move between repeats, then every candidate config of _configs.py (and EXTRA ones)
# timed on the given shapes next to SDPA (scripts/tune.py).
#   OUT=/some/dir SHAPES=16x16384x64,1x4096x64 EXTRA=bwd:64/128/8/2/1 bash tools/gpu/h100-flash-explore.sh
set -uo pipefail
export COLUMNS=250 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 120 python3 tools/gpu/host_profile.py > "$OUT/host_profile.txt" 2>&1; echo "host_profile rc=$?"
grep "^== " "$OUT/host_profile.txt"
timeout 150 python3 tools/gpu/host_noise.py "${NOISE_ROUNDS:-3}" > "$OUT/host_noise.txt" 2>&1; echo "host_noise rc=$?"
cat "$OUT/host_noise.txt"
timeout "${TUNE_TIMEOUT:-400}" python3 packages/flashattn-triton/scripts/tune.py --shapes "${SHAPES}" \
    --fp32-shapes "${FP32_SHAPES:-}" --extra "${EXTRA:-}" --workers 14 --rep 20 --out "$OUT/tune.csv" 2>&1 \
    | grep -v "^{" | tee "$OUT/tune.txt"
echo "tune rc=$?"
