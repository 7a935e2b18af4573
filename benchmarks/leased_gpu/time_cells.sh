#!/usr/bin/env bash
# One GPU: a campaign's cells at equal GPU time, each alone (sweeps/time_cells.py), evaluated on the ground truth the
# committed campaign pinned, so their τ pairs with that campaign's cells and its prompt lookup.
#
#   CELLS="recipe/d2_dpace_l8 recipe/d1_dpace" SECONDS_A_CELL=180 bash benchmarks/leased_gpu/time_cells.sh [campaign [override ...]]
#
# Arguments after the campaign go to every cell: sweeps.time_cells' own (counts=loop: the seconds count all from
# the loop's start, how the cells of 2026-12-07 ran; the default, counts=training, counts training from the first
# step on, since on a fresh machine first data and compiling took 88-115 s of a 160-s budget and on a warm one
# 10-41 s) or run overrides (trainer.eval_at_tokens=[...]: a learning curve outside the training seconds).
# Env: CELLS (factor/option, space-separated, run in that order), SECONDS_A_CELL (each cell's trainer.time_budget_s),
# SEED (default 0), TRUTH_OF (the committed campaign whose pinned ground truth is used; default engine, the one the
# served_recipe campaign evaluated on), W (work folder, default /tmp/time_cells: outside the carried tree), OUT.
# Every cell writes its own online data (a shard folder of its own, the same stream from the same seed): the target's
# writing is inside each cell's seconds, as in a user's run, and no cell reads what an earlier one paid for.
# Each cell is its own `sweeps.time_cells` call, packed into $OUT/cells.tar.xz as soon as it ends (its metrics.jsonl,
# config.yaml and task tables: no weights), so a call its limit cuts still brings back the cells it finished. Only
# hydra, omegaconf and fla are needed beside the machine's stack: tracking is off (metrics.jsonl and the run
# folder's task tables hold all the report reads); `python -m sweeps.time_cells <campaign> report out=<unpacked>
# cells=[...]` reads them back on any machine (unpack every call's cells.tar.xz into one folder: a fresh machine's
# archive holds only its own call's cells).
set -uo pipefail
C=${1:-served_recipe}
shift $(( $# > 0 ? 1 : 0 ))
OUT=${OUT:-gpu_out}
W=${W:-/tmp/time_cells}
TRUTH_OF=${TRUTH_OF:-engine}
mkdir -p "$OUT" "$W" && OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/wheels.sh" || exit 1
export PYTHONUNBUFFERED=1 DFLASH_LOG_TIME=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
truth=$W/campaign_out/$TRUTH_OF/truth
[ -d "$truth" ] || tar -xJf benchmarks/ablations/campaign_out.tar.xz -C "$W" "campaign_out/$TRUTH_OF/truth" || exit 1
for cell in ${CELLS:?space-separated factor/option names}; do
  t=$SECONDS
  python -m sweeps.time_cells "$C" "cells=[$cell]" "seconds=${SECONDS_A_CELL:?}" "seed=${SEED:-0}" "out=$W/out" \
    tracking.enabled=false "eval.truth_dir=$truth" "data.pool.cache_dir=$W/pool" \
    "data.online.shard_dir=$W/shards/${cell//\//-}" "$@" >> "$OUT/time_cells.log" 2>&1
  echo "== $cell: rc $? in $((SECONDS - t)) s"
  (cd "$W/out" && tar -cJf "$OUT/cells.tar.xz" --exclude='final' --exclude='checkpoints' --exclude='*.png' .)
done
grep -E "first step|stopping|time budget|eval/tau_served =" "$OUT/time_cells.log" | cut -c1-200
