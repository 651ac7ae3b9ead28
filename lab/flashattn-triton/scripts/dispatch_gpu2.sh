#!/usr/bin/env bash
# Issue 40's second GPU run, from the repository root: OUT=/some/dir bash lab/flashattn-triton/scripts/dispatch_gpu2.sh.
# The cold first call with the shipped kernels (and, without them, what a second fresh process still compiles),
# transformers' Llama with flash_attention registered, eager and compiled, the Llama-style training step
# compiled beside SDPA, and the CUDA tests of the mask recognition.
set -uo pipefail
export COLUMNS=220 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; mkdir -p "$OUT/res"; L=$OUT/log.txt
PROBE=lab/flashattn-triton/scripts/dispatch_probe.py
{
  nvidia-smi -L
  echo "== cold first call, shipped kernels, fresh process, empty caches"
  for shape in 4x8x2048x64 2x16x4096x128 1x32x1024x64; do
    TRITON_CACHE_DIR=$(mktemp -d) FLASHATTN_TRITON_CACHE_DIR=$(mktemp -d) timeout 40 python3 $PROBE cold $shape
  done
  echo "== no shipped kernels: two fresh processes sharing one Triton cache"
  C=$(mktemp -d)
  for i in 1 2; do
    FLASHATTN_TRITON_SHIPPED_KERNELS=0 TRITON_CACHE_DIR=$C FLASHATTN_TRITON_CACHE_DIR=$(mktemp -d) timeout 40 python3 $PROBE cold 4x8x2048x64
  done
  echo "== transformers Llama"
  FLASHATTN_TRITON_LOG_ROUTES=1 timeout 80 python3 $PROBE hf
  echo "== Llama-style training step, compiled"
  timeout 130 python3 -m benchmarks.e2e --size llama-8L --context 2048 --precision bf16 --attention sdpa,flash \
      --compile --warmup 2 --steps 5 --name e2e_llama_compiled_causal --results-dir "$OUT/res"
  echo "== CUDA tests of the routes"
  (cd packages/flashattn-triton && timeout 60 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_features.py -k "route or mask" 2>&1 | tail -8)
} > "$L" 2>"$OUT/stderr.txt"
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$OUT/res"
