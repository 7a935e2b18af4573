"""Tests for dflash.tracking.loggers / dflash.tracking.sysmetrics against a real MLflow sqlite store (CPU)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dflash.tracking.sysmetrics import system_metrics
from dflash.tracking.loggers import (ConsoleLogger, JsonlLogger, Logger, MLflowLogger, MultiLogger, TrackingConfig,
                                     build_loggers)
from dflash.tracking.run_info import TRUNCATION_MARKER, flatten_config, git_sha

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the module (schema migration is the slow part)."""
    d = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{d}/mlflow.db"


def _disabled_warnings(rec) -> list:
    return [w for w in rec if issubclass(w.category, RuntimeWarning) and "tracking disabled" in str(w.message)]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- MLflow


def test_mlflow_run_lifecycle_and_resume(store, tmp_path):
    cfg = TrackingConfig(tracking_uri=store, experiment="t-lifecycle", run_name="r1", console=False)
    params = {f"p{i:03d}": i for i in range(150)}  # > 100 -> several batches
    params["long"] = "x" * 7000  # > 6000 chars -> truncated
    params["nested"] = {"a": {"b": [1, 2]}, "c": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "tracking disabled" allowed
        lg = MLflowLogger(cfg, params=params, tags={"purpose": "test", "weird key!": "v"})
        assert lg.healthy and lg.run_id
        # 1500 metrics in one call -> two log_batch chunks
        big = {f"sys/m{i}": float(i) for i in range(1500)}
        for step in (0, 10, 20):
            lg.log({"train/loss": 3.0 - step / 10, "train/acc": step / 100, **big}, step)
        lg.log({"eval/acc": 0.5}, 20)
        art = tmp_path / "notes.txt"
        art.write_text("hello")
        lg.log_artifact(art)
        lg.log_text("some text", "texts/sample.txt")
        lg.log_dict({"a": 1, "b": [1, 2]}, "cfg/config.json")
        lg.close()
    assert lg.healthy

    c = MlflowClient(store)
    run = c.get_run(lg.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "r1"
    exp = c.get_experiment(run.info.experiment_id)
    assert exp.name == "t-lifecycle"
    assert exp.artifact_location.endswith("mlartifacts")  # next to the db, not in cwd
    p = run.data.params
    assert len([k for k in p if k.startswith("p")]) == 150
    assert p["p042"] == "42"
    assert len(p["long"]) == 6000 and p["long"].endswith(TRUNCATION_MARKER)
    assert p["nested.a.b"] == "[1, 2]" and p["nested.c"] == "None"
    assert run.data.tags["purpose"] == "test"
    assert run.data.tags["weird key_"] == "v"  # sanitized key
    hist = c.get_metric_history(lg.run_id, "train/loss")
    assert [(m.step, m.value) for m in hist] == [(0, 3.0), (10, 2.0), (20, 1.0)]
    assert [m.step for m in c.get_metric_history(lg.run_id, "sys/m1499")] == [0, 10, 20]
    assert run.data.metrics["eval/acc"] == 0.5
    top = {f.path for f in c.list_artifacts(lg.run_id)}
    assert {"notes.txt", "texts", "cfg"} <= top
    assert [f.path for f in c.list_artifacts(lg.run_id, "texts")] == ["texts/sample.txt"]
    local = c.download_artifacts(lg.run_id, "cfg/config.json", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text()) == {"a": 1, "b": [1, 2]}

    # resume: reopen by run_id, same params again (+1 new, 1 changed) -> no error, metrics append
    params2 = dict(params, p000="changed", extra=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        lg2 = MLflowLogger(cfg, params=params2, run_id=lg.run_id)
        assert lg2.run_id == lg.run_id and lg2.resumed
        assert c.get_run(lg.run_id).info.status == "RUNNING"
        lg2.log({"train/loss": 0.5}, 30)
        lg2.close("KILLED")
    run = c.get_run(lg.run_id)
    assert run.info.status == "KILLED"
    assert run.data.params["p000"] == "0" and run.data.params["extra"] == "1"
    assert run.data.tags["param_changed.p000"] == "changed"
    hist = c.get_metric_history(lg.run_id, "train/loss")
    assert [m.step for m in hist] == [0, 10, 20, 30]


def test_per_prompt_metrics_stay_out_of_mlflow(store, tmp_path):
    """Per-prompt τ goes to MLflow as each suite's table (the tasks.json artifacts), not as one metric key per
    prompt; the run folder's metrics.jsonl keeps every key."""
    cfg = TrackingConfig(tracking_uri=store, experiment="t-per-task", run_name="r", console=False,
                         system_metrics=False)
    loggers = build_loggers(cfg, tmp_path, params={}, tags=None, total_steps=None)
    metrics = {"eval/tau_vanilla": 3.0, "eval/task/p1/tau_vanilla": 2.0, "eval/task/p1/tau_tree_16": 2.5,
               "eval/suite/coding10/tau_vanilla": 4.0, "eval/suite/coding10/task/q/tau_vanilla": 5.0,
               "eval/t1/task/p1/tau_vanilla": 2.0, "eval/suite/coding10/t0/task/q/tau_tree_16": 5.0,
               "eval/tasks_mean": 1.0}
    loggers.log(metrics, 10)
    run_id = next(lg.run_id for lg in loggers.loggers if isinstance(lg, MLflowLogger))
    loggers.close()
    logged = MlflowClient(store).get_run(run_id).data.metrics
    assert {k for k in logged if k.startswith("eval/")} == {"eval/tau_vanilla", "eval/suite/coding10/tau_vanilla",
                                                          "eval/tasks_mean"}
    lines = _read_jsonl(next(tmp_path.glob("**/metrics.jsonl")))
    assert any("eval/task/p1/tau_vanilla" in line for line in lines)


def test_log_figure(store):
    plt = pytest.importorskip("matplotlib.pyplot")
    lg = MLflowLogger(TrackingConfig(tracking_uri=store, experiment="t-fig"), {}, {})
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    lg.log_figure(fig, "figures/curve")
    plt.close(fig)
    lg.close()
    assert lg.healthy
    paths = [f.path for f in MlflowClient(store).list_artifacts(lg.run_id, "figures")]
    assert paths == ["figures/curve.png"]


def test_two_loggers_coexist_and_generated_name(store):
    cfg = TrackingConfig(tracking_uri=store, experiment="t-multi")
    a, b = MLflowLogger(cfg, {"w": 0}, {}), MLflowLogger(cfg, {"w": 1}, {})
    assert a.run_id != b.run_id and a.run_name and a.run_name != b.run_name
    a.log({"x": 1.0}, 1)
    b.log({"x": 2.0}, 1)
    a.close()
    b.close("FAILED")
    c = MlflowClient(store)
    assert c.get_run(a.run_id).data.metrics["x"] == 1.0
    assert c.get_run(b.run_id).data.metrics["x"] == 2.0
    assert c.get_run(b.run_id).info.status == "FAILED"


# ----------------------------------------------------------------------------- outages


def test_outage_at_start(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = "http://127.0.0.1:9"
    cfg = TrackingConfig(tracking_uri=uri, console=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        logger = build_loggers(cfg, tmp_path / "run", {"a": 1}, {"t": "x"}, total_steps=10)
        for step in range(3):
            logger.log({"train/loss": 1.0 / (step + 1)}, step)
        logger.log_artifact(tmp_path / "run" / "metrics.jsonl")
        logger.close()
    dis = _disabled_warnings(rec)
    assert len(dis) == 1
    assert uri in str(dis[0].message)
    ml = logger.mlflow
    assert ml is not None and not ml.healthy and ml.run_id is None
    rows = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["train/loss"] == 0.5 and "time" in rows[1]
    assert not (tmp_path / "run" / "mlflow_run.json").exists()


def test_outage_mid_run(store, tmp_path, monkeypatch):
    cfg = TrackingConfig(tracking_uri=store, experiment="t-outage", console=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        logger = build_loggers(cfg, tmp_path / "run", {"a": 1}, {}, total_steps=10)
        ml = logger.mlflow
        assert ml.healthy
        logger.log({"train/loss": 1.0}, 0)
        logger.log({"train/loss": 0.9}, 1)

        calls = []

        def boom(*a, **k):
            calls.append(1)
            raise ConnectionError("store went away")

        monkeypatch.setattr(ml.client, "log_batch", boom)
        for step in range(2, 6):
            logger.log({"train/loss": 1.0 - step / 10}, step)
        logger.set_tags({"late": "tag"})
        logger.log_params({"late": 1})
        logger.close()
    dis = _disabled_warnings(rec)
    assert len(dis) == 1 and "store went away" in str(dis[0].message) and store in str(dis[0].message)
    assert len(calls) == 1  # no further attempts after disabling
    assert not ml.healthy
    rows = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    hist = MlflowClient(store).get_metric_history(ml.run_id, "train/loss")
    assert [m.step for m in hist] == [0, 1]
    assert json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"] == ml.run_id


def test_build_loggers_disabled_and_params_files(tmp_path, capsys):
    cfg = TrackingConfig(enabled=False, console=True)
    logger = build_loggers(cfg, tmp_path / "r", {"model": {"layers": 2}}, {"k": "v"}, total_steps=100)
    assert logger.mlflow is None and logger.run_id is None
    assert [type(lg) for lg in logger.loggers] == [JsonlLogger, ConsoleLogger]
    with logger:
        logger.log({"train/loss": 2.0}, 10)
    assert "step 10/100 | loss 2.000" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "params.json").read_text()) == {"model.layers": "2"}
    tags = json.loads((tmp_path / "r" / "tags.json").read_text())
    assert tags["k"] == "v" and "dflash.git_sha" in tags


def test_jsonl_disk_error_raises(tmp_path):
    lg = JsonlLogger(tmp_path / "r")
    lg.log({"a": 1}, 0)
    lg._f.close()
    lg._f = open(lg.path, "r")  # writes now fail like a broken disk would
    with pytest.raises(OSError):
        MultiLogger([lg]).log({"a": 2}, 1)
    lg._f.close()
    assert _read_jsonl(lg.path) == [{"step": 0, "time": pytest.approx(_read_jsonl(lg.path)[0]["time"]), "a": 1.0}]


def test_multilogger_close_closes_all_then_raises():
    closed = []

    class Bad(Logger):
        def log(self, metrics, step):
            pass

        def close(self, status="FINISHED"):
            raise OSError("disk")

    class Good(Logger):
        def log(self, metrics, step):
            pass

        def close(self, status="FINISHED"):
            closed.append(status)

    m = MultiLogger([Bad(), Good()])
    with pytest.raises(OSError):
        with m:
            raise ValueError("train crashed")
    assert closed == ["FAILED"]


# ----------------------------------------------------------------------------- console


def test_console_format(capsys):
    lg = ConsoleLogger(total_steps=1000)
    m = {
        "train/loss": 2.31449,
        "train/acc": 0.4121,
        "train/anchor_streak": 1.834,
        "perf/drafter_tok_s": 12345.0,
        "buffer/total": 14,
        "buffer/max_depth": 20,
        "sys/host_rss_gb": 3.2,
    }
    assert lg.format(m, 100, now=1000.0) == (
        "step 100/1000 | loss 2.314 | acc 0.412 | anchor streak 1.83 | 12.3k tok/s | buf 14/20"
    )
    # 20 steps in 4 s -> 0.2 s/step -> 880 steps left = 176 s
    assert lg.format(m, 120, now=1004.0) == (
        "step 120/1000 | loss 2.314 | acc 0.412 | anchor streak 1.83 | 12.3k tok/s | buf 14/20 | ETA 2m56s"
    )
    # missing keys skipped; pipeline tok/s fallback; eval keys
    assert lg.format({"train/loss": 1.0, "perf/pipeline_tok_s": 850.0}, 130, now=1006.0) == (
        "step 130/1000 | loss 1.000 | 850 tok/s | ETA 2m54s"
    )
    assert lg.format({"eval/tau_vanilla": 2.5, "eval/task/x/tau_vanilla": 9}, 140, now=1008.0).startswith(
        "step 140/1000 | eval tau_vanilla 2.5 | ETA")  # per-task and per-position keys stay off the console
    assert lg.format({"sys/host_rss_gb": 1.0}, 150) is None
    # consumed (trained-on) tok/s leads when logged, not the drafter's busy rate
    assert "| 42.5k tok/s" in lg.format({"perf/consumed_tok_s": 42_500.0, "perf/drafter_tok_s": 74_000.0}, 160)

    # a time budget that ends the run first (trainer.schedule_by_time): 10% of it in 4 s -> 0.5 left = 20 s
    timed = ConsoleLogger(total_steps=10**7)
    timed.format({"train/loss": 1.0, "train/time_progress": 0.4}, 10, now=0.0)
    assert timed.format({"train/loss": 1.0, "train/time_progress": 0.5}, 20, now=4.0).endswith("| ETA 20s")
    # an in-training evaluation's line has no train/time_progress: the budget's ETA goes on (less the 6 s since),
    # not the max_steps estimate (10**7 steps at one a second: 2777h46m)
    assert timed.format({"eval/subset/tau_served": 1.5}, 20, now=10.0).endswith("| ETA 14s")

    lg2 = ConsoleLogger(total_steps=1000)
    lg2.log({"train/loss": 2.0, "train/acc": 0.25}, 5)
    lg2.log({"sys/host_rss_gb": 1.0}, 6)  # nothing to show -> no line
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 5/1000 | loss 2.000 | acc 0.250"]


def test_console_long_eta_and_no_total():
    lg = ConsoleLogger(total_steps=100_000)
    lg.format({"train/loss": 1.0}, 0, now=0.0)
    assert lg.format({"train/loss": 1.0}, 10, now=10.0).endswith("ETA 27h46m")
    lg = ConsoleLogger(total_steps=0)
    assert lg.format({"train/loss": 1.0, "perf/drafter_tok_s": 2.5e6}, 7) == "step 7 | loss 1.000 | 2.50M tok/s"


# ----------------------------------------------------------------------------- helpers


def test_flatten_config():
    @dataclass
    class Opt:
        lr: float = 1e-3
        betas: tuple = (0.9, 0.95)

    @dataclass
    class Cfg:
        opt: Opt = field(default_factory=Opt)
        name: str = "x"

    d = {
        "model": {"layers": 4, "dims": [1, 2, 3], "act": None, "deep": {"x": True}},
        "lr": 1e-4,
        "empty": {},
        "path": Path("/a/b"),
        "dc": Cfg(),
    }
    assert flatten_config(d) == {
        "model.layers": "4",
        "model.dims": "[1, 2, 3]",
        "model.act": "None",
        "model.deep.x": "True",
        "lr": "0.0001",
        "empty": "{}",
        "path": "/a/b",
        "dc.opt.lr": "0.001",
        "dc.opt.betas": "[0.9, 0.95]",
        "dc.name": "x",
    }
    assert flatten_config({"a": 1}, prefix="cfg") == {"cfg.a": "1"}
    assert flatten_config({}) == {}


def test_git_sha_never_raises():
    s = git_sha()
    assert isinstance(s, str) and s


def test_tracking_config_defaults():
    c = TrackingConfig()
    assert (c.tracking_uri, c.experiment, c.run_name, c.log_every) == ("sqlite:///mlflow.db", "dflash", "", 10)
    assert c.console and c.system_metrics and c.enabled


def test_system_metrics_host_keys():
    m = system_metrics()
    assert m["sys/host_rss_gb"] > 0
    assert 0 <= m["sys/host_mem_used_pct"] <= 100
    assert all(k.startswith("sys/") and isinstance(v, float) for k, v in m.items())


# ----------------------------------------------------------------------------- what a run is (issue 16)


def test_run_name_is_the_run_folder_and_the_run_says_what_it_is(tmp_path, monkeypatch, capsys):
    """No run_dir given: the folder is runs/<loss>-<noise>-<buffer>-s<seed>-<time>, the MLflow run has the
    same name, MLflow's Source / commit / Description fields are set, and the run id, folder and `mlflow
    ui` command are printed before the first step."""
    from dflash.tracking.run_info import command_line
    from dflash.app.run import train
    from experiments.config import compose_config
    from tests.conftest import FAST

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose_config(FAST + ["+loss=streak", "+noise=cosine", "seed=3", f"tracking.tracking_uri={uri}",
                                 "tracking.console=true", "trainer.max_steps=2"])
    res = train(cfg)
    assert res.run_dir.parent.name == "runs" and res.run_dir.name.startswith("streak-cosine-r10_20-s3-")
    run = MlflowClient(uri).get_run(res.run_id)
    assert run.info.run_name == res.run_dir.name
    t = run.data.tags
    assert t["mlflow.source.type"] == "LOCAL" and t["mlflow.source.name"]
    note = t["mlflow.note.content"]
    assert command_line() in note and str(res.run_dir.resolve()) in note
    if git_sha() != "unknown":
        assert len(t["mlflow.source.git.commit"]) == 40 and t["mlflow.source.git.commit"] in note
    out = capsys.readouterr().out
    head = out[: out.index("step 1/2")]
    assert f"mlflow run: {res.run_dir.name} ({res.run_id})" in head
    assert f"run folder: {res.run_dir.resolve()}" in head
    assert f"mlflow ui --backend-store-uri {uri}" in head
    # MLflow 3 opens the GenAI view unless the URL asks for the training one (mlflow/server/js, 3.17)
    assert f"/#/experiments/{run.info.experiment_id}/runs/{res.run_id}?workflowType=machine_learning" in head
    key = "dflash-key-metrics"
    assert f"/#/experiments/{run.info.experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning" in head
    exp = MlflowClient(uri).get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(exp.tags[f"mlflow.sharedViewState.{key}"])  # MLflow's saved-view envelope
    assert isinstance(view["name"], str) and isinstance(view["createdAt"], int)
    state = json.loads(view["state"])
    cols = state["selectedColumns"]
    from dflash.evaluation.protocol import OBJECTIVE  # the objective's name: one place
    from dflash.tracking.ui_view import TAU_TAG
    assert f"tags.`{TAU_TAG}`" in cols and state["orderByKey"] == f"metrics.`{OBJECTIVE}`"
    assert "tags.`stage`" in cols and "tags.`option`" in cols  # a campaign's labels (sweeps.results_summary)
    # every header distinct and wide enough to read: the UI widens only the columns `columnOrder` names (the
    # table's default 100 px cuts `eval/tau_served_ci_low` and `_ci_high` to one name)
    headers = [c.split("`")[1] for c in cols]
    assert len(set(headers)) == len(headers)
    assert all(state["columnWidths"][c] >= 8 * len(c.split("`")[1]) for c in state["columnOrder"])
    assert set(cols) - set(state["columnOrder"]) == {"attributes.`Source`"}
    if OBJECTIVE in run.data.metrics:  # the run's τ [CI] as the view shows it: three decimals, one cell
        m = run.data.metrics
        assert t[TAU_TAG] == f"{m[OBJECTIVE]:.3f} [{m[OBJECTIVE + '_ci_low']:.3f}, {m[OBJECTIVE + '_ci_high']:.3f}]"
    # only the active variants' knobs: streak reads alpha and gamma, not another loss's temperature
    p = run.data.params
    assert {"loss.alpha", "loss.gamma", "noise.start", "noise.end", "target.random.hidden_size"} <= set(p)
    assert not {"loss.kl_weight", "loss.temperature", "loss.dpace_a", "loss.lk_eta", "noise.sigma"} & set(p)
    # nor the settings of disabled data features: no online writer, no regeneration on a stdlib run
    assert not [k for k in p if k.startswith(("data.online.", "data.pool.", "data.corpus.", "data.regen_"))]
    assert {"data.source", "data.max_len"} <= set(p)
    m = run.data.metrics
    assert m["data/consumed_tokens"] > 0 and m["train/ce"] > 0  # the budget; the loss-independent CE


def test_run_params_drop_unread_knobs():
    from dflash.tracking.run_info import run_params
    cfg = {"loss": {"name": "hard_ce", "gamma": 7.0, "alpha": 1.0}, "target": {"path": "/m", "random": {"h": 8}},
           "seed": 0}
    assert run_params(cfg, {"loss": ("name", "gamma")}, drop=["target.random"]) == {
        "loss.name": "hard_ce", "loss.gamma": "7.0", "target.path": "/m", "seed": "0"}
    assert "target.random.h" in run_params(cfg)


def test_every_variant_names_real_config_keys():
    """`config_keys` decide which params a run logs: a misspelt key would silently drop a real knob."""
    import dataclasses

    from dflash.training.losses import LOSSES, LossConfig
    from dflash.training.noise import NOISES, NoiseConfig
    for registry, conf in ((LOSSES, LossConfig), (NOISES, NoiseConfig)):
        fields = {f.name for f in dataclasses.fields(conf)}
        for name, cls in registry.items():
            assert "name" in cls.config_keys and set(cls.config_keys) <= fields, (name, cls.config_keys)


def test_system_metrics_land_in_mlflows_system_tab(store):
    cfg = TrackingConfig(tracking_uri=store, experiment="t-sysmetrics", console=False,
                         system_metrics_interval_s=0.1)
    lg = MLflowLogger(cfg)
    import time
    time.sleep(0.35)
    lg.close()
    c = MlflowClient(store)
    metrics = c.get_run(lg.run_id).data.metrics
    assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100
    assert "system/system_memory_usage_megabytes" in metrics
    assert len(c.get_metric_history(lg.run_id, "system/cpu_utilization_percentage")) >= 2
    short = MLflowLogger(cfg)  # closed before one interval: its sample is still logged
    time.sleep(0.02)
    short.close()
    assert "system/cpu_utilization_percentage" in c.get_run(short.run_id).data.metrics
    off = MLflowLogger(TrackingConfig(tracking_uri=store, experiment="t-sysmetrics", system_metrics=False))
    off.close()
    assert not any(k.startswith("system/") for k in c.get_run(off.run_id).data.metrics)


def test_reopened_run_keeps_the_description_that_made_it(store):
    from dflash.tracking.run_info import NOTE
    cfg = TrackingConfig(tracking_uri=store, experiment="t-note", console=False, system_metrics=False)
    first = MLflowLogger(cfg, tags={NOTE: "python -m experiments.run +loss=soft_kl"})
    first.close()
    again = MLflowLogger(cfg, tags={NOTE: "pytest", "other": "x"}, run_id=first.run_id)
    again.close()
    tags = MlflowClient(store).get_run(first.run_id).data.tags
    assert tags[NOTE] == "python -m experiments.run +loss=soft_kl" and tags["other"] == "x"


def test_reopened_runs_folder_says_what_mlflow_shows(store, tmp_path):
    """A run reopened by another process (a resume, a sweep worker taking a pre-made trial run) keeps its
    Description in MLflow, and its folder's tags.json says the same, not the reopening process's command line."""
    from dflash.tracking.run_info import NOTE
    cfg = TrackingConfig(tracking_uri=store, experiment="t-note-folder", console=False, system_metrics=False)
    first = build_loggers(cfg, tmp_path / "r", {}, {NOTE: "python -m experiments.run trainer.lr=1e-3"}, 10)
    first.close()
    again = build_loggers(cfg, tmp_path / "r", {}, {}, 10, run_id=first.run_id)  # NOTE: this process's command
    again.close()
    folder = json.loads((tmp_path / "r" / "tags.json").read_text())
    assert folder[NOTE] == MlflowClient(store).get_run(first.run_id).data.tags[NOTE]
    assert folder[NOTE] == "python -m experiments.run trainer.lr=1e-3"


def test_split_jobs_by_each_jobs_loop_seconds():
    """A resumed run's metrics.jsonl: one job per process, each ended by its sys/loop_s; what the end logs after the
    loop stays with its job, and windows after the last end are a job cut short."""
    from dflash.tracking.records import split_jobs
    w = lambda step: {"step": step, "perf/consumed_tok_s": 1.0}
    rows = [w(10), w(20), {"step": 20, "sys/loop_s": 5.0}, {"step": 20, "eval/tau_vanilla": 1.5},
            w(30), {"step": 30, "sys/loop_s": 4.0}, w(40)]
    jobs = split_jobs(rows)
    assert [(len(recs), ended) for recs, ended in jobs] == [(4, True), (2, True), (1, False)]
    assert jobs[0][0][-1] == {"step": 20, "eval/tau_vanilla": 1.5}
    assert split_jobs(rows[:-1])[-1] == ([w(30), {"step": 30, "sys/loop_s": 4.0}], True)
    assert split_jobs([]) == [] and split_jobs([{"step": 1}]) == [([{"step": 1}], False)]
