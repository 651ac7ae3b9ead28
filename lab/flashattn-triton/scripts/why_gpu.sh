#!/usr/bin/env bash
# Issue 40's diagnosis run on one GPU, from the repository root: OUT=/some/dir bash lab/flashattn-triton/scripts/why_gpu.sh
# Where a fresh process's first call spends its time (cProfile, shipped kernels, empty caches), where a small
# call's host time goes (with the floors: an empty autograd.Function, a bare Triton launch, SDPA), then the
# CUDA tests of float32's 3xTF32 split and infinities (#43's change, tested under the interpreter before) and of
# each backend's launch path the floor-plan reorganisation touched.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
PROBE=lab/flashattn-triton/scripts/dispatch_probe.py
nvidia-smi -L > "$OUT/device.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/device.txt"
TRITON_CACHE_DIR=$(mktemp -d) FLASHATTN_TRITON_CACHE_DIR=$(mktemp -d) timeout 45 python3 $PROBE why_cold 4x8x2048x64 \
    > "$OUT/why_cold.txt" 2>&1
timeout 30 python3 $PROBE why_host > "$OUT/why_host.txt" 2>&1
TESTS=${TESTS:-tf32 or infinities or config_too_big or hopper_backward or hopper_forward or runs_triton_on_cuda \
or feature_kernels_match or varlen_matches or causal_or_window_mask or repeated_layouts or skip_the_dispatcher \
or gluon_kernels_take or varlen_tuned_kernels_match or deterministic_backward_is or opcheck}
(cd packages/flashattn-triton && timeout ${TEST_S:-70} python3 -m pytest -q -n 8 -p no:cacheprovider -rf \
    tests/test_cuda.py tests/test_cuda_features.py -k "$TESTS" > "$OUT/cuda_tests.txt" 2>&1)
tail -3 "$OUT/cuda_tests.txt"
