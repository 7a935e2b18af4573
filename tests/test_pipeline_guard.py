"""The pipeline's guard: trained-on tokens per second against the serial sum of its own two sides.

On one GPU the trainer runs the target's forward and the drafter's step back to back (the inline producer), so
the pipeline can reach, not beat, the serial sum 1 / (1 / target tok/s + 1 / drafter tok/s) measured in the same
process. Anything the loop adds on the consumer's critical path shows here as a ratio below 1: the τ probe at every
10-step log interval took the 27B pipeline from 6,499 to 5,110 trained-on tok/s (benchmarks/RESULTS.md,
2026-12-04). The shape is small enough for one GPU call, large enough that the GPU, not the host, sets the pace.
"""
import pytest

from experiments.bench import main

pytestmark = pytest.mark.gpu

SMALL = ["+target=tiny_random_gpu", "target.random.hidden_size=2048", "target.random.intermediate_size=6144",
         "target.random.num_layers=8", "target.random.vocab_size=32768", "target.random.num_heads=16",
         "target.random.head_dim=128", "+drafter=small", "drafter.num_layers=2", "+trainer=gpu",
         "bench.seq_len=2048", "bench.anchors=256", "trainer.producer_batch=4", "bench.sections=target,drafter,pipeline",
         "bench.pipeline_steps=24", "bench.pipeline_repeats=2", "bench.pipeline_warmup=8", "bench.profile_steps=0",
         "bench.kernel_profile=0", "results=", "+tracking=off"]
FLOOR = 0.97


def test_pipeline_keeps_up_with_its_serial_sum(tmp_path):
    out = main([*SMALL, f"run_dir={tmp_path / 'run'}"])
    p = out["pipeline"]
    assert "error" not in p, p
    assert p["of_serial_sum"] >= FLOOR, (
        f"pipeline {p['consumed_tok_s']:,.0f} trained-on tok/s is {p['of_serial_sum']:.3f} of its serial sum "
        f"{out['back_to_back_tok_s']:,.0f} (target {out['target']['tok_s']:,.0f}, drafter {out['drafter']['tok_s']:,.0f})"
        f": something on the consumer's critical path (floor {FLOOR})")
