#!/usr/bin/env bash
# The two-GPU runs of issue 25 (nvidia-h200-x2), in two parts that each fit one 600 s device call:
#   PART=a: all-reduce on NCCL at 2 GPUs, DDP against torch DDP (25 and 100 MiB), shardopt with overlap_with
#   PART=b: FSDP against torch FSDP2 at xl and 2.7B, then minddp's and shardopt's NCCL tests
# Run from the repo root on a machine whose python3 has torch and triton:
#   OUT=/some/dir PART=a bash apps/benchmarks/scripts/h200x2_distributed.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 COLUMNS=160 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/minddp/src:$PWD/packages/shardopt/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; PART=${PART:-a}; mkdir -p "$OUT/results"
# step NAME SECONDS COMMAND...: run it with a time limit, its log in $OUT/NAME.log, its tail and duration shown
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS; echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $((SECONDS - start)) s"; tail -c 2500 "$OUT/$name.log"; }
if [ "$PART" = a ]; then
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  step allreduce 120 python3 -m benchmarks.allreduce --backends nccl --world-sizes 2 --results-dir "$OUT/results" --timeout 110
  step ddp 230 python3 -m benchmarks.ddp --strategy bucketed,torch --bucket-mb 25,100 --size xl --precision bf16 \
      --batch 4 --context 512 --warmup 5 --steps 30 --results-dir "$OUT/results" --timeout 220
  step shardopt 200 python3 -m benchmarks.shardopt --optimizers unsharded,sharded,overlap,zero --results-dir "$OUT/results" \
      --timeout 190
else
  step fsdp_xl 200 python3 -m benchmarks.fsdp --size xl --results-dir "$OUT/results" --timeout 190
  for f in "$OUT"/results/*/fsdp.*; do mv "$f" "${f%/fsdp.*}/fsdp_xl.${f##*.}"; done  # the 2.7B run writes fsdp.* too
  step fsdp_2.7B 250 python3 -m benchmarks.fsdp --size 2.7B --results-dir "$OUT/results" --timeout 240
  step nccl_tests 120 bash -c 'cd packages/minddp && python3 -m pytest -q -p no:cacheprovider -rs tests/test_nccl.py &&
      cd ../.. && python3 -m pytest -q -p no:cacheprovider -rs packages/shardopt/tests/test_nccl.py'
fi
# Only 8 files come back from the device machine: pack the results into one.
tar czf "$OUT/results-$PART.tgz" -C "$OUT" results && rm -r "$OUT/results"
