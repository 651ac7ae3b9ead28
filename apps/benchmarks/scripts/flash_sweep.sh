#!/usr/bin/env bash
# flashattn-triton's record sweeps on one H100 (run 54 of lab/flashattn-triton/decisions.md):
# the bfloat16 sweep against SDPA's flash and cuDNN backends, then the float32 sweep against its
# memory-efficient backend, each its own process and results file; then each compared, cell by cell, with
# the committed results (flash_regression.py). About 6 minutes; run from the repository root:
#   OUT=/some/dir bash apps/benchmarks/scripts/flash_sweep.sh
# Results: $OUT/results/<device>/flash_sdpa.{csv,md} and flash_fp32.{csv,md}; the log: $OUT/log.txt.
set -uo pipefail
export COLUMNS=250 PYTHONUNBUFFERED=1 FLASHATTN_TRITON_AUTOTUNE_LOG=1  # tuning decisions to stderr.txt
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; R=$OUT/results; mkdir -p "$R"; L=$OUT/log.txt
BASELINE=${BASELINE:-results/nvidia-h100-80gb-hbm3}
SEQ=1024,2048,4096,8192,16384,32768,65536
{
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  # Compiles every candidate kernel in parallel first, so the sweeps' first calls only time them.
  timeout 60 python3 lab/flashattn-triton/scripts/tune.py --precompile-only --workers 14
  timeout 260 python3 -m benchmarks.flash --name flash_sdpa --dtypes bfloat16 --seq $SEQ --dims 16,32,64,128 \
      --impls triton,sdpa-flash,sdpa-cudnn --warmup 5 --rep 25 --repeats 3 --max-minutes 3.6 --results-dir "$R"
  echo "bench bf16 rc=$?"
  timeout 220 python3 -m benchmarks.flash --name flash_fp32 --dtypes float32 --shapes '' --seq $SEQ \
      --impls triton,sdpa-efficient --warmup 5 --rep 25 --repeats 3 --max-minutes 3.0 --results-dir "$R"
  echo "bench fp32 rc=$?"
  for name in flash_sdpa flash_fp32; do
    for new in "$R"/*/"$name.csv"; do
      [ -f "$new" ] && python3 apps/benchmarks/scripts/flash_regression.py "$BASELINE/$name.csv" "$new"
    done
  done
} > "$L" 2>"$OUT/stderr.txt"
grep -E "geomean|geometric|T >=|T>=|wrote|rc=|slower|cells" "$L" | tail -60
