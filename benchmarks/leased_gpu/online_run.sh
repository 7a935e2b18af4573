#!/usr/bin/env bash
# One GPU: the `+trainer=gpu` defaults (online data the target writes: the installed corpus's prompt
# pool, graph decode, batches written ahead, data.online.reuse auto) with a 5-layer drafter, as one run made of
# jobs of under ten minutes each. The first call starts the run; a later call with the same OUT resumes it from
# its checkpoint (on a machine that kept OUT). Prints each job's consumed tok/s and, after the last, data/epochs.
#
#   RUN_S=300 bash benchmarks/leased_gpu/online_run.sh [OUT]     (default OUT=gpu_work/online_run)
#
# Env: RUN_S (this job's time budget, default 300 s), TOKENS (the run's token budget, which is also the plan the
# memorization guard judges; default 220 M: 3.8 epochs of the GPU machine's 180,736-prompt installed pool), CORPUS
# (data.corpus.scope, default installed), BASE (the run's groups, default "+trainer=gpu drafter.num_layers=5
# +eval=off"; e.g. "+recipe=best_reference" with TOKENS its budget), EXTRA (more overrides, first job only), PY.
# Across machines (benchmarks/leased_gpu/carry.py): RETURN=<the device's $OUT> packs the run folder and its MLflow store
# there in checked parts after the job; later calls stage those parts in CARRY_IN (default /tmp/carry), one
# call per part, and the job that finds no run in OUT restores it from there and resumes it:
#   RETURN=$OUT RUN_S=480 BASE=+recipe=best_reference TOKENS=<its budget> CORPUS=stdlib \
#     EXTRA="eval.truth_dir=$PWD/gpu_work/recipe/truth" bash benchmarks/leased_gpu/online_run.sh gpu_work/recipe
set -euo pipefail
RETURN=${RETURN:-}
CARRY_IN=${CARRY_IN:-/tmp/carry}
OUT=${1:-gpu_work/online_run}
RUN_S=${RUN_S:-300}
TOKENS=${TOKENS:-220000000}
CORPUS=${CORPUS:-installed}
PY=${PY:-python}
EXTRA=${EXTRA:-}
BASE=${BASE:-+trainer=gpu drafter.num_layers=5 +eval=off}  # what the run is (e.g. +recipe=best_reference)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ ! -f "$OUT/run/config.yaml" ] && [ -f "$CARRY_IN/carry.manifest.json" ]; then
  echo "== restoring the run carried in $CARRY_IN" >&2
  $PY benchmarks/leased_gpu/carry.py unpack "$CARRY_IN" "$OUT"
fi
if [ -f "$OUT/run/config.yaml" ]; then
  echo "== resuming $OUT/run for ${RUN_S} s" >&2
  $PY -m experiments.run resume="$OUT/run" trainer.time_budget_s=$RUN_S >> "$OUT/run.log" 2>&1 \
    || { tail -30 "$OUT/run.log"; exit 1; }
else
  echo "== new run in $OUT/run for ${RUN_S} s" >&2
  $PY -m experiments.run $BASE run_dir="$OUT/run" \
    tracking.tracking_uri="sqlite:///$OUT/mlflow.db" tracking.log_every=10 tracking.system_metrics=false \
    trainer.max_steps=1000000 trainer.checkpoint_every=1000000 trainer.token_budget=$TOKENS \
    trainer.time_budget_s=$RUN_S data.corpus.scope=$CORPUS data.pool.cache_dir="$OUT/pool" \
    data.online.shard_dir="$OUT/shards" $EXTRA > "$OUT/run.log" 2>&1 || { tail -30 "$OUT/run.log"; exit 1; }
fi

$PY - "$OUT" <<'EOF'
import statistics, sys
from dflash.tracking.records import read_metric_records, split_jobs
out = sys.argv[1]
rows = read_metric_records(f"{out}/run")
# the jobs that ended (each logged its sys/loop_s): their step windows and loop seconds
jobs = [([r for r in recs if "perf/consumed_tok_s" in r], next(r["sys/loop_s"] for r in recs if "sys/loop_s" in r))
        for recs, ended in split_jobs(rows) if ended]
print("\nonline data: +trainer=gpu defaults (online data), drafter.num_layers=5, one GPU\n")
print("| job | steps | consumed tokens | loop s | whole job tok/s | median window tok/s | consumer waits | "
      "written batches | write tok/s |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
prev_tokens, total_s = 0.0, 0.0
for i, (win, loop_s) in enumerate(jobs):
    last = win[-1]
    tokens = last["data/consumed_tokens"] - prev_tokens
    steady = win[2:] or win  # the first windows of a job hold compilation
    med = statistics.median(r["perf/consumed_tok_s"] for r in steady)
    wait = statistics.median(r["perf/consumer_wait_frac"] for r in steady)
    print(f"| {i + 1} | {win[0]['step']}-{last['step']} | {tokens:,.0f} | {loop_s:.0f} | {tokens / loop_s:,.0f} | "
          f"{med:,.0f} | {wait:.0%} | {int(last.get('data/written_batches', 0))} | "
          f"{last.get('perf/write_tok_s', 0):,.0f} |")
    prev_tokens, total_s = last["data/consumed_tokens"], total_s + loop_s
last = [r for r in rows if "data/epochs" in r][-1]
print(f"\nafter {total_s:.0f} s of training in {len(jobs)} job(s), step {last['step']}: data/epochs "
      f"{last['data/epochs']:.3f}, data/views_per_sequence {last.get('data/views_per_sequence', 0):.3f}, "
      f"data/unique_sequences {last['data/unique_sequences']:,.0f}, data/consumed_tokens "
      f"{last['data/consumed_tokens']:,.0f} ({last['data/consumed_tokens'] / total_s:,.0f} tok/s over all jobs)")
EOF
if [ -n "$RETURN" ]; then  # after the table: a failed pack still leaves the job's figures printed
  # truth/: the eval's pinned ground truth when the run set eval.truth_dir=$OUT/truth (tokens only, small): the
  # next machine then recomputes only the features, not the greedy decode (157 s on an H200 for the full suite)
  $PY benchmarks/leased_gpu/carry.py pack "$RETURN/carry" "$OUT/run" "$OUT/mlflow.db" $([ -d "$OUT/truth" ] && echo "$OUT/truth")
fi
