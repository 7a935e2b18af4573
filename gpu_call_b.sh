#!/usr/bin/env bash
# session 11 call B: tests of the new kernels on the GPU, the LM-head micro-benchmark, then the 27B bench with the
# pipeline: the new defaults against the old (target.fused_ops=off & loss.lm_head_kernel=torch), one process
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_lm_head_triton.py tests/test_target_fused.py > $OUT/tests.log 2>&1
timeout 80 python benchmarks/gpu/lm_head_kernels.py > $OUT/lm_head_kernels.log 2>&1
date
timeout ${BENCH_S:-470} python -m experiments.bench +target=qwen3_6_27b_random +drafter=published bench.seq_len=2048 bench.anchors=256 +trainer=gpu trainer.producer_batch=4 bench.sections=peak,target,drafter,pipeline bench.pipeline_steps=24 bench.pipeline_repeats=2 bench.pipeline_warmup=8 bench.profile_steps=0 "bench.target_variants=target.fused_ops=off" "bench.pipeline_variants=target.fused_ops=off&loss.lm_head_kernel=torch" bench.kernel_profile=1 results=$OUT/RESULTS_b.md tracking.enabled=false run_dir=/tmp/benchB > $OUT/bench_b.log 2>&1
echo "bench rc=$?"; date
tail -3 $OUT/tests.log; tail -6 $OUT/lm_head_kernels.log
grep -E "^(device|matmul|target|drafter|back|pipeline|peak)" $OUT/bench_b.log | cut -c1-400
grep -E "bench (pipeline|target)" $OUT/bench_b.log | cut -c1-600
