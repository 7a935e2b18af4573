"""Fault injection, fourth round (issue 59's table, one test or more per row): a store that a stop during its
creation cannot break, bounded waits on a dead or silent tracking server for every command, checksum manifests on
exports, MLflow backfilled from metrics.jsonl on resume, no folder left by a stop before the first step, a sweep's
parent run closed FAILED, `champion` looked up before the target loads, bad input named with exit 2 and nothing
left behind, and the suite's own venv-in-the-clone case."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from dflash.config import ConfigError, validate
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _compose(tmp, *overrides, run="r"):
    from experiments.config import compose_config
    return compose_config(FAST + [f"run_dir={tmp / run}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                  *overrides])


def _healthy_logger(uri: str):
    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ml = MLflowLogger(TrackingConfig(tracking_uri=uri, console=False, system_metrics=False))
    ml.log({"train/loss": 1.0}, 1)
    ml.close("FINISHED")
    return ml


# ------------------------------------------------------------------ row 1: the store's creation
_CREATE = "import sys; from dflash.tracking.transport import prepare_store; prepare_store(sys.argv[1])"


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_stop_while_the_store_is_created_leaves_one_that_tracks(tmp_path, sig):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    p = subprocess.Popen([sys.executable, "-c", _CREATE, uri], env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:  # mid-migration: the file has grown past its start
        if any(_size(f) > 100_000 for f in tmp_path.glob("mlflow.db*") if not f.name.endswith(".lock")):
            break
        time.sleep(0.02)
    assert p.poll() is None, "the store was made before the stop could land"
    p.send_signal(sig)
    p.wait(timeout=60)
    assert not db.exists() or _size(db) > 100_000  # the path holds a whole store or nothing
    ml = _healthy_logger(uri)
    assert ml.healthy and ml.run_id
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]  # no temp file left


def _half_made(db: Path, runs: int) -> None:
    """A store cut short mid-migration: some tables, an old schema revision, `runs` rows."""
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL);"
                      "INSERT INTO alembic_version VALUES ('451aebb31d03');"
                      "CREATE TABLE experiments (experiment_id INTEGER, name TEXT);"
                      "CREATE TABLE runs (run_uuid TEXT);")
    con.executemany("INSERT INTO runs VALUES (?)", [(f"r{i}",) for i in range(runs)])
    con.commit()
    con.close()


def test_a_half_made_store_without_runs_is_made_again(tmp_path):
    db = tmp_path / "mlflow.db"
    _half_made(db, runs=0)
    with pytest.warns(RuntimeWarning, match=r"half-made MLflow store .* moved to mlflow\.db\.half-made-"):
        from dflash.tracking.store import check_tracking_uri
        check_tracking_uri(f"sqlite:///{db}")
    assert _healthy_logger(f"sqlite:///{db}").healthy
    assert len(list(tmp_path.glob("mlflow.db.half-made-*"))) == 1  # kept, not deleted


def test_a_damaged_store_with_runs_exits_2_with_its_repair_before_any_work(tmp_path):
    db = tmp_path / "mlflow.db"
    _half_made(db, runs=3)
    out = subprocess.run([sys.executable, "-m", "experiments.run", *FAST, f"run_dir={tmp_path / 'r'}",
                          f"tracking.tracking_uri=sqlite:///{db}"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "tracking.tracking_uri=" in err[0] and f"mlflow db upgrade sqlite:///{db}" in err[0]
    assert not (tmp_path / "r").exists()


def test_a_store_left_with_a_hot_journal_by_a_kill_is_rolled_back_and_tracks(tmp_path):
    """A process killed inside a write transaction (kill -9, the OOM killer, a lost machine) leaves a hot journal
    beside the store; the next run's check rolls it back and tracks, where a read-only check had refused the store
    as unreadable ("attempt to write a readonly database") and a resume after a kill could not start."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    first = _healthy_logger(uri)
    # a tiny page cache spills the uncommitted rows into the file, so the journal is hot when the process dies
    code = ("import os, sqlite3, sys; con = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "con.execute('PRAGMA cache_size=1'); con.execute('BEGIN'); "
            "[con.execute('INSERT INTO tags (key, value, run_uuid) VALUES (?, ?, ?)', (f'k{i}', 'x' * 200, 'r')) "
            "for i in range(3000)]; os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(db)], check=True, timeout=120)
    assert (tmp_path / "mlflow.db-journal").is_file()
    from dflash.tracking.store import check_tracking_uri
    check_tracking_uri(uri)  # refused before the fix
    assert not (tmp_path / "mlflow.db-journal").exists()
    second = _healthy_logger(uri)
    assert second.healthy and second.run_id != first.run_id
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM tags WHERE run_uuid = 'r'").fetchone()[0] == 0  # rolled back
    con.close()


# ------------------------------------------------------------------ row 9: a URI that cannot be tracked
def test_an_untrackable_uri_exits_2_before_any_work(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.run", *FAST, f"run_dir={tmp_path / 'r'}",
                          "tracking.tracking_uri=bogus://x"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: tracking.tracking_uri=bogus://x" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, no store


def test_tracking_off_does_not_check_the_uri(tmp_path):
    from dflash.app.run import check_tracking
    check_tracking(_compose(tmp_path, "tracking.tracking_uri=bogus://x", "tracking.enabled=false"))
    with pytest.raises(ConfigError, match=r"tracking\.tracking_uri=bogus://x.*not a tracking store"):
        check_tracking(_compose(tmp_path, "tracking.tracking_uri=bogus://x"))


# ------------------------------------------------------------------ row 2: bounded waits for every command
@pytest.fixture
def silent_server():
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel completes the handshake; nobody ever answers
    yield f"http://127.0.0.1:{mute.getsockname()[1]}"
    mute.close()


def _dead_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("server", ["silent", "dead"])
def test_promote_against_a_silent_or_dead_server_is_one_line_within_seconds(silent_server, server):
    uri = silent_server if server == "silent" else _dead_port()
    env = {k: v for k, v in ENV.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}  # the library's own bounds
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "experiments.promote", "0" * 32, "--dry-run", "--tracking-uri", uri],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "does not answer" in err[0] and uri.split("//")[1] in err[0]
    assert took < 25, took  # 5 s bound, the rest the interpreter's imports


def test_every_command_opens_its_store_through_the_bounded_client():
    """No MlflowClient made outside the store module, the logger, and reports of finished studies."""
    allowed = {"dflash/tracking/store.py", "dflash/tracking/mlflow_logger.py", "dflash/tracking/analysis.py",
               "sweeps/support.py", "sweeps/sweep_report.py", "sweeps/campaign_mlflow.py"}
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("dflash", "experiments", "sweeps")
             for p in sorted((ROOT / d).rglob("*.py")) if str(p.relative_to(ROOT)) not in allowed
             for i, line in enumerate(p.read_text().splitlines(), 1) if "MlflowClient(" in line]
    assert found == []


# ------------------------------------------------------------------ a trained run for rows 3 and 7
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dflash.app.run import train
    tmp = tmp_path_factory.mktemp("trained")
    res = train(_compose(tmp, run="run"))
    return res.run_dir, tmp


# ------------------------------------------------------------------ row 3: weights checked before use
def test_an_export_writes_a_manifest_that_loading_verifies(trained, tmp_path):
    import shutil

    from dflash.safe_load import MANIFEST, UnsafeFileError
    from dflash.serving.export import load_drafter
    run_dir, _ = trained
    folder = tmp_path / "final"
    shutil.copytree(run_dir / "final", folder)
    lines = (folder / MANIFEST).read_text().splitlines()
    assert sorted(ln.split("  ")[1] for ln in lines) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    load_drafter(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of weight data
    weights.write_bytes(bytes(data))
    with pytest.raises(UnsafeFileError, match=r"model\.safetensors: its sha256 differs from checksums\.sha256"):
        load_drafter(folder)


def test_eval_refuses_a_flipped_byte_before_the_target_loads(trained, tmp_path, monkeypatch):
    import shutil

    from experiments import eval as eval_cli
    run_dir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    weights = copy / "final" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(eval_cli, "Target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ConfigError, match=r"final/model\.safetensors: its sha256 differs"):
        eval_cli.main([str(copy), f"--out={tmp_path / 'out'}"])


def test_a_published_folder_with_a_torn_header_is_one_line_naming_it(trained, tmp_path):
    import shutil

    from dflash.safe_load import MANIFEST, UnsafeFileError
    from dflash.serving.export import load_drafter
    folder = tmp_path / "published"
    shutil.copytree(trained[0] / "final", folder)
    (folder / MANIFEST).unlink()  # a published drafter: no manifest, its structure is checked
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])  # the header's length field
    with pytest.raises(UnsafeFileError, match=r"published/model\.safetensors: unreadable safetensors"):
        load_drafter(folder)


def test_a_target_folder_of_pickled_weights_is_refused_by_name(tmp_path):
    import shutil
    folder = tmp_path / "target"
    folder.mkdir()
    shutil.copy(ROOT / "dflash/assets/reference_target/config.json", folder / "config.json")
    torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"target\.path=.*pytorch_model\.bin holds pickled weights") as e:
        validate(_compose(tmp_path, f"target.path={folder}", "target.layer_ids=[1]"))
    assert "weights_only" not in str(e.value)


# ------------------------------------------------------------------ row 7: champion before the target
def test_a_missing_champion_is_found_before_the_target_loads(trained, tmp_path, monkeypatch):
    from experiments import eval as eval_cli
    monkeypatch.setattr(eval_cli, "Target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ConfigError, match=r"B='champion': no dflash-drafter@champion|B='champion': no .*@champion"):
        eval_cli.main([str(trained[0]), "champion", f"--out={tmp_path / 'out'}"])


# ------------------------------------------------------------------ row 4: MLflow gets what metrics.jsonl has
@pytest.mark.slow
def test_resume_sends_mlflow_the_steps_it_lost(tmp_path):
    from mlflow.tracking import MlflowClient

    from dflash.app.run import train
    res = train(_compose(tmp_path, run="cut"))
    info = json.loads((res.run_dir / "mlflow_run.json").read_text())
    con = sqlite3.connect(tmp_path / "mlflow.db")  # the MLflow calls in flight at a kill -9: never stored
    con.execute("DELETE FROM metrics WHERE run_uuid = ? AND step >= 5", (info["run_id"],))
    con.commit()
    con.close()
    client = MlflowClient(info["tracking_uri"])
    assert sorted(m.step for m in client.get_metric_history(info["run_id"], "train/loss")) == [1, 2, 3, 4]
    from experiments.config import resume_config
    train(resume_config(str(res.run_dir), ["trainer.max_steps=8"]))  # as `experiments.run resume=… trainer.max_steps=8`
    steps = sorted(m.step for m in client.get_metric_history(info["run_id"], "train/loss"))
    assert steps == list(range(1, 9))  # each once: the lost 5 and 6 sent, 7 and 8 trained
    local = {r["step"]: r["train/loss"] for r in map(json.loads, (res.run_dir / "metrics.jsonl").read_text()
                                                     .splitlines()) if "train/loss" in r}
    assert {m.step: m.value for m in client.get_metric_history(info["run_id"], "train/loss")} == local


# ------------------------------------------------------------------ row 5: a stop before the first step
_STOP_AS_MLFLOW_OPENS = textwrap.dedent("""
    import os, signal, sys
    from dflash.app import run as app_run
    real = app_run.TrainingRun._loggers
    def loggers(self):  # `timeout` lands while the run's MLflow run opens, after its folder is made
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self)
    app_run.TrainingRun._loggers = loggers
    from experiments.config import run_cli
    from experiments.run import main
    sys.argv = ["experiments.run", *sys.argv[1:]]
    run_cli(main)
""")


@pytest.mark.slow
def test_a_stop_before_the_first_step_leaves_no_run(tmp_path):
    from mlflow.tracking import MlflowClient
    out = subprocess.run([sys.executable, "-c", _STOP_AS_MLFLOW_OPENS, *FAST,
                          f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 143 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "stopped by SIGTERM before the first step" in out.stderr
    assert not (tmp_path / "runs").exists()  # neither the run folder nor the runs/ made for it
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dflash").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


@pytest.mark.slow
def test_a_folder_stopped_before_its_first_checkpoint_resumes_from_step_0(tmp_path):
    """What a kill -9 during setup leaves (config.yaml, nothing else): `resume=` trains it from step 0."""
    from dflash.app.run import train
    from dflash.config import to_dict
    from dflash.run_dir import RunDir
    from experiments.config import resume_config
    folder = RunDir(tmp_path / "cut").create()
    folder.write_config(to_dict(_compose(tmp_path, run="cut")))
    res = train(resume_config(str(folder.root), []))
    steps = [r["step"] for r in map(json.loads, (folder.root / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r]
    assert steps == list(range(1, 7)) and res.checkpoint == folder.final and folder.newest_checkpoint_step() == 6


# ------------------------------------------------------------------ row 6: sweeps on a CPU, a failed sweep
def test_a_failed_sweep_closes_its_parent_run_failed(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    import sweeps.worker
    from sweeps import launch

    def broken(*a, **k):
        raise RuntimeError("a worker fault")
    monkeypatch.setattr(sweeps.worker, "worker_main", broken)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(RuntimeError, match="a worker fault"):
        launch.main(["cpu_smoke", "n_trials=1", "workers=1", f"out={tmp_path / 'out'}",
                     f"tracking.tracking_uri={uri}"])
    client = MlflowClient(uri)
    parents = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
               if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.status for r in parents] == ["FAILED"]


def test_a_gpu_sweep_on_a_cpu_says_so_before_it_starts(tmp_path, monkeypatch, capsys):
    from sweeps import launch
    from sweeps.space import load_sweep, merge_overrides
    monkeypatch.setattr(launch, "detect_gpus", lambda: [])
    args = launch.parse_args(["loss_variants", "n_trials=2", "workers=2", "trainer.device=cpu"])
    sweep = load_sweep("loss_variants")
    cfg = launch.validate(sweep, merge_overrides(sweep.fixed, args.overrides), tmp_path)
    assert launch.warn_cpu_budget(args, sweep, cfg)
    err = capsys.readouterr().err
    assert "3,125 steps" in err and "heldout (128 prompts x 256 tokens) + coding10 (10 prompts" in err
    assert "sweeps.launch cpu_smoke" in err
    smoke = load_sweep("cpu_smoke")
    small = launch.validate(smoke, merge_overrides(smoke.fixed, ["trainer.device=cpu"]), tmp_path)
    assert not launch.warn_cpu_budget(launch.parse_args(["cpu_smoke", "n_trials=2"]), smoke, small)


def test_pruner_type_none_drops_the_old_pruners_options():
    from sweeps.space import load_sweep
    assert load_sweep("cpu_smoke", ["pruner.type=none"]).pruner.type == "none"


def test_campaign_seeds_that_are_not_integers_are_named():
    import yaml

    from sweeps.campaign_spec import parse_campaign
    raw = yaml.safe_load((ROOT / "conf/campaign/reference.yaml").read_text())
    with pytest.raises(ConfigError, match=r"seeds='abc'; expected a non-empty list of distinct integers"):
        parse_campaign({**raw, "seeds": "abc"}, "campaign")


# ------------------------------------------------------------------ row 8: bad input, exit 2, nothing left
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has the device")
def test_a_cuda_device_on_a_cpu_machine_is_named(tmp_path):
    for key in ("trainer.device", "target.device", "eval.device"):
        with pytest.raises(ConfigError, match=rf"^{key}=cuda: this machine has no CUDA GPU"):
            validate(_compose(tmp_path, f"{key}=cuda"))
    with pytest.raises(ConfigError, match=r"trainer\.device='gpu0': not a device"):
        validate(_compose(tmp_path, "trainer.device=gpu0"))


def test_a_run_dir_that_cannot_be_made_is_named(tmp_path):
    from dflash.app.run import TrainingRun
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"run_dir=.*file/x/y: the run folder cannot be made"):
        TrainingRun(_compose(tmp_path, f"run_dir={blocker / 'x' / 'y'}"))
    with pytest.raises(ConfigError, match=r"run_dir=/proc/x/y: the run folder cannot be made"):
        TrainingRun(_compose(tmp_path, "run_dir=/proc/x/y"))


def test_a_pool_without_prompts_that_fit_names_max_prompt_len():
    from dflash.data.pool import PoolConfig, _mix
    with pytest.raises(ConfigError, match=r"data\.pool\.max_prompt_len"):
        _mix([], [], PoolConfig(max_prompt_len=16, chunk_max_len=16), corpus=None, tokenizer=None)


# ------------------------------------------------------------------ row 10: malformed chat data leaves no runs/
def test_malformed_chat_data_leaves_no_runs_folder(tmp_path):
    bad = tmp_path / "data" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    out = subprocess.run([sys.executable, "-m", "experiments.run", "+target=tiny_random_chat", "+data=conversations",
                          f"data.path={bad}", f"data.conversations.cache_dir={tmp_path / 'hf'}", "+eval=off",
                          "tracking.enabled=false", "trainer.max_steps=1"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "bad.jsonl: line 2" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ row 11: a venv inside the clone
def test_the_fresh_interpreter_keeps_a_venv_made_inside_the_clone():
    from tests.test_export import REPO_SOURCE
    scope: dict = {}
    exec(REPO_SOURCE, scope)
    ours = scope["repo_source"]
    repo = str(ROOT)
    assert ours(repo, repo) and ours(f"{repo}/benchmarks", repo) and ours("", repo)
    assert not ours(f"{repo}/.venv/lib/python3.12/site-packages", repo)  # torch lives there
    assert not ours("/usr/lib/python3/dist-packages", repo) and not ours(f"{repo}-other", repo)
