"""What a tracked run is and the small rules its logging follows: MLflow's limits and how values are cut to
them, config flattening, run names, the git commit and command line, the source tags and Description a run
carries, sqlite store paths and the experiment's artifact location. `dflash.tracking.loggers` builds the
loggers on top of these; anything that needs one rule (a sweep's tags, the promotion gate's store path) imports it
from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable, Sequence

from dflash.tracking.ui_view import (KEY_METRICS_VIEW, SAVED_VIEW_PREFIX, experiment_view_tags, stale_view,
                                     ui_run_url, ui_runs_table_url)


# MLflow limits (mirrors mlflow.utils.validation; the real values are read when mlflow loads).
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250
TRUNCATION_MARKER = "...[truncated]"

# --------------------------------------------------------------------------- helpers


def absolute_sqlite_uri(uri: str) -> str:
    """`sqlite:///mlflow.db` is relative to the process's working folder; pin it so the run directory's
    records (mlflow_run.json, config.yaml) still point at the same store from anywhere."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and ":memory:" not in uri:
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


def default_run_name(label: str = "") -> str:
    """``<label>-YYYYmmdd-HHMMSS-xxxx`` (local time + 4 random hex chars; no label: the stamp alone).

    The label says what the run is (the trainer's `run_label`: ``hard_ce-cosine-r30_90-s0``) and comes first,
    so MLflow's run list, legends and compare headers show it even when they cut the name short."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    return f"{label}-{stamp}" if label else stamp


def git_sha(full: bool = False) -> str:
    """Sha of HEAD (short, or all 40 digits) of the git repo containing this file, or ``"unknown"``.
    Never raises."""
    try:
        res = subprocess.run(
            ["git", "rev-parse", *([] if full else ["--short"]), "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=5,
        )
        sha = res.stdout.strip()
        if res.returncode == 0 and sha:
            return sha
    except Exception:
        pass
    return "unknown"


def param_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        seq = sorted(v, key=str) if isinstance(v, (set, frozenset)) else list(v)
        return json.dumps(seq, default=json_default)
    if isinstance(v, Path):
        return str(v)
    return str(v)


def json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, Mapping):
        return dict(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def flatten_config(d: Mapping[str, Any] | Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> flat ``{"a.b.c": "value"}`` with string values.

    Accepts any Mapping (dict, OmegaConf DictConfig) or dataclass instance at any level.
    Lists/tuples become JSON strings, ``None`` -> ``"None"``, empty mappings -> ``"{}"``.
    """
    if dataclasses.is_dataclass(d) and not isinstance(d, type):
        d = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        if isinstance(v, Mapping):
            if len(v) == 0:
                out[key] = "{}"
            else:
                out.update(flatten_config(v, key))
        else:
            out[key] = param_str(v)
    return out


def to_float(v: Any) -> float | None:
    """float(v) for numbers / 0-d tensors / numpy scalars; None if not convertible."""
    if v is None or isinstance(v, (str, bytes)):
        return None
    try:
        if hasattr(v, "item"):
            v = v.item()
        return float(v)
    except Exception:
        return None


def truncate(s: str, limit: int) -> str:
    """`s` cut to `limit` characters, ending in TRUNCATION_MARKER when cut (MLflow tag/param limits)."""
    if len(s) <= limit:
        return s
    return s[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


_BAD_KEY_CHARS = re.compile(r"[^\w\-. :/]")


def sanitize_key(k: str) -> str:
    """Make ``k`` a valid MLflow metric/param/tag name (invalid chars -> ``_``; length cap)."""
    k = re.sub(r"/+", "/", _BAD_KEY_CHARS.sub("_", str(k))).strip("/") or "_"
    if len(k) > MAX_KEY_LENGTH:
        suffix = "~" + hashlib.sha1(k.encode()).hexdigest()[:8]
        k = k[: MAX_KEY_LENGTH - len(suffix)] + suffix
    return k


def in_batches(seq: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def fmt_duration(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_rate(v: float) -> str:
    if abs(v) >= 1e6:
        return f"{v / 1e6:.2f}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def fmt_num(v: float) -> str:
    if math.isfinite(v) and abs(v) >= 1e4:
        return fmt_rate(v)
    return f"{v:.4g}"


def sqlite_db_path(uri: str) -> Path | None:
    """The absolute database file of a ``sqlite:///…`` URI; None for other stores and in-memory sqlite."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri[len("sqlite:///") :].split("?", 1)[0]
    if not db or db == ":memory:":
        return None
    return Path(db).expanduser().resolve()


def resolve_relative_sqlite(uri: str, run_dir: Path | None) -> str:
    """A relative `sqlite:///x.db` is relative to the training process's cwd: look for it from here,
    then from the folders above the run dir (runs/<name> sits next to mlflow.db by default)."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:////"):
        return uri
    rel, _, query = uri[len("sqlite:///"):].partition("?")
    if not rel or rel == ":memory:":
        return uri
    bases = [Path.cwd()] + ([run_dir, *run_dir.parents][:4] if run_dir is not None else [])
    for base in bases:
        if (base / rel).is_file():
            return f"sqlite:///{(base / rel).resolve()}" + (f"?{query}" if query else "")
    return uri


def _sqlite_artifact_location(uri: str) -> str | None:
    """For ``sqlite:///path/x.db`` -> ``file:///abs/path/mlartifacts`` (artifacts next to the db,
    not in the current working directory). None for other stores (server default)."""
    db = sqlite_db_path(uri)
    return None if db is None else (db.parent / "mlartifacts").as_uri()


def local_artifact_dir(artifact_uri: str | None, tracking_uri: str, run_id: str) -> Path | None:
    """A run's artifact folder on this machine: the recorded one when it exists, a relative one (a relocatable
    store, `relocate_artifacts`) from the sqlite file's folder, else `mlartifacts/<run id>/artifacts` beside the
    sqlite file (a store written on another machine and copied here). None when there is none."""
    from urllib.parse import unquote, urlparse
    db = sqlite_db_path(tracking_uri)
    u = urlparse(artifact_uri or "")
    recorded = Path(unquote(u.path)) if u.scheme in ("", "file") and u.path else None
    candidates = []
    if recorded is not None:
        candidates.append(recorded if recorded.is_absolute() or db is None else db.parent / recorded)
    if db is not None:
        candidates.append(db.parent / "mlartifacts" / run_id / "artifacts")
    return next((c for c in candidates if c.is_dir()), None)


def _relative_location(location: str) -> bool:
    """An artifact location MLflow would resolve against the working folder (no scheme, not absolute)."""
    from urllib.parse import urlparse
    return bool(location) and not urlparse(location).scheme and not Path(location).is_absolute()


def relocate_artifacts(db: str | os.PathLike, relative: bool = True) -> int:
    """Point a sqlite store's artifact locations at the `mlartifacts/` folder beside the database file, so the
    store shows its artifacts wherever it is extracted: `relative=True` writes `mlartifacts/<run id>/artifacts`
    (resolved from the folder `mlflow ui` starts in: run it beside `mlflow.db`), `relative=False` the absolute
    path of this copy. Registered model versions follow their run (the gate registers a run's `checkpoint`
    artifact: its source named the GPU machine's folder). Returns the number of rows changed."""
    import sqlite3
    db = Path(db).resolve()
    base = "mlartifacts" if relative else (db.parent / "mlartifacts").as_uri()
    con = sqlite3.connect(db)
    try:
        n = 0
        for eid, loc in con.execute("SELECT experiment_id, artifact_location FROM experiments").fetchall():
            if loc and "mlartifacts" in loc:
                n += con.execute("UPDATE experiments SET artifact_location=? WHERE experiment_id=?",
                                 (base, eid)).rowcount
        for rid, uri in con.execute("SELECT run_uuid, artifact_uri FROM runs").fetchall():
            if uri and "mlartifacts" in uri:
                n += con.execute("UPDATE runs SET artifact_uri=? WHERE run_uuid=?",
                                 (f"{base}/{rid}/artifacts", rid)).rowcount
        n += _relocate_model_versions(con, base)
        con.commit()
    finally:
        con.close()
    return n


def _relocate_model_versions(con, base: str) -> int:
    """model_versions.source / storage_location under a run's `mlartifacts/<run id>/artifacts/` moved to `base`."""
    if not con.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='model_versions'").fetchone():
        return 0  # a store that never registered a model (older MLflow schemas have no registry tables)
    n = 0
    rows = con.execute("SELECT rowid, run_id, source, storage_location FROM model_versions").fetchall()
    for rowid, rid, source, storage in rows:
        marker = f"mlartifacts/{rid}/artifacts"
        if rid and marker in f"{source} {storage}":
            moved = [f"{base}/{rid}/artifacts" + u.split(marker, 1)[1] if u and marker in u else u
                     for u in (source, storage)]
            n += con.execute("UPDATE model_versions SET source=?, storage_location=? WHERE rowid=?",
                             (*moved, rowid)).rowcount
    return n


def get_or_create_experiment(client, name: str, tracking_uri: str) -> str:
    """The id of experiment `name` (restored if deleted, created if missing; a concurrent creation wins), marked
    as a training experiment with the key-metrics runs-table view (`experiment_view_tags`)."""
    from mlflow.exceptions import MlflowException
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            eid = client.create_experiment(name, artifact_location=_sqlite_artifact_location(tracking_uri),
                                           tags=experiment_view_tags())
            return eid
        except MlflowException:
            exp = client.get_experiment_by_name(name)  # created concurrently
            if exp is None:
                raise
    if getattr(exp, "lifecycle_stage", "active") == "deleted":
        client.restore_experiment(exp.experiment_id)
    db = sqlite_db_path(tracking_uri)
    if db is not None and _relative_location(getattr(exp, "artifact_location", "") or ""):
        # A relocatable store (`relocate_artifacts`, a committed store extracted here): MLflow resolves its relative
        # artifact location against this process's working folder, so a new run's artifacts (its eval tables, the
        # checkpoint the promotion gate registers) would land outside the store and never travel with it. The recipe
        # sweep's first trials lost theirs that way (they went to the GPU machine's repo root): pin it beside the db.
        relocate_artifacts(db, relative=False)
    have = dict(getattr(exp, "tags", {}) or {})
    view = SAVED_VIEW_PREFIX + KEY_METRICS_VIEW
    for k, v in experiment_view_tags().items():
        # an experiment made before these tags (or by hand) gets them; its kind is never overwritten, dflash's
        # own saved view is replaced when it is an older one (`stale_view`)
        if k not in have or (k == view and stale_view(have[k])):
            try:
                client.set_experiment_tag(exp.experiment_id, k, v)
            except MlflowException:
                pass
    return exp.experiment_id


# --------------------------------------------------------------------------- what a run is

# MLflow's own fields for a run's Source column and its Description box (mlflow.utils.mlflow_tags).
SOURCE_NAME, SOURCE_TYPE, GIT_COMMIT, NOTE = ("mlflow.source.name", "mlflow.source.type",
                                              "mlflow.source.git.commit", "mlflow.note.content")
# Written once: a reopened run (resume, a sweep trial's pre-made child) keeps the command that made it.
WRITE_ONCE_TAGS = (SOURCE_NAME, SOURCE_TYPE, NOTE)


def command_line() -> str:
    """This process's command line as typed (`python -m experiments.run +loss=soft_kl`)."""
    import shlex
    return shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])


def _entry_point() -> str:
    """`experiments.run` for `python -m experiments.run`, else the script's path."""
    argv = list(getattr(sys, "orig_argv", None) or [])
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def run_description(command: str, run_dir: str | os.PathLike, commit: str) -> str:
    """The run's Description (markdown): how to make it again, where it lives, which code made it."""
    return (f"```\n{command}\n```\n\nrun folder: `{Path(run_dir).resolve()}`  \n"
            f"git commit: `{commit}`")


def source_tags(run_dir: str | os.PathLike, command: str | None = None) -> dict[str, str]:
    """MLflow's Source, git commit and Description fields for a run started by this process."""
    full = git_sha(full=True)
    tags = {SOURCE_NAME: _entry_point(), SOURCE_TYPE: "LOCAL",
            NOTE: run_description(command or command_line(), run_dir, full)}
    if full != "unknown":
        tags[GIT_COMMIT] = full
    return tags


def run_params(cfg: Mapping[str, Any], active_keys: Mapping[str, Iterable[str]] | None = None,
               drop: Iterable[str] = ()) -> dict[str, str]:
    """The run config as flat params, less the knobs the run never reads.

    `active_keys`: group → the keys its chosen variant reads (e.g. ``{"loss": LossClass.config_keys}``);
    the group's other keys are dropped. `drop`: dotted prefixes dropped whole (``target.random`` for a
    checkpoint target). MLflow's compare view then shows only what could have made a difference."""
    flat = flatten_config(cfg)
    drop = tuple(drop)
    keep = {g: {f"{g}.{k}" for k in keys} for g, keys in (active_keys or {}).items()}

    def wanted(key: str) -> bool:
        if any(key == d or key.startswith(d + ".") for d in drop):
            return False
        group = key.split(".", 1)[0]
        return group not in keep or key in keep[group]
    return {k: v for k, v in flat.items() if wanted(k)}


# Library chatter at run start: MLflow's database setup (2-4 lines on a fresh store), alembic's
# migration log, the system-metrics monitor's start/stop lines, and transformers' per-kernel fallback
# notices, which repeat what the target's own kernel report (`dflash.target.kernels`) already says.
# mlflow.store.db.utils logs every failed query at ERROR with its traceback and SQL (about 90 lines for one write on
# a full disk) before raising it; the caller's one warning or error line says what failed.
_QUIET_LOGGERS = {"mlflow.store.db.utils": "CRITICAL", "alembic": "WARNING", "alembic.runtime.migration": "WARNING",
                  "mlflow.system_metrics": "WARNING", "mlflow.system_metrics.system_metrics_monitor": "WARNING",
                  "transformers.integrations.hub_kernels": "ERROR"}


def quiet_library_logs() -> None:
    import logging
    for name, level in _QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def mlflow_ui_hint(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str:
    """The command that shows this store, the run's address in it and the runs table with the key metrics
    (the UI's default port; MLflow 3's training view, not its GenAI one)."""
    cmd = f"mlflow ui --backend-store-uri {tracking_uri}"
    if not (tracking_uri.startswith(("sqlite:", "file:", "postgresql", "mysql")) or "://" not in tracking_uri):
        cmd = f"open {tracking_uri}"  # a tracking server: it already serves the UI
        base = tracking_uri.rstrip("/")
    else:
        base = "http://127.0.0.1:5000"
    if experiment_id and run_id:
        return (f"{cmd}  ->  {ui_run_url(base, experiment_id, run_id)}\n"
                f"runs table: {ui_runs_table_url(base, experiment_id)}")
    return cmd
