#!/usr/bin/env bash
# session 11 call A: new kernels' tests, the LM-head micro-benchmark, the 27B target and drafter sides before/after
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
echo "== tests"; timeout 120 python -m pytest -q -p no:cacheprovider tests/test_lm_head_triton.py tests/test_target_fused.py tests/test_target.py 2>&1 | tail -6
echo "== lm_head_kernels"; timeout 90 python benchmarks/gpu/lm_head_kernels.py 2>&1 | tail -8
echo "== bench A"; date
timeout ${BENCH_S:-400} python -m experiments.bench +target=qwen3_6_27b_random +drafter=published bench.seq_len=2048 bench.anchors=256 +trainer=gpu trainer.producer_batch=4 bench.sections=peak,target,drafter bench.pipeline_steps=0 "bench.target_variants=target.fused_ops=off" "bench.drafter_variants=loss.lm_head_kernel=torch" bench.kernel_profile=1 results=$OUT/RESULTS_a.md tracking.enabled=false run_dir=/tmp/benchA > $OUT/bench_a.log 2>&1
echo "bench rc=$?"; date
grep -E "bench (target|drafter|peak)" $OUT/bench_a.log | cut -c1-1500
tail -25 $OUT/bench_a.log
