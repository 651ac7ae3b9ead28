#!/usr/bin/env bash
# flashattn-triton on one H100 (nvidia-h100-x1): precompile the kernel candidates, the bfloat16 and
# float32 sweeps of benchmarks.flash (each its own process and results file), then the GPU tests.
#   OUT=/some/dir bash tools/gpu/h100-flash.sh
set -uo pipefail
export COLUMNS=250 PYTHONUNBUFFERED=1 FLASHATTN_TRITON_AUTOTUNE_LOG=1
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/minddp/src:$PWD/packages/shardopt/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; R=$OUT/results; mkdir -p "$R"; L=$OUT/log.txt
{
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  timeout 90 python3 packages/flashattn-triton/scripts/tune.py --precompile-only --workers 14
  timeout 250 python3 -m benchmarks.flash --dtypes bfloat16 --warmup 5 --rep 25 --max-minutes 3.2 \
      --torch-max-seq 2048 --results-dir "$R"
  echo "bench bf16 rc=$?"
  timeout 110 python3 -m benchmarks.flash --name flash_fp32 --dtypes float32 --shapes '' --warmup 5 --rep 25 \
      --max-minutes 1.2 --torch-max-seq 2048 --results-dir "$R"
  echo "bench fp32 rc=$?"
} > "$L" 2>"$OUT/stderr.txt"
timeout 140 python3 -m pytest packages/flashattn-triton/tests apps/benchmarks/tests/test_flash.py -n 14 -q \
    -p no:cacheprovider -rfE > "$OUT/tests.txt" 2>&1
echo "pytest rc=$?" >> "$L"; tail -25 "$OUT/tests.txt" >> "$L"
pkill -f pytest 2>/dev/null
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -r "$R"
grep -E "T >=|T>=|geomean|geometric|wrote|rc=|passed|failed" "$L" | tail -40
