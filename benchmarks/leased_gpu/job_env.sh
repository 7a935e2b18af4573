# Sourced by the GPU job scripts (campaign.sh, sweep.sh, conversations.sh): the environment every job runs with.
source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"  # the wheel folders into /tmp/site, PYTHONPATH
# said at once, not as a ModuleNotFoundError deep in a launch (a 2026-12-02 sweep's second call: issued more than 30 s after
# the first returned, it met a fresh machine, with neither /tmp/site's first folder nor the sweep's checkpoints)
missing=$(python3 -c 'import importlib.util as u; print(*[m for m in ("mlflow", "optuna", "hydra", "sqlalchemy", "pydantic_core", "fla") if u.find_spec(m) is None])')
[ -z "$missing" ] || echo "job_env: this machine lacks $missing: carry the next wheel folder in the next call at once (a machine goes back 30 s after a call, with /tmp/site and every checkpoint)" >&2
# datasets serves data.source=conversations only, and shared/tools/gpu-wheels.sh does not fetch it (the sweeps of
# 2026-12-02 and 2026-12-03 ran without it): said apart, so it is not read as a missing wheel folder
python3 -c 'import importlib.util as u; exit(u.find_spec("datasets") is None)' \
  || echo "job_env: no datasets on this machine: data.source=conversations will not load (other jobs do not need it)" >&2
# No TOKENIZERS_PARALLELISM=false: it kept the prompt pool's Rust tokenizer on one of 16 cores (a fresh H200 built
# the recipe's 112,000-prompt pool in 47 s, 2026-12-02; with the tokenizer's threads the pool builds 1.3-1.5x as fast on
# 2 cores: benchmarks/pool_build.py). Nothing forks after them: sweep workers and the header parser's pool are
# spawned, campaign cells are new processes (a fork would get the tokenizer's own fallback: one thread, one warning).
export PYTHONUNBUFFERED=1 DFLASH_LOG_TIME=1  # timed log lines
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# pack_store OUT.tar.xz DB FOLDER: FOLDER without weights, checkpoints, shards or figures, as OUT.tar.xz (commit it as
# the committed store), its sqlite store DB as SQL text (`<DB without .db>.sql`, dflash.tracking.packed_store: the
# campaign store's database packs to 3.0 MB as a dump against 7.3 MB vacuumed, 2026-12-03), made from a copy whose
# artifact locations are relative to itself (docs/tracking.md: unpacked anywhere, `mlflow ui` beside mlflow.db shows
# them; `python -m dflash.tracking.packed_store unpack OUT.tar.xz` rebuilds the database). The machine's own DB is
# not touched: it keeps its absolute locations for later runs of a warm machine. xz, not gzip (half the size,
# 2026-12-02), and every GPU call carries the committed stores inside its 64 MiB working tree beside the wheels; 16 MiB
# blocks: xz -9's default block is 192 MiB, so a 95 MB store packed on one core, 48 s; in blocks the cores share it,
# 21 s on two, for 6.6 MB against 6.4.
pack_store() {
  local out=$1 db=$2 folder=$3 rc sql=""
  if [ -f "$db" ]; then  # no store when tracking was off: the folder alone
    sql="${db%.db}.sql"
    cp "$db" "$db.pack" || return 1
    ${PY:-python} -c "import sys; from dflash.tracking.run_info import relocate_artifacts as r
from dflash.tracking.packed_store import dump_store as d
r(sys.argv[1]); d(sys.argv[1], sys.argv[2])" "$db.pack" "$sql" || { rm -f "$db.pack" "$sql"; return 1; }
    rm -f "$db.pack"
  fi
  XZ_OPT="-9 -T0 --block-size=16MiB" tar cJf "$out" --exclude='checkpoints' --exclude='final' --exclude='checkpoint' \
    --exclude='*.pt' --exclude='*.safetensors' --exclude='*.png' --exclude='*.bin' --exclude='*.lock' \
    --exclude='*.pack' --exclude='*.partial' --exclude="$(basename "$db")" "$folder"
  rc=$?
  [ -n "$sql" ] && rm -f "$sql"
  return $rc
}

# use_store DIR ARCHIVE: the store a job continues, said in its log. DIR as this warm machine kept it when DIR holds
# its MLflow database (its run folders still hold their checkpoints); else ARCHIVE (the committed store) unpacked
# into it, the database rebuilt from its SQL dump; else a new store. The folder alone does not say a store is there:
# sweep.sh's TRUTH= extracts campaign_out/<name>/truth from the committed campaign store, and a 2026-12-03 campaign
# job, next on the same machine, took that folder for the store, skipped the committed one and ran the loss stage's
# seed-1 cells in a new, empty store (its MLflow log: "Creating initial MLflow database tables").
use_store() {
  local dir=$1 archive=$2
  if [ -f "$dir/mlflow.db" ]; then
    echo "== store: $dir as this machine kept it" >&2
  elif [ -f "$archive" ]; then
    echo "== store: $archive, unpacked into $dir" >&2
    ${PY:-python} -m dflash.tracking.packed_store unpack "$archive" >&2 || return 1
  else
    echo "== store: none committed ($archive): a new one in $dir" >&2
  fi
}

# needs_gate RUN_DIR: whether the run is tracked and has no gate decision yet (no model version made of it), read in
# the run's own store (its mlflow_run.json): what PROMOTE=new gates
needs_gate() {
  ${PY:-python} - "$1" <<'EOF'
import sys
from mlflow.tracking import MlflowClient
from dflash.serving.promotion import VERSION_TAG
from dflash.tracking.records import read_mlflow_record
rec = read_mlflow_record(sys.argv[1])
sys.exit(0 if rec and VERSION_TAG not in MlflowClient(rec["tracking_uri"]).get_run(rec["run_id"]).data.tags else 1)
EOF
}

# gate_and_split OUT: the job's best run (OUT/best_run_dir.txt, written by the job) through the promotion gate
# (docs/evaluation.md), its decision in the store's registry before the store is packed: PROMOTE=new (default) when
# it has no gate decision yet (needs_gate), 1 always, 0 never; PROMOTE_ARGS e.g. "--dry-run" or "--margin 0.05".
# The gate reads the MLflow store only (seconds, no GPU), and it needs the run's checkpoint on this machine: the
# 2026-12-03 sweep job left it to a later call, the machine went back, and the sweep's best (trial 30) could not be gated at all. Then
# OUT/best_drafter.tgz in parts when a call could not bring it back whole (16 MiB a file): an 8-layer drafter packs
# to 39 MiB; join them with `cat best_drafter.tgz.part* > best_drafter.tgz`.
gate_and_split() {
  local out=$1 run=""
  [ -f "$out/best_run_dir.txt" ] && run=$(cat "$out/best_run_dir.txt")
  if [ -n "$run" ] && { [ "${PROMOTE:-new}" = 1 ] || { [ "${PROMOTE:-new}" = new ] && needs_gate "$run"; }; }; then
    ${PY:-python} -m experiments.promote "$run" ${PROMOTE_ARGS:-} > "$out/promote.log" 2>&1
    echo "== promote exited $? (0 promoted, 3 refused): $(tail -3 "$out/promote.log" | tr '\n' ' ')" >&2
  fi
  # DRAFTER=0: the drafter stays on the machine (the gate above has read it). A call brings back 8 files: an 8-layer
  # drafter's three parts left a 2026-12-03 job's report.md out, and make the sweep job's 8 of 8, its archive last by name
  if [ "${DRAFTER:-1}" = 0 ]; then rm -f "$out/best_drafter.tgz"; fi
  if [ -f "$out/best_drafter.tgz" ] && [ "$(stat -c %s "$out/best_drafter.tgz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15M -d -a 1 "$out/best_drafter.tgz" "$out/best_drafter.tgz.part" && rm "$out/best_drafter.tgz"
  fi
}
