"""The benchmark runs end to end at tiny shapes on CPU and reports every figure it promises."""

import dataclasses

import pytest

from experiments.bench import main
from tests.conftest import FAST


def test_entries_go_to_the_results_log_of_the_day(tmp_path, monkeypatch):
    """Without `results=`, an entry goes to benchmarks/log/<UTC date>.md: a new day's file gets the logs' title once,
    and later entries append beneath it; `results=FILE` and `results=` still choose the file or none."""
    import json
    from datetime import datetime, timedelta, timezone

    import experiments.bench as bench
    monkeypatch.setattr(bench, "LOG_DIR", tmp_path / "log")
    late = datetime(2026, 12, 5, 23, 30, tzinfo=timezone.utc)
    next_morning_east = late.astimezone(timezone(timedelta(hours=2)))  # 2026-12-06 01:30 at UTC+2: the same UTC day
    for now in (late, next_morning_east):
        assert bench.parse_bench_args(["bench.iters=1"], now=now)[2] == str(tmp_path / "log" / "2026-12-05.md")
    assert bench.parse_bench_args(["results=x.md"], now=late)[2] == "x.md"
    assert bench.parse_bench_args(["results="], now=late)[2] is None
    day = bench.log_file(late)
    for i in range(2):
        bench.append_entry(day, f"python -m experiments.bench bench.iters={i}", f"table {i}", {"i": i},
                           late + timedelta(minutes=i))
    text = day.read_text()
    assert text.startswith("# Measured results of 2026-12-05\n") and text.count("# Measured results") == 1
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == ["## 2026-12-05 23:30 UTC — bench output", "## 2026-12-05 23:31 UTC — bench output"]
    assert [json.loads(b.split("\n```")[0]) for b in text.split("```json\n")[1:]] == [{"i": 0}, {"i": 1}]
    assert "`python -m experiments.bench bench.iters=1`" in text and "table 1" in text


def test_bench_reports_all_sections(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = main([*FAST, "bench.seq_len=48", "bench.anchors=4", "bench.target_batch=1", "bench.iters=1",
                "bench.warmup=1", "bench.pipeline_steps=4", "drafter.attn_group=2", f"results={results}",
                "bench.drafter_variants=drafter.attn_group=0;loss.lm_head_grad=recompute&loss.chunk_size=7",
                "bench.pipeline_variants=trainer.producer_mode=inline",
                "bench.target_variants=target.fused_ops=eager",
                f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}", f"run_dir={tmp_path / 'run'}"])
    for side in ("target", "drafter"):
        assert out[side]["tok_s"] > 0 and out[side]["flops_per_tok"] > 0 and 0 < out[side]["mfu"]
    assert out["pipeline"]["perf/pipeline_tok_s"] > 0 and "mfu" in out["pipeline"]
    variants = out["drafter_variants"]  # FAST: 4 anchors, groups of 2 beside one call; the recomputing loss
    assert set(variants) == {"drafter.attn_group=0", "loss.lm_head_grad=recompute&loss.chunk_size=7"}
    assert all(v["tok_s"] > 0 and v["mfu"] > 0 for v in variants.values())
    # the recomputing LM-head loss multiplies the head once more: more FLOPs for the same tokens
    assert variants["loss.lm_head_grad=recompute&loss.chunk_size=7"]["flops_per_tok"] > out["drafter"]["flops_per_tok"]
    assert out["pipeline"]["producer_mode"] == "thread"  # CPU: auto keeps the producer thread
    assert out["pipeline_variants"]["trainer.producer_mode=inline"]["producer_mode"] == "inline"
    inline = out["pipeline_variants"]["trainer.producer_mode=inline"]
    assert inline["perf/pipeline_tok_s"] > 0
    # each pipeline measurement reads its own metrics (a shared folder once handed the variant the default's)
    assert inline["perf/consumed_tok_s"] != out["pipeline"]["perf/consumed_tok_s"]
    for sub in ("pipeline", "pipeline_variant0"):
        assert (tmp_path / "run" / sub / "metrics.jsonl").is_file()
    assert out["pipeline"]["host_syncs_per_step"] == 0  # CPU: nothing to sync, but the trace ran
    # no op in the step reads a device value back (.item(), nonzero, ...): a sync on CUDA, visible on CPU
    # (the CPU's unfused AdamW reads its step counts on the host: allowed there, fused on the GPU)
    sites = out["pipeline"]["sync_sites"]
    assert all(site.startswith("dflash.optimizer:") for site in sites), sites
    fused = out["target_variants"]["target.fused_ops=eager"]  # on the same target, then back to the default
    assert fused["fused_ops"] == "eager" and fused["tok_s"] > 0 and out["target"]["fused_ops"] == "off"
    assert out["back_to_back_tok_s"] < min(out["target"]["tok_s"], out["drafter"]["tok_s"])
    text = results.read_text()
    assert "python -m experiments.bench" in text and "pipeline tok/s" in text
    assert "target tok/s [target.fused_ops=eager]" in text
    assert "drafter tok/s [drafter.attn_group=0]" in text and "pipeline tok/s [trainer.producer_mode=inline]" in text


def test_bad_variant_is_rejected_before_any_work(tmp_path, monkeypatch):
    import pytest

    from dflash.bench import runner as bench
    from dflash.config import ConfigError
    monkeypatch.setattr(bench, "Target", lambda *a, **k: pytest.fail("built the target before checking variants"))
    for bad, msg in [("drafter.attn_grup=0", "unknown key 'attn_grup'"), ("trainer.producer_mode=eager", "producer_mode"),
                     ("drafter.attn_group=two", "expected int")]:
        with pytest.raises(ConfigError, match=msg):
            main([*FAST, f"bench.drafter_variants={bad}", "results=", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"bench\.kernel_top=0"):
        main([*FAST, "bench.kernel_top=0", "results=", f"run_dir={tmp_path / 'run'}"])


def test_count_step_syncs_counts_only_the_steps_own_blocking_calls():
    from types import SimpleNamespace as E

    from dflash.bench.profiling import count_step_syncs

    def ev(name, thread, start, end=None):
        return E(name=name, thread=thread, time_range=E(start=start, end=end if end is not None else start + 1))
    events = [ev("dflash.train_step", 1, 0, 100), ev("dflash.train_step", 1, 200, 300),
              ev("cudaStreamSynchronize", 1, 50), ev("cudaMemcpyAsync", 1, 60),  # async: not a sync
              ev("cudaStreamSynchronize", 2, 50),  # a producer thread's own sync
              ev("cudaMemcpy", 1, 150),  # between steps: the interval's metric read
              ev("cudaMemcpy", 1, 250)]
    events += [ev("aten::item", 1, 240, 260), ev("dflash.optimizer", 1, 230, 270), ev("aten::_local_scalar_dense", 1, 245)]
    got = count_step_syncs(events)
    assert got["steps"] == 2 and got["syncs"] == 2 and got["host_reads"] == 2
    assert got["cudaStreamSynchronize"] == 1 and got["cudaMemcpy"] == 1
    assert got["sites"] == {"cudaStreamSynchronize": 1,
                            "dflash.optimizer: aten::item": 2,  # the read op itself, and the memcpy inside it
                            "dflash.optimizer: aten::item > aten::_local_scalar_dense": 1}


def test_fused_attention_flops_handle_gqa_masks_and_causal():
    import torch

    from dflash.bench.flops import _sdpa_flop_mapping

    aten = torch.ops.aten
    mapping = _sdpa_flop_mapping()
    eff, flash = mapping[aten._scaled_dot_product_efficient_attention], mapping[aten._scaled_dot_product_flash_attention]
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 24, 32), torch.randn(2, 2, 24, 32)  # GQA 8:2
    dense = 2 * 2 * 8 * 16 * 24 * (32 + 32)  # QK^T and PV over every key
    assert flash(q, k, v, 0.0, False) == dense
    mask = torch.zeros(2, 1, 16, 24, dtype=torch.bool)
    mask[..., :6] = True  # a quarter of the keys visible
    assert eff(q, k, v, mask, False) == dense // 4
    assert flash(q, k, k, 0.0, True) == int(dense * 17 / 48)  # causal: (s_q + 1) / (2 s_k) of the keys
    bwd = mapping[aten._scaled_dot_product_efficient_attention_backward]
    assert bwd(torch.randn(2, 8, 16, 32), q, k, v, mask) == 2 * dense // 4


def test_kernel_breakdown_groups_device_time_and_skips_annotations():
    from types import SimpleNamespace as E

    from dflash.bench.profiling import kernel_breakdown

    def ev(name, us, device="CUDA"):
        return E(name=name, device_type=f"DeviceType.{device}", time_range=E(start=0, end=us))
    events = [ev("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 3000), ev("nvjet_sm90_tst_256x128", 1000),
              ev("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", 500),
              ev("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 400),
              ev("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda", 200),
              ev("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
                 "launch_clamp_scalar(at::TensorIteratorBase&)::{lambda()#1}::operator()() const>", 600),
              ev("Optimizer.step#AdamW.step", 9000),  # a GPU-side annotation: its kernels are listed apart
              ev("aten::mm", 7000, device="CPU")]
    got = kernel_breakdown(events, steps=2)
    assert got["ms_per_step"] == {"gemm": 2.0, "elementwise": 0.3, "attention": 0.25, "triton": 0.2,
                                 "copy/index": 0.1}
    assert got["top"][0] == {"kernel": "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "ms_per_step": 1.5,
                             "calls_per_step": 0.5}


def test_kernel_profile_writes_a_trace_with_python_stacks(tmp_path, monkeypatch):
    """`trace=`: the profile also lands in a Chrome trace whose host events carry the Python lines that ran (here on
    the CPU, the CUDA synchronizations stubbed out)."""
    import json

    import torch

    from dflash.bench import profiling

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def step_of_the_model():
        torch.randn(16, 16) @ torch.randn(16, 16)

    trace = tmp_path / "traces" / "drafter.json"
    got = profiling.profile_kernels(step_of_the_model, steps=1, trace=str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("step_of_the_model" in e.get("name", "") for e in events)  # a Python frame: with_stack was on
    assert set(got) == {"ms_per_step", "top"}
    trace.unlink()
    profiling.profile_kernels(step_of_the_model, steps=1)  # no trace asked: nothing written
    assert list(tmp_path.rglob("*.json")) == []


def _run_bench(tmp_path, *extra, results=True):
    return main([*FAST, "bench.seq_len=48", "bench.anchors=4", "bench.target_batch=1", "bench.iters=1",
                 "bench.warmup=1", "bench.kernel_profile=0", *extra,
                 f"results={tmp_path / 'RESULTS.md' if results else ''}",
                 f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}", f"run_dir={tmp_path / 'run'}"])


def test_pipeline_headline_is_what_trained_and_agrees_with_the_trainer(tmp_path):
    """Issue 13: the headline is tokens trained on per second on the bench's own clock; it agrees with the
    trainer's perf/consumed_tok_s over the same windows within 2%; the stock-credited figure is labelled;
    the entry names its shapes, and MLflow leads with the headline."""
    import json

    import mlflow
    out = _run_bench(tmp_path, "bench.sections=pipeline", "bench.pipeline_steps=6", "bench.pipeline_repeats=3",
                     "bench.pipeline_warmup=2", "bench.profile_steps=0", "trainer.producer_mode=inline",
                     "buffer.min_ready=1", "trainer.producer_batch=2")
    p = out["pipeline"]
    assert p["measured_steps"] == 6 and p["repeats"] == 3 and len(p["consumed_tok_s_per_window"]) == 3
    assert p["tokens_trained"] == 6 * 48  # six steps of one 48-token sequence
    assert abs(p["consumed_tok_s"] - p["perf/consumed_tok_s"]) <= 0.02 * p["perf/consumed_tok_s"]
    assert p["spread"] >= 0 and p["stock_credited_tok_s"] > 0
    text = (tmp_path / "RESULTS.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("pipeline tok/s"))
    assert f"{p['consumed_tok_s']:,.0f}" in row.split()[2] and "stock-credited" in row
    raw = json.loads(text.split("```json\n")[1].split("\n```")[0])
    assert {k: raw["shapes"][k] for k in ("target", "seq_len", "anchors", "gpus")} == {
        "target": "tiny_random", "seq_len": 48, "anchors": 4, "gpus": 1}
    assert raw["shapes"]["drafter"].startswith("1x64")
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").search_experiments()])[0]
    assert run.data.metrics["perf/consumed_tok_s"] == p["consumed_tok_s"]
    assert run.data.metrics["perf/stock_credited_tok_s"] == p["stock_credited_tok_s"]
    assert run.data.tags["seq_len"] == "48" and run.data.tags["anchors"] == "4"


def test_serving_section_times_every_call_and_prints_what_tau_buys(tmp_path):
    out = _run_bench(tmp_path, "bench.sections=serving", "bench.serving_contexts=24,40",
                     "bench.serving_budgets=4,8", "bench.serving_iters=1", results=False)
    s = out["serving"]
    assert set(s["contexts"]) == {24, 40}
    for ms in s["contexts"].values():
        for key in ("greedy", "verify_block", "readvance", "draft", "verify_tree_4", "verify_tree_8"):
            assert ms[key] > 0, key
        assert ms["tree_nodes_8"] == 8
        sp = ms["speedup"]
        assert set(sp) == {"block", "block + re-advance", "tree-4", "tree-8"}
        assert all(len(v) == 8 for v in sp.values())  # tau = 1 .. block size (8 in FAST)
        # tau * t_greedy / (t_draft + t_verify): linear in tau
        assert abs(sp["block"][7] - 8 * sp["block"][0]) < 1e-9 * sp["block"][7] + 1e-12
        assert sp["block + re-advance"][0] < sp["block"][0] and sp["block + re-advance"][7] == sp["block"][7]
    from dflash.bench.serving_speed import serving_table
    table = serving_table(s)
    assert "serving after 40 tokens" in table and "tree-8" in table and len(table.splitlines()) == 2 * (2 + 8)


def test_tree_verify_of_a_chain_equals_the_block_verify_and_a_branch_changes_it():
    """The tree mask reaches the attention layers: a tree that is one chain gives the block verify's labels
    and features; a tree with a branch does not (the second child hides its sibling)."""
    import torch

    from dflash.bench.serving_speed import tree_inputs, verify_tree
    from dflash.evaluation.speculative import TargetSession
    from dflash.target.model import Target, TargetConfig, TinyTargetSpec
    t = Target(TargetConfig(random=TinyTargetSpec(hidden_size=64, num_layers=4, intermediate_size=128, head_dim=16,
                                                  linear_head_dim=16), layer_ids=[0, 1, 2], device="cpu"))
    prompt, block = torch.randint(0, 256, (20,)), torch.randint(0, 256, (5,))
    chain = [tuple([0] * d) for d in range(1, 5)]  # depth d: rank 0 at every depth
    idx = [[int(block[d + 1])] + [7, 9] for d in range(4)]
    results = []
    for nodes, ids in ((chain, None), ([(0,), (1,), (0, 0)], None)):
        sess = TargetSession(t, need_features=True)
        sess.forward(prompt)
        results.append(verify_tree(sess, *tree_inputs(nodes, idx, int(block[0]), 20, t.device)))
    sess = TargetSession(t, need_features=True)
    sess.forward(prompt)
    feats, labels = sess.forward(block)
    assert torch.equal(results[0][1], labels) and torch.allclose(results[0][0], feats, atol=1e-5)
    # branch tree [root, (0,), (1,), (0,0)]: node (0,0) sees root and (0,) but not (1,): unlike a chain
    assert not torch.allclose(results[1][0][:, 3], feats[:, 3], atol=1e-5)


def test_drafter_step_bench_runs_the_trainers_step_and_times_its_phases(fast_cfg, caplog):
    """The drafter section is the trainer's own Trainer.step (no copy of it); its phase boundaries come from
    public hooks (forward hook, the loss, the optimizer's step hooks): four phases per step, in order."""
    import time

    import torch

    from dflash.bench.config import BenchConfig
    from dflash.bench.drafter_step import PHASES, DrafterStepBench
    from dflash.target.model import Target

    class HostEvent:
        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3
    cfg = fast_cfg()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=5000))
    bench = DrafterStepBench(cfg, Target(cfg.target), BenchConfig(seq_len=48, anchors=4, warmup=1, iters=1))
    assert "MEMORIZATION RISK" not in caplog.text  # it times one fixed batch; the run's max_steps do not apply
    before = [p.detach().clone() for p in bench.trainer.drafter.parameters()]
    loss_fn = bench.trainer.loss_fn
    phases = bench.phases(steps=2, event=HostEvent, sync=lambda: None)
    assert list(phases) == list(PHASES) and all(v > 0 for v in phases.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, bench.trainer.drafter.parameters()))  # it stepped
    assert bench.trainer.loss_fn is loss_fn  # the timing wrapper is gone again
    out = bench.run()
    assert out["tok_s"] > 0 and out["flops_per_tok"] > 0 and out["sec_per_step"] > 0


def test_pipeline_windows_hold_whole_producer_periods():
    """A window that cuts the producer's period holds a varying number of target forwards (a 24.6%
    spread at producer_batch 4 and windows of 10 steps): windows are rounded up to whole periods."""
    from dflash.bench.config import BenchConfig
    from dflash.bench.pipeline import Schedule
    b = BenchConfig(pipeline_steps=40, pipeline_repeats=4, pipeline_warmup=10)
    assert (Schedule.of(b).window, Schedule.of(b).warmup) == (10, 10)
    s = Schedule.of(b, producer_batch=4)
    assert (s.window, s.warmup, s.measured_end) == (12, 12, 60)
    assert Schedule.of(BenchConfig(pipeline_steps=40, pipeline_repeats=4, drafter_batch=2), 4).window == 10
    assert Schedule.of(BenchConfig(pipeline_steps=24, pipeline_repeats=2, drafter_batch=4), 4).window == 12
    assert Schedule.of(BenchConfig(pipeline_steps=4, pipeline_repeats=2), 3).window == 3


def test_window_records_are_the_measured_windows_of_the_latest_run(tmp_path):
    import json

    from dflash.bench.pipeline import Schedule, window_records
    s = Schedule(warmup=4, window=2, repeats=3, profiled=1)
    old = [{"step": k, "perf/consumed_tok_s": 1.0} for k in range(2, 12, 2)]  # an earlier run in this folder
    new = [{"step": k, "perf/consumed_tok_s": 2.0} for k in range(2, 12, 2)] + [{"step": 11, "perf/consumed_tok_s": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old + new))
    got = window_records(tmp_path, s)
    assert [r["step"] for r in got] == [6, 8, 10] and all(r["perf/consumed_tok_s"] == 2.0 for r in got)


def test_bench_variants_may_not_change_how_the_target_is_built():
    import pytest

    from dflash.config import ConfigError
    with pytest.raises(ConfigError, match=r"bench\.target_variants: variant 'target\.soft_top_k=3' changes target keys"):
        main([*FAST, "bench.target_variants=target.soft_top_k=3", "bench.sections=peak"])
    with pytest.raises(ConfigError, match=r"bench\.pipeline_variants: .*target\.fused_ops"):
        main([*FAST, "bench.pipeline_variants=target.dtype=float32", "bench.sections=peak"])


def test_drafter_step_bench_of_a_dflash2_drafter_with_muon_counts_its_modules(fast_cfg):
    """DFlash 2 + Muon in the drafter section: the optimizer's step hooks fire (four phases), and the useful FLOPs
    are the counter's matmuls (kernel projections, selector projection, candidate logits, the top-k's full
    logits) plus the convolutions' and pair scores' elementwise work, which the counter does not see."""
    import time

    import torch

    from dflash.bench.config import BenchConfig
    from dflash.bench.drafter_step import DrafterStepBench
    from dflash.bench.flops import count_flops, dflash2_elementwise_flops
    from dflash.target.model import Target

    class HostEvent:
        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3
    cfg = fast_cfg("+drafter=dflash2", "drafter.num_layers=1", "drafter.layer_types=[sliding_attention]",
                   "drafter.head_dim=16", "drafter.intermediate_size=128", "drafter.block_size=8",
                   "trainer.optimizer=muon")
    target = Target(cfg.target)
    bench = DrafterStepBench(cfg, target, BenchConfig(seq_len=48, anchors=4, warmup=1, iters=1))
    phases = bench.phases(steps=1, event=HostEvent, sync=lambda: None)
    assert all(v > 0 for v in phases.values())
    extra = dflash2_elementwise_flops(cfg.drafter, target.hidden_size, int(bench.batch.anchors_BN.numel()))
    assert extra > 0
    assert bench.useful_flops() == count_flops(bench.step) + extra
    plain = DrafterStepBench(fast_cfg(), target, BenchConfig(seq_len=48, anchors=4, warmup=1, iters=1))
    assert bench.useful_flops() > plain.useful_flops()  # convs, selector and the top-k's logits on top
    assert torch.isfinite(torch.tensor(bench.run()["flops_per_tok"]))


def test_each_drafter_steps_own_peak_memory_is_printed_where_measured():
    """A GPU bench records every drafter step's own peak (DFlash 1 beside DFlash 2 in one process); a CPU one has
    none, and its rows say nothing of memory."""
    from dflash.bench.runner import format_table
    side = {"tok_s": 1000.0, "flops_per_tok": 2e9, "sec_per_step": 0.5, "mfu": 0.5}
    out = {"device": "H200", "kernels": "fla", "drafter": {**side, "peak_mem_gb": 61.25},
           "drafter_variants": {"drafter.architecture=dflash2": {**side, "peak_mem_gb": 70.04}, "cpu": side}}
    rows = {line.split("  ")[0]: line for line in format_table(out).splitlines()}
    assert "peak 61.2 GiB" in rows["drafter tok/s"]
    assert "peak 70.0 GiB" in rows["drafter tok/s [drafter.architecture=dflash2]"]
    assert "GiB" not in rows["drafter tok/s [cpu]"]


def test_the_dflash2_bench_variant_is_the_27b_dflash2_drafter():
    """docs/dflash2.md measures DFlash 2 at 27B shapes as overrides of the published drafter in one process (one
    target built): those overrides must compose exactly conf/drafter/dflash2_qwen3_6_27b.yaml."""
    import re
    from pathlib import Path

    from dflash.bench.config import variant_configs
    from experiments.bench import compose_config, parse_bench_args
    doc = (Path(__file__).resolve().parent.parent / "docs" / "dflash2.md").read_text()
    d2 = re.search(r'D2="([^"]+)"', doc).group(1).replace("$L", "sliding_attention")
    base = ["+target=qwen3_6_27b_random", "+trainer=gpu", "+tracking=off"]
    b, overrides, _ = parse_bench_args([*base, "+drafter=published", f"bench.drafter_variants={d2}", "results="])
    variant = variant_configs(compose_config(overrides), b.drafter_variants, "drafter_variants")[d2]
    assert variant.drafter == compose_config([*base, "+drafter=dflash2_qwen3_6_27b"]).drafter


def test_the_reference_shape_dflash2_bench_variant_is_the_dflash2_drafter():
    """docs/dflash2.md's reference-shape side by side: its R2 overrides of the default drafter compose exactly
    +drafter=dflash2 (one process, one target)."""
    import re
    from pathlib import Path

    from dflash.bench.config import variant_configs
    from experiments.bench import compose_config, parse_bench_args
    doc = (Path(__file__).resolve().parent.parent / "docs" / "dflash2.md").read_text()
    r2 = re.search(r'R2="([^"]+)"', doc).group(1).replace("$L", "sliding_attention")
    b, overrides, _ = parse_bench_args(["+trainer=gpu", "+tracking=off", f"bench.drafter_variants={r2}", "results="])
    variant = variant_configs(compose_config(overrides), b.drafter_variants, "drafter_variants")[r2]
    assert variant.drafter == compose_config(["+trainer=gpu", "+tracking=off", "+drafter=dflash2"]).drafter
    assert variant.trainer.compile


def test_a_drafter_only_bench_releases_the_targets_layers_and_its_steps_still_run(tmp_path, monkeypatch):
    """bench.sections=peak,drafter runs no target forward: the target's decoder layers are freed (a 27B target's
    50 GiB, so a drafter step fits beside its embedding and head on an 80 GiB GPU), the steps of DFlash 1 and of a
    DFlash 2 variant still run on what is kept, the table says what was left out, and a forward through the
    released target fails by name instead of running a decoder without layers."""
    import torch

    from dflash.target.model import Target
    from experiments.config import compose_config
    d2 = ("drafter.architecture=dflash2&drafter.layer_types=[sliding_attention]&drafter.sliding_window=64"
          "&drafter.block_size=8")
    monkeypatch.chdir(tmp_path)  # +tracking=off: no store made, not even the default sqlite:///mlflow.db here
    out = main([*FAST, "bench.seq_len=48", "bench.anchors=4", "bench.iters=1", "bench.warmup=1",
                "bench.sections=peak,drafter", f"bench.drafter_variants={d2}", "drafter.num_layers=1",
                f"results={tmp_path / 'RESULTS.md'}", f"run_dir={tmp_path / 'run'}", "+tracking=off"])
    assert not list(tmp_path.glob("mlflow.db*"))
    assert out["target_released_gb"] > 0 and out["drafter"]["tok_s"] > 0
    assert out["drafter_variants"][d2]["tok_s"] > 0 and "error" not in out["drafter_variants"][d2]
    assert "target layers released" in (tmp_path / "RESULTS.md").read_text()

    target = Target(compose_config(FAST).target)
    kept = [target.embed_weight().clone(), target.lm_head_weight().clone()]
    layers = sum(p.numel() * p.element_size() for p in target.decoder.layers.parameters())
    assert target.release_decoder_layers() == pytest.approx(layers / 2**30)
    assert not list(target.decoder.layers.parameters())
    assert torch.equal(target.embed_weight(), kept[0]) and torch.equal(target.lm_head_weight(), kept[1])
    with pytest.raises(RuntimeError, match="decoder layer 0 was released"):
        target.forward_features(torch.zeros(1, 8, dtype=torch.long))

    full = main([*FAST, "bench.seq_len=48", "bench.anchors=4", "bench.iters=1", "bench.warmup=1",
                 "bench.target_batch=1", "bench.sections=target,drafter", "+tracking=off",
                 f"results={tmp_path / 'RESULTS2.md'}", f"run_dir={tmp_path / 'run2'}"])
    assert "target_released_gb" not in full and full["target"]["tok_s"] > 0  # a section runs the target: kept


def test_a_pipeline_variant_is_held_to_the_serial_sum_of_its_own_drafter_step():
    """A DFlash 2 pipeline beside the DFlash 1 default: its ratio to the serial sum is against the target and the
    DFlash 2 drafter step (the drafter variant of the same overrides), not the default drafter's; a pipeline variant
    with no drafter variant of its own keeps the default's."""
    from dflash.bench.runner import derive, format_table
    d2 = "drafter.architecture=dflash2"
    pipe = {"consumed_tok_s": 300.0, "stock_credited_tok_s": 300.0, "spread": 0.0, "perf/consumed_tok_s": 300.0,
            "measured_steps": 4, "repeats": 2}
    out = derive({"device": "H100", "kernels": "fla", "peak_flops": 1e15,
                  "target": {"tok_s": 1000.0, "flops_per_tok": 1e9},
                  "drafter": {"tok_s": 1000.0, "flops_per_tok": 1e9, "sec_per_step": 0.1},
                  "drafter_variants": {d2: {"tok_s": 500.0, "flops_per_tok": 2e9, "sec_per_step": 0.2}},
                  "pipeline": dict(pipe, consumed_tok_s=500.0),
                  "pipeline_variants": {d2: dict(pipe), "trainer.producer_mode=inline": dict(pipe)}})
    assert out["pipeline"]["of_serial_sum"] == pytest.approx(1.0)  # 1 / (1/1000 + 1/1000) = 500
    own = out["pipeline_variants"][d2]
    assert own["serial_sum_tok_s"] == pytest.approx(1 / (1 / 1000 + 1 / 500))
    assert own["of_serial_sum"] == pytest.approx(0.9)
    assert own["mfu"] == pytest.approx(300 * 3e9 / 1e15)
    assert out["pipeline_variants"]["trainer.producer_mode=inline"]["of_serial_sum"] == pytest.approx(0.6)
    rows = {line.split("  ")[0]: line for line in format_table(out).splitlines()}
    assert "0.900 of its serial sum 333" in rows[f"pipeline tok/s [{d2}]"]
    assert "0.50x the default" in rows[f"drafter tok/s [{d2}]"]
