"""The promotion gate (DESIGN §5): register an *evaluated* run's checkpoint in the MLflow Model Registry
and move the serving alias only when its acceptance beats the current holder.

    decision = promote(run_id, PromoteConfig(margin=0.05, floor=3.0), "sqlite:///mlflow.db")

Rules, in order:
1. The run must be FINISHED, have the gate metric (`eval/tau_vanilla` by default) and a finite value,
   and have a `checkpoint` artifact. Otherwise the decision is "refused", nothing is registered, and the
   reason is written on the *run* as tags (`dflash.serving.promotion.decision` / `dflash.serving.promotion.reason`).
2. Otherwise a model version is registered (source = the run's `checkpoint` artifact URI, `run_id` set)
   with every `eval/` metric (τ per budget), the per-task table reference and the run's config as tags.
3. The alias moves to it only if `value >= floor` and `value > holder + margin`, where the holder is the
   version the alias points at now and its value is the metric tag recorded on that version (the
   holder's run metric if the tag is missing). Without a holder only the floor applies.
4. The decision and its reason are written on the version (and on the run) either way.

Steps 2–4 run inside one exclusive lock per registry (an `fcntl` lock file beside the sqlite database;
a lock directory for other stores), so two promotions racing cannot both win: the second one reads the
first one's result as its holder. After moving the alias, it is read back as a last check.

`dry_run=True` reads only: it registers nothing, writes no tag and returns the decision it would take.

Only `mlflow.tracking.MlflowClient` is used (mlflow-skinny compatible); mlflow is imported lazily.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from dflash.tracking.loggers import sqlite_db_path, truncate

log = logging.getLogger(__name__)

DECISION_TAG = "dflash.promotion.decision"
REASON_TAG = "dflash.promotion.reason"
PREFIX = "dflash.promotion."
TARGET_FP = "dflash.target_fingerprint"  # run and version tag: the target the drafter was trained for
PROMOTED, REFUSED = "promoted", "refused"
_TAG_VALUE_LIMIT = 5000  # reasons and run tags: keeps the UI readable
_CONFIG_TAG_LIMIT = 60_000  # the flattened run config (MLflow's registry tag limit is 100,000)


@dataclass
class PromoteConfig:
    model_name: str = "dflash-drafter"
    alias: str = "champion"
    metric: str = "eval/tau_vanilla"
    margin: float = 0.0  # the candidate must beat the holder by more than this
    floor: float = 0.0  # and be >= this
    enabled: bool = False  # auto-promote at the end of a training run
    tracking_uri: str = ""  # registry store; empty → the run's own tracking URI


@dataclass
class Decision:
    promoted: bool
    reason: str
    version: str | None = None  # the registered version (None: nothing registered)
    candidate_value: float | None = None
    holder_version: str | None = None
    holder_value: float | None = None
    run_id: str = ""
    model_name: str = ""
    alias: str = ""
    metric: str = ""
    dry_run: bool = False

    def summary(self) -> str:
        head = ("[dry run] would promote" if self.promoted else "[dry run] would refuse") if self.dry_run \
            else ("PROMOTED" if self.promoted else "REFUSED")
        ver = f" as {self.model_name} v{self.version}" if self.version else ""
        target = f" → @{self.alias}" if self.promoted else ""
        return f"{head} run {self.run_id}{ver}{target}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PromotionError(ValueError):
    """Bad input (unknown run, missing store): no decision could be taken."""


# ----------------------------------------------------------------------------------------- helpers
def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:.4f}"


def _as_float(s: Any) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def check_store(uri: str) -> None:
    """A sqlite store must already exist: opening a missing one would silently create an empty db."""
    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise PromotionError(f"tracking store {uri!r}: no database file at {db} (pass the URI the run "
                             f"was tracked with, e.g. sqlite:////abs/path/mlflow.db)")


def _lock_path(uri: str) -> Path:
    db = sqlite_db_path(uri)
    if db is not None:
        return db.with_name(db.name + ".promote.lock")
    key = hashlib.sha1(uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"dflash-promote-{key}.lockdir"


@contextlib.contextmanager
def registry_lock(uri: str, timeout: float = 300.0, stale_after: float = 600.0) -> Iterator[Path]:
    """Exclusive lock around the read-compare-set of one registry.

    sqlite store: `fcntl.flock` on `<db>.promote.lock` (released by the kernel if the process dies).
    Other stores: an atomic `mkdir` lock directory in the temp dir (this host only), broken when older
    than `stale_after` seconds; the alias is also read back after it is set.
    """
    path = _lock_path(uri)
    deadline = time.monotonic() + timeout
    if sqlite_db_path(uri) is not None:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"promotion lock {path} still held after {timeout:.0f} s") from e
                    time.sleep(0.05)
            try:
                yield path
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
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


def _client(uri: str):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _error_code(e: BaseException) -> str:
    return str(getattr(e, "error_code", ""))


def _get_run(client, run_id: str, uri: str):
    from mlflow.exceptions import MlflowException
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if _error_code(e) == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(e).lower():
            raise PromotionError(f"run {run_id!r} not found in tracking store {uri!r}") from e
        raise


def _current_holder(client, cfg: PromoteConfig) -> tuple[Any | None, float | None]:
    """(holder ModelVersion or None, its recorded metric value or None)."""
    from mlflow.exceptions import MlflowException
    try:
        model = client.get_registered_model(cfg.model_name)
    except MlflowException as e:
        if _error_code(e) == "RESOURCE_DOES_NOT_EXIST":
            return None, None
        raise
    version = (model.aliases or {}).get(cfg.alias)
    if version is None:
        return None, None
    holder = client.get_model_version(cfg.model_name, str(version))
    value = _as_float(holder.tags.get(cfg.metric))
    if value is None and holder.run_id:  # tag missing (e.g. aliased by hand): the holder's run metric
        with contextlib.suppress(Exception):
            value = client.get_run(holder.run_id).data.metrics.get(cfg.metric)
    return holder, value


def _eligibility(client, run, cfg: PromoteConfig) -> tuple[str | None, float | None]:
    """(reason to refuse or None, candidate value)."""
    status = run.info.status
    if status != "FINISHED":
        return f"run status is {status}; only FINISHED runs can be promoted", None
    metrics = run.data.metrics
    if cfg.metric not in metrics:
        have = sorted(k for k in metrics if k.startswith("eval/")) or "none"
        return f"run has no {cfg.metric} metric (eval/ metrics present: {have}); evaluate it first", None
    value = float(metrics[cfg.metric])
    if not math.isfinite(value) or abs(value) >= sys.float_info.max:  # sql stores save ±inf as ±max
        shown = value if not math.isfinite(value) else math.copysign(math.inf, value)
        return f"{cfg.metric} is {shown} (not finite)", value
    if not _has_checkpoint(client, run.info.run_id):
        return "run has no 'checkpoint' artifact (the serving folder logged at the end of training)", value
    return None, value


def _has_checkpoint(client, run_id: str) -> bool:
    try:
        return len(client.list_artifacts(run_id, "checkpoint")) > 0
    except Exception:  # an unreadable artifact store: do not register something we cannot see
        return False


def _compare(value: float, holder, holder_value: float | None, cfg: PromoteConfig,
             target_fp: str | None = None) -> tuple[bool, str]:
    m = cfg.metric
    if value < cfg.floor:
        return False, f"{m}={_fmt(value)} is below the floor {_fmt(cfg.floor)}"
    if holder is None:
        return True, f"{m}={_fmt(value)} clears the floor {_fmt(cfg.floor)}; no current @{cfg.alias} holder"
    hv = f"@{cfg.alias} v{holder.version}"
    holder_fp = (holder.tags or {}).get(TARGET_FP)
    if target_fp and holder_fp != target_fp:  # a champion of another target: its metric does not compare
        return True, (f"{m}={_fmt(value)} clears the floor; holder {hv} was trained for target "
                      f"{holder_fp or 'unrecorded'}, this run for {target_fp}: the champion is replaced")
    if holder_value is None or not math.isfinite(holder_value):
        return True, f"{m}={_fmt(value)}; holder {hv} has no recorded {m}"
    if value > holder_value + cfg.margin:
        return True, (f"{m}={_fmt(value)} beats holder {hv} ({_fmt(holder_value)}) by more than "
                      f"margin {_fmt(cfg.margin)}")
    return False, (f"{m}={_fmt(value)} does not beat holder {hv} ({_fmt(holder_value)}) by more than "
                   f"margin {_fmt(cfg.margin)}")


def _task_table_ref(client, run_id: str) -> str:
    """runs:/ URI of the per-task table the evaluation logged (an `eval/` artifact named like a table)."""
    try:
        files, stack = [], ["eval"]
        while stack:
            for f in client.list_artifacts(run_id, stack.pop()):
                (stack if f.is_dir else files).append(f.path)
    except Exception:
        return ""
    tables = [p for p in files if p.endswith((".json", ".csv", ".md", ".txt", ".parquet"))]
    tasks = [p for p in tables if "task" in os.path.basename(p).lower()]
    pick = (tasks or tables or [""])[0]
    return f"runs:/{run_id}/{pick}" if pick else ""


def _version_tags(client, run, cfg: PromoteConfig, value: float) -> dict[str, str]:
    run_id = run.info.run_id
    tags = {k: repr(float(v)) for k, v in run.data.metrics.items() if k.startswith("eval/")}
    tags[cfg.metric] = repr(float(value))
    tags.update({
        "dflash.run_id": run_id,
        "dflash.run_name": run.info.run_name or "",
        "dflash.gate_metric": cfg.metric,
        "dflash.task_table": _task_table_ref(client, run_id),
        "dflash.config_uri": f"runs:/{run_id}/config.yaml",
        "dflash.config": truncate(json.dumps(dict(sorted(run.data.params.items()))), _CONFIG_TAG_LIMIT),
    })
    for k in ("loss", "noise", "buffer", "target", "git_sha", "dflash.run_dir", TARGET_FP):
        if k in run.data.tags:
            tags[k if k.startswith("dflash.") else f"dflash.{k}"] = truncate(run.data.tags[k], _TAG_VALUE_LIMIT)
    return tags


def _decision_tags(d: Decision, cfg: PromoteConfig) -> dict[str, str]:
    return {
        DECISION_TAG: PROMOTED if d.promoted else REFUSED,
        REASON_TAG: truncate(d.reason, _TAG_VALUE_LIMIT),
        PREFIX + "alias": cfg.alias,
        PREFIX + "metric": cfg.metric,
        PREFIX + "margin": repr(float(cfg.margin)),
        PREFIX + "floor": repr(float(cfg.floor)),
        PREFIX + "holder_version": d.holder_version or "",
        PREFIX + "holder_value": "" if d.holder_value is None else repr(float(d.holder_value)),
        PREFIX + "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _tag_run(client, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag
    try:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as e:  # the registry is the record; a run tag is a convenience
        log.warning("could not tag run %s with the promotion decision: %s", run_id, e)


def _register(client, cfg: PromoteConfig, run, tags: dict[str, str]):
    from mlflow.exceptions import MlflowException
    try:
        client.create_registered_model(
            cfg.model_name, description="DFlash drafters; the serving alias moves only through the gate")
    except MlflowException as e:
        if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{run.info.artifact_uri.rstrip('/')}/checkpoint"
    return client.create_model_version(cfg.model_name, source, run_id=run.info.run_id, tags=tags)


# ------------------------------------------------------------------------------------------- API
def promote(run_id: str, cfg: PromoteConfig, tracking_uri: str | None, dry_run: bool = False,
            lock_timeout: float = 300.0) -> Decision:
    """Gate `run_id` (see module doc). The store is `cfg.tracking_uri` if set, else `tracking_uri`
    (the run's own). Returns the decision; raises `PromotionError` when the run or store is missing."""
    uri = cfg.tracking_uri or tracking_uri or ""
    if not uri:
        raise PromotionError("no tracking URI: set promote.tracking_uri or pass the run's tracking URI")
    if not (math.isfinite(cfg.margin) and math.isfinite(cfg.floor)):
        raise PromotionError(f"promote.margin={cfg.margin} and promote.floor={cfg.floor} must be finite")
    check_store(uri)
    client = _client(uri)
    run = _get_run(client, run_id, uri)
    base = dict(run_id=run_id, model_name=cfg.model_name, alias=cfg.alias, metric=cfg.metric, dry_run=dry_run)

    refusal, value = _eligibility(client, run, cfg)
    if refusal is not None:
        d = Decision(False, refusal, candidate_value=value, **base)
        if not dry_run:
            _tag_run(client, run_id, _decision_tags(d, cfg))
        log.info(d.summary())
        return d

    if dry_run:
        holder, holder_value = _current_holder(client, cfg)
        if holder is not None and holder.run_id == run_id:
            return Decision(False, f"run already holds @{cfg.alias} (v{holder.version})", None, value,
                            str(holder.version), holder_value, **base)
        ok, reason = _compare(value, holder, holder_value, cfg, run.data.tags.get(TARGET_FP))
        return Decision(ok, reason, None, value, holder and str(holder.version), holder_value, **base)

    with registry_lock(uri, timeout=lock_timeout):
        holder, holder_value = _current_holder(client, cfg)  # read inside the lock: the re-check
        hv = None if holder is None else str(holder.version)
        if holder is not None and holder.run_id == run_id:
            d = Decision(False, f"run already holds @{cfg.alias} (v{hv}); nothing registered", None, value,
                         hv, holder_value, **base)
            log.info(d.summary())
            return d
        ok, reason = _compare(value, holder, holder_value, cfg, run.data.tags.get(TARGET_FP))
        mv = _register(client, cfg, run, _version_tags(client, run, cfg, value))
        version = str(mv.version)
        d = Decision(ok, reason, version, value, hv, holder_value, **base)
        if ok:
            client.set_registered_model_alias(cfg.model_name, cfg.alias, version)
            now = client.get_registered_model(cfg.model_name).aliases.get(cfg.alias)
            if str(now) != version:  # only possible if something bypassed the lock
                d.promoted = False
                d.reason = f"lost a race: @{cfg.alias} points at v{now} after setting it; {reason}"
            elif holder is not None:
                with contextlib.suppress(Exception):
                    client.set_model_version_tag(cfg.model_name, hv, PREFIX + "superseded_by", version)
        for k, v in _decision_tags(d, cfg).items():
            client.set_model_version_tag(cfg.model_name, version, k, v)
        _tag_run(client, run_id, {**_decision_tags(d, cfg), PREFIX + "version": version,
                                  PREFIX + "model": cfg.model_name})
    log.info(d.summary())
    return d


def auto_promote(run_id: str | None, cfg: PromoteConfig, tracking_uri: str | None) -> Decision | None:
    """End-of-run hook: promotes when `cfg.enabled`. Call it after the MLflow run is closed FINISHED.
    Never raises (the training run already succeeded); problems are logged and give None."""
    if not cfg.enabled:
        return None
    if not run_id:
        log.warning("promote.enabled but the run has no MLflow run id (tracking disabled or down)")
        return None
    try:
        d = promote(run_id, cfg, tracking_uri)
    except Exception as e:
        log.warning("auto-promotion of run %s failed: %s: %s", run_id, type(e).__name__, e)
        return None
    print(d.summary(), flush=True)
    return d


__all__ = ["PromoteConfig", "Decision", "PromotionError", "promote", "auto_promote", "registry_lock",
           "check_store", "DECISION_TAG", "REASON_TAG"]
