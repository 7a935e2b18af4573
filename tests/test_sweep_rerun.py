"""`rerun=[N]`: a trial trained again from scratch with trial N's params, for when N's drafter went with the GPU
machine that trained it (a fresh machine gets the committed store without weights; the recipe sweep's trial 30).
The promotion gate then reads the rerun (`sweeps.objective.gate_trial`). CPU, the cpu_smoke sweep."""
import shutil
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from sweeps.space import SweepError

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _argv(tmp, *extra):
    return ["cpu_smoke", f"out={tmp / 'out'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            "tracking.experiment=sweeps", f"eval.cache_dir={tmp / 'eval_cache'}", "workers=1", *extra]


def _study(tmp):
    from sweeps.storage import make_storage
    return optuna.load_study(study_name="cpu_smoke", storage=make_storage(str(tmp / "out" / "cpu_smoke.journal")))


def test_a_rerun_trains_the_trial_again_and_the_gate_reads_it(tmp_path):
    from sweeps.launch import main
    from sweeps.objective import gate_trial
    from sweeps.sweep_report import render
    from sweeps.space import load_sweep

    main(_argv(tmp_path, "n_trials=1"))
    [first] = _study(tmp_path).get_trials()
    assert first.state == TrialState.COMPLETE
    first_dir = Path(first.user_attrs["sweep.run_dir"])
    assert gate_trial(_study(tmp_path))["number"] == 0  # its own drafter is here
    shutil.rmtree(first_dir / "final")  # the machine went back: the committed store has no weights
    assert gate_trial(_study(tmp_path)) is None
    with pytest.raises(SweepError, match=r"rerun: trial\(s\) \[7\] .* \(trials with params: \[0\]\)"):
        main(_argv(tmp_path, "n_trials=1", "rerun=[7]"))
    assert len(_study(tmp_path).get_trials()) == 1  # refused before anything was enqueued or trained
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sweeps").experiment_id
    assert len(client.search_runs([exp])) == 2  # the first launch's parent and trial: no parent left RUNNING

    main(_argv(tmp_path, "n_trials=1", "rerun=[0]"))
    study = _study(tmp_path)
    first, again = study.get_trials()  # the rerun is the launch's one trial: nothing new sampled
    assert again.state == TrialState.COMPLETE and again.params == first.params
    assert again.user_attrs["sweep.rerun_of"] == 0 and "sweep.continues" not in again.user_attrs
    again_dir = Path(again.user_attrs["sweep.run_dir"])
    assert again_dir != first_dir and (again_dir / "final").is_dir()
    # the same params, seed and data on the CPU: the same drafter, so the same τ
    assert again.value == pytest.approx(first.value, abs=1e-9)
    g = gate_trial(study)
    assert g["number"] == 1 and g["run_dir"] == str(again_dir) and g["best"] == study.best_trial.number
    tags = client.get_run(again.user_attrs["mlflow.run_id"]).data.tags
    assert tags["sweep.rerun_of"] == "0"
    report = render(study, load_sweep("cpu_smoke"), tmp_path / "out")
    assert "| 1 (rerun of 0) | COMPLETE |" in report


def test_rerun_counts_against_n_trials():
    from sweeps.launch import parse_args
    assert parse_args(["cpu_smoke", "rerun=[3]", "n_trials=1"]).rerun == [3]
    with pytest.raises(SweepError, match=r"rerun=\[3, 4\]: 2 trial\(s\) .* more than n_trials=1"):
        parse_args(["cpu_smoke", "rerun=[3,4]", "n_trials=1"])
