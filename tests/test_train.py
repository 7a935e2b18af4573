"""CPU smoke run, MLflow contents, exact resume, SIGKILL resume, tracking outage."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dflash.app.run import train
from tests.conftest import interrupted_copy

ROOT = Path(__file__).resolve().parent.parent


def _losses(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_smoke_run_lands_in_mlflow(fast_cfg, tmp_path):
    cfg = fast_cfg("+loss=soft_kl", "+noise=cosine", "tracking.system_metrics=true")
    res = train(cfg)
    assert res.run_id and (res.run_dir / "final" / "model.safetensors").is_file()
    client = MlflowClient(cfg.tracking.tracking_uri)
    run = client.get_run(res.run_id)
    assert run.info.status == "FINISHED"
    p, t, m = run.data.params, run.data.tags, run.data.metrics
    assert p["loss.name"] == "soft_kl" and p["noise.name"] == "cosine" and p["loss.temperature"] == "2.0"
    assert t["loss"] == "soft_kl" and t["noise"] == "cosine" and t["buffer"] == "r10_20" and "git_sha" in t
    for key in ["train/loss", "train/acc", "train/acc_pos01", "train/anchor_streak", "train/lr", "train/noise_sigma",
                "perf/target_tok_s", "perf/drafter_tok_s", "perf/pipeline_tok_s", "buffer/depth_b0",
                "buffer/total", "system/cpu_utilization_percentage"]:  # MLflow's System metrics tab
        assert key in m, key
    assert len(client.get_metric_history(res.run_id, "train/loss")) == cfg.trainer.max_steps
    arts = {a.path for a in client.list_artifacts(res.run_id)}
    assert {"config.yaml", "checkpoint"} <= arts
    assert {a.path for a in client.list_artifacts(res.run_id, "checkpoint")} >= {
        "checkpoint/config.json", "checkpoint/model.safetensors"}
    assert m["train/noise_sigma"] < 0.1


def test_resume_reproduces_the_uninterrupted_run(fast_cfg, tmp_path):
    full = train(fast_cfg("+buffer=deterministic", "buffer.max_depth=4", "buffer.min_ready=4",
                          "+noise=uniform", "+loss=streak", run="full"))
    ref = _losses(full.run_dir)
    # Interrupted copy: the run dir as it stood after the step-3 checkpoint.
    part = interrupted_copy(full.run_dir, 3, tmp_path / "part")
    res = train(fast_cfg(f"resume={part}", run="ignored"))
    got = _losses(res.run_dir)
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), (s, got, ref)


def test_inline_producer_trains_exactly_like_a_producer_thread(fast_cfg):
    """A deterministic buffer hands out the same items whoever fills it: the consumer topping the buffer up
    itself (one GPU's default) must give the producer thread's losses step for step."""
    det = ("+buffer=deterministic", "buffer.max_depth=4", "buffer.min_ready=4", "trainer.producer_batch=3")
    threaded = _losses(train(fast_cfg(*det, "trainer.producer_mode=thread", run="thread")).run_dir)
    inline = _losses(train(fast_cfg(*det, "trainer.producer_mode=inline", run="inline")).run_dir)
    assert threaded == inline and len(inline) == 6


def test_unknown_producer_mode_is_rejected(fast_cfg):
    from dflash.config import ConfigError
    with pytest.raises(ConfigError, match="trainer.producer_mode"):
        train(fast_cfg("trainer.producer_mode=eager"))


def test_tracking_outage_keeps_training(fast_cfg, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = fast_cfg("tracking.tracking_uri=http://127.0.0.1:9")
    with pytest.warns(RuntimeWarning, match="127.0.0.1:9"):
        res = train(cfg)
    assert len(_losses(res.run_dir)) == cfg.trainer.max_steps
    assert res.run_id is None


def test_producer_error_stops_the_run_with_that_error(fast_cfg, monkeypatch):
    from dflash.target import model as target_mod

    def boom(self, *a, **k):
        raise RuntimeError("target exploded")
    monkeypatch.setattr(target_mod.Target, "forward_features", boom)
    for mode in ("thread", "inline"):
        with pytest.raises(Exception, match="target exploded|producer"):
            train(fast_cfg(f"trainer.producer_mode={mode}"))


@pytest.mark.slow
def test_sigkill_then_resume(tmp_path):
    from tests.conftest import FAST
    run_dir = tmp_path / "killed"
    args = [sys.executable, "-m", "experiments.run", *FAST, "trainer.max_steps=40", "trainer.checkpoint_every=2",
            f"run_dir={run_dir}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not list((run_dir / "checkpoints").glob("step_*.pt"))[1:]:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert 2 <= saved < 40
    out = subprocess.run([sys.executable, "-m", "experiments.run", f"resume={run_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert max(_losses(run_dir)) == 40
    assert not list((run_dir / "checkpoints").glob(".step_*")), "no torn temp files left behind"


def test_resume_can_extend_a_run_but_not_change_its_groups(fast_cfg):
    from dflash.config import ConfigError
    from experiments.run import main
    first = train(fast_cfg())
    main([f"resume={first.run_dir}", "trainer.max_steps=8"])
    assert sorted(_losses(first.run_dir))[-1] == 8
    with pytest.raises(ConfigError, match="config group"):
        main([f"resume={first.run_dir}", "+loss=soft_kl"])


def test_time_budget_stops_at_a_log_interval_with_checkpoint_and_final(fast_cfg):
    res = train(fast_cfg("trainer.time_budget_s=1e-6", "trainer.max_steps=50", "trainer.producer_batch=3"))
    assert sorted(_losses(res.run_dir)) == [1]  # log_every=1: the first interval is past the budget
    assert (res.run_dir / "checkpoints" / "step_00000001.pt").is_file()
    assert (res.run_dir / "final" / "model.safetensors").is_file()


def test_negative_time_budget_is_rejected(fast_cfg):
    from dflash.config import ConfigError, validate
    with pytest.raises(ConfigError, match="trainer.time_budget_s"):
        validate(fast_cfg("trainer.time_budget_s=-1"))


def _rows(run_dir, key):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def test_time_progress_spans_the_budget_left_after_the_first_step():
    from dflash.training.trainer import TimeProgress, warmup_cosine
    p = TimeProgress(100.0, True)
    assert p.fraction(5.0) == 0.0  # before the first step: nothing spent
    p.first_step_done(t_loop=0.0, now=20.0)  # 20 s compiling: the cosine spans the other 80
    assert p.fraction(60.0) == pytest.approx(0.5) and p.fraction(500.0) == 1.0
    p.update(0.5)
    p.update(0.25)  # a reading never moves it back
    assert p.value == 0.5
    assert warmup_cosine(50, 10, 10**6, 0.1, p.value) == pytest.approx(0.55)  # the step fraction alone: ~1
    assert warmup_cosine(2, 10, 10**6, 0.1) == pytest.approx(0.3)  # inside the warmup: its ramp
    assert warmup_cosine(2, 10, 10**6, 0.1, 1.0) == pytest.approx(0.1)  # a budget spent inside it: the floor
    assert warmup_cosine(2, 10, 10**6, 0.1, 0.5) == pytest.approx(0.3)  # the ramp where it is lower
    resumed = TimeProgress(10.0, True, start=0.5)  # a resumed job goes on from its checkpoint's progress
    resumed.first_step_done(0.0, 0.0)
    assert resumed.fraction(5.0) == pytest.approx(0.75)
    own = TimeProgress(100.0, True, from_first_step=True)  # trainer.time_budget_counts=training: all 100 s
    own.first_step_done(t_loop=0.0, now=20.0)
    assert own.fraction(70.0) == pytest.approx(0.5) and own.fraction(120.0) == 1.0
    off = TimeProgress(10.0, False, start=0.3)
    off.first_step_done(0.0, 0.0)
    assert off.fraction(9.0) == 0.3 and not off.enabled


def test_schedule_by_time_decays_the_lr_over_the_time_budget_and_resumes_from_it(fast_cfg):
    """With max_steps far away, the step fraction barely moves; the time budget decays the LR to its floor and the
    checkpoint keeps the progress, so a resumed job starts decayed."""
    import torch
    res = train(fast_cfg("trainer.time_budget_s=2", "trainer.schedule_by_time=true", "trainer.max_steps=100000",
                         "trainer.checkpoint_every=100000", "trainer.min_lr_ratio=0.1", run="timed"))
    progress = [v for _, v in _rows(res.run_dir, "train/time_progress")]
    assert len(progress) >= 3 and progress == sorted(progress) and progress[-1] == 1.0
    lrs = [v for _, v in _rows(res.run_dir, "train/lr")]
    assert lrs[-1] < 0.6 * max(lrs)  # decayed by time: 100,000 steps would leave it at ~max
    (ckpt,) = (res.run_dir / "checkpoints").glob("step_*.pt")
    assert torch.load(ckpt, weights_only=False)["time_progress"] == 1.0
    last_step = _rows(res.run_dir, "train/lr")[-1][0]
    again = train(fast_cfg(f"resume={res.run_dir}", run="ignored"))  # another job of the saved config's 2 s
    resumed = [(s, v) for s, v in _rows(again.run_dir, "train/lr") if s > last_step]
    assert resumed and resumed[0][1] == pytest.approx(0.1 * 1e-3, rel=1e-6)  # trainer.lr's floor from step one


def test_a_training_time_budget_leaves_the_first_step_out(fast_cfg):
    """The budget's seconds are training after the first step; the seconds before it are logged beside them."""
    res = train(fast_cfg("trainer.time_budget_s=1.5", "trainer.time_budget_counts=training", "trainer.max_steps=100000",
                         "trainer.schedule_by_time=true", "trainer.checkpoint_every=100000", run="from_first"))
    (loop_s,), (first_s,) = [[v for _, v in _rows(res.run_dir, k)] for k in ("sys/loop_s", "sys/first_step_s")]
    assert 0 < first_s < loop_s and loop_s - first_s >= 1.5
    assert [v for _, v in _rows(res.run_dir, "train/time_progress")][-1] == 1.0


@pytest.mark.parametrize("counts", ["training", "loop"])
def test_in_training_evaluations_count_in_a_loop_budget_and_not_in_a_training_one(fast_cfg, monkeypatch, counts):
    """time_budget_counts=training: a learning curve's evaluations stop the budget's clock, so the run trains its
    whole budget beside them and train/budget_s (the curve's x in time) counts training alone. loop: a deadline,
    the evaluations inside it."""
    from dflash.app.run import RunHooks
    monkeypatch.setattr(RunHooks, "on_eval", lambda self, trainer, step: time.sleep(0.4))
    res = train(fast_cfg("trainer.time_budget_s=1.5", "trainer.eval_every=15", "trainer.max_steps=100000",
                         f"trainer.time_budget_counts={counts}", "trainer.schedule_by_time=true",
                         "trainer.checkpoint_every=100000", run="curve"))
    (loop_s,), (eval_s,), (first_s,) = [[v for _, v in _rows(res.run_dir, k)]
                                        for k in ("sys/loop_s", "sys/train_eval_s", "sys/first_step_s")]
    budget = [v for _, v in _rows(res.run_dir, "train/budget_s")]
    assert eval_s >= 0.4 and budget == sorted(budget) and budget[-1] >= 1.5
    if counts == "training":  # training had all its seconds; the first step and the evaluations came on top
        assert loop_s - eval_s - first_s >= budget[-1]
    else:  # a deadline: the first step and the evaluations are inside its seconds
        assert eval_s + first_s <= budget[-1] <= loop_s
    assert [v for _, v in _rows(res.run_dir, "train/time_progress")][-1] == 1.0


def test_time_budget_counts_is_checked(fast_cfg):
    from dflash.config import ConfigError, validate
    with pytest.raises(ConfigError, match="trainer.time_budget_counts must be 'loop' or 'training'"):
        validate(fast_cfg("trainer.time_budget_counts=compile"))


def test_schedule_by_time_needs_a_time_budget(fast_cfg):
    from dflash.config import ConfigError, validate
    with pytest.raises(ConfigError, match="trainer.schedule_by_time=true needs trainer.time_budget_s"):
        validate(fast_cfg("trainer.schedule_by_time=true"))
