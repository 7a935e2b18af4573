"""The benchmark runs end to end at tiny shapes on CPU and reports every figure it promises."""

from experiments.bench import main
from tests.conftest import FAST


def test_bench_reports_all_sections(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = main([*FAST, "bench.seq_len=48", "bench.anchors=4", "bench.target_batch=1", "bench.iters=1",
                "bench.warmup=1", "bench.pipeline_steps=4", f"results={results}",
                f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}", f"run_dir={tmp_path / 'run'}"])
    for side in ("target", "drafter"):
        assert out[side]["tok_s"] > 0 and out[side]["flops_per_tok"] > 0 and 0 < out[side]["mfu"]
    assert out["pipeline"]["perf/pipeline_tok_s"] > 0 and "mfu" in out["pipeline"]
    assert out["back_to_back_tok_s"] < min(out["target"]["tok_s"], out["drafter"]["tok_s"])
    text = results.read_text()
    assert "python -m experiments.bench" in text and "pipeline tok/s" in text
