"""One study database for every worker: three sweep launches (three machines, or three Slurm jobs) on one real
PostgreSQL server share one study and finish every trial once: none lost, none twice.

The server is Debian's `postgresql` package (.ci/run installs it), started here in a temporary folder with
initdb / pg_ctl; as root it runs as the `postgres` user (the server refuses root). Skipped where neither is there."""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parent.parent


def _pg_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def eval_cache(tmp_path):
    return tmp_path / "eval_cache"


@pytest.fixture
def postgres_url():
    """A PostgreSQL server of its own (trust auth on 127.0.0.1), stopped and removed after the test."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install -y postgresql; .ci/run does)")
    pytest.importorskip("psycopg")
    as_root = os.geteuid() == 0
    if as_root and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start the server as the postgres user")
    base = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
    base.chmod(0o755)
    data, port = base / "data", _free_port()

    def pg(*cmd: str) -> None:
        full = [str(bin_dir / cmd[0]), *cmd[1:]]
        if as_root:
            full = ["runuser", "-u", "postgres", "--", *full]
        subprocess.run(full, check=True, capture_output=True, timeout=120)
    if as_root:
        shutil.chown(base, "postgres")
    try:
        pg("initdb", "-D", str(data), "-U", "dflash", "--auth=trust", "-E", "UTF8")
        pg("pg_ctl", "-D", str(data), "-l", str(base / "server.log"), "-w", "start",
           "-o", f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=200")
        yield f"postgresql://dflash@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


def _launch(tmp: Path, cache: Path, url: str, n: int) -> subprocess.Popen:
    """One machine's launch: its own process, its own run folders, the shared study and MLflow store."""
    cmd = [sys.executable, "-m", "sweeps.launch", "cpu_smoke", f"storage={url}", "study=shared", f"n_trials={n}",
           "workers=1", f"out={tmp / 'out'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
           "tracking.experiment=sweeps", f"eval.cache_dir={cache}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_three_workers_share_one_postgres_study_without_loss_or_duplicate(postgres_url, tmp_path, eval_cache):
    from sweeps.storage import make_storage
    # the first launch creates the study and its MLflow parent run; the other two join it, as on other machines
    first = _launch(tmp_path, eval_cache, postgres_url, 2)
    for _ in range(600):
        try:
            study = optuna.load_study(study_name="shared", storage=make_storage(postgres_url))
            if study.user_attrs.get("mlflow.parent_run_id"):
                break
        except KeyError:  # not created yet
            pass
        assert first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.5)
    others = [_launch(tmp_path, eval_cache, postgres_url, 2) for _ in range(2)]
    for p in [first, *others]:
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, log[-3000:]
    study = optuna.load_study(study_name="shared", storage=make_storage(postgres_url))
    trials = study.get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(6))  # 3 × 2: none lost, none twice
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials), [t.state for t in trials]
    run_dirs = [t.user_attrs["sweep.run_dir"] for t in trials]
    assert len(set(run_dirs)) == 6 and all(Path(d).is_dir() for d in run_dirs)
    assert len({t.user_attrs["sweep.pid"] for t in trials}) == 3  # every launch ran its share
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sweeps")
    children = client.search_runs([exp.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{study.user_attrs['mlflow.parent_run_id']}'")
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == list(range(6))
