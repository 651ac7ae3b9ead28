#!/usr/bin/env bash
# Experiment on one H100: host-built (TMA) vs device-built tensor descriptors in flashattn-triton:
# per-call host overhead, then the bfloat16 sweep with device descriptors, then the float32 sweep.
set -uo pipefail
export COLUMNS=250 PYTHONUNBUFFERED=1
SRC=$PWD/packages/flashattn-triton/src:$PWD/packages/minddp/src:$PWD/packages/shardopt/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
DEV=$PWD/tools/gpu/device_descriptors
OUT=${OUT:-out/gpu}; R=$OUT/results; mkdir -p "$R"; L=$OUT/log.txt
{
  nvidia-smi -L; PYTHONPATH=$SRC python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  PYTHONPATH=$SRC timeout 60 python3 tools/gpu/host_profile.py | grep "^== "
  PYTHONPATH=$DEV:$SRC timeout 90 python3 tools/gpu/host_profile.py | grep "^== "
  PYTHONPATH=$DEV:$SRC timeout 100 python3 packages/flashattn-triton/scripts/tune.py --precompile-only --workers 14
  PYTHONPATH=$DEV:$SRC timeout 230 python3 -m benchmarks.flash --name flash_device_descriptors --dtypes bfloat16 \
      --warmup 5 --rep 25 --max-minutes 3.0 --torch-max-seq 2048 --results-dir "$R"
  echo "bench bf16 (device descriptors) rc=$?"
  PYTHONPATH=$SRC timeout 150 python3 -m benchmarks.flash --name flash_fp32 --dtypes float32 --shapes '' \
      --impls triton,naive,sdpa-efficient --warmup 5 --rep 25 --max-minutes 1.6 --results-dir "$R"
  echo "bench fp32 rc=$?"
} > "$L" 2>"$OUT/stderr.txt"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -r "$R"
grep -E "descriptors=|T>=|wrote|rc=" "$L" | tail -40
