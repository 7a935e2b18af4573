"""The promotion gate against a real MLflow sqlite store: promote, refuse (with the reason recorded),
margin, floor, failed/NaN runs, dry-run, the CLI, and two promotions racing."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
from mlflow.entities import Metric  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

import dflash.serving.promotion as promotion  # noqa: E402
from dflash.serving.promotion import (DECISION_TAG, PROTOCOL_TAG, REASON_TAG, PromoteConfig,  # noqa: E402
                              PromotionError, auto_promote, promote)

MODEL = "dflash-drafter"


class Store:
    def __init__(self, tmp_path, template=None):
        self.tmp = tmp_path
        self.uri = f"sqlite:///{tmp_path}/mlflow.db"
        if template is not None:  # an already-migrated empty database: creating one takes seconds
            shutil.copy(template, tmp_path / "mlflow.db")
        self.client = MlflowClient(self.uri)
        self.exp = self.client.create_experiment("promo", artifact_location=(tmp_path / "art").as_uri())
        ck = tmp_path / "ckpt_src"
        ck.mkdir()
        (ck / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
        (ck / "model.safetensors").write_bytes(b"tiny")
        self.ckpt = ck

    def run(self, tau: float | None, status: str = "FINISHED", checkpoint: bool = True, name: str = "") -> str:
        c = self.client
        r = c.create_run(self.exp, run_name=name or None, tags={"loss": "soft_kl", "dflash.kind": "train"})
        rid = r.info.run_id
        ts = int(time.time() * 1000)
        ms = [Metric("train/loss", 1.0, ts, 10)]
        if tau is not None:
            ms += [Metric("eval/tau_served", tau - 0.5, ts, 5),  # an earlier, cheaper eval
                   Metric("eval/tau_served", tau, ts + 1, 10),
                   Metric("eval/tau_tree_16", tau + 1.0, ts + 1, 10),
                   Metric("eval/tau_tree_64", tau + 2.0, ts + 1, 10)]
        c.log_batch(rid, metrics=ms)
        c.log_param(rid, "loss.name", "soft_kl")
        if checkpoint:
            c.log_artifacts(rid, str(self.ckpt), "checkpoint")
        c.log_text(rid, json.dumps({"fizzbuzz": 3.0}), "eval/per_task.json")
        c.set_terminated(rid, status)
        return rid

    def holder(self) -> str | None:
        try:
            return str(self.client.get_registered_model(MODEL).aliases.get("champion") or "") or None
        except Exception:
            return None

    def versions(self, run_id: str | None = None) -> list:
        try:
            vs = self.client.search_model_versions(f"name='{MODEL}'")
        except Exception:
            return []
        return [v for v in vs if run_id is None or v.run_id == run_id]

    def version(self, v: str):
        return self.client.get_model_version(MODEL, v)


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory):
    d = tmp_path_factory.mktemp("template")
    MlflowClient(f"sqlite:///{d}/mlflow.db").search_experiments()  # creates and migrates the schema
    return d / "mlflow.db"


@pytest.fixture
def store(tmp_path, empty_db):
    return Store(tmp_path, empty_db)


def test_one_registered_model_per_target(store):
    """Drafters of two targets never share a registered model: each goes to `<model_name>-<fingerprint>` (the run's
    `dflash.target_fingerprint`), whose @champion is weighed only against drafters of its own target."""
    from dflash.serving.promotion import TARGET_FP, registry_name

    def run(tau: float, fp: str) -> str:
        rid = store.run(tau)
        store.client.set_tag(rid, TARGET_FP, fp)
        return rid
    fa, fb = "aaaa000000000000", "bbbb000000000000"
    first_a = promote(run(3.0, fa), PromoteConfig(), store.uri)
    other = promote(run(2.0, fb), PromoteConfig(), store.uri)  # lower τ, another target: not weighed against A's
    assert first_a.model_name == registry_name(MODEL, fa) == f"{MODEL}-{fa}" and other.model_name == f"{MODEL}-{fb}"
    assert first_a.promoted and other.promoted and "no current @champion holder" in other.reason
    for d, fp in ((first_a, fa), (other, fb)):
        model = store.client.get_registered_model(d.model_name)
        assert model.aliases["champion"] == 1 and model.tags[TARGET_FP] == fp and fp in model.description
        assert store.client.get_run(d.run_id).data.tags["dflash.promotion.model"] == d.model_name
    worse_a = promote(run(2.5, fa), PromoteConfig(), store.uri)  # A's champion is A's alone
    assert not worse_a.promoted and worse_a.version == "2" and worse_a.holder_version == "1"
    assert store.holder() is None  # nothing registered under the bare name: every run here records its target


def test_first_promotion_wins_and_records_everything(store):
    rid = store.run(3.0)
    d = promote(rid, PromoteConfig(), store.uri)
    assert d.promoted and d.version == "1" and d.candidate_value == 3.0  # the final value, not step 5's
    assert d.holder_version is None and "no current @champion holder" in d.reason
    assert store.holder() == "1"
    mv = store.version("1")
    assert mv.run_id == rid
    assert mv.source == store.client.get_run(rid).info.artifact_uri + "/checkpoint"
    t = mv.tags
    assert t[DECISION_TAG] == "promoted" and t[REASON_TAG] == d.reason
    assert float(t["eval/tau_served"]) == 3.0 and float(t["eval/tau_tree_16"]) == 4.0
    assert t["eval/tau_served"] == "3.000"  # rounded for reading; the gate reads the run's metric
    assert t[PROTOCOL_TAG].startswith("served: τ at the target's sampling setting")
    assert float(t["eval/tau_tree_64"]) == 5.0
    assert t["dflash.task_table"] == f"runs:/{rid}/eval/per_task.json"
    assert "dflash.config" not in t  # the config is one link away (dflash.config_uri), not a tag blob
    assert store.version("1").description.startswith("PROMOTED to @champion: ")
    assert t["dflash.config_uri"] == f"runs:/{rid}/config.yaml" and t["dflash.loss"] == "soft_kl"
    run_tags = store.client.get_run(rid).data.tags
    assert run_tags[DECISION_TAG] == "promoted" and run_tags["dflash.promotion.version"] == "1"
    # short sets, as the README promises: the gate adds 4 tags to the run, a version carries under 20
    added = {k for k in run_tags if k.startswith("dflash.promotion.")}
    assert added == {DECISION_TAG, REASON_TAG, "dflash.promotion.version", "dflash.promotion.model"}
    assert len(t) < 20 and not any(k.endswith(("_ci_low", "_ci_high")) for k in t), sorted(t)


def test_worse_refused_with_reason_on_version(store):
    promote(store.run(3.0), PromoteConfig(), store.uri)
    worse = store.run(2.5)
    d = promote(worse, PromoteConfig(), store.uri)
    assert not d.promoted and d.version == "2" and d.holder_version == "1" and d.holder_value == 3.0
    assert "does not beat holder @champion v1" in d.reason
    assert store.holder() == "1"
    t = store.version("2").tags
    assert t[DECISION_TAG] == "refused" and t[REASON_TAG] == d.reason
    assert t["dflash.promotion.holder_version"] == "1"
    assert store.version("2").description.startswith(f"REFUSED (not @champion): {d.reason}")
    # an equal value does not beat the holder either (strictly greater is required)
    assert not promote(store.run(3.0), PromoteConfig(), store.uri).promoted
    better = promote(store.run(3.2), PromoteConfig(), store.uri)
    assert better.promoted and store.holder() == better.version
    assert store.version("1").tags["dflash.promotion.superseded_by"] == better.version


def test_margin(store):
    cfg = PromoteConfig(margin=0.5)
    promote(store.run(3.0), cfg, store.uri)
    d = promote(store.run(3.3), cfg, store.uri)
    assert not d.promoted and "margin 0.5000" in d.reason and store.holder() == "1"
    assert store.version(d.version).tags[DECISION_TAG] == "refused"
    d = promote(store.run(3.6), cfg, store.uri)
    assert d.promoted and store.holder() == d.version


def test_floor(store):
    cfg = PromoteConfig(floor=4.0)
    d = promote(store.run(3.5), cfg, store.uri)  # no holder: only the floor applies
    assert not d.promoted and "below the floor 4.0000" in d.reason and store.holder() is None
    assert store.version(d.version).tags[DECISION_TAG] == "refused"
    promote(store.run(4.5), PromoteConfig(), store.uri)
    d = promote(store.run(5.0), PromoteConfig(floor=6.0), store.uri)  # beats holder, below floor
    assert not d.promoted and "below the floor" in d.reason and store.holder() == "2"


@pytest.mark.parametrize("case", ["failed", "nan", "inf", "no_metric", "no_checkpoint", "running"])
def test_ineligible_runs_never_registered_nor_aliased(store, case):
    promote(store.run(2.0), PromoteConfig(), store.uri)
    rid = {"failed": lambda: store.run(9.0, status="FAILED"),
           "nan": lambda: store.run(math.nan),
           "inf": lambda: store.run(math.inf),
           "no_metric": lambda: store.run(None),
           "no_checkpoint": lambda: store.run(9.0, checkpoint=False),
           "running": lambda: store.run(9.0, status="RUNNING")}[case]()
    d = promote(rid, PromoteConfig(), store.uri)
    assert not d.promoted and d.version is None
    expect = {"failed": "FAILED", "nan": "nan", "inf": "inf", "no_metric": "no eval/tau_served",
              "no_checkpoint": "no 'checkpoint' artifact", "running": "RUNNING"}[case]
    assert expect in d.reason
    assert store.versions(rid) == [] and store.holder() == "1"
    tags = store.client.get_run(rid).data.tags
    assert tags[DECISION_TAG] == "refused" and tags[REASON_TAG] == d.reason


def test_dry_run_registers_nothing(store):
    rid = store.run(3.0)
    d = promote(rid, PromoteConfig(), store.uri, dry_run=True)
    assert d.promoted and d.dry_run and d.version is None and "would promote" in d.summary()
    with pytest.raises(Exception):
        store.client.get_registered_model(MODEL)  # not even the registered model was created
    assert DECISION_TAG not in store.client.get_run(rid).data.tags
    promote(rid, PromoteConfig(), store.uri)
    worse = store.run(1.0)
    d = promote(worse, PromoteConfig(), store.uri, dry_run=True)
    assert not d.promoted and d.holder_version == "1" and "does not beat" in d.reason
    assert len(store.versions()) == 1 and DECISION_TAG not in store.client.get_run(worse).data.tags
    d = promote(store.run(math.nan), PromoteConfig(), store.uri, dry_run=True)
    assert not d.promoted and len(store.versions()) == 1


def test_same_run_again_is_refused_without_new_version(store):
    rid = store.run(3.0)
    promote(rid, PromoteConfig(), store.uri)
    d = promote(rid, PromoteConfig(), store.uri)
    assert not d.promoted and "already holds" in d.reason and len(store.versions()) == 1


def test_holder_without_metric_tag_uses_its_run_metric(store):
    rid = store.run(3.0)
    store.client.create_registered_model(MODEL)
    mv = store.client.create_model_version(MODEL, "file:///x", run_id=rid)  # aliased by hand, no tags
    store.client.set_registered_model_alias(MODEL, "champion", mv.version)
    d = promote(store.run(2.0), PromoteConfig(), store.uri)
    assert not d.promoted and d.holder_value == 3.0


def test_bad_input(store, tmp_path):
    with pytest.raises(PromotionError, match="not found"):
        promote("0" * 32, PromoteConfig(), store.uri)
    with pytest.raises(PromotionError, match="no database file"):
        promote(store.run(3.0), PromoteConfig(), f"sqlite:///{tmp_path}/missing.db")
    assert not (tmp_path / "missing.db").exists()
    with pytest.raises(PromotionError, match="must be finite"):
        promote(store.run(3.0), PromoteConfig(margin=math.nan), store.uri)
    assert auto_promote(store.run(3.0), PromoteConfig(enabled=False), store.uri) is None
    assert auto_promote(None, PromoteConfig(enabled=True), store.uri) is None


# ------------------------------------------------------------------------------------------ race
def test_race_threads_exactly_one_winner(store, monkeypatch):
    """The critical section is widened with a sleep after reading the holder: without the lock both
    would read 'no holder' and both would set the alias."""
    a, b = store.run(3.0), store.run(3.0)
    real = promotion._current_holder
    barrier = threading.Barrier(2)

    def slow_holder(client, cfg, name):
        out = real(client, cfg, name)
        time.sleep(0.3)
        return out

    def slow_lock(uri, timeout=300.0):
        barrier.wait()  # both threads arrive at the lock together
        return real_lock(uri, timeout)

    real_lock = promotion.registry_lock
    monkeypatch.setattr(promotion, "_current_holder", slow_holder)
    monkeypatch.setattr(promotion, "registry_lock", slow_lock)
    results = {}

    def go(rid):
        results[rid] = promote(rid, PromoteConfig(), store.uri)

    ts = [threading.Thread(target=go, args=(r,)) for r in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert set(results) == {a, b}
    winners = [d for d in results.values() if d.promoted]
    losers = [d for d in results.values() if not d.promoted]
    assert len(winners) == 1 and len(losers) == 1
    assert store.holder() == winners[0].version
    assert losers[0].holder_version == winners[0].version and "does not beat" in losers[0].reason
    assert store.version(losers[0].version).tags[DECISION_TAG] == "refused"
    assert store.version(winners[0].version).tags[DECISION_TAG] == "promoted"


_CHILD = """
import json, sys
from dflash.serving.promotion import PromoteConfig, promote
from mlflow.tracking import MlflowClient
MlflowClient(sys.argv[2]).search_experiments(max_results=1)  # open the store before the start signal
print("ready", flush=True)
sys.stdin.readline()  # the start signal: both children promote at the same moment
print(json.dumps(promote(sys.argv[1], PromoteConfig(), sys.argv[2]).to_dict()), flush=True)
"""


def test_race_processes_exactly_one_winner(store):
    runs = [store.run(3.0), store.run(3.0)]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    ps = [subprocess.Popen([sys.executable, "-c", _CHILD, r, store.uri], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for r in runs]
    try:
        for p in ps:
            assert p.stdout.readline().strip() == "ready"
        for p in ps:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in ps]
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ps] == [0, 0]
    winners = [d for d in out if d["promoted"]]
    assert len(winners) == 1, out
    loser = next(d for d in out if not d["promoted"])
    assert store.holder() == winners[0]["version"] and loser["holder_version"] == winners[0]["version"]
    assert store.version(loser["version"]).tags[DECISION_TAG] == "refused"
    assert len(store.versions()) == 2


# ------------------------------------------------------------------------------------------- CLI
def _run_dir(tmp_path, store, rid, uri=None):
    d = tmp_path / "runs" / "r1"
    (d / "final").mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text("seed: 0\n")
    (d / "mlflow_run.json").write_text(json.dumps({"tracking_uri": uri or store.uri, "run_id": rid}))
    return d


def test_cli(store, tmp_path, capsys, monkeypatch):
    from experiments.promote import main
    rid = store.run(3.0)
    run_dir = _run_dir(tmp_path, store, rid)
    d = main([str(run_dir), "--dry-run"])
    assert d.promoted and d.dry_run and store.versions() == []
    assert "[dry run] would promote" in capsys.readouterr().out
    d = main([str(run_dir / "final"), "--floor", "2.5"])
    assert d.promoted and store.holder() == d.version
    assert "PROMOTED" in capsys.readouterr().out
    d = main([store.run(3.1), "--tracking-uri", store.uri, "--margin", "0.5"])
    assert not d.promoted and "REFUSED" in capsys.readouterr().out  # refusal: a normal return
    d = main([store.run(5.0), "--tracking-uri", store.uri, "--alias", "canary", "--model-name", "other"])
    assert d.promoted and store.client.get_registered_model("other").aliases == {"canary": 1}
    # a relative sqlite URI in mlflow_run.json is found from the folders above the run dir
    monkeypatch.chdir(run_dir)
    (run_dir / "mlflow_run.json").write_text(json.dumps({"tracking_uri": "sqlite:///mlflow.db", "run_id": rid}))
    assert "already holds" in main([str(run_dir)]).reason


@pytest.mark.parametrize("argv, msg", [
    (["does/not/exist"], "neither an existing run directory nor an MLflow run id"),
    (["0" * 32, "--tracking-uri", "TMP/none.db"], "no database file"),
    (["0" * 32, "--tracking-uri", "STORE"], "not found"),
    (["RUNDIR_NO_MLFLOW"], "without mlflow_run.json"),
])
def test_cli_bad_input_exits_nonzero(store, tmp_path, capsys, argv, msg):
    from experiments.promote import main
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text("seed: 0\n")
    argv = [a.replace("TMP/", f"sqlite:///{tmp_path}/").replace("STORE", store.uri)
            .replace("RUNDIR_NO_MLFLOW", str(bare)) for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


# ------------------------------------------------------------------------------ with a real run
def test_training_run_then_promote_and_export(fast_cfg, tmp_path, capsys):
    """A real (tiny, CPU) training run: its run dir, mlflow_run.json and `checkpoint` artifact are what
    the gate and the export read. The eval metric is logged by hand here (evaluation is tested apart)."""
    pytest.importorskip("experiments.config")
    from dflash.serving.export import load_drafter
    from dflash.app.run import train
    from experiments.export import main as export_main
    from experiments.promote import main as promote_main
    cfg = fast_cfg()
    res = train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    assert "already" not in promote_main([str(res.run_dir), "--dry-run"]).reason
    d = promote_main([str(res.run_dir)])
    assert not d.promoted and "no eval/tau_served" in d.reason  # not evaluated: refused
    client.log_metric(res.run_id, "eval/tau_served", 1.7, step=cfg.trainer.max_steps)
    d = promote_main([str(res.run_dir)])
    fp = client.get_run(res.run_id).data.tags["dflash.target_fingerprint"]
    assert d.model_name == f"{MODEL}-{fp}"  # the registered model of this run's target
    assert d.promoted and client.get_model_version_by_alias(d.model_name, "champion").run_id == res.run_id
    from experiments.eval import _target_model
    assert _target_model(client, cfg) == d.model_name  # `eval … champion` reads the configured target's model
    mv = client.get_model_version(d.model_name, d.version)
    assert mv.tags["dflash.loss"] == cfg.loss.name and mv.tags["dflash.run_name"] == res.run_dir.name
    assert not any(k.startswith(("eval/task/", "eval/acc_pos")) for k in mv.tags)  # a short, readable set
    served = export_main([str(res.run_dir), "--out", str(tmp_path / "served")])
    assert load_drafter(served).block_size == cfg.drafter.block_size
    capsys.readouterr()
