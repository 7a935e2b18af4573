"""A sweep trial cut by a job's time limit (SIGTERM after a checkpoint, or its worker gone) continues in the next
launch from its checkpoint: same params, same run dir and MLflow run, counted once. Trials that failed on their
own, or left no checkpoint, are not continued (CPU, the cpu_smoke sweep)."""
import datetime
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parent.parent
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _argv(tmp, cache, *extra):
    # cpu_smoke's trial 0 draws lr=1e-2: not pruned (tests/test_sweeps.py), so its continuation runs to the end
    return ["cpu_smoke", f"out={tmp / 'out'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            "tracking.experiment=sweeps", f"eval.cache_dir={cache}", *extra]


def _study(tmp):
    from sweeps.storage import make_storage
    return optuna.load_study(study_name="cpu_smoke", storage=make_storage(str(tmp / "out" / "cpu_smoke.journal")))


@pytest.fixture
def sigterm_at(monkeypatch):
    """SIGTERM this process once the trainer logs step k (what `timeout` sends at a job's limit): the trainer
    checkpoints at that step boundary and raises RunInterrupted (a KeyboardInterrupt)."""
    from dflash.app.run import RunHooks
    original = RunHooks.on_log

    def arm(k: int):
        fired = []

        def on_log(self, trainer, metrics, step):
            original(self, trainer, metrics, step)
            if step == k and not fired:
                fired.append(step)
                os.kill(os.getpid(), signal.SIGTERM)
        monkeypatch.setattr(RunHooks, "on_log", on_log)
    yield arm
    monkeypatch.setattr(RunHooks, "on_log", original)


def test_cut_trial_continues_from_its_checkpoint(tmp_path, sigterm_at, monkeypatch):
    from dflash.app.run import RunHooks
    from sweeps.launch import main
    from sweeps.objective import continued_map

    original = RunHooks.on_log
    cache = tmp_path / "eval_cache"
    sigterm_at(4)
    with pytest.raises(KeyboardInterrupt) as cut:
        main(_argv(tmp_path, cache, "n_trials=1", "workers=1"))
    assert cut.value.step == 4  # stopped at the step boundary, with a checkpoint
    monkeypatch.setattr(RunHooks, "on_log", original)
    [old] = _study(tmp_path).get_trials()
    assert old.state == TrialState.FAIL and old.user_attrs["sweep.interrupted"] is True
    run_dir = Path(old.user_attrs["sweep.run_dir"])
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))[-1] == "step_00000004.pt"

    res = main(_argv(tmp_path, cache, "n_trials=1", "workers=1"))
    study = _study(tmp_path)
    trials = study.get_trials()
    assert len(trials) == 2  # the continuation is this launch's one trial: nothing new sampled
    new = trials[1]
    assert new.state == TrialState.COMPLETE and math.isfinite(new.value)
    assert new.params == old.params and new.user_attrs["sweep.continues"] == 0
    assert new.user_attrs["sweep.run_dir"] == str(run_dir) and new.user_attrs["sweep.resume_step"] == 4
    assert continued_map(trials) == {0: 1} and study.user_attrs["sweep.continued_as"] == {"0": 1}

    # the run went on from step 4: every step logged once, to max_steps (6), tokens counted on from the checkpoint
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6]
    tokens = [r["data/consumed_tokens"] for r in trained]
    assert all(b > a for a, b in zip(tokens, tokens[1:]))
    per_step = tokens[3] / 4
    assert tokens[-1] < tokens[3] + 3 * per_step  # 6 steps' worth, not 4 + 6
    assert new.value == pytest.approx(trained[-1]["train/loss"])

    # one logical trial: continued, not failed; the best is the continuation
    assert res["n_trials"] == 1 and res["n_continued"] == 1 and res["n_new"] == 1
    assert res["states"]["FAIL"] == 0 and res["states"]["COMPLETE"] == 1 and res["best"]["number"] == 1
    assert res["continued_now"] == {0: 1}

    # MLflow: the cut run was reopened, not duplicated
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sweeps")
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{res['parent_run_id']}'")
    assert len(children) == 1
    run = children[0]
    assert run.info.run_id == old.user_attrs["mlflow.run_id"] == new.user_attrs["mlflow.run_id"]
    assert run.info.status == "FINISHED" and run.data.tags["optuna.state"] == "COMPLETE"
    assert run.data.tags["optuna.trial_number"] == "1" and run.data.tags["sweep.continues"] == "0"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    parent = client.get_run(res["parent_run_id"]).data.tags
    assert parent["sweep.n_continued"] == "1" and parent["sweep.n_failed"] == "0"
    assert parent["sweep.best_trial"] == "1"

    # what continuing cost, measured for the report (sweeps/sweep_report.py): each launch recorded its start; the
    # continuation started after the second one's and logged its first step after its own start
    from sweeps.sweep_report import job_costs
    starts = [datetime.datetime.fromisoformat(t) for t in study.user_attrs["sweep.launch_starts"]]
    assert all(s.utcoffset() is not None for s in starts)  # the launch machine's offset, recorded
    starts = [s.replace(tzinfo=None) for s in starts]  # its local wall time, as Optuna's trial starts are
    assert len(starts) == 2 and starts[0] <= old.datetime_start <= starts[1] <= new.datetime_start
    costs = job_costs(study, run_dir.parent)
    assert costs["launch"] == pytest.approx((new.datetime_start - starts[1]).total_seconds())
    assert 0 < costs["resume"] < (new.datetime_complete - new.datetime_start).total_seconds()

    # a third launch continues nothing again
    again = main(_argv(tmp_path, cache, "n_trials=0", "workers=1"))
    assert again["continued_now"] == {} and len(_study(tmp_path).get_trials()) == 2


def _ckpt(run_dir: Path, step: int) -> str:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / f"step_{step:08d}.pt").write_bytes(b"x")
    return str(run_dir)


def _fail(study, attrs: dict):
    t = study.ask()
    t.suggest_float("x", 0.0, 1.0)
    for k, v in attrs.items():
        t.set_user_attr(k, v)
    study.tell(t, state=TrialState.FAIL)
    return t.number


def test_only_cut_trials_with_a_checkpoint_are_continued(tmp_path):
    from sweeps.objective import continue_interrupted, study_summary
    from sweeps.storage import Lease, make_storage, reap_stale

    study = optuna.create_study(study_name="s", storage=make_storage(str(tmp_path / "s.journal")))
    d = tmp_path / "runs"
    no_ckpt = _fail(study, {"sweep.run_dir": str(d / "a"), "sweep.interrupted": True,
                            "sweep.error": "RunInterrupted: stopped by SIGTERM"})
    real_error = _fail(study, {"sweep.run_dir": _ckpt(d / "b", 3), "sweep.error": "ValueError: boom"})
    cut = _fail(study, {"sweep.run_dir": _ckpt(d / "c", 3), "sweep.interrupted": True,
                        "sweep.error": "RunInterrupted: stopped by SIGTERM after step 3"})
    reaped_before = _fail(study, {"sweep.run_dir": _ckpt(d / "e", 2)})  # no error attr: its worker died
    stuck = _fail(study, {"sweep.run_dir": _ckpt(d / "f", 5), "sweep.interrupted": True,
                          "sweep.resume_step": 5})  # cut again without moving on: not again
    done = study.ask()
    done.suggest_float("x", 0.0, 1.0)
    done.set_user_attr("sweep.run_dir", _ckpt(d / "g", 6))
    study.tell(done, 0.5)
    # a RUNNING trial whose worker is gone (what reap_stale finds)
    code = "import sys; from sweeps.storage import Lease; l = Lease(sys.argv[1]); print(l.path)"
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path / "leases")], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    mine = Lease(tmp_path / "leases")
    orphan = study.ask()
    orphan.suggest_float("x", 0.0, 1.0)
    for k, v in {**mine.attrs(), "sweep.lease": dead, "sweep.run_dir": _ckpt(d / "h", 3)}.items():
        orphan.set_user_attr(k, v)
    reaped = reap_stale(study)
    assert reaped == [orphan.number]

    made = continue_interrupted(study, reaped)
    assert sorted(made) == [cut, reaped_before, orphan.number]
    assert no_ckpt not in made and real_error not in made and stuck not in made
    trials = {t.number: t for t in study.get_trials()}
    for old, new in made.items():
        assert trials[new].state == TrialState.WAITING
        assert trials[new].user_attrs["sweep.resume_dir"] == trials[old].user_attrs["sweep.run_dir"]
        assert trials[new].user_attrs["sweep.continues"] == old
    assert continue_interrupted(study, reaped) == {}  # already continued
    # the samplers take the continuations first, with the old params
    t = study.ask()
    assert t.number == min(made.values()) and t.suggest_float("x", 0.0, 1.0) == trials[cut].params["x"]
    s = study_summary(study)
    assert s["n_continued"] == 3 and s["states"]["FAIL"] == 3  # no_ckpt, real_error, stuck
    mine.release()
