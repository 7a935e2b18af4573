#!/usr/bin/env bash
# Conversation data at the 27B shapes on ONE H200 (kind nvidia-h200), one device call of at most 9 minutes:
#     bash benchmarks/gpu/conversations.sh
# A random Qwen3.6-27B-shaped target (+target=qwen3_6_27b_random, the tiny chat tokenizer for its chat template:
# token ids < 4,100 of its 248,320) with the published drafter, on benchmarks/data/conversations_sample.jsonl with
# data.conversations.responses=target (every assistant turn rewritten by the target to data.max_len tokens):
# 1. regen:  `python -m experiments.regen` writes REGEN_BATCHES batches ahead at auto write_batch → written tok/s;
# 2. ahead:  +trainer=gpu training on the shards stage 1 wrote (nothing written in the loop) → consumed tok/s;
# 3. loop:   the same run with the target writing its responses in the loop (empty shards) → consumed tok/s;
# then a short table: written tok/s, both consumed tok/s, and how many writing GPUs one training GPU needs.
# Each stage is its own process under `timeout`, working in WORK; logs, metrics and the table come back in
# $OUT/conversations.
# Env: SEQ (data.max_len, default 2048), PROMPT (data.pool.max_prompt_len, default 256), LOOP_S / AHEAD_S (time budgets, default 150 / 90 s), REGEN_BATCHES
# (default 2), REUSE (data.online.reuse, default 2), AHEAD_REUSE (the views stage 2 reads of each written row, default
# 16: the shards are not keyed by it, so one regen batch gives minutes of training at the same shapes, past the
# compilation of the first steps), STAGES (default "regen ahead loop": a call that cannot hold all three runs some,
# and a later call on the same warm machine the rest; WORK, default gpu_work/conversations, keeps them between
# calls), LOOP_RESUME (1: the loop stage resumes the in-loop run a call before left on this warm machine, and the
# table reads its last job: the steady state past the first written batches takes longer than one call),
# LIMIT (s the script may take, default 530), BIG / SHAPE (the target + drafter, and the trainer's shape: e.g. tiny ones for a CPU dry run of this
# script), TRACKING (e.g. +tracking=off: no MLflow, for a machine without its wheels), PY (python).
# Wheels: with TRACKING=+tracking=off (metrics still land in each run's metrics.jsonl, which the table reads) the
# machine needs only hydra-core, omegaconf, antlr4-python3-runtime, fla-core, flash-linear-attention, datasets, dill,
# multiprocess and fsspec (about 3 MiB): a fresh machine takes them in the same call as the 44 MiB working tree.
# Measured on 2026-12-02 (benchmarks/log/2026-12-02.md): regen writes 64 rows of 2,048 tokens in about 88 s; a training
# stage's first step comes about 65 s (ahead; a warm compile cache) to 256 s (in the loop, fresh machine: the first
# batch, the first target forward's autotuning, 97 s of compilation) after its loop begins, and the budgets count
# from there, so LOOP_S well past 270 s sees the in-loop writer beside training.
# The calls of 2026-12-02 (a stage on a fresh machine compiles again, about 97 s; the loop stage needs no regen):
#     REGEN_BATCHES=1 STAGES=regen bash benchmarks/gpu/conversations.sh
#     STAGES=ahead AHEAD_S=240 bash benchmarks/gpu/conversations.sh    # the same warm machine: it reads regen's shard
#     STAGES=loop LOOP_S=300 bash benchmarks/gpu/conversations.sh      # the table (its regen row from a warm WORK)
set -uo pipefail
OUT=${OUT:-gpu_out}
W=${WORK:-gpu_work/conversations}  # kept on a warm machine between calls; logs and metrics are copied to $OUT
mkdir -p "$W" "$OUT/conversations" && W=$(cd "$W" && pwd)
STAGES=${STAGES:-regen ahead loop}
has() { [[ " $STAGES " == *" $1 "* ]]; }
source "$(dirname "$0")/../leased_gpu/job_env.sh"  # wheels (datasets among them), PYTHONPATH, the job environment
PY=${PY:-python}
$PY -c "import datasets" || { echo "error: Hugging Face datasets is not importable (add its wheels to a wheel folder: benchmarks/leased_gpu/wheel_folders.py)"; exit 1; }
T0=$SECONDS
left() { echo $(( ${LIMIT:-530} - (SECONDS - T0) )); }
cap() { local want=$1 reserve=$2; local l=$(( $(left) - reserve )); echo $(( l < want ? l : want )); }
SEQ=${SEQ:-2048}
LOOP_S=${LOOP_S:-150}
AHEAD_S=${AHEAD_S:-90}
REGEN_BATCHES=${REGEN_BATCHES:-2}
# the tiny chat tokenizer brings its own mask token (id 2): the 27B id 248,070 is past its 4,100 ids
BIG=${BIG:-"+target=qwen3_6_27b_random target.tokenizer=builtin:tiny_chat target.mask_token_id=2 +drafter=published"}
DATA="+data=conversations data.path=$PWD/benchmarks/data/conversations_sample.jsonl data.conversations.responses=target \
      data.max_len=$SEQ data.pool.max_prompt_len=${PROMPT:-256} data.conversations.cache_dir=$W/hf data.conversations.coding10_chat=false data.online.reuse=${REUSE:-2}"
# the 27B training shape of benchmarks/RESULTS.md: 2,048-token sequences, 256 anchors, 4 sequences per target forward
SHAPE=${SHAPE:-"+trainer=gpu trainer.producer_batch=4 trainer.sequences_per_step=4 trainer.num_anchors=256"}
TRAIN="$SHAPE +eval=off ${TRACKING:-} tracking.log_every=10 tracking.system_metrics=false trainer.max_steps=1000000 \
       trainer.checkpoint_every=1000000"
has regen && rm -rf "$W/ahead" "$W/regen.log"
has ahead && rm -rf "$W/run_ahead" "$W/run_ahead.log"
# LOOP_RESUME=1: a later call on the same warm machine resumes the in-loop run (its shards, checkpoint and log
# kept), so its steady state past the first written batches can be seen over two calls
has loop && [ "${LOOP_RESUME:-0}" != 1 ] && rm -rf "$W/loop" "$W/run_loop" "$W/run_loop.log"

# every thread's stack into a stage's log at these seconds from now, while the stage runs (SIGUSR1: experiments'
# entry points dump and go on); the trace a silent in-loop run of 2026-12-02 lacked
# (the watcher holds no stdout of the call's, and `undump` ends it with its stage)
dump_at() { local pat=$1; shift; ( t0=$SECONDS; for t in "$@"; do sleep $(( t - (SECONDS - t0) > 0 ? t - (SECONDS - t0) : 0 ));
  pkill -USR1 -f "$pat" && echo "stacks dumped at ${t} s ($pat)"; done ) >> "$W/dumps.txt" 2>&1 & DUMP_PID=$!; }
undump() { pkill -P "$DUMP_PID" 2>/dev/null; kill "$DUMP_PID" 2>/dev/null; true; }

if has regen; then
echo "== 1/3 regen: $REGEN_BATCHES batches at auto write_batch (seq $SEQ)" >&2
timeout -k 15 $(cap 200 250) $PY -m experiments.regen $BIG $DATA data.online.shard_dir=$W/ahead regen.batches=$REGEN_BATCHES \
  regen.progress=false > $W/regen.log 2>&1
echo "regen: rc $? at $((SECONDS - T0)) s: $(tail -1 $W/regen.log)"
fi

# the certain measurement first: a stall in the riskier in-loop stage (2026-12-02) no longer costs it
if has ahead; then
# read back no more than stage 1 wrote: its rows x AHEAD_REUSE views, less what the buffer (max_depth 20), one
# producer batch (4) and the log interval the budget is checked at (10 steps x 4) hold past the budget, x the length
AHEAD_REUSE=${AHEAD_REUSE:-16}
BUDGET=$($PY - "$W" "$SEQ" "$AHEAD_REUSE" <<'EOF'
import re, sys
w, seq, reuse = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
text = open(f"{w}/regen.log").read()
get = lambda k: float(re.findall(rf"{k}=([\d.e+]+)", text)[-1])
print(max(int(get("data/regen_batches_per_rank") * get("data/write_batch") * reuse - 64) * seq, seq))
EOF
)
echo "== 2/3 training on the shards regen wrote ahead (token budget ${BUDGET:-?}, <= ${AHEAD_S} s)" >&2
T=$(cap $((AHEAD_S + 120)) 140); dump_at "^[^ ]*python[0-9.]* -m experiments.run .*run_dir=$W/run_ahead" $((T - 30))
# data.online.ahead=0: nothing written in the background. With its default 1, the first try (2026-12-02) wrote batch 1
# beside training (regen wrote batch 0 only): 435 consumed tok/s, a measure of neither stage
timeout -k 15 $T $PY -m experiments.run $BIG $DATA $TRAIN data.online.shard_dir=$W/ahead data.online.ahead=0 \
  data.online.reuse=$AHEAD_REUSE trainer.time_budget_s=$AHEAD_S trainer.token_budget=${BUDGET:-1} run_dir=$W/run_ahead \
  tracking.tracking_uri=sqlite:///$W/ahead.db > $W/run_ahead.log 2>&1
echo "ahead: rc $? at $((SECONDS - T0)) s"; undump
fi

if has loop; then
echo "== 3/3 training, the target writing its responses in the loop (${LOOP_S} s)" >&2
T=$(cap $((LOOP_S + 120)) 20); dump_at "^[^ ]*python[0-9.]* -m experiments.run .*run_dir=$W/run_loop" 180 $((T - 30))
if [ -f "$W/run_loop/config.yaml" ]; then  # (LOOP_RESUME=1 and a run there)
  timeout -k 15 $T $PY -m experiments.run resume=$W/run_loop trainer.time_budget_s=$LOOP_S >> $W/run_loop.log 2>&1
else
  timeout -k 15 $T $PY -m experiments.run $BIG $DATA $TRAIN data.online.shard_dir=$W/loop \
    trainer.time_budget_s=$LOOP_S trainer.token_budget=200000000 run_dir=$W/run_loop \
    tracking.tracking_uri=sqlite:///$W/loop.db > $W/run_loop.log 2>&1
fi
echo "loop: rc $? at $((SECONDS - T0)) s"; undump; grep -E "online data: wrote|step |error|Thread|File" $W/run_loop.log | tail -40
fi


$PY - "$W" "$SEQ" "${REUSE:-2}" <<'EOF' | tee "$OUT/conversations/table.md"
import re, statistics, sys
from dflash.tracking.records import read_metric_records, split_jobs
w, seq, reuse = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def regen():  # (a loop stage on a fresh machine has no regen log)
    try:
        text = open(f"{w}/regen.log").read()
    except OSError:
        return {}
    found = dict(re.findall(r"(\S+)=([\d.e+-]+)", text.splitlines()[-1])) if text.strip() else {}
    return {k: float(v) for k, v in found.items()}

def run(name):
    rows = read_metric_records(f"{w}/{name}")
    if not rows:
        return {}
    jobs = split_jobs(rows)  # the last job's rows (a resumed run holds one job per call)
    job = jobs[-1][0]
    before = [r["data/consumed_tokens"] for recs, _ in jobs[:-1] for r in recs if "data/consumed_tokens" in r]
    perf = [r for r in job if "perf/consumed_tok_s" in r]
    steady = perf[2:] or perf  # the first windows hold compilation
    last = [r for r in job if "data/consumed_tokens" in r][-1] if perf else {}
    loop_s = next((r["sys/loop_s"] for r in job if "sys/loop_s" in r), 0.0)
    tokens = last.get("data/consumed_tokens", 0) - (before[-1] if before else 0)
    med = lambda k: statistics.median(r.get(k, 0.0) for r in steady) if steady else float("nan")
    return {"median": med("perf/consumed_tok_s"), "whole": tokens / loop_s if loop_s else float("nan"),
            "written": last.get("data/written_batches", 0), "reads": last.get("data/shard_reads", 0),
            "write_tok_s": last.get("perf/write_tok_s", 0.0), "wait": med("perf/consumer_wait_frac"),
            "jobs": len(jobs)}

def loop_writes():  # the in-loop writer's batches after its first (that one is written before training starts)
    try:
        text = open(f"{w}/run_loop.log").read()
    except OSError:
        return []
    return [float(x) for x in re.findall(r"wrote batch [1-9]\d*, .*?\((\d+) written tok/s", text)]

g, loop, ahead = regen(), run("run_loop"), run("run_ahead")
wtok = g.get("perf/write_tok_s", float("nan"))
print(f"\nconversations at the 27B shapes, seq {seq}, responses=target, auto write_batch "
      f"{g.get('data/write_batch', float('nan')):.0f}, one H200\n")
print("| measure | tok/s | notes |\n| --- | --- | --- |")
print(f"| written (experiments.regen) | {wtok:,.0f} | {g.get('data/regen_written_shards', 0):.0f} batches, "
      f"{g.get('sys/regen_s', 0):.0f} s |")
for name, r in (("consumed, writing in the loop", loop), ("consumed, shards written ahead", ahead)):
    if r:
        job = f"job {r['jobs']} of the run: " if r["jobs"] > 1 else ""
        print(f"| {name} | {r['median']:,.0f} (whole loop {r['whole']:,.0f}) | {job}written batches {r['written']:.0f}, "
              f"shard reads {r['reads']:.0f}, consumer waits {r['wait']:.0%} |")
beside = loop_writes()
if beside:
    print(f"| written in the loop, beside training | {statistics.median(beside):,.0f} | median of {len(beside)} batches "
          f"after the first |")
if ahead and wtok == wtok and wtok > 0 and g.get("data/regen_written_shards"):
    # a training sequence is one view of a written row (data.online.reuse views each); a row's written part is
    # what regen wrote per row
    per_row = g["data/written_tokens"] / (g["data/regen_written_shards"] * g["data/write_batch"])
    rows_needed = ahead["median"] / seq / reuse
    need = rows_needed / (wtok / per_row)
    if beside and loop:  # can one GPU feed its own trainer by writing in the loop?
        takes, writes = loop["median"] / seq / reuse, statistics.median(beside) / per_row
        print(f"\none GPU writing in the loop: writes {writes:,.2f} rows/s beside training, which takes {takes:,.2f} "
              f"rows/s while it runs: it feeds {writes / takes:.0%} of its own trainer")
    print(f"\nwriting GPUs per training GPU (greedy, reuse {reuse}): {need:.2f} (training takes {rows_needed:,.1f} written "
          f"rows/s of {per_row:,.0f} written tokens each; one GPU writes {wtok / per_row:,.1f} rows/s)")
EOF
# what comes back: the logs and each run's metrics, config and tags (not the shards, the HF cache or checkpoints)
for f in regen.log run_ahead.log run_loop.log dumps.txt; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/conversations/"; done
for r in run_ahead run_loop; do
  [ -d "$W/$r" ] && mkdir -p "$OUT/conversations/$r" && cp "$W/$r"/{metrics.jsonl,config.yaml,tags.json} "$OUT/conversations/$r/" 2>/dev/null
done
true
