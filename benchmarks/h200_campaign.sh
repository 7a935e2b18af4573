#!/usr/bin/env bash
# The GPU runs behind benchmarks/log/2026-11-30.md exactly as run on a
# 2 x H200 machine:   bash benchmarks/h200_campaign.sh <stage>      (stages a-g; g on one H200)
# Everything a stage writes lands in $OUT (default ./gpu_out): logs, MLflow sqlite files, results tables,
# packed into one tarball at the end. Each stage keeps inside 10 minutes of wall time.
#
# a  GPU 0: the 27B-shaped benchmark, one H200, then its pipeline with producer_batch=1 (before).
#    GPU 1: the reference target's fast-vs-torch benchmark, then side by side on the same GPU:
#           5-minute hard_ce and soft_kl runs on target-regenerated data and the loss sweep.
# b  Both GPUs: the 27B-shaped pipeline under torchrun (DDP, target+drafter on each GPU); then the one-H200
#    benchmark on GPU 0 beside the reference target's fast-vs-torch benchmark on GPU 1; then, time allowing,
#    target on GPU 0 and drafter on GPU 1 in one process.
# c  The split layout (target GPU 0, drafter GPU 1); then 8 more trials of stage a's loss sweep, one worker per
#    GPU (copy stage a's loss_variants.journal and sweep.db into gpu_carry/ and carry it).
# d  (superseded by e, not run) the grouped-anchor drafter step beside the one-call step; the split layout.
# e  2026-11-30, before/after in one process each. GPU 0: the drafter step under every speed setting
#    (attention kernel, fused LM-head loss, torch.compile) beside today's default and the 2026-11-30 default.
#    GPU 1: the one-H200 pipeline, inline producer (default) beside the producer thread, sync sites with stacks.
#    (As run, the kernels had their first names, sdpa = K/V heads expanded and sdpa_gqa = masked GQA; they are
#    sdpa_expanded and sdpa now, and this stage is written with today's names.)
# f  GPU 0: the variants stage e could not measure (flex, compile); GPU 1: the one-H200 pipeline, inline beside
#    thread; then both GPUs: torchrun DDP (target + drafter on each GPU), then the split layout (target GPU 0,
#    drafter GPU 1, one process).
# g  One H200: the pipeline inline beside the producer thread and beside the compiled drafter.
set -uo pipefail
STAGE=${1:?stage a, b, c, d, e, f or g}
OUT=${OUT:-gpu_out}
W=gpu_work/$STAGE
mkdir -p "$OUT" "$W"
source "$(dirname "$0")/leased_gpu/wheels.sh" || exit 1  # our dependencies beside the machine's torch / transformers / triton
export PYTHONUNBUFFERED=1
# Stages a-g ran before +trainer=gpu turned on the compiled drafter: pinned off here so they reproduce as run.
BIG="+target=qwen3_6_27b_random +drafter=published bench.seq_len=2048 bench.anchors=256 trainer.compile=false trainer.pad_multiple=1"
REGEN="+data=target_regen data.num_sequences=8192 data.regen_batch_size=512"
db() { echo "tracking.tracking_uri=sqlite:///$PWD/$W/$1.db"; }

stage_a() {
  ( export CUDA_VISIBLE_DEVICES=0
    timeout 330 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 \
      bench.sections=peak,target,drafter,pipeline results=$W/RESULTS_27b_1gpu.md "$(db bench27b)" > $W/bench27b.log 2>&1
    timeout 170 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=1 \
      bench.sections=pipeline bench.profile_steps=0 results=$W/RESULTS_27b_pb1.md "$(db bench27b_pb1)" > $W/bench27b_pb1.log 2>&1
  ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 90 python -m experiments.bench +target=reference +trainer=gpu bench.seq_len=1024 bench.target_batch=8 \
      bench.anchors=64 bench.sections=peak,target,target_torch,drafter,pipeline results=$W/RESULTS_ref.md "$(db bench_ref)" \
      > $W/bench_ref.log 2>&1
    for loss in hard_ce soft_kl; do
      timeout 420 python -m experiments.run +trainer=gpu $REGEN +loss=$loss trainer.time_budget_s=300 trainer.max_steps=6000 \
        trainer.eval_every=1000 trainer.checkpoint_every=2000 run_dir=$W/i4_$loss "$(db i4_$loss)" > $W/i4_$loss.log 2>&1 &
      [ $loss = hard_ce ] && for i in $(seq 90); do ls .cache/dflash/regen/*.pt >/dev/null 2>&1 && break; sleep 2; done
    done
    timeout 380 python -m sweeps.launch loss_variants n_trials=16 workers=2 gpus=1 timeout=230 out=$W/sweeps $REGEN \
      "$(db sweep)" > $W/sweep.log 2>&1
    wait
  ) &
  wait
}

stage_b() {
  local t0=$SECONDS
  timeout 300 torchrun --nproc_per_node=2 -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 \
    bench.sections=peak,target,drafter,pipeline results=$W/RESULTS_27b_2gpu_ddp.md "$(db bench27b_ddp)" > $W/bench27b_ddp.log 2>&1
  ( export CUDA_VISIBLE_DEVICES=0
    timeout 270 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 \
      bench.sections=peak,target,drafter,pipeline results=$W/RESULTS_27b_1gpu.md "$(db bench27b)" > $W/bench27b.log 2>&1 ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 150 python -m experiments.bench +target=reference +trainer=gpu bench.seq_len=1024 bench.target_batch=8 \
      bench.anchors=64 bench.sections=peak,target,target_torch,drafter,pipeline results=$W/RESULTS_ref.md "$(db bench_ref)" \
      > $W/bench_ref.log 2>&1 ) &
  wait
  if (( SECONDS - t0 < 330 )); then  # target on GPU 0, drafter on GPU 1, one process
    timeout $(( 560 - (SECONDS - t0) )) python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 \
      target.device=cuda:0 trainer.device=cuda:1 bench.sections=peak,target,drafter,pipeline \
      results=$W/RESULTS_27b_2gpu_split.md "$(db bench27b_split)" > $W/bench27b_split.log 2>&1
  fi
}

stage_c() {  # the split layout, then more trials of stage a's sweep (its journal + MLflow db carried in gpu_carry/)
  timeout 250 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 target.device=cuda:0 \
    trainer.device=cuda:1 bench.sections=peak,target,drafter,pipeline results=$W/RESULTS_27b_2gpu_split.md \
    "$(db bench27b_split)" > $W/bench27b_split.log 2>&1
  mkdir -p gpu_work/a/sweeps && cp gpu_carry/loss_variants.journal gpu_work/a/sweeps/ && cp gpu_carry/sweep.db gpu_work/a/
  timeout 230 python -m sweeps.launch loss_variants n_trials=8 workers=2 gpus=0,1 timeout=130 out=gpu_work/a/sweeps $REGEN \
    "tracking.tracking_uri=sqlite:///$PWD/gpu_work/a/sweep.db" > $W/sweep.log 2>&1
  cp gpu_work/a/sweep.db gpu_work/a/sweeps/loss_variants.journal $W/
}

stage_d() {  # next: grouped vs one-call drafter attention and the sync sites (GPU 0), then the split layout
  timeout 300 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 bench.pipeline_steps=10 \
    bench.profile_steps=2 bench.sync_stacks=1 bench.sections=peak,target,drafter,drafter_ungrouped,pipeline \
    results=$W/RESULTS_27b_1gpu.md "$(db bench27b)" > $W/bench27b.log 2>&1
  timeout 250 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 target.device=cuda:0 \
    trainer.device=cuda:1 bench.profile_steps=0 bench.sections=peak,target,drafter,pipeline \
    results=$W/RESULTS_27b_2gpu_split.md "$(db bench27b_split)" > $W/bench27b_split.log 2>&1
}

OLD="loss.lm_head_grad=recompute"  # the 2026-11-30 default step (masked-GQA SDPA, recomputing LM-head loss)

stage_e() {
  ( export CUDA_VISIBLE_DEVICES=0
    timeout 560 python -m experiments.bench $BIG +trainer=gpu bench.sections=peak,target,drafter bench.pipeline_steps=0 \
      "bench.drafter_variants=$OLD;drafter.attn_kernel=sdpa_expanded;drafter.attn_group=0;drafter.attn_kernel=flex;trainer.compile=true;drafter.attn_kernel=flex&trainer.compile=true" \
      results=$W/RESULTS_27b_drafter.md "$(db bench27b_drafter)" > $W/bench27b_drafter.log 2>&1 ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 560 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 bench.sections=peak,target,drafter,pipeline \
      bench.kernel_profile=0 bench.profile_steps=3 bench.sync_stacks=1 \
      "bench.pipeline_variants=trainer.producer_mode=thread;trainer.producer_mode=thread&trainer.producer_batch=1" \
      results=$W/RESULTS_27b_1gpu.md "$(db bench27b_1gpu)" > $W/bench27b_1gpu.log 2>&1 ) &
  wait
}

stage_f() {  # one 2 x H200 call: phase 1 side by side, then DDP over both GPUs, then the split layout
  local P="bench.profile_steps=0 bench.kernel_profile=0"
  ( export CUDA_VISIBLE_DEVICES=0  # what failed or did nothing in stage e, now that FLOPs are counted eagerly
    timeout 250 python -m experiments.bench $BIG +trainer=gpu bench.sections=peak,drafter bench.pipeline_steps=0 \
      "bench.drafter_variants=drafter.attn_kernel=flex;trainer.compile=true;drafter.attn_kernel=sdpa_expanded" \
      results=$W/RESULTS_27b_drafter.md "$(db bench27b_drafter)" > $W/bench27b_drafter.log 2>&1 ) &
  ( export CUDA_VISIBLE_DEVICES=1  # one H200: inline producer (default) beside the producer thread
    timeout 250 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 bench.pipeline_steps=40 \
      bench.sections=peak,target,drafter,pipeline bench.profile_steps=2 bench.kernel_profile=0 \
      "bench.pipeline_variants=trainer.producer_mode=thread" \
      results=$W/RESULTS_27b_1gpu.md "$(db bench27b_1gpu)" > $W/bench27b_1gpu.log 2>&1 ) &
  wait
  timeout 170 torchrun --nproc_per_node=2 -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 \
    bench.sections=pipeline bench.pipeline_steps=30 $P results=$W/RESULTS_27b_2gpu_ddp.md "$(db bench27b_ddp)" \
    > $W/bench27b_ddp.log 2>&1
  timeout 140 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 target.device=cuda:0 \
    trainer.device=cuda:1 bench.sections=pipeline bench.pipeline_steps=30 $P \
    results=$W/RESULTS_27b_2gpu_split.md "$(db bench27b_split)" > $W/bench27b_split.log 2>&1
}

stage_g() {  # one H200 (kind nvidia-h200): the pipeline, inline (default) beside the producer thread and beside
  # the compiled drafter on padded shapes, 20 steps each
  timeout 310 python -m experiments.bench $BIG +trainer=gpu trainer.producer_batch=4 \
    bench.sections=pipeline bench.pipeline_steps=20 bench.profile_steps=0 bench.kernel_profile=0 \
    "bench.pipeline_variants=trainer.producer_mode=thread;trainer.compile=true&trainer.pad_multiple=256" \
    results=$W/RESULTS_g.md "$(db g)" > $W/g.log 2>&1
}

shift
stage_$STAGE "$@"
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv > $W/nvidia_smi.txt 2>&1
tar czf "$OUT/stage_$STAGE.tgz" --exclude='*.pt' --exclude='*.safetensors' -C gpu_work "$STAGE"
for f in $W/*.log; do echo "== $f"; grep -v "^INFO\|^W1\|Warning" "$f" | tail -14; done
