"""One exclusive lock per MLflow registry around the promotion gate's read-compare-set (dflash.serving.promotion),
so two promotions racing cannot both win: the second reads the first one's result as its holder."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

from dflash.tracking.run_info import sqlite_db_path

log = logging.getLogger(__name__)


def _lock_path(uri: str) -> Path:
    db = sqlite_db_path(uri)
    if db is not None:
        return db.with_name(db.name + ".promote.lock")
    key = hashlib.sha1(uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"dflash-promote-{key}.lockdir"


@contextlib.contextmanager
def registry_lock(uri: str, timeout: float = 300.0, stale_after: float = 600.0) -> Iterator[Path]:
    """Exclusive lock around the read-compare-set of one registry.

    sqlite store: `fcntl.flock` on `<db>.promote.lock` (`dflash.tracking.store.exclusive`: released by the kernel if
    the process dies).
    Other stores: an atomic `mkdir` lock directory in the temp dir (this host only), broken when older
    than `stale_after` seconds; the alias is also read back after it is set.
    """
    path = _lock_path(uri)
    deadline = time.monotonic() + timeout
    if sqlite_db_path(uri) is not None:
        from dflash.tracking.store import exclusive
        path.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(path, timeout):
            yield path
        return
    while True:
        try:
            path.mkdir()
            (path / "owner").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            break
        except FileExistsError:
            try:
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > stale_after:
                log.warning("breaking stale promotion lock %s (%.0f s old)", path, age)
                _remove_lockdir(path)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"promotion lock {path} still held after {timeout:.0f} s")
            time.sleep(0.05)
    try:
        yield path
    finally:
        _remove_lockdir(path)


def _remove_lockdir(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (path / "owner").unlink()
    with contextlib.suppress(FileNotFoundError, OSError):
        path.rmdir()


__all__ = ["registry_lock"]
