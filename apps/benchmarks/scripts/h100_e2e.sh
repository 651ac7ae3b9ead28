#!/usr/bin/env bash
# The single-GPU experiments of profkit and the model (nvidia-h100-x1): profkit's CUDA tests,
# e2e for all five sizes, per-phase kernel tables, the 2.7B memory timeline, attention, precision.
#   OUT=/some/dir bash apps/benchmarks/scripts/h100_e2e.sh
set -uo pipefail
export COLUMNS=200 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/minddp/src:$PWD/packages/shardopt/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; R=$OUT/results; mkdir -p "$R" /tmp/mem
{
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -m pytest -q -p no:cacheprovider -rs packages/profkit/tests \
      apps/benchmarks/tests/test_attention.py::test_measured_memory_matches_the_formula_on_cuda
  python3 -m benchmarks.precision --results-dir "$R"
  python3 -m benchmarks.e2e --results-dir "$R" --size small,medium,large,xl,2.7B --context 128,256,512 \
      --precision fp32,bf16 --mode train --warmup 3 --steps 5
  python3 -m benchmarks.e2e --results-dir "$R" --name e2e_profile --size medium --context 512 \
      --precision fp32,bf16 --warmup 2 --steps 3 --profile kernels
  python3 -m benchmarks.e2e --results-dir "$R" --name e2e_2.7B --size 2.7B --context 256 --precision bf16 \
      --warmup 1 --steps 2 --memory /tmp/mem/e2e_memory_2.7B.pickle && cp /tmp/mem/e2e_memory_2.7B.png "$OUT/"
  timeout $((570 - SECONDS)) python3 -m benchmarks.attention --results-dir "$R" --warmup 2
} > "$OUT/log.txt" 2>&1
# Only 8 files come back from the device machine: pack the results into one.
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -r "$R"
tail -c 11000 "$OUT/log.txt"
