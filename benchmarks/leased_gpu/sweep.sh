#!/usr/bin/env bash
# One H200: an Optuna sweep (conf/sweep/<name>.yaml) in GPU jobs of under ten minutes, trials cut by the job's
# limit continuing in the next job.
#
#   N=4 WORKERS=2 DEADLINE=300 bash benchmarks/leased_gpu/sweep.sh [sweep] [run overrides ...]    (default sweep: loss_variants)
#   TRUTH=campaign_out/reference_64m/truth N=4 WORKERS=4 DEADLINE=400 bash benchmarks/leased_gpu/sweep.sh recipe_reference
#   TRUTH=campaign_out/reference_64m/truth N=1 WORKERS=1 bash benchmarks/leased_gpu/sweep.sh recipe_reference 'rerun=[30]'
#     (the best trial trained again from scratch, when its drafter went with an earlier machine: the gate reads it)
#
# 1. Continues the sweep store: sweeps_out/ as a warm machine kept it (trial run dirs WITH their checkpoints), else
#    the committed one, if any: $STORE (default benchmarks/sweeps/sweeps_out.tar.xz: sweeps_out/ without weights).
# 2. `python -m sweeps.launch <sweep> n_trials=$N workers=$WORKERS timeout=$DEADLINE out=sweeps_out` under
#    `timeout $HARD`: no trial starts after DEADLINE seconds; at HARD the launch and its workers get SIGTERM, each
#    trainer checkpoints at its next step boundary and the trial ends FAIL "interrupted". The next launch on the
#    same store enqueues a continuation of every such trial (same params, resumed from its newest checkpoint,
#    same MLflow run) before sampling anything new; it counts against that launch's n_trials.
#    Checkpoints stay on the machine: only the next job on the SAME WARM machine can continue a cut trial. A fresh
#    machine gets the committed store without checkpoints; its cut trials then stay FAIL (nothing to resume) and
#    the sweep goes on with new trials. Run dirs are recorded as absolute paths: run from the same checkout path.
# 3. $OUT/sweep.tar.xz: sweeps_out/ without weights, checkpoints or figures (commit it as $STORE),
#    $OUT/best_drafter.tgz (in 15 MiB parts when larger): the best complete trial's final/ drafter, $OUT/report.md: the study as one table
#    (`python -m sweeps.launch <sweep> report`; a cut trial's row gives the seconds the next job needs for it).
# 4. TRUTH=campaign_out/<name>/truth: the trials evaluate on that pinned ground truth (eval.truth_dir), extracted from
#    the committed campaign store ($CAMPAIGN_STORE, default benchmarks/ablations/campaign_out.tar.xz) when this
#    machine lacks it: they then pair prompt for prompt with that campaign's cells and with every launch before.
#    (2026-12-02 left the extraction out of one call on a fresh machine: the launch built the truth again from the
#    target, the same tokens, 71 s more.)
# Env: N (trials this job adds, default 4), WORKERS (default 2), DEADLINE (s, default 300), LIMIT (s, the device
# call's own limit, default 590), HARD (s, default LIMIT - 60: the packing after it needs the rest; not DEADLINE +
# 220, which cut a resuming job with a short DEADLINE long before its call's limit), STUDY (default: the sweep's
# name), STORE, TRUTH, CAMPAIGN_STORE, OUT (default gpu_out), PROMOTE (new / 1 / 0: the best trial through the gate, below), PROMOTE_ARGS, DRAFTER (0: the best drafter is
# gated and not brought back: a call brings back 8 files, and an 8-layer drafter takes 3), PY (python).
# The GPU machine lacks our stack's wheels: ship them in .whl/, .whl2/, ... (wheel_folders.py) as for benchmarks/leased_gpu/campaign.sh.
set -uo pipefail
S=${1:-loss_variants}
shift || true
OUT=${OUT:-gpu_out}
N=${N:-4}
WORKERS=${WORKERS:-2}
DEADLINE=${DEADLINE:-300}
LIMIT=${LIMIT:-590}
HARD=${HARD:-$((LIMIT - 60))}
STORE=${STORE:-benchmarks/sweeps/sweeps_out.tar.xz}
STUDY=${STUDY:-$(basename "$S" .yaml)}
PY=${PY:-python}
mkdir -p "$OUT"
source "$(dirname "$0")/job_env.sh"  # wheels, PYTHONPATH, the job environment
# a warm machine's sweeps_out/ holds the checkpoints the committed store lacks: it wins (job_env.sh's use_store)
use_store sweeps_out "$STORE" || exit 1
if [ -n "${TRUTH:-}" ]; then
  [ -d "$TRUTH" ] || tar xf "${CAMPAIGN_STORE:-benchmarks/ablations/campaign_out.tar.xz}" "$TRUTH" || exit 1
  set -- "$@" "eval.truth_dir=$PWD/$TRUTH"
fi
echo "== sweep $S study $STUDY: +$N trials, $WORKERS worker(s), deadline ${DEADLINE}s, hard ${HARD}s, in $PWD" >&2
t0=$(date +%s)
# -k 60: a trainer that has not checkpointed and exited a minute after the SIGTERM is killed (its trial is then
# reaped as "worker gone" and continued from its previous checkpoint)
timeout -k 60 "$HARD" $PY -m sweeps.launch "$S" n_trials="$N" workers="$WORKERS" timeout="$DEADLINE" \
    study="$STUDY" out=sweeps_out "tracking.tracking_uri=sqlite:///$PWD/sweeps_out/mlflow.db" "$@" \
    > "$OUT/sweep.log" 2>&1
rc=$?
echo "== sweep exited $rc after $(( $(date +%s) - t0 )) s" >&2
# xz, not gzip: the MLflow sqlite file packs to half the size, and the committed store rides in every GPU call's
# 64 MiB working tree
[ -d sweeps_out ] || { cat "$OUT/sweep.log" >&2; exit $rc; }  # the launch failed before it made a store
# the study as the store holds it (the launch's own summary is lost when HARD cut it), and the best drafter
$PY - "$STUDY" "$OUT" <<'EOF' || true
import json, sys, tarfile
from pathlib import Path
import optuna
from sweeps.objective import gate_trial, study_summary
from sweeps.storage import make_storage
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name=sys.argv[1], storage=make_storage(f"sweeps_out/{sys.argv[1]}.journal"))
s = study_summary(study)
print(json.dumps({k: s[k] for k in ("n_trials", "n_continued", "states")}))
b = gate_trial(study)  # the best trial, or a rerun of it (rerun=N) when the best's own drafter is not here
if b:
    with tarfile.open(f"{sys.argv[2]}/best_drafter.tgz", "w:gz") as tar:
        tar.add(Path(b["run_dir"]) / "final", arcname=Path(b["run_dir"]).name)
    again = "" if b["number"] == b["best"] else f" (a rerun of the best, #{b['best']} {b['best_value']:.6g})"
    print(f"best trial #{b['number']} {b['value']:.6g}{again} {json.dumps(b['params'], default=str)} -> best_drafter.tgz")
    Path(f"{sys.argv[2]}/best_run_dir.txt").write_text(b["run_dir"])
else:
    print("no complete trial with its final/ drafter on this machine (the best's own, or a rerun of it: rerun=N)")
EOF
gate_and_split "$OUT"  # job_env.sh: the best trial through the gate (PROMOTE), a large drafter in parts
pack_store "$OUT/sweep.tar.xz" sweeps_out/mlflow.db sweeps_out  # job_env.sh
# the study as one table: a cut trial's row says how many seconds the next job needs for it, starting, training and
# evaluating (2026-12-02 cut 8-layer trials 7-30 s of training short of their end: a fresh machine cannot
# continue them)
$PY -m sweeps.launch "$S" report out=sweeps_out study="$STUDY" > "$OUT/report.md" 2>&1 && cat "$OUT/report.md" >&2
ls -la "$OUT" >&2
grep -E "continuing cut|marked stale|trial [0-9]+ (COMPLETE|PRUNED|FAIL)|^study |Error" "$OUT/sweep.log" | tail -20 >&2
exit $rc
