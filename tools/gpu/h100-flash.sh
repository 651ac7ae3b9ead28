#!/usr/bin/env bash
# flashattn-triton on one H100 (nvidia-h100-x1): precompile the kernel candidates, the bfloat16 sweep
# against SDPA's flash and cuDNN backends and the float32 sweep against its memory-efficient backend
# (each its own process and results file), then the GPU tests. PART=bench or PART=tests runs one half
# (each fits one 10-minute device call).
#   OUT=/some/dir [PART=bench|tests] bash tools/gpu/h100-flash.sh
set -uo pipefail
export COLUMNS=250 PYTHONUNBUFFERED=1 FLASHATTN_TRITON_AUTOTUNE_LOG=1
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/minddp/src:$PWD/packages/shardopt/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; R=$OUT/results; mkdir -p "$R"; L=$OUT/log.txt; PART=${PART:-all}
SEQ=1024,2048,4096,8192,16384,32768,65536
{
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  if [ "$PART" != tests ]; then
    timeout 60 python3 packages/flashattn-triton/scripts/tune.py --precompile-only --workers 14
    timeout 260 python3 -m benchmarks.flash --name flash_sdpa --dtypes bfloat16 --seq $SEQ --dims 16,32,64,128 \
        --impls triton,sdpa-flash,sdpa-cudnn --warmup 5 --rep 25 --repeats 3 --max-minutes 3.6 --results-dir "$R"
    echo "bench bf16 rc=$?"
    timeout 220 python3 -m benchmarks.flash --name flash_fp32 --dtypes float32 --shapes '' --seq $SEQ \
        --impls triton,sdpa-efficient --warmup 5 --rep 25 --repeats 3 --max-minutes 3.0 --results-dir "$R"
    echo "bench fp32 rc=$?"
  fi
} > "$L" 2>"$OUT/stderr.txt"
if [ "$PART" != bench ]; then
  timeout 240 python3 -m pytest packages/flashattn-triton/tests apps/benchmarks/tests/test_flash.py -n 14 -q \
      -p no:cacheprovider -rfE > "$OUT/tests.txt" 2>&1
  echo "pytest rc=$?" >> "$L"; tail -25 "$OUT/tests.txt" >> "$L"
  pkill -f pytest 2>/dev/null
fi
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -r "$R"
grep -E "T >=|T>=|geomean|geometric|wrote|rc=|passed|failed" "$L" | tail -40
