#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
ls gpu_work/online_run/run 2>/dev/null | head -3
RUN_S=${RUN_S:-300} timeout ${LIMIT:-560} bash benchmarks/gpu/online_run.sh gpu_work/online_run > $OUT/summary.txt 2> /tmp/err.txt; echo "rc $?"
grep -v "falling back\|Loading" /tmp/err.txt | tail -8
grep -h "prompt pool\|static decode\|online data\|MEMORIZATION\|planned" gpu_work/online_run/run.log | cut -c1-300 | sort | uniq -c | head
cp gpu_work/online_run/run/metrics.jsonl $OUT/metrics.jsonl; cat $OUT/summary.txt; echo "== done ($(( $(date +%s) - T0 )) s)"
