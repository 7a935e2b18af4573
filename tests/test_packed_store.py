"""A tracking store packed for the repository (`dflash.tracking.packed_store`, `pack_store` in
benchmarks/leased_gpu/job_env.sh): its database as SQL text, unpacked anywhere back to a store MLflow reads with every run,
metric, tag, model version and artifact; atomic and refusing to overwrite a store."""
import os
import shutil
import sqlite3
import subprocess
import tarfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dflash.tracking.packed_store import dump_store, main, restore_store, unpack

ROOT = Path(__file__).resolve().parents[1]


def _store(folder: Path) -> dict:
    """A small MLflow store as the GPU jobs leave one: runs with metric histories and tags, an artifact in the
    store's own mlartifacts/ (absolute locations, the machine's), a registered model version with an alias."""
    from dflash.tracking.run_info import get_or_create_experiment
    folder.mkdir(parents=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    c = MlflowClient(uri)
    eid = get_or_create_experiment(c, "campaign", uri)
    runs = []
    for i in range(3):
        r = c.create_run(eid, run_name=f"cell{i}").info.run_id
        for step in range(50):
            c.log_metric(r, "train/loss", 1.0 / (step + 1 + i), step=step)
        c.set_tag(r, "note", f"run {i}")
        runs.append(r)
    art = folder / "a.txt"
    art.write_text("drafter card")
    c.log_artifact(runs[0], str(art))
    art.unlink()
    c.create_registered_model("dflash-drafter")
    v = c.create_model_version("dflash-drafter", f"{c.get_run(runs[0]).info.artifact_uri}/a.txt", run_id=runs[0])
    c.set_registered_model_alias("dflash-drafter", "champion", v.version)
    (folder / "runs" / "cell0" / "checkpoints").mkdir(parents=True)
    (folder / "runs" / "cell0" / "checkpoints" / "step_1.pt").write_bytes(b"weights")
    (folder / "runs" / "cell0" / "metrics.jsonl").write_text('{"step": 1}\n')
    return {"uri": uri, "runs": runs}


def _same_store(uri: str, runs: list[str]):
    c = MlflowClient(uri)
    assert sorted(r.info.run_name for r in c.search_runs([c.get_experiment_by_name("campaign").experiment_id])) == \
        ["cell0", "cell1", "cell2"]
    for i, r in enumerate(runs):
        hist = c.get_metric_history(r, "train/loss")
        assert [m.value for m in hist][:2] == [1.0 / (1 + i), 1.0 / (2 + i)] and len(hist) == 50
        assert c.get_run(r).data.tags["note"] == f"run {i}"
    assert c.get_model_version_by_alias("dflash-drafter", "champion").run_id == runs[0]


def test_dump_and_restore_keep_every_row(tmp_path):
    s = _store(tmp_path / "a")
    size = dump_store(tmp_path / "a" / "mlflow.db", tmp_path / "b.sql")
    assert size == (tmp_path / "b.sql").stat().st_size > 0
    restore_store(tmp_path / "b.sql", tmp_path / "b.db")
    _same_store(f"sqlite:///{tmp_path / 'b.db'}", s["runs"])
    with pytest.raises(FileExistsError, match="b.db: a store is already there"):
        restore_store(tmp_path / "b.sql", tmp_path / "b.db")


def test_a_broken_dump_leaves_no_store(tmp_path):
    s = _store(tmp_path / "a")
    dump_store(tmp_path / "a" / "mlflow.db", tmp_path / "x.sql")
    text = (tmp_path / "x.sql").read_text()
    (tmp_path / "x.sql").write_text(text[: len(text) // 2])  # cut mid-statement: a copy that did not finish
    with pytest.raises(ValueError, match="x.sql: not a complete SQL dump"):
        restore_store(tmp_path / "x.sql", tmp_path / "x.db")
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "x.db.partial").exists()
    assert s["runs"]


def test_pack_store_then_unpack_elsewhere(tmp_path):
    """job_env.sh's pack_store, as the GPU jobs call it, then `unpack` in another folder: the database comes back
    from its dump with relative artifact locations, the weights stay out, and the machine's own store is untouched."""
    work = tmp_path / "machine"
    s = _store(work / "campaign_out")
    before = (work / "campaign_out" / "mlflow.db").read_bytes()
    env = {**os.environ, "PY": shutil.which("python") or "python"}
    script = f"source {ROOT / 'benchmarks/leased_gpu/job_env.sh'} 2>/dev/null; pack_store out.tar.xz campaign_out/mlflow.db campaign_out"
    subprocess.run(["bash", "-c", script], cwd=work, env=env, check=True)
    assert (work / "campaign_out" / "mlflow.db").read_bytes() == before  # the live store: not relocated, not moved
    assert not list((work / "campaign_out").glob("mlflow.sql*")) and not list((work / "campaign_out").glob("*.pack"))
    with tarfile.open(work / "out.tar.xz") as t:
        names = t.getnames()
    assert "campaign_out/mlflow.sql" in names and "campaign_out/mlflow.db" not in names
    assert not any(n.endswith(".pt") or "checkpoints" in n for n in names)
    assert "campaign_out/runs/cell0/metrics.jsonl" in names

    there = tmp_path / "elsewhere"
    there.mkdir()
    assert main(["unpack", str(work / "out.tar.xz"), str(there)]) == 0
    db = there / "campaign_out" / "mlflow.db"
    assert db.is_file() and not (there / "campaign_out" / "mlflow.sql").exists()
    _same_store(f"sqlite:///{db}", s["runs"])
    con = sqlite3.connect(db)
    uris = [u for (u,) in con.execute("SELECT artifact_uri FROM runs")]
    con.close()
    assert all(u.startswith("mlartifacts/") for u in uris), uris  # relative: shows wherever it is unpacked
    assert main(["unpack", str(work / "out.tar.xz"), str(there)]) == 2  # the store there is not replaced


def test_an_archive_with_the_database_itself_unpacks_as_it_is(tmp_path):
    """Stores packed before the dumps (up to 2026-12-03) hold mlflow.db: unpack extracts it unchanged."""
    s = _store(tmp_path / "src" / "sweeps_out")
    with tarfile.open(tmp_path / "old.tar.xz", "w:xz") as t:
        t.add(tmp_path / "src" / "sweeps_out", arcname="sweeps_out")
    assert unpack(tmp_path / "old.tar.xz", tmp_path / "dst") == []
    _same_store(f"sqlite:///{tmp_path / 'dst' / 'sweeps_out' / 'mlflow.db'}", s["runs"])


def _use_store(work: Path, archive: Path) -> str:
    """job_env.sh's use_store in `work`, as campaign.sh calls it: what it said."""
    env = {**os.environ, "PY": shutil.which("python") or "python"}
    script = f"source {ROOT / 'benchmarks/leased_gpu/job_env.sh'} 2>/dev/null; use_store campaign_out {archive}"
    return subprocess.run(["bash", "-c", script], cwd=work, env=env, check=True, capture_output=True,
                          text=True).stderr


def test_use_store_continues_the_committed_store_where_only_a_truth_folder_is(tmp_path):
    """sweep.sh's TRUTH= had extracted campaign_out/<name>/truth, and the campaign job after it took that
    folder for the store and ran its cells in a new, empty one. A folder without its database is not a store: the
    committed one is unpacked into it; a warm machine's store (its database there) is kept; no archive, a new one."""
    packed = tmp_path / "packed"
    s = _store(packed / "campaign_out")
    env = {**os.environ, "PY": shutil.which("python") or "python"}
    subprocess.run(["bash", "-c", f"source {ROOT / 'benchmarks/leased_gpu/job_env.sh'} 2>/dev/null; "
                    "pack_store store.tar.xz campaign_out/mlflow.db campaign_out"], cwd=packed, env=env, check=True)
    archive = packed / "store.tar.xz"

    machine = tmp_path / "machine"
    truth = machine / "campaign_out" / "reference_64m" / "truth"
    truth.mkdir(parents=True)
    (truth / "gt.json").write_text("{}")
    said = _use_store(machine, archive)
    assert f"{archive}, unpacked" in said
    db = machine / "campaign_out" / "mlflow.db"
    _same_store(f"sqlite:///{db}", s["runs"])  # every committed run, beside the truth folder
    assert (truth / "gt.json").read_text() == "{}"

    kept = db.read_bytes()
    assert "as this machine kept it" in _use_store(machine, archive) and db.read_bytes() == kept

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert "none committed" in _use_store(fresh, tmp_path / "absent.tar.xz")
    assert not (fresh / "campaign_out").exists()
