# Sourced by the GPU job scripts (campaign.sh, sweep.sh, conversations.sh): the environment every job runs with.
# The GPU machine has torch / transformers / triton but not our other dependencies: their wheels travel in .whl/
# (and .whl2/, when the 64 MiB a call carries cannot hold the working tree and all of them at once: then an
# earlier call on the same warm machine installs one folder, and /tmp/site keeps it for the next call).
# Keep each folder a fixed set and carry both on every fresh machine: .whl = cryptography, sqlalchemy,
# mlflow-skinny, pydantic-core (15 MiB); .whl2 = the rest, datasets included (7 MiB). Session 14 carried a trimmed
# .whl2 on the belief that the machine was still warm. It was a fresh one, and the call failed on a missing hydra.
# A machine goes back after 30 s idle.
for d in .whl .whl2; do
  if compgen -G "$d/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
      || exit 1
  fi
done
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PWD; else export PYTHONPATH=$PWD; fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false DFLASH_LOG_TIME=1  # timed log lines
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# pack_store OUT.tar.xz DB FOLDER: FOLDER without weights, checkpoints, shards or figures, as OUT.tar.xz (commit it as
# the committed store), its sqlite store DB recording artifact locations relative to itself in the archive
# (docs/tracking.md: `mlflow ui` beside mlflow.db shows them wherever it is extracted; tests/test_committed_store.py
# checks the committed campaign store). The machine's own DB keeps its absolute ones, for later runs of a warm
# machine: relocated, packed, restored. xz, not gzip: the sqlite file packs to half the size (6.4 against 13.6 MB in
# session 13), and every GPU call carries the committed store inside its 64 MiB working tree beside the wheels;
# 16 MiB blocks: xz -9's default block is 192 MiB, so a 95 MB store packed on one core, 48 s; in blocks the cores
# share it, 21 s on two, for 6.6 MB against 6.4.
pack_store() {
  local out=$1 db=$2 folder=$3 rc
  if [ -f "$db" ]; then  # no store when tracking was off: the folder alone
    cp "$db" "$db.keep" || return 1
    ${PY:-python} -c "import sys; from dflash.tracking.run_info import relocate_artifacts as r; r(sys.argv[1])" "$db"
  fi
  XZ_OPT="-9 -T0 --block-size=16MiB" tar cJf "$out" --exclude='checkpoints' --exclude='final' --exclude='checkpoint' \
    --exclude='*.pt' --exclude='*.safetensors' --exclude='*.png' --exclude='*.bin' --exclude='*.lock' \
    --exclude='*.keep' "$folder"
  rc=$?
  [ -f "$db.keep" ] && mv "$db.keep" "$db"
  return $rc
}
