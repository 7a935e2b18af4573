#!/usr/bin/env bash
# session 11 call C: the GPU tests with the new defaults, then the pipeline's default stream against the side stream
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 210 python -m pytest -q -p no:cacheprovider tests/test_target_fused.py tests/test_lm_head_triton.py tests/test_gpu.py tests/test_speed_settings.py > $OUT/tests_c.log 2>&1
echo "tests rc=$?"; date
timeout ${BENCH_S:-320} python -m experiments.bench +target=qwen3_6_27b_random +drafter=published bench.seq_len=2048 bench.anchors=256 +trainer=gpu trainer.producer_batch=4 bench.sections=pipeline bench.pipeline_steps=24 bench.pipeline_repeats=2 bench.pipeline_warmup=8 bench.profile_steps=0 "bench.pipeline_variants=trainer.producer_stream=side" bench.kernel_profile=0 results=$OUT/RESULTS_c.md tracking.enabled=false run_dir=/tmp/benchC > $OUT/bench_c.log 2>&1
echo "bench rc=$?"; date
grep -E "passed|failed" $OUT/tests_c.log | tail -3; grep -E "^(FAILED|E )" $OUT/tests_c.log | head -10
grep -E "^(pipeline|peak)" $OUT/bench_c.log | cut -c1-400
