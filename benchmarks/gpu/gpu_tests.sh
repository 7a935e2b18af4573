#!/usr/bin/env bash
# One H200 call: the GPU-marked tests (`pytest -m gpu`), so that a call's limit costs the failures' text of nothing.
#
#   bash benchmarks/gpu/gpu_tests.sh [pytest args, e.g. -k "not training_steps" or tests/test_eval_gpu.py]
#
# Sessions 22 and 23 lost what failed: a plain `timeout N pytest …` kills pytest with SIGTERM before its summary, the
# only place a failure's text is printed (session 23's `test_real_decoding_on_gpu[float32]` showed as one "F").
# Here the job's limit sends SIGINT: pytest stops as on Ctrl-C and still prints the failures and errors so far (-rfE)
# and the durations. Each test has its own limit (pytest-timeout, on the GPU machine), so one slow test fails with
# its stack instead of taking the call (session 22's test_gpu_training_steps ran past 250 s; in session 23 it passed
# in 70 s). The log is $OUT/gpu_tests.log, a JUnit file $OUT/gpu_tests.xml (written when pytest ends, even on SIGINT).
# pytest-timeout is on the GPU machine, not in our dev extras: this script is for that machine.
# Env: LIMIT (s, default 540: under the call's 600 with the start), PER_TEST (s, default 240), OUT (default gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
source "$(dirname "$0")/job_env.sh"  # wheels, PYTHONPATH, the job environment
timeout -s INT -k 30 "${LIMIT:-540}" python -m pytest -m gpu -p no:cacheprovider --timeout "${PER_TEST:-240}" \
  -rfE --durations=0 --junitxml "$OUT/gpu_tests.xml" "${@:-tests}" > "$OUT/gpu_tests.log" 2>&1
rc=$?
tail -40 "$OUT/gpu_tests.log"
echo "== pytest -m gpu exited $rc (0 all passed, 1 a failure, 124 stopped at LIMIT: the summary above is of the tests that ran)"
exit $rc
