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
