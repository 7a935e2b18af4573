"""`python -m experiments.eval` on a run directory and on a bare serving folder (MLflow in a temp store)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml

from dflash.config import RunConfig, to_dict
from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.serving.export import save_drafter
from dflash.target.model import TargetConfig, read_target_info, resolve_layer_ids, resolve_mask_token
from dflash.tracking.loggers import MLflowLogger, TrackingConfig

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("hydra")
from mlflow.tracking import MlflowClient  # noqa: E402

from experiments import eval as eval_cli  # noqa: E402



@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalcli")
    (d / "suite.json").write_text(json.dumps([{"name": "sq", "prompt": "def sq(x):\n"},
                                              {"name": "inc", "prompt": "def inc(x):\n    return"}]))
    return d


def _drafter_folder(folder, tcfg: TargetConfig):
    info = read_target_info(tcfg)
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig(block_size=4), info.hidden_size, info.num_layers,
                      resolve_mask_token(tcfg), resolve_layer_ids(tcfg, info))
    save_drafter(d, folder)


def _eval_overrides(workdir) -> list[str]:
    return [f"eval.suite={workdir / 'suite.json'}", "eval.max_new_tokens=6", "eval.tree_budgets=[2,4]",
            f"eval.cache_dir={workdir / 'gt'}"]


def _tracked_run(workdir, name):
    """A finished 'training' run: config.yaml, final/, an MLflow run and its mlflow_run.json."""
    store = f"sqlite:///{workdir}/mlflow.db"
    run_dir = workdir / name
    cfg = RunConfig(run_dir=str(run_dir), target=TargetConfig(device="cpu"),
                    tracking=TrackingConfig(tracking_uri=store, experiment="evalcli", console=False))
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    _drafter_folder(run_dir / "final", cfg.target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train = MLflowLogger(cfg.tracking, tags={"dflash.kind": "train"})
        train.close("FINISHED")
    (run_dir / "mlflow_run.json").write_text(json.dumps({"tracking_uri": store, "experiment": "evalcli",
                                                         "run_id": train.run_id, "run_name": name}))
    return store, run_dir, train


def test_run_dir_logs_a_linked_eval_run(workdir):
    store, run_dir, train = _tracked_run(workdir, "run")
    metrics = eval_cli.main([str(run_dir), *_eval_overrides(workdir)])
    assert {"eval/t0/tau_vanilla", "eval/t0/tau_tree_2", "eval/t0/tau_tree_4", "eval/t0/acc_pos01",
            "eval/tau_served"} <= set(metrics)
    assert "eval/t0/task/sq/tau_vanilla" in metrics and metrics["eval/t0/num_tasks"] == 2

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("evalcli")
    evals = client.search_runs([exp.experiment_id],
                               f"tags.`dflash.kind` = 'eval' and tags.`dflash.evaluated_run` = '{train.run_id}'")
    assert len(evals) == 1
    ev = evals[0]
    assert ev.data.tags["dflash.evaluated_run"] == train.run_id and ev.info.status == "FINISHED"
    assert ev.data.metrics["eval/tau_served"] == pytest.approx(metrics["eval/tau_served"])
    assert ev.data.params["eval.max_new_tokens"] == "6"
    arts = {a.path for a in client.list_artifacts(ev.info.run_id, "eval/served")}
    assert arts == {"eval/served/tasks.json", "eval/served/tasks.md", "eval/served/acceptance_per_position.png"}
    trained = client.get_run(train.run_id)
    assert trained.info.status == "FINISHED" and trained.data.tags["dflash.last_eval_run"] == ev.info.run_id
    assert not any(k.startswith("eval/") for k in trained.data.metrics)  # the training run is left as it was
    outs = list((run_dir / "eval").iterdir())
    assert len(outs) == 1 and (outs[0] / "report" / "served" / "tasks.md").is_file()
    assert json.loads((outs[0] / "mlflow_run.json").read_text())["run_id"] == ev.info.run_id
    assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == train.run_id  # untouched


def test_into_run_makes_the_training_run_carry_the_eval(workdir):
    store, run_dir, train = _tracked_run(workdir, "run2")
    train_id = train.run_id
    metrics = eval_cli.main([str(run_dir), *_eval_overrides(workdir), "--into-run"])
    client = MlflowClient(store)
    trained = client.get_run(train_id)
    assert trained.info.status == "FINISHED"
    assert trained.data.metrics["eval/tau_served"] == pytest.approx(metrics["eval/tau_served"])
    hist = client.get_metric_history(train_id, "eval/tau_served")
    assert [h.step for h in hist] == [RunConfig().trainer.max_steps]
    arts = {a.path for a in client.list_artifacts(train_id, "eval/served")}
    assert "eval/served/tasks.json" in arts and "eval/served/acceptance_per_position.png" in arts


def test_bare_serving_folder_takes_the_target_from_overrides(workdir):
    folder = workdir / "published"
    _drafter_folder(folder, TargetConfig())
    out = workdir / "out"
    metrics = eval_cli.main([str(folder), "+target=tiny_random", "tracking.enabled=false", "target.device=cpu",
                             *_eval_overrides(workdir), "eval.real_decode=true", f"--out={out}"])
    assert metrics["eval/t0/real/lossless"] == 1.0 and metrics["eval/t0/real/tau_matches_sim"] == 1.0
    assert (out / "report" / "served" / "tasks.json").is_file() and (out / "metrics.jsonl").is_file()
    with pytest.raises(eval_cli.ConfigError, match="--into-run"):
        eval_cli.main([str(folder), "tracking.enabled=false", "--into-run"])


def test_the_real_loop_at_the_sampled_setting_is_reported_beside_the_simulated_tau(workdir, capsys):
    """`eval.real_decode=true` at T=1 (the reference target's served setting): the real loop's τ on its own samples,
    with its CI and whether it lies inside the simulated τ's, in the metrics, the console table and the report. It
    once ran the whole evaluation and then failed printing the table (it looked for the greedy loop's lossless
    column)."""
    folder = workdir / "published"
    _drafter_folder(folder, TargetConfig())
    out = workdir / "out"
    metrics = eval_cli.main([str(folder), "+target=tiny_random", "tracking.enabled=false", "target.device=cpu",
                             *_eval_overrides(workdir), "eval.real_decode=true", "eval.sampling.temperature=1.0",
                             "eval.sampling.top_p=1.0", "eval.sampling.top_k=0", "eval.bootstrap=200",
                             f"--out={out}"])
    assert metrics["eval/t1/argmax/real/tau"] >= 1.0 and metrics["eval/t1/argmax/real/tau_in_sim_ci"] in (0.0, 1.0)
    assert metrics["eval/t1/argmax/real/tau_ci_low"] <= metrics["eval/t1/argmax/real/tau"] <= metrics["eval/t1/argmax/real/tau_ci_high"]
    assert metrics["eval/t1/argmax/real/tok_s"] > 0 and not any(k.startswith("eval/t0/real/") for k in metrics)  # served only
    printed = capsys.readouterr().out
    assert "τ real (own samples)" in printed and "the real loop's τ" in printed and "inside the simulated" in printed
    rows = json.loads((out / "report" / "served" / "tasks.json").read_text())["tasks"]
    assert all(r["real_tau"] >= 1.0 and "lossless" not in r for r in rows)


def test_run_without_final_uses_its_latest_checkpoint(workdir):
    from dflash.training.checkpoint import save_checkpoint
    run_dir = workdir / "crashed"
    cfg = RunConfig(run_dir=str(run_dir), target=TargetConfig(device="cpu"),
                    drafter=DrafterConfig(block_size=3), tracking=TrackingConfig(enabled=False, console=False))
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    info = read_target_info(cfg.target)
    d = build_drafter(cfg.drafter, info.hidden_size, info.num_layers, resolve_mask_token(cfg.target),
                      resolve_layer_ids(cfg.target, info))
    save_checkpoint(run_dir / "checkpoints", 7, {"step": 7, "drafter": d.state_dict(), "config": to_dict(cfg)})
    metrics = eval_cli.main([str(run_dir), *_eval_overrides(workdir)])
    # block size 3: positions 1..2, each logged only when some round reached it (position 1 always is)
    assert "eval/t0/acc_pos01" in metrics
    assert set(k for k in metrics if k.startswith("eval/t0/acc_pos")) <= {"eval/t0/acc_pos01", "eval/t0/acc_pos02"}
    lines = (next((run_dir / "eval").iterdir()) / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 7


def test_bad_path_is_a_config_error(workdir):
    from dflash.config import ConfigError
    with pytest.raises(ConfigError, match="not a run directory"):
        eval_cli.main([str(workdir / "nope")])
