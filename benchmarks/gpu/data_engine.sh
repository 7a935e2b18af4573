#!/usr/bin/env bash
# The online data engine on one H200, < 8 minutes: the bench's back-to-back tok/s against the real run's consumed
# tok/s at the same shapes (reference target, 5-layer drafter, +trainer=gpu: 64 x 320 tokens, 128 anchors per step), the
# online engine's generation tok/s, and data/epochs after each run.
#
#   bash benchmarks/gpu/data_engine.sh [OUT]            (default OUT=gpu_work/data_engine)
#
# 1. bench: target forward and compiled drafter step at 64 x 320 / 128 anchors → back-to-back (serial sum).
# 2. run "write": +trainer=gpu on online data with empty shards: the target writes every sequence while the
#    run trains (generation + features + drafter on one GPU).
# 3. run "read": the same data settings again (a later run / another sweep trial): it reads the shards run 2
#    wrote, so the loop is target features + drafter only — the figure to hold against the bench.
# 4. with PROFILE=N (N > 0): benchmarks/profile_run.py on run 3's settings, N loop steps after 30: where the
#    loop's time goes (inline producer, drafter step, the rest) and the GPU's busy fraction.
# Env: WRITE_S / READ_S (time budgets, default 100 / 60 s); CORPUS (data.corpus.scope, default stdlib: its pool
# of ~13 K prompts builds in seconds; `installed` parses every site-packages file once, then it is cached);
# EXTRA (overrides for all three, e.g. a tiny CPU test: EXTRA='+target=tiny_random ...'), BENCH_EXTRA (bench.*
# keys for the bench alone), PY (python).
set -euo pipefail
OUT=${1:-gpu_work/data_engine}
WRITE_S=${WRITE_S:-100}
READ_S=${READ_S:-60}
CORPUS=${CORPUS:-stdlib}
BENCH_EXTRA=${BENCH_EXTRA:-}
PY=${PY:-python}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
DB="tracking.tracking_uri=sqlite:///$OUT/mlflow.db"
SHAPE="+trainer=gpu drafter.num_layers=5 +eval=off"  # the gpu profile's 64 x 320 / 128 anchors
RUN="$SHAPE $DB data.corpus.scope=$CORPUS data.pool.cache_dir=$OUT/pool data.online.shard_dir=$OUT/shards tracking.log_every=10 trainer.checkpoint_every=1000000 \
     trainer.max_steps=1000000 tracking.system_metrics=false"
rm -rf "$OUT/shards" "$OUT/run_write" "$OUT/run_read" "$OUT/bench"

echo "== 1/3 bench (64 x 320 tokens, 128 anchors)" >&2
timeout 240 $PY -m experiments.bench $SHAPE $DB bench.seq_len=320 bench.target_batch=64 bench.drafter_batch=64 \
    bench.anchors=128 bench.sections=target,drafter bench.kernel_profile=0 bench.pipeline_steps=0 \
    results="$OUT/RESULTS.md" run_dir="$OUT/bench" $EXTRA $BENCH_EXTRA > "$OUT/bench.txt"
cat "$OUT/bench.txt" >&2

echo "== 2/3 run writing its data online (empty shards, ${WRITE_S} s)" >&2
# token_budget caps the plan the epoch guard sees (the time budget ends the run first)
timeout $((WRITE_S + 150)) $PY -m experiments.run $RUN trainer.time_budget_s=$WRITE_S trainer.token_budget=200000000 \
    run_dir="$OUT/run_write" $EXTRA > "$OUT/run_write.log" 2>&1 || { tail -30 "$OUT/run_write.log"; exit 1; }

# Read back no more than run 2 wrote, so run 3 never writes: its budget is run 2's consumed tokens.
BUDGET=$($PY - "$OUT" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/run_write/metrics.jsonl")]
print(int([r for r in rows if "data/consumed_tokens" in r][-1]["data/consumed_tokens"]))
EOF
)
echo "== 3/3 run reading run 2's shards (token budget $BUDGET, <= ${READ_S} s)" >&2
timeout $((READ_S + 150)) $PY -m experiments.run $RUN trainer.time_budget_s=$READ_S trainer.token_budget=$BUDGET \
    run_dir="$OUT/run_read" $EXTRA > "$OUT/run_read.log" 2>&1 || { tail -30 "$OUT/run_read.log"; exit 1; }

if [ "${PROFILE:-0}" -gt 0 ]; then
  echo "== 4/4 profile of run 3's loop ($PROFILE steps after 30)" >&2
  timeout 240 $PY benchmarks/profile_run.py --start 30 --steps "$PROFILE" --out "$OUT/loop_profile.json" -- \
      $RUN run_dir="$OUT/run_profile" $EXTRA > "$OUT/profile.log" 2>&1 || tail -20 "$OUT/profile.log"
  grep -A3 "^loop profile" "$OUT/profile.log" >&2 || true
fi

$PY - "$OUT" <<'EOF'
import json, re, statistics, sys
out = sys.argv[1]
bench = open(f"{out}/bench.txt").read()
num = lambda name: float(re.search(rf"^{name}\s+([\d,]+)", bench, re.M).group(1).replace(",", ""))
b2b, tgt, dft = num("back-to-back tok/s"), num("target tok/s"), num("drafter tok/s")

def run(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    perf = [r for r in rows if "perf/consumed_tok_s" in r]
    steady = perf[2:] or perf  # the first intervals hold compilation and autotuning
    last = [r for r in rows if "data/epochs" in r][-1]
    med = lambda k: statistics.median(r[k] for r in steady)
    loop_s = next((r["sys/loop_s"] for r in rows if "sys/loop_s" in r), 0.0)
    # the median window hides the stalls of a run that writes (a window in which the target writes a batch);
    # the whole loop's rate (its first window's compiles included) does not
    return {"consumed": med("perf/consumed_tok_s"), "target": med("perf/target_tok_s"),
            "drafter": med("perf/drafter_tok_s"), "wait": med("perf/consumer_wait_frac"), "last": last,
            "overall": last["data/consumed_tokens"] / loop_s if loop_s else 0.0, "loop_s": loop_s}

w, r = run("run_write"), run("run_read")
print(f"\nonline data engine, one GPU — reference target, drafter.num_layers=5, 64 x 320 tokens, 128 anchors\n")
print(f"| figure | tok/s | note |\n| --- | --- | --- |")
print(f"| bench target forward (64 x 320) | {tgt:,.0f} | |")
print(f"| bench drafter step (64 x 320, 128 anchors, compiled) | {dft:,.0f} | |")
print(f"| bench back-to-back | {b2b:,.0f} | serial sum of the two |")
for name, x, note in (("run reading shards (consumed)", r, "target features + drafter"),
                      ("run writing online (consumed)", w, "+ the target writing every sequence")):
    print(f"| {name} | {x['consumed']:,.0f} | median window, {x['consumed'] / b2b:.0%} of back-to-back; target side "
          f"{x['target']:,.0f}, drafter side {x['drafter']:,.0f}, consumer waits {x['wait']:.0%}; whole loop "
          f"{x['overall']:,.0f} ({x['last']['data/consumed_tokens']:,.0f} tokens in {x['loop_s']:.0f} s); {note} |")
print(f"| engine generation (written tokens / writing time) | {w['last'].get('perf/write_tok_s', 0):,.0f} | "
      f"{int(w['last'].get('data/written_batches', 0))} batches of data.online.write_batch written in run 2 |")
for name, x in (("run writing online", w), ("run reading shards", r)):
    L = x["last"]
    print(f"| {name}: after step {L['step']} | data/epochs {L['data/epochs']:.3f} | views per sequence "
          f"{L.get('data/views_per_sequence', 0):.2f}, data/unique_sequences "
          f"{L['data/unique_sequences']:,.0f}, data/consumed_tokens {L['data/consumed_tokens']:,.0f}, "
          f"shards read {int(L.get('data/shard_reads', 0))}, written {int(L.get('data/written_batches', 0))} |")
EOF
