#!/usr/bin/env bash
# The two-GPU runs (nvidia-h200-x2, issue 25): minddp and shardopt tests on NCCL, all-reduce, DDP against
# torch DDP (25 and 100 MiB), FSDP against torch FSDP2, shardopt with overlap_with. Run from the repo root
# on a machine whose python3 has torch and triton:
#   OUT=/some/dir bash apps/benchmarks/scripts/h200x2_distributed.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 COLUMNS=160 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/packages/flashattn-triton/src:$PWD/packages/minddp/src:$PWD/packages/shardopt/src:$PWD/packages/profkit/src:$PWD/apps/benchmarks/src
OUT=${OUT:-out/gpu}; mkdir -p "$OUT/results"
log=$OUT/log.txt
{
  nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  (cd packages/minddp && timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_nccl.py)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs packages/shardopt/tests/test_nccl.py
  timeout 200 python3 -m benchmarks.allreduce --results-dir "$OUT/results"
  timeout 240 python3 -m benchmarks.ddp --strategy bucketed,torch --bucket-mb 25,100 --size xl --precision bf16 \
      --batch 4 --context 512 --warmup 5 --steps 30 --results-dir "$OUT/results"
  timeout 240 python3 -m benchmarks.fsdp --size xl --results-dir "$OUT/results"
  timeout 170 python3 -m benchmarks.shardopt --optimizers unsharded,sharded,overlap,zero --results-dir "$OUT/results" \
      --timeout 150
} > "$log" 2>&1
# Only 8 files come back from the device machine: pack the results into one.
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -r "$OUT/results"
tail -c 11000 "$log"
