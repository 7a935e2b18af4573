"""Sweeps: strict sweep definitions, sampling → overrides, the launcher with several workers + pruning +
resume, MLflow parent/child runs, and a worker killed mid-trial (CPU, the cpu_smoke sweep)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from dflash.config import ConfigError
from sweeps.space import (SWEEP_DIR, SweepError, build_pruner, build_sampler, check_against_config,
                          check_conflicts, format_value, load_sweep, merge_overrides, parse_sweep, suggest,
                          sweep_names)

ROOT = Path(__file__).resolve().parent.parent
optuna.logging.set_verbosity(optuna.logging.WARNING)


# --------------------------------------------------------------------------- definitions


def test_shipped_sweeps_validate():
    from sweeps.launch import main
    assert {"loss_variants", "noise_schedule", "buffer_settings", "cpu_smoke"} <= set(sweep_names())
    for name in sweep_names():
        s = load_sweep(name)
        assert s.space and s.objective.direction in ("maximize", "minimize")
        assert main([name, "--check"]) == {"check": "ok", "sweep": s.name}  # composes every group option
    assert load_sweep("loss_variants").objective.metric == "eval/tau_served"
    assert load_sweep(str(SWEEP_DIR / "cpu_smoke.yaml")).name == "cpu_smoke"  # by path too


GOOD = {"space": {"loss": {"type": "choice", "choices": ["hard_ce", "soft_kl"]},
                  "trainer.lr": {"type": "float", "low": "1e-4", "high": 1.0e-2, "log": True}}}


def _with(**edits):
    raw = json.loads(json.dumps(GOOD))
    for path, value in edits.items():
        node = raw
        *head, last = path.split("__")
        for h in head:
            node = node.setdefault(h, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return raw


@pytest.mark.parametrize("raw, match", [
    (_with(sampler={"type": "tpe", "sed": 1}), "sampler.sed"),
    (_with(objectve={"metric": "x"}), "objectve"),
    (_with(space__loss={"type": "choice", "choices": ["hard_ce", "nope"]}), r"space.loss.choices.*nope"),
    (_with(**{"space__trainer.lr": {"type": "float", "low": 1.0, "high": 0.1}}), r"space.trainer.lr.*low"),
    (_with(**{"space__trainer.lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}),
     r"space.trainer.lr.*log"),
    (_with(**{"space__trainer.lr": {"type": "float", "low": 0.1}}), r"space.trainer.lr needs low and high"),
    (_with(**{"space__trainer.lr": {"type": "float", "low": 0.1, "high": 1.0, "stepp": 2}}),
     "space.trainer.lr.stepp"),
    (_with(**{"space__buffer.min_ready": {"type": "int", "low": 2.5, "high": 9}}), r"space.buffer.min_ready.low"),
    (_with(**{"space__loss.temperature": {"type": "float", "low": 0.5, "high": 2, "when": {"noise": ["x"]}}}),
     r"space.loss.temperature.when.noise"),
    (_with(**{"space__loss.temperature": {"type": "float", "low": 0.5, "high": 2,
                                          "when": {"loss": ["lk"]}}}), r"space.loss.temperature.when.loss"),
    (_with(space__noise={"type": "float", "low": 0, "high": 1}), "config group"),
    (_with(space__run_dir={"type": "choice", "choices": ["a"]}), "run_dir"),
    (_with(fixed=["+loss=soft_kl"]), r"both fixed and searched \(space.loss\)"),
    (_with(fixed=["trainer.max_steps=5", "trainer.max_steps=6"]), "trainer.max_steps more than once"),
    (_with(pruner={"type": "hyperband", "reduction_factor": 1}), "pruner.reduction_factor"),
    (_with(pruner={"type": "threshold"}), "pruner.lower or pruner.upper"),
    (_with(pruner={"type": "median", "n_warmup_steps": -1}), "pruner.n_warmup_steps"),
    (_with(pruner={"type": "bogus"}), "pruner.type"),
    (_with(objective={"direction": "up"}), "objective.direction"),
    (_with(space=None), "space must be a non-empty mapping"),
])
def test_bad_sweep_names_the_key(raw, match):
    with pytest.raises(SweepError, match=match):
        parse_sweep(raw, where="t.yaml")
    assert issubclass(SweepError, ConfigError)  # the CLI exits 2 on it


def test_sweep_file_errors(tmp_path):
    with pytest.raises(SweepError, match="not found.*known sweeps"):
        load_sweep("no_such_sweep")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(_with(**{"space__trainer.lrr": {"type": "float", "low": 0.1, "high": 1.0}})))
    s = load_sweep(str(p))
    from experiments.config import compose_config
    from dflash.config import to_dict
    base = to_dict(compose_config([]))
    with pytest.raises(SweepError, match=r"space.trainer.lrr: no such key"):
        check_against_config(s, base)
    s2 = parse_sweep(_with(**{"space__trainer.max_steps": {"type": "float", "low": 1, "high": 9}}))
    with pytest.raises(SweepError, match=r"space.trainer.max_steps: float range on a int key"):
        check_against_config(s2, base)
    check_against_config(parse_sweep(GOOD), base)
    # sweep-level overrides edit the file for one launch
    s3 = load_sweep(str(p), ["sampler.seed=7", "pruner.type=none", "objective.metric=eval/tau_tree_64"])
    assert s3.sampler.options["seed"] == 7 and s3.pruner.type == "none"
    assert s3.objective.metric == "eval/tau_tree_64"
    with pytest.raises(SweepError, match="pruner.typo"):
        load_sweep(str(p), ["pruner.typo=1"])


def test_suggest_emits_group_and_key_overrides():
    s = parse_sweep({"space": {
        "loss": {"type": "choice", "choices": ["hard_ce", "soft_kl"]},
        "loss.temperature": {"type": "float", "low": 0.5, "high": 4.0, "log": True, "when": {"loss": "soft_kl"}},
        "buffer.min_ready": {"type": "int", "low": 2, "high": 64, "log": True},
        "trainer.lr": {"type": "choice", "choices": [1.0e-5, 0.01]}},
        "sampler": {"type": "random", "seed": 3}})
    study = optuna.create_study(sampler=build_sampler(s.sampler))
    seen = set()
    for _ in range(12):
        t = study.ask()
        ov, vals = suggest(t, s)
        study.tell(t, 0.0)
        assert ov[0] == f"+loss={vals['loss']}"
        assert ("loss.temperature" in vals) == (vals["loss"] == "soft_kl")  # `when`
        assert f"buffer.min_ready={vals['buffer.min_ready']}" in ov
        assert f"trainer.lr={format_value(vals['trainer.lr'])}" in ov
        seen.add(vals["loss"])
    assert seen == {"hard_ce", "soft_kl"}
    # trial-seeded random sampler: trial k draws the same values in any study / worker
    again = optuna.create_study(sampler=build_sampler(s.sampler))
    t0 = again.ask()
    assert suggest(t0, s)[1] == study.trials[0].params
    from experiments.config import compose_config
    cfg = compose_config(merge_overrides(["+loss=hard_ce", "trainer.lr=0.5"], suggest(again.ask(), s)[0]))
    assert cfg.trainer.lr in (1.0e-5, 0.01)
    assert format_value(1e-05) == "1e-05" and format_value("a b") == "'a b'" and format_value(True) == "true"


def test_overrides_merge_and_conflicts():
    assert merge_overrides(["+target=tiny_random_gpu", "trainer.max_steps=600"],
                           ["+target=qwen3_6_27b", "target.path=/m"]) == \
        ["trainer.max_steps=600", "+target=qwen3_6_27b", "target.path=/m"]
    s = load_sweep("loss_variants")
    with pytest.raises(SweepError, match="loss.temperature is searched"):
        check_conflicts(s, ["loss.temperature=2"])
    with pytest.raises(SweepError, match="run_dir"):
        check_conflicts(s, ["run_dir=/x"])
    for spec in ({"type": "median", "n_warmup_steps": 3}, {"type": "successive_halving", "min_resource": 2},
                 {"type": "none"}, {"type": "threshold", "upper": 1.0}):
        build_pruner(parse_sweep({**GOOD, "pruner": spec}).pruner)


def test_launch_args_errors():
    from sweeps.launch import main, parse_args
    a = parse_args(["cpu_smoke", "n_trials=3", "workers=2", "study=x", "sweep.sampler.seed=4", "+loss=lk",
                    "trainer.lr=0.1"])
    assert (a.n_trials, a.workers, a.study) == (3, 2, "x")
    assert a.sweep_overrides == ["sampler.seed=4"] and a.overrides == ["+loss=lk", "trainer.lr=0.1"]
    with pytest.raises(SweepError, match="workers must be >= 1"):
        parse_args(["cpu_smoke", "workers=0"])
    with pytest.raises(ConfigError, match="bogus_key"):  # a bad run-config override fails before any trial
        main(["loss_variants", "--check", "trainer.bogus_key=1"])
    r = subprocess.run([sys.executable, "-m", "sweeps.launch", "loss_variants", "loss=hard_ce"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "loss is searched" in r.stderr


# --------------------------------------------------------------------------- dead workers (unit)


def test_reap_stale_fails_trials_of_dead_workers(tmp_path):
    from sweeps.storage import Lease, lease_alive, make_storage, reap_stale

    storage = str(tmp_path / "s.journal")
    study = optuna.create_study(study_name="s", storage=make_storage(storage))
    mine = Lease(tmp_path / "leases")
    code = ("import sys; from sweeps.storage import Lease; l = Lease(sys.argv[1]); print(l.path)")
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path / "leases")], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()  # the process exited without releasing
    assert lease_alive(mine.path) and not lease_alive(dead)
    alive_t, dead_t, fresh_t = study.ask(), study.ask(), study.ask()
    for t, lease in ((alive_t, mine.attrs()), (dead_t, {**mine.attrs(), "sweep.lease": dead})):
        for k, v in lease.items():
            t.set_user_attr(k, v)
    assert reap_stale(study) == [dead_t.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {alive_t.number: TrialState.RUNNING, dead_t.number: TrialState.FAIL,
                      fresh_t.number: TrialState.RUNNING}  # untagged and young: being started
    mine.release()
    assert reap_stale(study) == [alive_t.number]


def test_pruning_evaluator_reports_and_prunes(tmp_path):
    from sweeps.support import EvalPruned, PruningEvaluator

    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.ThresholdPruner(upper=1.0))
    trial = study.ask()
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "train/loss": v}) for s, v in [(1, 0.5), (2, 0.7), (3, 2.0)]) + "\n")
    ev = PruningEvaluator(trial, "train/loss", tmp_path, base=lambda d, t, step, final: {"eval/x": 1.0})
    assert ev(None, None, 2, False) == {"eval/x": 1.0}  # value from metrics.jsonl at step <= 2
    assert ev.reports == [(2, 0.7)]
    assert ev(None, None, 3, True) == {"eval/x": 1.0}  # final: not reported
    with pytest.raises(EvalPruned) as e:
        ev(None, None, 3, False)
    assert isinstance(e.value, optuna.TrialPruned) and e.value.step == 3 and e.value.run_status == "FINISHED"
    # an eval/ objective is read, during training, from the subset evaluation's own name
    ev2 = PruningEvaluator(trial, "eval/x", tmp_path, base=lambda *a: {"eval/subset/x": 0.1})
    ev2(None, None, 4, False, logger=object())  # the trainer's logger argument is passed through
    assert ev2.reports == [(4, 0.1)]


# --------------------------------------------------------------------------- end to end (CPU)


@pytest.fixture(scope="module")
def eval_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("eval_cache")


def _argv(tmp, cache, *extra):
    return ["cpu_smoke", f"out={tmp / 'out'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            "tracking.experiment=sweeps", f"eval.cache_dir={cache}", *extra]


def _children(client, parent_id):
    exp = client.get_experiment_by_name("sweeps")
    return client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")


def test_sweep_two_workers_pruning_resume_and_mlflow(tmp_path, eval_cache):
    from dflash.tracking import analysis as A
    from sweeps.launch import main

    first = main(_argv(tmp_path, eval_cache, "n_trials=4", "workers=2"))
    assert first["n_trials"] == 4 and first["lost_workers"] == []
    # two workers: coding10's ground truth was made (and pinned under the study) once, before the trials; the
    # training prompts' (eval/tau_train of stored data) by the trials
    truth = tmp_path / "out" / "cpu_smoke" / "truth"
    made = json.loads((tmp_path / "out" / "cpu_smoke" / "write_ahead.json").read_text())
    pins = sorted(truth.glob("*.json"))
    assert made["eval/write_ahead_suites"] == 1 and len(pins) == 2
    # same storage + study: resumes (in this process: workers=1 runs here, no spawn)
    second = main(_argv(tmp_path, eval_cache, "n_trials=2", "workers=1"))
    assert second["n_before"] == 4 and second["n_trials"] == 6
    assert second["parent_run_id"] == first["parent_run_id"]

    study = optuna.load_study(study_name="cpu_smoke",
                              storage=optuna.storages.JournalStorage(
                                  optuna.storages.journal.JournalFileBackend(str(tmp_path / "out" / "cpu_smoke.journal"))))
    trials = study.get_trials()
    assert len(trials) == 6
    assert sorted(truth.glob("*.json")) == pins  # every trial evaluated on that pin
    for t in trials:
        assert yaml.safe_load(Path(t.user_attrs["sweep.run_dir"], "config.yaml").read_text())["eval"]["truth_dir"] \
            == str(truth)
    by_state = {s: [t for t in trials if t.state == s] for s in (TrialState.COMPLETE, TrialState.PRUNED)}
    # cpu_smoke's seeded draws: lr=1e-5 for trials 1 and 2 -> loss stays > 5.5 -> pruned at the step-4 report
    assert sorted(t.number for t in by_state[TrialState.PRUNED]) == [1, 2]
    assert len(by_state[TrialState.COMPLETE]) == 4
    assert len(list((tmp_path / "out" / "cpu_smoke" / "logs").glob("*-launch1-w*.log"))) == 2  # 2 workers

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sweeps")
    parents = client.search_runs([exp.experiment_id], "tags.`dflash.kind` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.run_id == first["parent_run_id"]
    parent = parents[0]
    children = _children(client, parent.info.run_id)
    assert len(children) == 6
    runs = {int(r.data.tags["optuna.trial_number"]): r for r in children}
    assert sorted(runs) == list(range(6))
    for t in trials:
        r = runs[t.number]
        assert r.info.run_id == t.user_attrs["mlflow.run_id"]
        assert r.data.tags["optuna.state"] == t.state.name and r.data.tags["optuna.study_name"] == "cpu_smoke"
        assert r.data.params["loss.name"] == t.params["loss"]  # the child IS the training run
        assert float(r.data.params["trainer.lr"]) == t.params["trainer.lr"]
        if t.state == TrialState.PRUNED:  # stopped by the pruner, not killed: FINISHED, and it says pruned
            assert r.info.status == "FINISHED" and r.data.tags["optuna.pruned_step"] == "4"
            assert r.data.tags["mlflow.note.content"].startswith("**Pruned** at step 4: ")
            assert "train/loss" in r.data.metrics and "eval/tau_served" not in r.data.metrics
        else:
            assert r.info.status == "FINISHED" and float(r.data.tags["optuna.value"]) == pytest.approx(t.value)
            assert r.data.metrics["train/loss"] == pytest.approx(t.value)
            assert {"eval/tau_served", "eval/t0/acc_pos01"} <= set(r.data.metrics)
    best = study.best_trial
    pt = parent.data.tags
    assert parent.info.status == "FINISHED"
    assert pt["sweep.best_trial"] == str(best.number) and float(pt["sweep.best_value"]) == pytest.approx(best.value)
    assert json.loads(pt["sweep.best_params"]) == best.params
    assert pt["sweep.best_run_id"] == runs[best.number].info.run_id
    assert Path(pt["sweep.best_checkpoint"], "model.safetensors").is_file()  # ready for experiments.promote
    assert json.loads(Path(pt["sweep.best_run_dir"], "mlflow_run.json").read_text())["run_id"] == \
        pt["sweep.best_run_id"]
    assert pt["sweep.n_trials"] == "6" and pt["sweep.n_pruned"] == "2" and pt["optuna.direction"] == "minimize"
    assert parent.data.params["objective.metric"] == "train/loss" and parent.data.params["pruner.type"] == "threshold"
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "sweep.yaml" in arts
    sweep_yaml = yaml.safe_load(Path(client.download_artifacts(parent.info.run_id, "sweep.yaml", str(tmp_path)))
                                .read_text())
    assert parse_sweep(sweep_yaml).to_dict() == load_sweep("cpu_smoke").to_dict()
    assert len(client.get_metric_history(parent.info.run_id, "sweep/best_value")) >= 2
    assert study.metric_names == ["train/loss"]  # optuna-dashboard names the axis, not "Objective 0"
    for t in trials:  # a trial's run is named like its folder, which says what it is
        name = runs[t.number].info.run_name
        assert name == Path(t.user_attrs["sweep.run_dir"]).name and name.startswith(f"trial_{t.number:05d}-")
        assert "python -m experiments.run" in runs[t.number].data.tags["mlflow.note.content"]
        folder_tags = json.loads((Path(t.user_attrs["sweep.run_dir"]) / "tags.json").read_text())
        assert folder_tags["mlflow.note.content"] == runs[t.number].data.tags["mlflow.note.content"]  # not the spawn
    assert f"/runs/{pt['sweep.best_run_id']}?workflowType=machine_learning)" in pt["mlflow.note.content"]
    from dflash.tracking.run_info import git_sha
    if git_sha() != "unknown":  # the code the sweep ran, as every trial carries it
        assert pt["mlflow.source.git.commit"] == git_sha(full=True) and pt["git_sha"] == git_sha()

    # the study as one table, from the store (sweeps/sweep_report.py: its arithmetic in tests/test_sweep_report.py)
    text = main(["cpu_smoke", "report", f"out={tmp_path / 'out'}"])["report"]
    assert "6 trials, 4 complete" in text and text.count("| PRUNED |") == 2 and text.count("| COMPLETE |") == 4
    col = next(line for line in text.splitlines() if line.startswith("| trial")).split(" | ").index("train/loss")
    for t in trials:  # the objective column: each trial's figure, a pruned one's at its step (never blank)
        row = next(line for line in text.splitlines() if line.startswith(f"| {t.number} |")).split(" | ")
        assert row[col] == (f"{t.value:.4g}" if t.state == TrialState.COMPLETE
                            else f"{t.intermediate_values[4]:.4g} at step 4"), row
    assert "- no trial went through the promotion gate" in text

    # the notebooks' view of the study
    df = A.load_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "sweeps", study="cpu_smoke")
    assert len(df) == 6 and set(df.loc[df["trial_state"] == "PRUNED", "trial"]) == {1, 2}
    assert set(df.loc[df["status"] == "PRUNED", "trial"]) == {1, 2}  # the analyses' "finished" leaves them out
    A.plot_study(df, "train/loss", "minimize").savefig(tmp_path / "study.png")


def test_killed_worker_leaves_the_study_usable(tmp_path, eval_cache):
    from sweeps.launch import main

    # Longer trials so one can be killed mid-run; trial 0 (lr=1e-2) is not pruned.
    argv = _argv(tmp_path, eval_cache, "n_trials=2", "workers=2", "trainer.max_steps=40",
                 "trainer.eval_every=10", "trainer.checkpoint_every=20")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sweeps.launch", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    journal = tmp_path / "out" / "cpu_smoke.journal"
    victim, deadline = None, time.time() + 240
    try:
        while victim is None and time.time() < deadline and proc.poll() is None:
            time.sleep(0.3)
            if not journal.exists():
                continue
            study = optuna.load_study(study_name="cpu_smoke", storage=optuna.storages.JournalStorage(
                optuna.storages.journal.JournalFileBackend(str(journal))))
            for t in study.get_trials(states=(TrialState.RUNNING,)):
                m = Path(t.user_attrs.get("sweep.run_dir", "/nonexistent")) / "metrics.jsonl"
                if t.number == 0 and m.is_file() and len(m.read_text().splitlines()) >= 3:
                    victim = t
        assert victim is not None, "trial 0 never got going"
        os.kill(int(victim.user_attrs["sweep.pid"]), signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out  # finished, reporting the lost worker
    assert "exited with -9" in out and "marked FAIL" in out

    study = optuna.load_study(study_name="cpu_smoke", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))))
    states = {t.number: t.state for t in study.get_trials()}
    assert states[0] == TrialState.FAIL and states[1] in (TrialState.COMPLETE, TrialState.PRUNED)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    killed = client.get_run(victim.user_attrs["mlflow.run_id"])
    assert killed.info.status == "FAILED" and killed.data.tags["optuna.state"] == "FAIL"
    assert "died mid-trial" in killed.data.tags["optuna.fail_reason"]

    # a later launch (in this process) completes new trials on the same study
    later = main(_argv(tmp_path, eval_cache, "n_trials=1", "workers=1"))
    assert later["n_trials"] == 3 and later["n_new"] == 1
    t2 = optuna.load_study(study_name="cpu_smoke", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal)))).trials[2]
    assert t2.state == TrialState.PRUNED  # cpu_smoke trial 2: lr=1e-5
    parent = later["parent_run_id"]
    assert len(_children(client, parent)) == 3


def test_trial_end_callback_never_kills_the_worker(capsys):
    import io

    from sweeps.objective import TrialEnd

    study = optuna.create_study()
    for outcome in ("fail", "prune", "ok"):
        t = study.ask()
        if outcome == "fail":
            t.set_user_attr("sweep.error", "RuntimeError: boom")
            study.tell(t, state=TrialState.FAIL)
        elif outcome == "prune":
            t.report(1.0, 3)
            study.tell(t, state=TrialState.PRUNED)
        else:
            study.tell(t, 0.5)
    console = io.StringIO()
    end = TrialEnd(None, None, 0, console)
    for ft in study.get_trials():
        end(study, ft)
    out = console.getvalue()
    assert "trial 0 FAIL RuntimeError: boom" in out and "trial 1 PRUNED pruned at step 3" in out
    assert "trial 2 COMPLETE value=0.5" in out and end.consecutive_failures == 0


def test_rdb_storage(tmp_path, eval_cache):
    """An RDB URL (here sqlite; postgresql://… alike) holds the study, with Optuna's heartbeat on."""
    from sweeps.launch import main
    from sweeps.storage import make_storage

    url = f"sqlite:///{tmp_path / 'db' / 'optuna.db'}"  # the folder is created
    res = main(_argv(tmp_path, eval_cache, "n_trials=1", "workers=1", f"storage={url}", "study=rdb"))
    assert res["storage"] == url and res["n_trials"] == 1
    storage = make_storage(url)
    assert storage.get_heartbeat_interval() > 0
    study = optuna.load_study(study_name="rdb", storage=storage)
    assert study.trials[0].state == TrialState.COMPLETE  # trial 0 of cpu_smoke: lr=1e-2
    assert study.user_attrs["mlflow.parent_run_id"] == res["parent_run_id"]


def test_cpu_smoke_keeps_the_fast_overrides():
    from sweeps.space import override_key
    from tests.conftest import FAST

    fixed = {override_key(o): o for o in load_sweep("cpu_smoke").fixed}
    deliberate = {"buffer.min_ready": "buffer.min_ready=4",  # the deterministic buffer pulls at full depth (4)
                  "eval": None}  # the smoke sweep evaluates (eval.subset=1): its children carry eval/* metrics
    for o in FAST:
        assert fixed.get(override_key(o)) == deliberate.get(override_key(o), o), o


def _tasks(folder: Path, sums: list[int], truth: str = "gt-A") -> str:
    """A trial's run folder with an objective task table (20 rounds per prompt, the given τ sums)."""
    (folder / "eval").mkdir(parents=True)
    rows = [{"task": f"p{i}", "rounds": 20, "tau_sum_vanilla": s} for i, s in enumerate(sums)]
    (folder / "eval" / "tasks.json").write_text(json.dumps({"tasks": rows, "info": {"ground_truth_key": truth}}))
    return str(folder)


def test_parent_names_the_trials_tied_with_the_best(tmp_path):
    """Three trials that score exactly the same and a clearly worse one: the parent names the best trial, the two
    tied with it (their paired Δ interval contains 0) and the best trial's pooled CI; the worse one is no tie."""
    import random

    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    from sweeps.objective import ATTR_RUN_DIR, ATTR_RUN_ID, update_parent
    from sweeps.support import SweepTracker
    tracker = SweepTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "ties")
    parent = tracker.ensure_parent("t", None, {"sweep.objective": "eval/tau_vanilla"}, {})
    rng = random.Random(0)
    same = [rng.randint(25, 45) for _ in range(30)]
    worse = [s - 10 for s in same]
    study = optuna.create_study(direction="maximize")
    lr = FloatDistribution(1e-5, 1e-3)
    for i, sums in enumerate([same, same, same, worse]):
        study.add_trial(create_trial(
            params={"trainer.lr": 1e-4 * (i + 1)}, distributions={"trainer.lr": lr},
            value=sum(sums) / (20 * len(sums)),
            user_attrs={ATTR_RUN_ID: tracker.create_child(parent, "t", i, run_name=f"trial_{i:05d}"),
                        ATTR_RUN_DIR: _tasks(tmp_path / f"trial_{i:05d}", sums)}))
    summary = update_parent(study, tracker, parent)
    ties = summary["best"]["ties"]
    assert summary["best"]["number"] == 0 and [t["number"] for t in ties["tied"]] == [1, 2]
    lo, hi = ties["ci"]
    assert lo < summary["best"]["value"] < hi
    tags = tracker.tags_of(parent)
    assert tags["sweep.tied_with_best"] == "1,2" and json.loads(tags["sweep.best_ci"]) == pytest.approx([lo, hi], abs=1e-6)
    note = tags["mlflow.note.content"]
    assert "**Best: trial 0, tied with trial(s) 1 (" in note and "2 (" in note and "contains 0" in note
    assert f"[95% CI {lo:.4f}, {hi:.4f}]" in note and "3 (" not in note.split("params:")[0]


def test_parent_shows_the_current_best_trial_only(tmp_path):
    """A new best trial with fewer params removes the previous best's `best.*` keys; the parent's Description
    links the best run."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import create_trial

    from sweeps.objective import ATTR_RUN_DIR, ATTR_RUN_ID, update_parent
    from sweeps.support import SweepTracker
    tracker = SweepTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "stale")
    parent = tracker.ensure_parent("s", None, {"sweep.objective": "eval/tau_vanilla"}, {})
    kids = [tracker.create_child(parent, "s", i, run_name=f"trial_{i:05d}") for i in range(2)]
    study = optuna.create_study(direction="maximize")
    loss = CategoricalDistribution(["hard_ce", "soft_kl_streak"])
    study.add_trial(create_trial(
        params={"loss": "soft_kl_streak", "loss.temperature": 2.0, "loss.alpha": 1.0}, value=1.02,
        distributions={"loss": loss, "loss.temperature": FloatDistribution(1, 3),
                       "loss.alpha": FloatDistribution(0, 2)},
        user_attrs={ATTR_RUN_ID: kids[0], ATTR_RUN_DIR: str(tmp_path / "trial_00000-soft_kl_streak")}))
    update_parent(study, tracker, parent)
    assert tracker.tags_of(parent)["best.loss.temperature"] == "2.0"
    study.add_trial(create_trial(
        params={"loss": "hard_ce"}, distributions={"loss": loss}, value=1.07,
        user_attrs={ATTR_RUN_ID: kids[1], ATTR_RUN_DIR: str(tmp_path / "trial_00001-hard_ce")}))
    update_parent(study, tracker, parent)
    tags = tracker.tags_of(parent)
    assert {k: v for k, v in tags.items() if k.startswith("best.")} == {"best.loss": "hard_ce"}
    assert tags["sweep.best_run_id"] == kids[1] and tags["sweep.best_run_name"] == "trial_00001-hard_ce"
    note = tags["mlflow.note.content"]
    assert f"[trial_00001-hard_ce](#/experiments/{tracker.experiment_id}/runs/{kids[1]}?workflowType=machine_learning)" \
        in note
    assert "eval/tau_vanilla = 1.0700" in note and "soft_kl_streak" not in note
