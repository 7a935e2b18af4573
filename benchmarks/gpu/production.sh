#!/usr/bin/env bash
# The production-shape figures on ONE H200 (kind nvidia-h200), one device call of at most 9 minutes:
#     bash benchmarks/gpu/production.sh
# 0. tests/test_speed_settings.py's GPU test: the side-stream producer trains to the one-stream losses;
# 1. the training side at the 27B shapes (2,048 tokens, 256 anchors, +trainer=gpu): target, drafter step and the
#    pipeline's headline (tokens trained on per second, 4 windows of 12 steps after 12 warm-up steps), each
#    speed setting beside the default in the same process (before / after):
#      target:   target.fused_ops=off (transformers' own norms, MLP and attention; the default compiles them fused);
#      drafter:  loss.lm_head_kernel=torch (the torch LM-head chunk; the default runs it on two Triton kernels);
#      pipeline: both of those off (the pre-2026-12-01 pipeline), then trainer.producer_stream=side (the target's
#                forwards on their own stream; a tie with the default on 2026-12-01);
# 2. what τ buys (bench.sections=serving): greedy decode step, block verify (B = 16), DDTree verify of 16 / 64 /
#    256 nodes, re-advance and the drafter's round, after 1 K / 2 K / 4 K / 8 K tokens of context;
# 3. time allowing: the CUDA-graph drafter in the pipeline and trainer.compile_mode=max-autotune-no-cudagraphs
#    (inductor autotunes every matmul: slow to compile), read against stage 1's defaults.
# Each stage is its own process under `timeout`, so one that runs long cannot take the others' figures. Every
# stage writes a RESULTS entry (table + raw JSON with target, drafter, seq_len, anchors, GPUs) and a sqlite MLflow
# store under $OUT/production; the end prints the short table. Copy the entries into the day's log, benchmarks/log/<date>.md.
set -uo pipefail
OUT=${OUT:-gpu_out}
W=$OUT/production
mkdir -p "$W" && W=$(cd "$W" && pwd)  # absolute: $OUT may be either
source "$(dirname "$0")/../leased_gpu/wheels.sh" || exit 1  # our dependencies beside the machine's torch / transformers / triton
export PYTHONUNBUFFERED=1
T0=$SECONDS
left() { echo $(( 530 - (SECONDS - T0) )); }
# BIG / TRAIN / SERVE may be set from outside for a CPU dry run of this script at tiny shapes
BIG=${BIG:-"+target=qwen3_6_27b_random +drafter=published bench.seq_len=2048 bench.anchors=256"}
TRAIN=${TRAIN:-"$BIG +trainer=gpu trainer.producer_batch=4 bench.pipeline_steps=40 bench.pipeline_repeats=4 bench.pipeline_warmup=10"}
SERVE=${SERVE:-"$BIG bench.serving_iters=10"}
db() { echo "tracking.tracking_uri=sqlite:///$W/$1.db"; }

# 0. the side stream's synchronisation on this GPU: same losses as one stream (inline and thread producers)
timeout 75 python -m pytest -q -p no:cacheprovider tests/test_speed_settings.py -m gpu > $W/gpu_tests.log 2>&1
echo "gpu tests: rc $? at $((SECONDS - T0)) s: $(tail -1 $W/gpu_tests.log)"

timeout $(( $(left) - 100 < 330 ? $(left) - 100 : 330 )) python -m experiments.bench $TRAIN \
  bench.sections=peak,target,drafter,pipeline bench.profile_steps=2 bench.kernel_profile=1 \
  "bench.target_variants=target.fused_ops=off" "bench.drafter_variants=loss.lm_head_kernel=torch" \
  "bench.pipeline_variants=target.fused_ops=off&loss.lm_head_kernel=torch;trainer.producer_stream=side" \
  results=$W/RESULTS_train.md "$(db train)" > $W/train.log 2>&1
echo "train: rc $? at $((SECONDS - T0)) s"

timeout $(( $(left) - 10 < 180 ? $(left) - 10 : 180 )) python -m experiments.bench $SERVE bench.sections=serving \
  results=$W/RESULTS_serving.md "$(db serving)" > $W/serving.log 2>&1
echo "serving: rc $? at $((SECONDS - T0)) s"

if (( $(left) > 150 )); then  # time allowing: the CUDA-graph drafter in the pipeline, the autotuned drafter step
  timeout $(( $(left) - 10 )) python -m experiments.bench $TRAIN bench.sections=peak bench.kernel_profile=0 \
    "bench.pipeline_variants=trainer.compile_mode=reduce-overhead" \
    "bench.drafter_variants=trainer.compile_mode=max-autotune-no-cudagraphs" \
    results=$W/RESULTS_extra.md "$(db extra)" > $W/extra.log 2>&1
  echo "extra: rc $? at $((SECONDS - T0)) s"
fi

echo; echo "== production shapes, one H200, 27B shapes (2,048 tokens, 256 anchors) =="
for f in train extra; do
  [ -f $W/RESULTS_$f.md ] && grep -E "^(shapes|matmul peak|target tok/s|drafter tok/s|back-to-back|pipeline tok/s|drafter step|peak GPU)" $W/RESULTS_$f.md
done
[ -f $W/RESULTS_serving.md ] && awk '/^```/{on=0} /^serving after/{on=($3==2048 || $3==8192)}
  on && (/^serving after/ || /tau/ || /failed/ || $1 ~ /^(1|2|3|4|6|8|12|16)$/)' $W/RESULTS_serving.md
for f in train serving extra; do  # a stage cut short: its measurements as logged
  [ -f $W/$f.log ] && [ ! -f $W/RESULTS_$f.md ] && { echo "-- $f: no table; figures as logged:"; grep -E "bench [a-z_]+( \[.*\])?:" $W/$f.log | cut -c1-600; }
done
