# Sourced by job_env.sh, production.sh and ../h200_campaign.sh: the wheel folders a call carries, installed into /tmp/site.
# The GPU machine has torch / transformers / triton but not our other dependencies: their wheels (about 22 MB) travel
# in .whl/, .whl2/, ... one folder per call on the same warm machine, because the 64 MiB a call carries cannot hold
# the working tree and all of them at once: each call installs the folder it carries into /tmp/site, which lasts
# until the machine goes back (30 s after a call). Make the folders with
# `python benchmarks/leased_gpu/wheel_folders.py <gpu-wheels.sh's folder>` (the fewest that each leave 3 MB beside the tree:
# two of 11.2 MB beside the 2026-12-03 stores packed as SQL text, 7.8 MB left); `--check` prints the room left beside
# each; it keeps wheels that share a top-level folder (opentelemetry-*) in one folder, because pip's --target
# --upgrade replaces such a folder wholesale (2026-12-03: mlflow lost opentelemetry.sdk so). Checked on a fresh H200
# on 2026-12-03 with three folders: after the three calls mlflow, optuna, hydra, sqlalchemy, fla and
# pydantic_core import. History: two folders of 11.1 / 11.3 MB (2026-12-02 and 2026-12-03) left 0.2 / 0.05 MB once the 2026-12-03
# campaign store (9.5 MB) was committed (the tree 55.8 MB); three left 3.9 MB, then 1.7 MB beside the 2026-12-03 store
# as the call packed it (11.7 MB), 5.2 MB once both stores were vacuumed; two again (2026-12-03) once the stores held
# their databases as SQL text (dflash.tracking.packed_store: 10.0 + 5.1 MB became 5.5 + 2.7). A 2026-12-02 job carried a trimmed
# folder on the belief that the machine was still warm. It was a fresh one, and the call failed on a missing hydra:
# carry every folder, one per call, on every fresh machine, the job with the last.
# SITE (default /tmp/site): where the wheels go. One install at a time (flock on $SITE.lock), and a wheel already
# installed there (its file name in $SITE/.installed) is not installed again: a second job sourcing job_env.sh on a
# warm machine (the oracle beside a campaign, 2026-12-06) re-installed the folder it carried while the first job's
# install ran, and pip's --target --upgrade removed a folder under the other (FileNotFoundError: keys.pyi).
SITE=${SITE:-/tmp/site}
exec 9> "$SITE.lock"
flock 9
for d in .whl .whl[0-9]*; do  # the folders wheel_folders.py made, whichever this call carries
  [[ $d =~ ^\.whl[0-9]*$ ]] || continue  # not its half-written .whl2.new
  compgen -G "$d/*.whl" > /dev/null || continue
  new=0
  for w in "$d"/*.whl; do
    grep -qxF "${w##*/}" "$SITE/.installed" 2>/dev/null || new=1
  done
  (( new )) || continue
  # the whole folder, not its new wheels alone: wheels sharing a top-level folder travel together (wheel_folders.py)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$d"/*.whl \
    || { exec 9>&-; exit 1; }
  for w in "$d"/*.whl; do echo "${w##*/}"; done >> "$SITE/.installed"
done
exec 9>&-
if [ -d "$SITE" ]; then export PYTHONPATH=$SITE:$PWD; else export PYTHONPATH=$PWD; fi
