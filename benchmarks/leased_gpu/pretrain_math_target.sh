#!/bin/bash
# The math reference target's pretraining on one H100/H200 in one call of under 10 minutes (docs/target.md;
# its results file: benchmarks/reference_math_target.md): experiments.pretrain_target data=math at the code reference's shape
# (h384_l8) unless EXTRA says otherwise (the shipped one: EXTRA="hidden_size=256 num_layers=6 intermediate_size=512
# num_heads=4 num_kv_heads=2 linear_num_key_heads=2 linear_num_value_heads=4 vocab_size=2048", 10 MB in bf16, so the
# working tree still fits a device call; TOTAL_S=405 gave 1,606 steps, 2026-12-06), max_steps sized to the time left at RATE tok/s (default: the code target's measured 259,853 at batch 128;
# the math target's tokens cost the same per step), then the quality bar on the written folder (held-out accuracy,
# entropy profile, ground-truth degeneracy, marginal oracle tau), the folder and its records tarred into 15 MB pieces
# under $OUT (reassemble: cat $OUT/math_target.tar.* | tar x).
# Needs the wheels every call installs (README: Hydra for the entry point); MLflow is off, the run's metrics.jsonl is
# the record.
# Usage (repo root): [RATE=...] [STEPS=N] [EXTRA=...] bash benchmarks/leased_gpu/pretrain_math_target.sh [TOTAL_S]
# Shipping what comes back: unpack it into dflash/assets/<name>/, then `python -m dflash.target.assets pack
# dflash/assets/<name>` (its weights committed as model.safetensors.xz with their sha256, docs/target.md).
set -o pipefail
source benchmarks/leased_gpu/wheels.sh   # the wheel folder the call carries, if any (README)
TOTAL=${1:-480}; OUT=${OUT:-/tmp/pm_out}; T0=$(date +%s)
W=/tmp/pm; mkdir -p $W $OUT
BATCH=${BATCH:-128}; RATE=${RATE:-259853}
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
SETUP=75     # 300,000 problems generated (~25 s), the stdlib corpus, the BPE on 8 MB, the encoding
FINAL=100    # final eval, save, continuations, then the quality bar (256 sampled solutions, 16 oracle problems)
LEFT=$(( TOTAL - ($(date +%s) - T0) - 20 ))   # 20 s for the tar at the end
TRAIN=$(( LEFT - FINAL - SETUP ))
STEPS=${STEPS:-$(python3 -c "print(int(0.9 * $RATE * $TRAIN / ($BATCH * 512)))")}
echo "math target: max_steps=$STEPS (batch $BATCH x 512) for ${TRAIN}s of training, job budget ${LEFT}s"
python3 -m experiments.pretrain_target data=math max_steps=$STEPS batch_size=$BATCH warmup_steps=100 gdn_kernels=torch \
  token_cache_dir=$W/tokens state_dir=$W/state run_dir=$W/run out_dir=$W/reference_math_target \
  results_path=$W/reference_math_target.md time_budget_s=$(( LEFT - 40 )) finalize_reserve_s=60 eval_every=200 \
  checkpoint_every=0 tracking.enabled=false $EXTRA 2>&1 \
  | grep -v "INFO dflash.tracking\|Writing model" | tee $W/pretrain.log
cp $W/run/pretrain_result.json $W/run/metrics.jsonl $W/pretrain.log $W/reference_math_target/ 2>/dev/null
cp $W/reference_math_target.md $W/reference_math_target/RESULTS.md 2>/dev/null
if [ -d $W/reference_math_target ]; then
  tar cf - -C $W reference_math_target | split -b 15M - $OUT/math_target.tar.
else
  cp $W/pretrain.log $W/run/metrics.jsonl $OUT/ 2>/dev/null
fi
ls -la $OUT; echo "total $(( $(date +%s) - T0 )) s"
