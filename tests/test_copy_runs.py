"""`dflash.tracking.copy_runs`: runs of one sqlite MLflow store copied into another with their ids, metric
histories, params, tags and artifacts, read back through MLflow itself; refusals leave the destination as it was."""
from pathlib import Path

import pytest
from mlflow.entities import RunStatus
from mlflow.tracking import MlflowClient

from dflash.tracking.copy_runs import CopyError, copy_runs, main
from dflash.tracking.run_info import get_or_create_experiment


def _client(folder: Path) -> tuple[MlflowClient, str]:
    folder.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    return MlflowClient(uri), uri


def _source(folder: Path) -> dict:
    """A campaign store as a job in the wrong store left it: one finished cell with a metric history, params,
    tags and an eval artifact; one killed cell."""
    c, uri = _client(folder)
    eid = get_or_create_experiment(c, "dflash-campaign-64m", uri)
    done = c.create_run(eid, run_name="s0-loss-dpace-seed1").info.run_id
    for step in range(0, 300, 10):
        c.log_metric(done, "train/loss", 6.0 - step / 100, step=step)
    c.log_metric(done, "eval/tau_vanilla", 3.835, step=300)
    c.log_param(done, "loss", "dpace")
    c.set_tag(done, "dflash.run_dir", "campaign_out/reference_64m/runs/s0-loss-dpace-seed1")
    art = folder / "tasks.json"
    art.write_text('{"tasks": []}')
    c.log_artifact(done, str(art), "eval")
    art.unlink()
    c.set_terminated(done, "FINISHED")
    cut = c.create_run(eid, run_name="s0-loss-lk-seed1").info.run_id
    c.log_metric(cut, "train/loss", 5.0, step=10)
    c.set_terminated(cut, "KILLED")
    return {"done": done, "cut": cut, "db": folder / "mlflow.db"}


def _destination(folder: Path) -> dict:
    """The committed store: other experiments first, so the campaign's experiment id differs from the source's."""
    c, uri = _client(folder)
    get_or_create_experiment(c, "dflash-ablation", uri)
    eid = get_or_create_experiment(c, "dflash-campaign-64m", uri)
    seed0 = c.create_run(eid, run_name="s0-loss-dpace-seed0").info.run_id
    c.set_terminated(seed0, "FINISHED")
    return {"eid": eid, "seed0": seed0, "db": folder / "mlflow.db", "uri": uri}


def test_finished_runs_join_the_store_with_their_history_and_artifacts(tmp_path):
    src, dst = _source(tmp_path / "wrong"), _destination(tmp_path / "committed")
    assert copy_runs(src["db"], dst["db"], finished=True) == [src["done"]]
    c = MlflowClient(dst["uri"])
    run = c.get_run(src["done"])  # the same id: the run folder's mlflow_run.json still names it
    assert run.info.experiment_id == dst["eid"] and run.info.status == RunStatus.to_string(RunStatus.FINISHED)
    hist = c.get_metric_history(src["done"], "train/loss")
    assert [(m.step, m.value) for m in hist] == [(s, 6.0 - s / 100) for s in range(0, 300, 10)]
    assert run.data.metrics["eval/tau_vanilla"] == 3.835 and run.data.params == {"loss": "dpace"}
    assert run.data.tags["dflash.run_dir"].endswith("s0-loss-dpace-seed1") and run.info.run_name == "s0-loss-dpace-seed1"
    assert run.info.artifact_uri == f"{(tmp_path / 'committed' / 'mlartifacts').as_uri()}/{src['done']}/artifacts"
    assert [a.path for a in c.list_artifacts(src["done"], "eval")] == ["eval/tasks.json"]
    local = c.download_artifacts(src["done"], "eval/tasks.json", str(tmp_path))
    assert Path(local).read_text() == '{"tasks": []}'
    names = {r.info.run_name for r in c.search_runs([dst["eid"]])}
    assert names == {"s0-loss-dpace-seed0", "s0-loss-dpace-seed1"}  # the killed cell stayed out
    assert not list((tmp_path / "committed").glob("*.partial"))


def test_an_experiment_the_destination_lacks_is_made_there(tmp_path):
    src = _source(tmp_path / "wrong")
    c, uri = _client(tmp_path / "other")
    get_or_create_experiment(c, "dflash-sweep", uri)
    assert sorted(copy_runs(src["db"], tmp_path / "other" / "mlflow.db")) == sorted([src["done"], src["cut"]])
    exp = c.get_experiment_by_name("dflash-campaign-64m")
    assert exp is not None and exp.artifact_location == "mlartifacts"
    assert {r.info.run_id for r in c.search_runs([exp.experiment_id])} == {src["done"], src["cut"]}
    assert (tmp_path / "other" / "mlartifacts" / src["done"] / "artifacts" / "eval" / "tasks.json").is_file()


def test_refusals_leave_the_destination_as_it_was(tmp_path):
    src, dst = _source(tmp_path / "wrong"), _destination(tmp_path / "committed")
    copy_runs(src["db"], dst["db"], [src["done"]])
    before = dst["db"].read_bytes()
    with pytest.raises(CopyError, match=f"{src['done']}.*already in the destination"):
        copy_runs(src["db"], dst["db"])
    with pytest.raises(CopyError, match="runs \\['nope'\\] are not in the source store"):
        copy_runs(src["db"], dst["db"], ["nope"])
    c = MlflowClient(f"sqlite:///{src['db']}")
    c.create_registered_model("dflash-drafter")
    c.create_model_version("dflash-drafter", "mlartifacts/x", run_id=src["cut"])
    with pytest.raises(CopyError, match=f"{src['cut']}.*rows in model_versions"):
        copy_runs(src["db"], dst["db"], [src["cut"]])
    assert dst["db"].read_bytes() == before and not list((tmp_path / "committed").glob("*.partial"))
    assert not (tmp_path / "committed" / "mlartifacts" / src["cut"]).exists()
    assert main([str(src["db"]), str(dst["db"]), src["cut"]]) == 2
    assert main([str(tmp_path / "absent.db"), str(dst["db"])]) == 2


def test_artifacts_kept_elsewhere_are_refused(tmp_path):
    """A destination experiment whose artifact location is not the mlartifacts/ beside its database: the rows would
    point where the copied artifacts are not."""
    import sqlite3
    src, dst = _source(tmp_path / "wrong"), _destination(tmp_path / "committed")
    con = sqlite3.connect(dst["db"])
    con.execute("UPDATE experiments SET artifact_location='/somewhere/else/mlartifacts' WHERE experiment_id=?",
                (dst["eid"],))
    con.commit()
    con.close()
    before = dst["db"].read_bytes()
    with pytest.raises(CopyError, match="keeps artifacts at '/somewhere/else/mlartifacts'"):
        copy_runs(src["db"], dst["db"], [src["done"]])
    assert dst["db"].read_bytes() == before and not (tmp_path / "committed" / "mlartifacts" / src["done"]).exists()
