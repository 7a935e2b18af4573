"""The tracking store, checked or made before any work: a URI MLflow can track, a sqlite file created whole.

A fresh sqlite store is migrated by the first client that opens it (alembic, ~30 revisions, a few seconds). A
SIGTERM or Ctrl-C in that window used to leave a half-migrated `mlflow.db` that every later run opened, failed on
and ran untracked with only a warning. Here the schema is built in a temporary file beside the database, under
the exclusive lock on `<db>.lock` with SIGTERM / SIGINT deferred, and renamed into place: the database's path
holds a whole store or nothing. A store found half-made (an older dflash, a copy cut short) is moved aside and
made again when it holds no run; one that holds runs is named in an error that says how to repair it.

`check_tracking_uri(uri)` is what a command calls before its work: StoreError (a ValueError) for a URI MLflow
cannot track or a store that cannot be repaired. `open_client(uri)` adds the bounded HTTP check
(`transport.http_preflight`) and returns an `MlflowClient`: every command's way to its store.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

# How long a process waits for another one creating the same sqlite store.
STORE_LOCK_TIMEOUT_S = 120.0
_CREATING = ".creating-"  # <db>.creating-<pid>: a store being built (left by a process killed with -9)


class StoreError(ValueError):
    """A tracking URI that cannot be tracked, or a store that is damaged (the message says how to repair it)."""


def check_scheme(uri: str) -> None:
    """StoreError naming `uri` when MLflow has no store for its scheme (e.g. `bogus://x`)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry
    try:
        registry.get_store_builder(uri)
    except Exception:  # noqa: BLE001 - MLflow's "unsupported URI" exception (its class moved between versions)
        from urllib.parse import urlsplit
        known = ", ".join(sorted(k for k in getattr(registry, "_registry", {}) if k))
        raise StoreError(f"{uri!r} is not a tracking store MLflow can use (scheme {urlsplit(uri).scheme!r}; "
                         f"expected one of {known}, e.g. sqlite:///mlflow.db)") from None


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM / SIGINT received inside are delivered on leaving (main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: got.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, prev in previous.items():
            signal.signal(s, prev)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)


@contextlib.contextmanager
def exclusive(lock: Path, timeout: float) -> Iterator[None]:
    """An exclusive `flock` on `lock` (released by the kernel if the process dies), waiting at most `timeout` s."""
    import fcntl
    with open(lock, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process holds {lock} for more than {timeout:g} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _head_revision() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision
    return _get_latest_schema_revision()


def store_state(db: Path) -> tuple[str | None, int | None]:
    """(the schema revision, the number of runs) of a sqlite store, None where the table is missing. Opened
    read-write (never created): a process killed inside a transaction (SIGKILL, OOM, a lost machine) leaves a hot
    journal, which sqlite rolls back on the next open, and a read-only connection cannot: it failed with "attempt to
    write a readonly database", and a resume after a kill -9 was refused as an unreadable store."""
    con = sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=30)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        rev = con.execute("SELECT version_num FROM alembic_version").fetchone() if "alembic_version" in tables \
            else None
        runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else None
        return (rev[0] if rev else None), runs
    finally:
        con.close()


def _build(db: Path) -> None:
    """The whole schema in `<db>.creating-<pid>`, renamed onto `db` (signals deferred until it is in place)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    tmp = db.with_name(f"{db.name}{_CREATING}{os.getpid()}")
    with signals_deferred():
        try:
            from mlflow.tracking._tracking_service.utils import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
            tmp_uri = f"sqlite:///{tmp}"
            store = SqlAlchemyStore(tmp_uri, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
            store.engine.dispose()  # every connection closed: no journal left beside the file
            SqlAlchemyStore._engine_map.pop(tmp_uri, None)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, db)
            fd = os.open(db.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _repair_hint(uri: str, db: Path) -> str:
    return (f"back it up, then run `mlflow db upgrade {uri}`; or move {db} aside to start a new store "
            f"(its runs stay in the moved file)")


def prepare_sqlite(uri: str, db: Path, lock_timeout: float = STORE_LOCK_TIMEOUT_S) -> None:
    """Make `db` a whole store at the current schema, under its lock: built when missing or empty, rebuilt when
    half-made and holding no run (the old file kept beside it), else StoreError saying how to repair it."""
    db.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(db.with_name(db.name + ".lock"), lock_timeout):
        for stale in db.parent.glob(f"{db.name}{_CREATING}*"):  # a builder killed with -9: we hold the lock
            stale.unlink(missing_ok=True)
        if not db.exists() or db.stat().st_size == 0:
            _build(db)
            return
        try:
            rev, runs = store_state(db)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{db}: not a readable MLflow store ({e}); {_repair_hint(uri, db)}") from e
        head = _head_revision()
        if rev == head:
            return
        if not runs:
            aside = db.with_name(f"{db.name}.half-made-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(db, aside)
            warnings.warn(f"{db}: a half-made MLflow store (schema {rev or 'none'}, no runs; its creation was "
                          f"stopped) was moved to {aside.name} and the store made again", RuntimeWarning,
                          stacklevel=3)
            _build(db)
            return
        raise StoreError(f"{db}: MLflow schema revision {rev or 'none'} with {runs} runs, expected {head} (a "
                         f"migration that did not finish, or a store of another MLflow version); "
                         f"{_repair_hint(uri, db)}")


def check_tracking_uri(uri: str, lock_timeout: float = STORE_LOCK_TIMEOUT_S) -> None:
    """Before any work: StoreError unless MLflow can track at `uri`; a sqlite store is made or checked here
    (`prepare_sqlite`). HTTP stores are checked where they are opened (`transport.prepare_store`)."""
    from dflash.tracking.run_info import sqlite_db_path
    check_scheme(uri)
    db = sqlite_db_path(uri)
    if db is None:
        return
    try:
        prepare_sqlite(uri, db, lock_timeout)
    except TimeoutError:
        raise
    except OSError as e:  # a folder that cannot hold it: read-only, not a folder, no space
        raise StoreError(f"{db}: the store cannot be made or opened there ({type(e).__name__}: "
                         f"{e.strerror or e})") from e


def open_client(uri: str, registry: bool = False) -> Any:
    """An `MlflowClient` on `uri` once the store answers: a URI MLflow can track (StoreError), an HTTP server
    that answers within seconds (ConnectionError naming it), a sqlite file made whole (`prepare_sqlite`)."""
    from dflash.tracking.transport import prepare_store
    check_scheme(uri)
    prepare_store(uri)
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri, registry_uri=uri if registry else None)
