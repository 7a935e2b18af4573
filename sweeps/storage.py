"""Optuna storage for a sweep, and what keeps a study usable when a worker dies mid-trial.

Storage (`storage=` on the command line):
- a file path (default `sweeps_out/<study>.journal`) or `journal:///abs/path`: Optuna's journal file
  (`JournalStorage(JournalFileBackend(path))`), safe for several worker processes on one machine.
- an RDB URL (`postgresql://user:pw@host/db`, `mysql+pymysql://…`, `sqlite:///x.db`): `RDBStorage` with
  Optuna's heartbeat (`HEARTBEAT_S`, `GRACE_S`), so workers on several machines can share one study and a
  trial whose worker stopped beating is failed by the next worker (`optuna.storages.fail_stale_trials`).
  The launcher creates the study (and an sqlite file's schema) once, before any worker starts.

Dead workers: the journal has no heartbeat, so each worker process holds an exclusive `flock` on its own
lease file (`<out>/<study>/leases/<host>-<pid>-<token>.lease`) for its whole life and records that path on
every trial it runs. The kernel drops the lock when the process dies (SIGKILL included): a RUNNING trial of
this host whose lease can be locked again is stale, and `reap_stale` marks it FAIL (and its MLflow child run
FAILED). Workers reap before every trial; the launcher reaps when a worker exits abnormally and at the start
and end of every launch. Trials of other hosts are left to the RDB heartbeat.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import secrets
import socket
import warnings
from pathlib import Path
from typing import Any

HEARTBEAT_S = 30
GRACE_S = 120
UNTAGGED_GRACE_S = 600  # a RUNNING trial that never got its lease attr (died between ask and tag)

ATTR_LEASE, ATTR_HOST, ATTR_PID = "sweep.lease", "sweep.host", "sweep.pid"


def is_rdb(desc: str) -> bool:
    return "://" in desc and not desc.startswith(("journal://", "file://"))


def journal_path(desc: str) -> Path:
    for prefix in ("journal://", "file://"):
        if desc.startswith(prefix):
            return Path(desc[len(prefix):])
    return Path(desc)


def ensure_sqlite_dir(uri: str) -> None:
    """sqlite:///rel/x.db or sqlite:////abs/x.db: create the file's folder (sqlite will not)."""
    from dflash.tracking.run_info import sqlite_db_path
    db = sqlite_db_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)


def make_storage(desc: str):
    import optuna

    if is_rdb(desc):
        ensure_sqlite_dir(desc)
        engine_kwargs = {"connect_args": {"timeout": 60}} if desc.startswith("sqlite") else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(desc, engine_kwargs=engine_kwargs,
                                              heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = journal_path(desc)
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def describe(desc: str) -> str:
    from sweeps.support import redact_uri
    return redact_uri(desc) if is_rdb(desc) else str(journal_path(desc).resolve())


class Lease:
    """An exclusive flock held for the life of a worker process; its file says the host, the pid and the GPU."""

    def __init__(self, lease_dir: str | os.PathLike, gpu: str | None = None):
        d = Path(lease_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.path = (d / f"{self.host}-{self.pid}-{secrets.token_hex(3)}.lease").resolve()
        self.lease_dir, self.gpu = d, gpu
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._info = {"host": self.host, "pid": self.pid, "gpu": gpu, "since": _dt.datetime.now().isoformat()}
        os.write(self._fd, json.dumps(self._info).encode())

    def leave_gpu_if_others_stay(self) -> int:
        """How many other live workers stay on this worker's GPU; where one or more do, this worker is marked as
        leaving it (no longer counted by `workers_on_gpu`). Decided under the GPU's lock in the lease folder, so
        workers that run out of memory together cannot all leave and strand the trials they queued again."""
        from dflash.tracking.store import exclusive
        with exclusive(self.lease_dir / f"gpu-{self.gpu}.lock", timeout=60):
            staying = workers_on_gpu(self.lease_dir, self.gpu) - 1
            if staying >= 1:
                self._info["leaving"] = True
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, json.dumps(self._info).encode(), 0)
            return staying

    def attrs(self) -> dict[str, Any]:
        return {ATTR_LEASE: str(self.path), ATTR_HOST: self.host, ATTR_PID: self.pid}

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None


def lease_alive(path: str | os.PathLike) -> bool:
    """True while the process that took the lease lives (its flock is held)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def workers_on_gpu(lease_dir: str | os.PathLike, gpu: str) -> int:
    """How many live workers of this host hold a lease on `gpu` (`Lease`) and stay there, the caller's own
    included (not those leaving it: `Lease.leave_gpu_if_others_stay`)."""
    host, n = socket.gethostname(), 0
    for path in Path(lease_dir).glob("*.lease"):
        try:
            info = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):  # a lease being written or gone: not counted
            continue
        n += (info.get("host") == host and info.get("gpu") == gpu and not info.get("leaving")
              and lease_alive(path))
    return n


def reap_stale(study, tracker=None) -> list[int]:
    """Mark FAIL the RUNNING trials of this host whose worker is gone; returns their numbers.
    With an RDB storage, also Optuna's heartbeat-stale trials (any host)."""
    import optuna
    from optuna.trial import TrialState

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ExperimentalWarning
            optuna.storages.fail_stale_trials(study)  # no-op without an RDB heartbeat
    except Exception:  # noqa: BLE001 - best effort
        pass
    host = socket.gethostname()
    now = _dt.datetime.now()
    reaped: list[int] = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        ua = t.user_attrs
        lease = ua.get(ATTR_LEASE)
        if lease is None:
            started = t.datetime_start or now
            if (now - started).total_seconds() < UNTAGGED_GRACE_S:
                continue
            reason = "never tagged by a worker (died between ask and start)"
        elif ua.get(ATTR_HOST) != host or lease_alive(lease):
            continue
        else:
            reason = f"worker pid {ua.get(ATTR_PID)} on {ua.get(ATTR_HOST)} died mid-trial"
        try:
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        except Exception:  # noqa: BLE001 - finished meanwhile
            continue
        reaped.append(t.number)
        run_id = ua.get("mlflow.run_id")
        if tracker is not None and run_id:
            tracker.finish_child(run_id, "FAIL", {"optuna.fail_reason": reason})
    return reaped
