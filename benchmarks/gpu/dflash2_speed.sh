#!/usr/bin/env bash
# DFlash 2's training speed against DFlash 1's on ONE GPU, the issue-70 figures in one command (about 7 minutes on
# an H100; docs/dflash2.md, "Speed"):
#     bash benchmarks/gpu/dflash2_speed.sh
# 1. `benchmarks/gpu/selector_kernels.py`: the selector's pieces, each way (the top-k in the Triton LM-head chunk,
#    the pair scores); then (stage conv) `benchmarks/gpu/conv_kernels.py`: the convolution around one sublayer as
#    torch ops and as its Triton kernels, beside its memory floor (about 40 s);
# 2. the 27B-shape drafter step (random bf16 target, 2,048 tokens, 256 anchors): DFlash 1's published layout and
#    DFlash 2 (5 sliding layers, conf/drafter/dflash2_qwen3_6_27b.yaml as overrides) in one process, both compiled,
#    with each one's kernel families (`bench.kernel_profile=1`); no target section, so it fits an 80 GiB card;
# 3. the reference-shape drafter step (the shipped target, 64 sequences x 320 tokens, 128 anchors each): DFlash 1
#    (2 layers) and DFlash 2 (2 sliding layers) the same way;
# 4. on a card of more than 100 GiB (an H200): the 27B pipeline with the DFlash 2 drafter against its serial sum
#    (the target's 54 GB beside the DFlash 2 step's 37 GiB peak do not fit 80 GiB); on an 80 GiB card, when ONLY
#    names it, the same pipeline with Muon (its smaller training state fits: 77.4 GiB on an H100).
# Each stage is its own process under `timeout` (one that runs long cannot take the others' figures) and writes its
# output under $OUT/dflash2_speed; the end prints the short table. Copy the lines into the day's log,
# benchmarks/log/<date>.md, with the card's name. Env: OUT (default gpu_out); BIG / REF / MICRO override stage 2's
# and 3's shapes and stage 1's arguments, CONV the conv stage's (a CPU dry run at tiny shapes:
# tests/test_dflash2_speed_script.py); BENCH_EXTRA adds overrides to every bench stage (e.g. bench.kernel_top=80: more
# of the costliest kernels named);
# NO_PIPELINE=1 skips stage 4; ONLY=<names, comma-separated> runs only those stages (micro, conv, drafter_27b,
# drafter_reference, pipeline_27b): on an H200 the four take more than a ten-minute job limit, so e.g. ONLY=pipeline_27b
# in one job and NO_PIPELINE=1 in another.
set -uo pipefail
OUT=${OUT:-gpu_out}
W=$OUT/dflash2_speed
mkdir -p "$W" && W=$(cd "$W" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/benchmarks/leased_gpu/wheels.sh" || exit 1  # our dependencies beside the machine's torch / transformers / triton
export PYTHONUNBUFFERED=1
L=sliding_attention
D2_27B="drafter.architecture=dflash2&drafter.layer_types=[$L,$L,$L,$L,$L]&drafter.sliding_window=2048&drafter.sliding_causal=false&drafter.rope_theta=0.0"
D2_REF="drafter.architecture=dflash2&drafter.layer_types=[$L,$L]&drafter.sliding_window=2048&drafter.sliding_causal=false"
BIG=${BIG:-"+target=qwen3_6_27b_random +drafter=published +trainer=gpu bench.seq_len=2048 bench.anchors=256 trainer.producer_batch=4"}
REF=${REF:-"+trainer=gpu bench.seq_len=320 bench.drafter_batch=64 bench.anchors=128"}
PIPE=${PIPE:-"+target=qwen3_6_27b_random +drafter=dflash2_qwen3_6_27b +trainer=gpu bench.seq_len=2048 bench.anchors=256 trainer.producer_batch=4"}
COMMON="bench.profile_steps=0 +tracking=off ${BENCH_EXTRA:-}"

wanted() {  # NAME: whether the stage runs (every stage, or those ONLY names)
  [[ -z ${ONLY:-} || ",$ONLY," == *",$1,"* ]]
}

stage() {  # NAME LIMIT COMMAND...: one process under its limit, its output in $W/NAME.txt
  local name=$1 limit=$2 t=$SECONDS
  shift 2
  if ! wanted "$name"; then
    echo "$name: skipped (ONLY=$ONLY)" | tee -a "$W/stages.txt"
    return
  fi
  timeout "$limit" "$@" > "$W/$name.txt" 2>&1
  echo "$name: rc $? in $((SECONDS - t)) s" | tee -a "$W/stages.txt"
}

: > "$W/stages.txt"
stage micro 120 python "$ROOT/benchmarks/gpu/selector_kernels.py" ${MICRO:-}
stage conv 150 python "$ROOT/benchmarks/gpu/conv_kernels.py" ${CONV:-}
stage drafter_27b 300 python -m experiments.bench $BIG $COMMON bench.kernel_profile=1 bench.sections=peak,drafter \
  "bench.drafter_variants=$D2_27B"
stage drafter_reference 150 python -m experiments.bench $REF $COMMON bench.kernel_profile=1 bench.sections=peak,drafter \
  "bench.drafter_variants=$D2_REF"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [[ -n ${NO_PIPELINE:-} ]]; then
  echo "pipeline_27b: skipped (NO_PIPELINE)" | tee -a "$W/stages.txt"
elif ! wanted pipeline_27b; then
  echo "pipeline_27b: skipped (ONLY=$ONLY)" | tee -a "$W/stages.txt"
elif (( ${MIB:-0} > 102400 )) || [[ -n ${FORCE_PIPELINE:-} ]]; then
  stage pipeline_27b 420 python -m experiments.bench $PIPE $COMMON bench.kernel_profile=0 \
    bench.sections=peak,target,drafter,pipeline
elif [[ -n ${MIB:-} && ",${ONLY:-}," == *",pipeline_27b,"* ]]; then
  # an 80 GiB card, the stage named: the DFlash 2 drafter with Muon, whose training state is 6.7 GiB smaller than
  # AdamW's (peak 77.4 GiB on an H100, benchmarks/log/2026-12-07.md); expandable segments against fragmentation
  echo "pipeline_27b: trainer.optimizer=muon (GPU memory $MIB MiB)" | tee -a "$W/stages.txt"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage pipeline_27b 420 python -m experiments.bench $PIPE $COMMON \
    bench.kernel_profile=0 bench.sections=peak,target,drafter,pipeline trainer.optimizer=muon
else
  echo "pipeline_27b: skipped (GPU memory ${MIB:-unknown} MiB: with AdamW it needs more than 100 GiB;" \
    "ONLY=pipeline_27b runs it with Muon on a card of 80 GiB)" | tee -a "$W/stages.txt"
fi

echo
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU'): DFlash 2 against DFlash 1"
for f in drafter_27b drafter_reference pipeline_27b; do
  [[ -f $W/$f.txt ]] || continue
  # the bench's own table rows: the default drafter (DFlash 1), the variant (DFlash 2, with its ratio), the pipeline
  grep -E '^(drafter tok/s|pipeline)' "$W/$f.txt" | sed -E "s/\[drafter\.architecture=dflash2.*\]/[DFlash 2]/; s/^/$f  /" \
    | tr -s ' ' | cut -c1-200
done
[[ -f $W/micro.txt ]] && grep -vE '^\{' "$W/micro.txt" | sed '/^$/d'
[[ -f $W/conv.txt ]] && grep -E '^\|' "$W/conv.txt"
exit 0
