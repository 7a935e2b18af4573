"""A registry of the old layout (every drafter in one `dflash-drafter`, two targets mixed, an old-protocol champion)
split into one registered model per target fingerprint, on a real MLflow sqlite store: version numbers, tags,
aliases and the runs' pointers kept, protocol tags added, figures rounded; then the gate replaces the old-protocol
champion with a served-protocol drafter of the same target."""
from __future__ import annotations

import json
import shutil
import time

import pytest

pytest.importorskip("mlflow")
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from dflash.serving.promotion import (PROTOCOL_TAG, RECORD_TAG, TARGET_FP, PromoteConfig,  # noqa: E402
                                      PromotionError, promote)
from dflash.serving.registry_split import SplitError, main, split_registry  # noqa: E402

OLD = "dflash-drafter"
FA, FB = "aaaa000000000000", "bbbb000000000000"


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory):
    d = tmp_path_factory.mktemp("template")
    MlflowClient(f"sqlite:///{d}/mlflow.db").search_experiments()  # creates and migrates the schema
    return d / "mlflow.db"


class OldStore:
    """Versions registered as the gate did before one model per target: all under `dflash-drafter`."""

    def __init__(self, tmp_path, template):
        shutil.copy(template, tmp_path / "mlflow.db")
        self.db = tmp_path / "mlflow.db"
        self.uri = f"sqlite:///{self.db}"
        self.c = MlflowClient(self.uri)
        self.exp = self.c.create_experiment("old", artifact_location=(tmp_path / "mlartifacts").as_uri())
        self.ckpt = tmp_path / "ckpt"
        self.ckpt.mkdir()
        (self.ckpt / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
        self.c.create_registered_model(OLD, description="DFlash drafters.")

    def run(self, metrics: dict[str, float], fp: str, checkpoint: bool = True) -> str:
        r = self.c.create_run(self.exp, tags={TARGET_FP: fp, "target": "reference", "loss": "hard_ce"})
        ts = int(time.time() * 1000)
        self.c.log_batch(r.info.run_id, metrics=[Metric(k, v, ts, 10) for k, v in metrics.items()],
                         params=[Param("drafter.architecture", "dflash2"), Param("drafter.num_layers", "2")])
        if checkpoint:
            self.c.log_artifacts(r.info.run_id, str(self.ckpt), "checkpoint")
        self.c.set_terminated(r.info.run_id)
        return r.info.run_id

    def register_old(self, tau: float, fp: str, decision: str, holder: str = "", record: bool = True) -> str:
        rid = self.run({"eval/tau_vanilla": tau}, fp)
        tags = {TARGET_FP: fp, "dflash.target": "reference", "eval/tau_vanilla": repr(tau),
                "dflash.promotion.decision": decision, "dflash.promotion.holder_version": holder}
        if record:
            tags[RECORD_TAG] = json.dumps({"metric": "eval/tau_vanilla", "holder_version": holder or None})
        else:  # the oldest layout: the record spread over tags
            tags["dflash.promotion.metric"] = "eval/tau_vanilla"
        v = self.c.create_model_version(OLD, f"{self.c.get_run(rid).info.artifact_uri}/checkpoint", run_id=rid,
                                        tags=tags)
        self.c.update_model_version(OLD, v.version, description=f"{decision} (run {rid})")
        self.c.set_tag(rid, "dflash.promotion.version", str(v.version))
        self.c.set_tag(rid, "dflash.promotion.model", OLD)
        if decision == "promoted":
            self.c.set_registered_model_alias(OLD, "champion", v.version)
        return rid


@pytest.fixture
def old(tmp_path, empty_db):
    s = OldStore(tmp_path, empty_db)
    s.register_old(1.620036682694691, FB, "refused", record=False)  # v1: another build of the target
    s.register_old(8.169077306733167, FA, "promoted")  # v2
    s.register_old(4.2656677524429965, FA, "refused", holder="2")  # v3
    s.register_old(8.543296817944706, FA, "promoted", holder="2")  # v4: @champion, old protocol
    return s


def test_split_keeps_numbers_aliases_and_runs_pointers(old):
    moves = split_registry(old.db)
    assert [(m.version, m.dest) for m in moves] == [(1, f"{OLD}-{FB}"), (2, f"{OLD}-{FA}"), (3, f"{OLD}-{FA}"),
                                                     (4, f"{OLD}-{FA}")]
    c = MlflowClient(old.uri)
    names = sorted(m.name for m in c.search_registered_models())
    assert names == [f"{OLD}-{FA}", f"{OLD}-{FB}"]  # the mixed model is gone: nothing was left in it
    a = c.get_registered_model(f"{OLD}-{FA}")
    assert a.aliases == {"champion": 4} and a.tags[TARGET_FP] == FA and FA in a.description
    assert "of target reference" in a.description
    assert c.get_registered_model(f"{OLD}-{FB}").aliases == {}
    assert sorted(int(v.version) for v in c.search_model_versions(f"name='{OLD}-{FA}'")) == [2, 3, 4]
    v4 = c.get_model_version(f"{OLD}-{FA}", "4")
    assert v4.tags["dflash.promotion.holder_version"] == "2"  # names the same version as before
    assert v4.tags["eval/tau_vanilla"] == "8.543"  # rounded, as the gate writes figures now
    assert v4.tags[PROTOCOL_TAG].startswith("old protocol") and v4.description.startswith("promoted")
    assert c.get_model_version(f"{OLD}-{FB}", "1").tags[PROTOCOL_TAG].startswith("old protocol")  # oldest layout
    run = c.get_run(v4.run_id)
    assert run.data.tags["dflash.promotion.model"] == f"{OLD}-{FA}"
    assert c.get_model_version_by_alias(f"{OLD}-{FA}", "champion").run_id == v4.run_id
    assert split_registry(old.db) == []  # done once: nothing left to move


def serving_folder(path, fp: str = FA, layers: int = 2):
    """A serving folder as export writes it: config.json with its training record, weights, checksums.sha256."""
    from dflash.safe_load import file_sha256
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"], "num_hidden_layers": layers,
                                                  "dflash_training": {"target_fingerprint": fp, "loss": "hard_ce"}}))
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "checksums.sha256").write_text("".join(f"{file_sha256(path / n)}  {n}\n"
                                                   for n in ("config.json", "model.safetensors")))
    return path


def test_gate_replaces_the_old_protocol_champion_after_the_split(old, tmp_path):
    """The committed store's case: the served run's weights were packed away; its folder comes back through the gate
    (`--checkpoint`), which replaces the old-protocol champion of the same target."""
    split_registry(old.db)
    served = old.run({"eval/tau_served": 1.584, "eval/tau_served_ci_low": 1.564, "eval/tau_served_ci_high": 1.604,
                      "eval/tau_served_prompt_lookup": 1.263}, FA, checkpoint=False)
    assert "no 'checkpoint' artifact" in promote(served, PromoteConfig(), old.uri, dry_run=True).reason
    folder = serving_folder(tmp_path / "final")
    assert promote(served, PromoteConfig(), old.uri, dry_run=True, checkpoint=folder).promoted
    assert not MlflowClient(old.uri).list_artifacts(served, "checkpoint")  # a dry run logs nothing
    d = promote(served, PromoteConfig(), old.uri, checkpoint=folder)
    assert d.promoted and d.model_name == f"{OLD}-{FA}" and d.version == "5" and d.holder_version == "4"
    assert "the old protocol" in d.reason and "the champion is replaced" in d.reason
    c = MlflowClient(old.uri)
    champ = c.get_model_version_by_alias(f"{OLD}-{FA}", "champion")
    assert str(champ.version) == "5" and champ.tags[PROTOCOL_TAG].startswith("served")
    assert champ.tags["eval/tau_served"] == "1.584"
    assert c.get_model_version(f"{OLD}-{FA}", "4").tags["dflash.promotion.superseded_by"] == "5"
    assert {a.path for a in c.list_artifacts(served, "checkpoint")} == {
        "checkpoint/config.json", "checkpoint/model.safetensors", "checkpoint/checksums.sha256"}
    with pytest.raises(PromotionError, match="already has a 'checkpoint' artifact"):
        promote(served, PromoteConfig(), old.uri, checkpoint=folder)


@pytest.mark.parametrize("case", ["fingerprint", "layers", "damaged"])
def test_a_folder_that_is_not_the_runs_drafter_is_refused(old, tmp_path, case):
    served = old.run({"eval/tau_served": 1.584}, FA, checkpoint=False)
    folder = serving_folder(tmp_path / "final", fp=FB if case == "fingerprint" else FA,
                            layers=5 if case == "layers" else 2)
    if case == "damaged":
        (folder / "model.safetensors").write_bytes(b"other weights")
    match = {"fingerprint": f"target fingerprint: folder {FB}, run {FA}", "layers": "drafter.num_layers: folder 5",
             "damaged": "sha256 differs"}[case]
    with pytest.raises(PromotionError, match=match):
        promote(served, PromoteConfig(), old.uri, checkpoint=folder)
    assert not MlflowClient(old.uri).list_artifacts(served, "checkpoint")


def test_a_relative_store_gets_the_checkpoint_beside_its_database(old, tmp_path, monkeypatch):
    """A committed store unpacked records artifact locations relative to its folder; promoting from elsewhere puts
    the folder beside the database, not under the working folder."""
    from dflash.tracking.run_info import relocate_artifacts
    served = old.run({"eval/tau_served": 1.584}, FA, checkpoint=False)
    relocate_artifacts(old.db, relative=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    d = promote(served, PromoteConfig(), old.uri, checkpoint=serving_folder(tmp_path / "final"))
    assert d.version is not None
    assert (old.db.parent / "mlartifacts" / served / "artifacts" / "checkpoint" / "model.safetensors").is_file()
    assert not (elsewhere / "mlartifacts").exists()


def test_dry_run_and_cli_write_nothing(old, capsys):
    assert main([str(old.db), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would move {OLD} v4 -> {OLD}-{FA} v4 (old protocol" in out
    c = MlflowClient(old.uri)
    assert [m.name for m in c.search_registered_models()] == [OLD]
    assert main([str(old.db)]) == 0 and "moved" in capsys.readouterr().out
    assert main([str(old.db)]) == 0 and "nothing to move" in capsys.readouterr().out


def test_a_taken_version_number_refuses_the_whole_split(old):
    c = MlflowClient(old.uri)
    c.create_registered_model(f"{OLD}-{FA}")
    rid = old.run({"eval/tau_served": 1.2}, FA)
    for _ in range(3):  # v1..v3 taken in the destination
        c.create_model_version(f"{OLD}-{FA}", "file:///nowhere", run_id=rid)
    with pytest.raises(SplitError, match="already has a version 2"):
        split_registry(old.db)
    assert len(c.search_model_versions(f"name='{OLD}'")) == 4  # nothing moved
    assert main([str(old.db)]) == 2


def test_a_relative_store_is_read_from_any_folder(old, tmp_path, monkeypatch):
    """The gate reads a committed store's artifacts beside its database whatever folder it runs in: its checkpoint
    (else "no checkpoint" refuses) and its task tables (else it compares recorded values only, silently)."""
    from dflash.serving import promotion
    from dflash.tracking.run_info import relocate_artifacts
    rid = old.run({"eval/tau_served": 1.584}, FA)
    MlflowClient(old.uri).log_text(rid, json.dumps({"rows": [1]}), "eval/served/tasks.json")
    relocate_artifacts(old.db, relative=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    client = MlflowClient(old.uri)
    assert promotion._task_table(client, rid, "eval/served/tasks.json") == {"rows": [1]}
    assert promote(rid, PromoteConfig(), old.uri, dry_run=True).promoted
