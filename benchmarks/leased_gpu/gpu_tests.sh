#!/usr/bin/env bash
# One H200 call: the GPU-marked tests (`pytest -m gpu`), so that a call's limit costs the failures' text of nothing.
#
#   bash benchmarks/leased_gpu/gpu_tests.sh [pytest args, e.g. -k "not training_steps" or tests/test_eval_gpu.py]
#
# Two runs of 2026-12-03 lost what failed: a plain `timeout N pytest …` kills pytest with SIGTERM before its summary, the
# only place a failure's text is printed (`test_real_decoding_on_gpu[float32]` showed as one "F").
# Here the job's limit sends SIGINT: pytest stops as on Ctrl-C and still prints the failures and errors so far (-rfE)
# and the durations. Each test has its own limit (pytest-timeout, on the GPU machine), so one slow test fails with
# its stack instead of taking the call (test_gpu_training_steps once ran past 250 s; in a later run of 2026-12-03 it passed
# in 70 s). The log is $OUT/gpu_tests.log (-v: a line per test, by node id), a JUnit file $OUT/gpu_tests.xml (written
# when pytest ends, even on SIGINT); a call stopped early also names the tests it did not reach (at the end).
# Give the call's limit as LIMIT, not as an outer `timeout` (that works too now: its TERM reaches pytest as INT).
# Env: LIMIT (s, default 540: under the call's 600 with the start), PER_TEST (s, default 240), OUT (default gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
source "$(dirname "$0")/job_env.sh"  # wheels, PYTHONPATH, the job environment
PER=()  # pytest-timeout is on the GPU machine, not in our dev extras (a CPU test runs this script)
python -c 'import pytest_timeout' 2>/dev/null && PER=(--timeout "${PER_TEST:-240}")
timeout -s INT -k 30 "${LIMIT:-540}" python -m pytest -m gpu -p no:cacheprovider "${PER[@]}" \
  -v -rfE --durations=0 --junitxml "$OUT/gpu_tests.xml" "${@:-tests}" > "$OUT/gpu_tests.log" 2>&1 &
pid=$!
# An outer limit sends this script TERM (a 2026-12-03 run under `timeout 300 bash gpu_tests.sh`: pytest died with the
# script, after 2 of 18 tests, with no summary and no JUnit file). Passed on as INT (timeout hands it to pytest),
# so pytest stops as on Ctrl-C and still writes both; wait again until it has.
trap 'kill -INT "$pid" 2>/dev/null' TERM INT
wait "$pid"
rc=$?
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"
  rc=$?
done
tail -40 "$OUT/gpu_tests.log"
echo "== pytest -m gpu exited $rc (0 all passed, 1 a failure, 124 stopped at LIMIT: the summary above is of the tests that ran)"
# Stopped early (124 at LIMIT, 2 on an outer TERM): the selected tests that never reported, by node id, for the next
# call's arguments (on 2026-12-03 it took three calls to find which 6 of 18 had not run: the log's dots name no test, -v
# does). Collecting takes a few seconds more of the call.
if (( rc == 124 || rc == 2 )); then
  python -m pytest -m gpu -p no:cacheprovider --collect-only -q "${@:-tests}" 2>/dev/null | grep '::' \
    > "$OUT/gpu_tests_selected.txt"
  python3 - "$OUT" <<'EOF'
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
ran = set(re.findall(r"^(\S+::\S+) (?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", (out / "gpu_tests.log").read_text(), re.M))
left = [t for t in (out / "gpu_tests_selected.txt").read_text().split() if t not in ran]
(out / "gpu_tests_not_run.txt").write_text("".join(f"{t}\n" for t in left))
print(f"== not reached ({len(left)}), in $OUT/gpu_tests_not_run.txt; the next call: bash benchmarks/leased_gpu/gpu_tests.sh "
      + " ".join(f"'{t}'" for t in left))
EOF
fi
exit $rc
