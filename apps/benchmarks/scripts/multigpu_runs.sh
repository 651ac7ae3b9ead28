#!/usr/bin/env bash
# Issue 45 on one machine of up to 4 GPUs (nvidia-h200-x4), in one call of under 9 minutes:
#   1. all-reduce bus bandwidth at 2 and 4 GPUs (NCCL);
#   2. BucketedDDP at 25 MiB against torch DDP at 2 GPUs, twice (the step spread is 20-30 ms), in both orders,
#      with exposed communication and overlap from each rank's traces (benchmarks.ddp);
#   3. FSDP (minddp) against torch FSDP2 at 2 and 4 GPUs (xl, bf16 compute by default), the same measures;
#   4. scaling at a fixed per-GPU batch, 1 -> 2 -> 4 GPUs, of BucketedDDP, torch DDP, minddp FSDP and FSDP2;
#   5. the profile of one step of each DDP at 2 GPUs (scripts/ddp_profile.py): hook and host times, NCCL
#      time no other kernel hid, the host-device synchronizations a step;
#   6. if time is left: FSDP at 2.7B (bf16) and at xl in fp32 on the most GPUs, then 2.7B on the others;
#   then a summary (apps/benchmarks/scripts/multigpu_summary.py): the tables, and the scaling table written
#   as multigpu_scaling.csv/.md.
#
#   bash apps/benchmarks/scripts/multigpu_runs.sh OUT_DIR
#
# Run from anywhere; it finds the repository from its own path. Leaves three files in OUT_DIR (a device
# call brings back only a few): log.txt (everything printed), summary.md (the tables) and results.tgz:
# results/<device>/<run>.csv and .md, one pair per run, named so the report picks them up (allreduce_*,
# ddp_*, fsdp_*; profile_ddp_* and multigpu_scaling beside them), and logs/<run>.log. Steps run in
# order of importance and each is skipped, said so in the log, when its estimate would pass BUDGET_S; each
# is killed (with its ranks) at its own limit, and none runs past BUDGET_S + 30 s, so a hang costs one step.
#
# Without GPUs it runs the same steps on CPU processes (gloo) at the tiny size: that is how it is tested
#   SIZE=tiny BATCH=2 CONTEXT=32 COUNTS="1 2" bash apps/benchmarks/scripts/multigpu_runs.sh /tmp/mg
#
# Environment overrides (defaults for 4 H200s):
#   PYTHON=python3  COUNTS="1 2 4" (GPU counts; the DDP comparison runs at 2)  BUDGET_S=480
#   SIZE=xl PRECISION=bf16 BATCH=4 CONTEXT=512 (per GPU, every run)  BUCKET_MB=25
#   DDP_WARMUP=3 DDP_STEPS=15     FSDP_WARMUP=2 FSDP_ITERS=5
#   FSDP_SIZES=xl FSDP_COMPUTE=bf16 (at 2 and 4 GPUs)   EXTRAS=1 with GPUs, else 0 (0: no step 6)
#   TRACE_STEPS=2
#   ALLREDUCE_SIZES_MB=1,10,100,1024
set -uo pipefail
OUT=${1:?usage: multigpu_runs.sh OUT_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 COLUMNS=160
export PYTHONPATH=$ROOT/packages/flashattn-triton/src:$ROOT/packages/minddp/src:$ROOT/packages/shardopt/src:$ROOT/packages/profkit/src:$ROOT/apps/benchmarks/src
PY=${PYTHON:-python3}
COUNTS=${COUNTS:-1 2 4}; BUDGET_S=${BUDGET_S:-480}
SIZE=${SIZE:-xl}; PRECISION=${PRECISION:-bf16}; BATCH=${BATCH:-4}; CONTEXT=${CONTEXT:-512}; BUCKET_MB=${BUCKET_MB:-25}
DDP_WARMUP=${DDP_WARMUP:-3}; DDP_STEPS=${DDP_STEPS:-15}; FSDP_WARMUP=${FSDP_WARMUP:-2}; FSDP_ITERS=${FSDP_ITERS:-5}
TRACE_STEPS=${TRACE_STEPS:-2}  # traced steps per configuration, for communication and overlap
FSDP_SIZES=${FSDP_SIZES:-$SIZE}; FSDP_COMPUTE=${FSDP_COMPUTE:-$PRECISION}
ALLREDUCE_SIZES_MB=${ALLREDUCE_SIZES_MB:-1,10,100,1024}
RUNS=$OUT/runs; RESULTS=$OUT/results; LOGS=$OUT/logs
rm -rf "$RUNS" "$RESULTS" "$LOGS"; mkdir -p "$RUNS" "$RESULTS" "$LOGS"

GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$GPUS" -gt 0 ]; then BACKEND=nccl; FSDP_DEVICE=cuda; else BACKEND=gloo; FSDP_DEVICE=cpu; fi
EXTRAS=${EXTRAS:-$([ "$GPUS" -gt 0 ] && echo 1 || echo 0)}  # 2.7B on CPU processes would fill the memory
if [ "$GPUS" -gt 0 ]; then  # only the counts this machine has (a 2-GPU machine runs 1 and 2)
  COUNTS=$(for n in $COUNTS; do [ "$n" -le "$GPUS" ] && echo "$n"; done | paste -sd' ' -)
fi
MULTI=$(for n in $COUNTS; do [ "$n" -gt 1 ] && echo "$n"; done | paste -sd, -)  # the counts above one GPU

# step NAME ESTIMATE_S LIMIT_S COMMAND...: run COMMAND (with --results-dir $RUNS/NAME) unless its estimate
# would pass the budget; its output in logs/NAME.log, its results copied to results/<device>/NAME.csv/.md.
step() {
  local name=$1 estimate=$2 limit=$3; shift 3
  if [ $((SECONDS + estimate)) -gt "$BUDGET_S" ]; then
    echo "=== $name: skipped (${estimate} s from ${SECONDS} s would pass BUDGET_S=${BUDGET_S})"; return
  fi
  local start=$SECONDS
  [ "$limit" -gt $((BUDGET_S + 30 - SECONDS)) ] && limit=$((BUDGET_S + 30 - SECONDS))
  echo "=== $name (${SECONDS} s in; estimate ${estimate} s, limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" --results-dir "$RUNS/$name" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || tail -n 25 "$LOGS/$name.log"
  for f in "$RUNS/$name"/*/*.csv "$RUNS/$name"/*/*.md; do
    [ -e "$f" ] || continue
    local device; device=$(basename "$(dirname "$f")"); mkdir -p "$RESULTS/$device"
    cp "$f" "$RESULTS/$device/$name.${f##*.}"
  done
}

{
  echo "### $(date -u '+%Y-%m-%d %H:%M UTC'): $GPUS GPUs, backend $BACKEND, counts $COUNTS, budget $BUDGET_S s"
  nvidia-smi -L 2>/dev/null; nvidia-smi topo -m 2>/dev/null | head -n 8
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl",
      torch.cuda.nccl.version() if torch.cuda.is_available() else "-")'
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE; per GPU: $SIZE $PRECISION, batch ${BATCH}x${CONTEXT}"

  # 1. All-reduce bus bandwidth at every count above one GPU.
  [ -n "$MULTI" ] && step "allreduce_${BACKEND}_x${MULTI//,/_}" 35 150 $PY -m benchmarks.allreduce \
      --backends "$BACKEND" --world-sizes "$MULTI" --sizes-mb "$ALLREDUCE_SIZES_MB" --timeout 140

  # 2. and 4. DDP: BucketedDDP against torch DDP, the bare model ("single") as reference; at 2 GPUs twice,
  # the second run in the other order, so neither wrapper always runs first after the reference.
  ddp() {  # ddp NAME NPROC STRATEGIES
    step "$1" 55 200 $PY -m benchmarks.ddp --nproc "$2" --backend "$BACKEND" --strategy "$3" \
        --bucket-mb "$BUCKET_MB" --size "$SIZE" --precision "$PRECISION" --batch "$BATCH" --context "$CONTEXT" \
        --warmup "$DDP_WARMUP" --steps "$DDP_STEPS" --trace-steps "$TRACE_STEPS" --timeout 190
  }
  ddp ddp_2gpu_a 2 bucketed,torch
  ddp ddp_2gpu_b 2 torch,bucketed

  # ---- FSDP: the one place to adapt when benchmarks.fsdp changes (e.g. minddp.fully_shard's strategy name).
  FSDP_STRATEGIES=${FSDP_STRATEGIES:-torch-fsdp2,minddp-fsdp}
  fsdp() {  # fsdp NPROC SIZE [COMPUTE]
    local compute=${3:-$FSDP_COMPUTE} estimate=40
    { [ "$2" = 2.7B ] || [[ $compute == *fp32* ]]; } && estimate=55
    step "fsdp_${2}_${compute//,/_}_${1}gpu" "$estimate" 200 $PY -m benchmarks.fsdp --nproc "$1" \
        --device "$FSDP_DEVICE" --size "$2" --compute "$compute" --strategies "$FSDP_STRATEGIES" --batch-size "$BATCH" \
        --context-length "$CONTEXT" --warmup "$FSDP_WARMUP" --iters "$FSDP_ITERS" --trace-steps "$TRACE_STEPS" \
        --timeout 190
  }
  for n in ${MULTI//,/ }; do for size in $FSDP_SIZES; do fsdp "$n" "$size"; done; done
  # ---- end of FSDP

  # 4. The rest of the scaling table: DDP and FSDP at the other counts (2 GPUs came from above).
  for n in $COUNTS; do
    [ "$n" -eq 2 ] && continue
    ddp "ddp_${n}gpu" "$n" bucketed,torch
    [ "$n" -eq 1 ] && fsdp 1 "$SIZE"
  done

  # 5. Where the DDP step's time goes at 2 GPUs: hooks, host, NCCL time no kernel hid, host syncs.
  [[ " $COUNTS " == *" 2 "* ]] && step profile_ddp_2gpu 50 200 $PY "$ROOT/apps/benchmarks/scripts/ddp_profile.py" \
      --nproc 2 --size "$SIZE" --configs single,bucketed,torch --bucket-mb "$BUCKET_MB" --batch "$BATCH" \
      --context "$CONTEXT" --warmup "$DDP_WARMUP" --steps 5 --timeout 190

  # 6. If time is left: FSDP at 2.7B, and in fp32, on the most GPUs, then 2.7B on the others.
  if [ "$EXTRAS" = 1 ] && [ -n "$MULTI" ]; then
    most=${MULTI##*,}
    [[ " $FSDP_SIZES " == *" 2.7B "* ]] || fsdp "$most" 2.7B
    [ "$FSDP_COMPUTE" = fp32 ] || fsdp "$most" "$SIZE" fp32
    for n in ${MULTI//,/ }; do [ "$n" = "$most" ] || [[ " $FSDP_SIZES " == *" 2.7B "* ]] || fsdp "$n" 2.7B; done
  fi

  echo "=== summary (${SECONDS} s in)"
  $PY "$ROOT/apps/benchmarks/scripts/multigpu_summary.py" "$RESULTS" --out "$OUT/summary.md"
  echo "### done in ${SECONDS} s"
} 2>&1 | tee "$OUT/log.txt"

# Only a few files come back from the device machine: the results and logs packed into one.
tar czf "$OUT/results.tgz" -C "$OUT" results logs && rm -rf "$RUNS" "$RESULTS" "$LOGS"
