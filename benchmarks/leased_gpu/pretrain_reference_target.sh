#!/bin/bash
# The reference target's pretraining on one H200 in one call of under 10 minutes (benchmarks/reference_target.md):
#   1. pretrain_shapes.py: the installed-packages corpus, its tokenizer, 3 shapes x SHAPE_S seconds each
#      (skipped when SHAPE=<name> is given: that shape, at RATE tok/s, default the rate measured at BATCH);
#   2. experiments.pretrain_target with the shape of lowest val loss that fits 40 MB, max_steps sized to the
#      time left (90% of the measured rate), EXTRA overrides appended (e.g. EXTRA="lr=0.002 compile=default");
#   3. the folder, results and logs tarred and split into 15 MB pieces under $OUT (reassemble: cat | tar x).
# Shipping what comes back: `python -m dflash.target.assets pack dflash/assets/reference_target` before committing
# (its weights committed as model.safetensors.xz with their sha256, docs/target.md).
# Usage (repo root, wheels installed): [SHAPE=h384_l8] [EXTRA=...] [STEPS=N] [BATCH=128] [INTERMEDIATE=1]
#   bash benchmarks/leased_gpu/pretrain_reference_target.sh [TOTAL_S] [SHAPE_S]
# A longer run: the same command with the same STEPS (and BATCH) in back-to-back calls on one warm machine (/tmp/pt
# persists there). INTERMEDIATE=1 on every job but the last: that job only checkpoints (finalize_every_job=false),
# so its ~110 s of final scoring go to training; the last job, without it, scores and writes the folder.
set -o pipefail
TOTAL=${1:-560}; SHAPE_S=${2:-25}; OUT=${OUT:-/tmp/pt_out}; T0=$(date +%s)
W=/tmp/pt; mkdir -p $W $OUT
BATCH=${BATCH:-128}   # the recipe's batch (experiments.pretrain_target); 32 before 2026-12-01
export PYTHONUNBUFFERED=1
SPLIT="--split-newlines"; [[ "$EXTRA" == *tokenizer_split_newlines=false* ]] && SPLIT=""  # the recipe splits newlines
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
if [ -z "$SHAPE" ]; then
  python3 benchmarks/gpu/pretrain_shapes.py --seconds $SHAPE_S --batch-size $BATCH --train-seconds 1 --token-cache $W/tokens $SPLIT \
    --tokenizer-out $W/tokenizer --out $W/shapes.json 2>&1 | grep -v "INFO dflash.tracking" | tee $W/shapes.log || exit 1
  TF="tokenizer_file=$W/tokenizer/tokenizer.json"
  read SHAPE RATE < <(python3 -c "
import json; d=json.load(open('$W/shapes.json'))
ok = {k: v for k, v in d['shapes'].items() if v['bf16_mb'] < 40}
s = min(ok, key=lambda k: ok[k]['val_loss']); print(s, ok[s]['tok_s'])")
fi
RATE=${RATE:-$([ "$BATCH" = 128 ] && echo 259853 || echo 132851)}   # tok/s measured at that batch (2026-12-01)
LEFT=$(( TOTAL - ($(date +%s) - T0) - 25 ))   # 25 s for the tar at the end
FINAL=110                                      # final eval, probes, save, continuations (Triton compiles)
if [ -n "$INTERMEDIATE" ]; then FINAL=15; EXTRA="$EXTRA finalize_every_job=false"; fi  # checkpoint only
SETUP=$([ -n "$TF" ] && echo 45 || echo 90)    # corpus (+ tokenizer training and encoding when not cached)
TRAIN=$(( LEFT - FINAL - SETUP ))
# STEPS=N: one run of N steps over several jobs on one machine (each job resumes state_dir's checkpoint, which needs
# the same max_steps; time_budget_s ends each job in time and writes a usable folder)
STEPS=${STEPS:-$(python3 -c "print(int(0.9 * $RATE * $TRAIN / ($BATCH * 512)))")}
OVR=$(python3 -c "
import sys; sys.path.insert(0, 'benchmarks/gpu'); from pretrain_shapes import SHAPES
print(' '.join(f'{k}={v}' for k, v in SHAPES['$SHAPE'].items()))")
echo "shape $SHAPE ($OVR): max_steps=$STEPS for ${TRAIN}s of training, job budget ${LEFT}s"
python3 -m experiments.pretrain_target $OVR max_steps=$STEPS batch_size=$BATCH warmup_steps=150 gdn_kernels=torch $TF \
  token_cache_dir=$W/tokens state_dir=$W/state run_dir=$W/run out_dir=$W/reference_target \
  results_path=$W/reference_target.md time_budget_s=$LEFT finalize_reserve_s=$FINAL eval_every=400 checkpoint_every=0 \
  tracking.tracking_uri=sqlite:///$W/mlflow.db $EXTRA 2>&1 | grep -v "INFO dflash.tracking\|Writing model" | tee $W/pretrain.log
cp $W/shapes.json $W/shapes.log $W/run/pretrain_result.json $W/run/metrics.jsonl $W/pretrain.log $W/reference_target/ 2>/dev/null
cp $W/reference_target.md $W/reference_target/RESULTS.md 2>/dev/null
if [ -d $W/reference_target ] && [ -z "$INTERMEDIATE" ]; then
  tar cf - -C $W reference_target | split -b 15M - $OUT/target.tar.
else
  cp $W/pretrain.log $W/run/metrics.jsonl $OUT/ 2>/dev/null
fi
ls -la $OUT; echo "total $(( $(date +%s) - T0 )) s"
