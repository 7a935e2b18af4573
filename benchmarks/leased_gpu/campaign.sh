#!/usr/bin/env bash
# One H200: the ablation campaign (conf/campaign/<name>.yaml) in GPU jobs of under ten minutes.
#
#   DEADLINE=400 bash benchmarks/leased_gpu/campaign.sh [campaign] [run overrides ...]      (default campaign: reference)
#
# 1. Continues campaign_out/ as a warm machine kept it (with its checkpoints: cut cells resume), else the committed
#    campaign, if any: benchmarks/ablations/campaign_out.tar.xz (campaign_out/ without weights) is unpacked, so
#    finished cells are skipped and the MLflow store goes on growing (job_env.sh's use_store says which, first).
# 2. `python -m sweeps.campaign <campaign> workers=$WORKERS deadline_s=$DEADLINE out=campaign_out`: the shared
#    inputs before the first cell that starts (prompt pool, online shards, eval ground truth; none in a launch that
#    starts no cell), then the cells, WORKERS at a time on the one GPU; no cell starts after DEADLINE seconds from
#    the launch (the shared inputs count for the later waves: 170-220 s when nothing is cached), so the job ends
#    with whole cells.
# 3. The report (campaign_out/<campaign>/ABLATIONS.md); $OUT/best_drafter.tgz: the best cell finished in this job,
#    its final/ drafter (for export and eval on any machine; in parts over 15 MiB), that cell through the promotion
#    gate (PROMOTE, as in sweep.sh); then $OUT/campaign.tar.xz: campaign_out/ without weights, checkpoints, shards
#    or figures (commit it as benchmarks/ablations/campaign_out.tar.xz).
# Env: DEADLINE (s, default 400), LIMIT (s, the device call's own limit, default 590), HARD (s, default and at most
# LIMIT - 60: the report and the packing after it take up to a minute, and a call cut in them brings back an empty
# store, as a 2026-12-02 job's last call did), WORKERS (default: the campaign's), OUT (default gpu_out), PROMOTE (new / 1 / 0,
# job_env.sh's gate_and_split), PROMOTE_ARGS, DRAFTER (0: not brought back, gated only), PY (python).
# HARD used to default to DEADLINE + 190: a resuming call with DEADLINE=30 then cut its cells at 220 s of a 590 s
# call (a 2026-12-02 job lost 300 s of two cells' training so).
# On a fresh machine the shared inputs alone took 184-254 s (2026-12-02): a DEADLINE below that started no
# cell at all (a 2026-12-02 job's second call) while the inputs were made before the deadline's check. Since 2026-12-03
# the first wave passes the check and then waits for the inputs; later waves still count them, so give the first
# call on a fresh machine DEADLINE >= 300 where more cells than WORKERS are to run.
# The GPU machine lacks our stack's wheels (about 22 MB, see wheels.sh); the working tree that travels with a call (48.1 MB,
# the reference target's weights and the stores included, 2026-12-03) leaves room for half of them: carry .whl/ in a
# short call, then .whl2/ with the job, on the same warm machine (wheel_folders.py makes the folders).
set -uo pipefail
C=${1:-reference}
shift || true
OUT=${OUT:-gpu_out}
DEADLINE=${DEADLINE:-400}
PY=${PY:-python}
mkdir -p "$OUT"
source "$(dirname "$0")/job_env.sh"  # wheels, PYTHONPATH, the job environment
# the warm machine's store, else the committed one (job_env.sh: a folder without its database is not a store)
use_store campaign_out benchmarks/ablations/campaign_out.tar.xz || exit 1
WORK=()
[ -n "${WORKERS:-}" ] && WORK=("workers=$WORKERS")
echo "== campaign $C (deadline ${DEADLINE}s) in $PWD" >&2
t0=$(date +%s)
# HARD: the whole campaign's limit (cells still running then are lost; the packing below still happens)
LIMIT=${LIMIT:-590}
HARD=${HARD:-$((LIMIT - 60))}
if (( HARD > LIMIT - 60 )); then
  echo "HARD=$HARD leaves the report and the packing less than 60 s of LIMIT=$LIMIT: using $((LIMIT - 60))" >&2
  HARD=$((LIMIT - 60))
fi
timeout -k 10 "$HARD" $PY -m sweeps.campaign "$C" "${WORK[@]}" deadline_s="$DEADLINE" out=campaign_out \
    "tracking.tracking_uri=sqlite:///$PWD/campaign_out/mlflow.db" "$@" > "$OUT/campaign.log" 2>&1
rc=$?
echo "== campaign exited $rc after $(( $(date +%s) - t0 )) s" >&2
EDITS=()  # the campaign.KEY=VALUE edits of this job apply to its report too
for a in "$@"; do [[ $a == campaign.* ]] && EDITS+=("$a"); done
$PY -m sweeps.campaign "$C" report out=campaign_out "${EDITS[@]}" > "$OUT/report.md" 2>&1 || tail -5 "$OUT/report.md" >&2
# the best finished cell's drafter of this job (the recipe's, for promotion / export / eval elsewhere): its final/ folder
$PY - "$C" "$OUT" <<'EOF' || true
import json, sys, tarfile
from pathlib import Path
s = json.loads(Path(f"campaign_out/{sys.argv[1]}/summary.json").read_text())
done = [c for c in s["cells"] if c.get("value") is not None and not c.get("reused_from")
        and (Path(c["run_dir"]) / "final").is_dir()]  # cells of earlier jobs came back without weights
if not done:
    sys.exit("no finished cell with its final/ drafter on this machine")
best = max(done, key=lambda c: c["value"])
with tarfile.open(f"{sys.argv[2]}/best_drafter.tgz", "w:gz") as tar:
    tar.add(Path(best["run_dir"]) / "final", arcname=best["cell"])
print("best cell", best["cell"], best["value"], file=sys.stderr)
Path(f"{sys.argv[2]}/best_run_dir.txt").write_text(best["run_dir"])
EOF
gate_and_split "$OUT"  # job_env.sh: the best cell through the gate (PROMOTE), a large drafter in parts
pack_store "$OUT/campaign.tar.xz" campaign_out/mlflow.db campaign_out  # job_env.sh
# every cell log this job wrote to, its tail: what a cut or slow cell was doing (cells of 2026-12-02 sat ~150 s
# with the GPU idle before training and left no trace)
find campaign_out -name '*.log' -newermt "@$t0" -print0 2>/dev/null | while IFS= read -r -d '' f; do
  echo "== $f"; tail -n 40 "$f"; done > "$OUT/cell_logs.txt"
ls -la "$OUT" >&2
grep -E "cell .* exited|stage [0-9]+ \(|not started|Error|error" "$OUT/campaign.log" | tail -20 >&2
exit $rc
