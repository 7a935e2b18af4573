"""`MLflowLogger`: one MLflow run through ``MlflowClient`` (no fluent/global active run), the
`dflash.tracking.loggers.Logger` interface over it. Split out of `dflash.tracking.loggers`, which re-exports it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash.tracking.logger_base import Logger, TrackingConfig
from dflash.tracking.run_info import (MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH,
                                      MAX_TAG_VAL_LENGTH, WRITE_ONCE_TAGS, in_batches, json_default, param_str,
                                      sanitize_key, to_float, default_run_name, flatten_config,
                                      get_or_create_experiment, quiet_library_logs, truncate)
from dflash.tracking.transport import HEARTBEAT_TAG, heartbeat_tags, prepare_store, utc_now
from dflash.tracking.ui_view import display_tags

_VALID_STATUSES = ("FINISHED", "FAILED", "KILLED")
# Per-prompt τ (any `task/` segment under eval/, whatever the evaluation's naming of settings and suites): one key
# per prompt made a campaign run carry ~1,000 keys, its charts and the compare view buried the few that answer. MLflow gets each
# suite's table instead (the `eval/tasks.json` / `eval/suite/<name>/tasks.json` artifacts the report pairs on);
# the run folder's metrics.jsonl keeps every key.
# per-prompt keys: eval/task/…, eval/<setting>/task/…, eval/suite/<name>/<setting>/task/…, eval/subset/<setting>/task/…
PER_TASK_METRIC = re.compile(r"^eval/(?:[^/]+/){0,3}task/")


def mlflow_metric_keys(metrics: Mapping[str, Any]) -> list[str]:
    """The keys of `metrics` that go to MLflow: every one but the per-prompt ones (`PER_TASK_METRIC`)."""
    return [k for k in metrics if not PER_TASK_METRIC.match(k)]


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's message on one line, without SQLAlchemy's SQL, parameters and links (a failed insert's message
    runs to kilobytes)."""
    noise = ("[SQL:", "[parameters:", "(Background on", "(raised as a result of")
    kept = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith(noise)]
    text = " ".join(kept)
    return text if len(text) <= limit else text[:limit] + " ..."


class MLflowLogger(Logger):
    """MLflow run through ``MlflowClient(cfg.tracking_uri)`` (no global fluent state).

    Creates the experiment if needed (for sqlite stores with artifacts in ``mlartifacts/``
    next to the db file) and a new run, or reopens ``run_id`` (status back to RUNNING,
    later metrics append). If the store is unreachable at start or any call fails later,
    emits ONE ``RuntimeWarning`` naming the URI and the error, and becomes a no-op
    (``healthy`` -> False); training goes on.
    """

    def __init__(
        self,
        cfg: TrackingConfig,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ):
        self.cfg = cfg
        self.tracking_uri = cfg.tracking_uri
        self.run_name = cfg.run_name or default_run_name()
        self.experiment_id: str | None = None
        self.client: Any = None
        self._run_id: str | None = None
        self._healthy = True
        self._closed = False
        self._resumed = False
        self._existing_params: dict[str, str] = {}
        self._existing_tags: dict[str, str] = {}
        self._sysmon: Any = None
        try:
            self._start(run_id)
        except Exception as e:  # store unreachable, mlflow missing, bad uri, ...
            self._disable("could not start the run", e)
            return
        if tags:
            self.set_tags({k: v for k, v in tags.items()
                           if not (k in WRITE_ONCE_TAGS and self._existing_tags.get(k))})
        if params:
            self.log_params(params)
        if cfg.system_metrics:
            from dflash.tracking.sysmetrics import start_system_metrics
            self._sysmon = start_system_metrics(self._run_id, self.tracking_uri, cfg.system_metrics_interval_s,
                                                resume=self._resumed)

    # ---- state
    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def kept_tags(self) -> dict[str, str]:
        """The write-once tags the reopened run already had, kept over this process's (`WRITE_ONCE_TAGS`)."""
        return {k: v for k, v in self._existing_tags.items() if k in WRITE_ONCE_TAGS and v}

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def resumed(self) -> bool:
        """True when an existing run was reopened."""
        return self._resumed

    @property
    def _active(self) -> bool:
        return self._healthy and not self._closed and self._run_id is not None

    def _disable(self, what: str, exc: BaseException) -> None:
        if not self._healthy:
            return
        self._healthy = False
        msg = f"{type(exc).__name__}: {one_line(exc)}"
        warnings.warn(
            f"MLflow tracking disabled ({what}; tracking_uri={self.tracking_uri!r}, "
            f"experiment={self.cfg.experiment!r}, run_id={self._run_id}): {msg}. "
            "Training continues; metrics are still written to metrics.jsonl.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> bool:
        if not self._active:
            return False
        try:
            fn(*args, **kwargs)
            return True
        except Exception as e:
            self._disable(what, e)
            return False

    # ---- start
    def _start(self, run_id: str | None) -> None:
        global MAX_PARAMS_TAGS_PER_BATCH, MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH
        global MAX_TAG_VAL_LENGTH
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            from mlflow.utils import validation as _v

            MAX_PARAMS_TAGS_PER_BATCH = int(getattr(_v, "MAX_PARAMS_TAGS_PER_BATCH", 100))
            MAX_METRICS_PER_BATCH = int(getattr(_v, "MAX_METRICS_PER_BATCH", 1000))
            MAX_PARAM_VAL_LENGTH = int(getattr(_v, "MAX_PARAM_VAL_LENGTH", 6000))
            MAX_TAG_VAL_LENGTH = int(getattr(_v, "MAX_TAG_VAL_LENGTH", 8000))
        except Exception:
            pass

        quiet_library_logs()  # before the store opens: its schema setup logs 2-4 INFO lines
        prepare_store(self.tracking_uri)  # HTTP: answers within seconds; sqlite: created once, under a lock
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        # sqlite: several processes creating the db/experiment at once may collide; retry.
        attempts = 3 if self.tracking_uri.startswith("sqlite:") else 1
        for attempt in range(attempts):
            try:
                self.experiment_id = get_or_create_experiment(self.client, self.cfg.experiment, self.tracking_uri)
                break
            except Exception:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))

        if run_id:
            try:
                run = self.client.get_run(run_id)
            except MlflowException as e:
                if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warnings.warn(
                    f"MLflow run {run_id!r} not found at {self.tracking_uri!r}; starting a new run.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                run = None
            if run is not None:
                last = run.data.tags.get(HEARTBEAT_TAG)
                # RUNNING with a heartbeat: a dflash process had it and died without closing it (kill -9, power
                # loss). Without one it was opened for us by a caller (a sweep's child run): not a takeover.
                if run.info.status == "RUNNING" and last:
                    warnings.warn(f"MLflow run {run_id} was still RUNNING (last heartbeat {last}): taken over by "
                                  f"this process, which closes it at the end", RuntimeWarning, stacklevel=4)
                    self.client.set_tag(run_id, "dflash.taken_over", utc_now())
                self.client.update_run(run_id, status="RUNNING")
                self._run_id = run_id
                self._resumed = True
                self.experiment_id = run.info.experiment_id
                self.run_name = run.info.run_name or self.run_name
                self._existing_params = dict(run.data.params)
                self._existing_tags = dict(run.data.tags)
                return
        run = self.client.create_run(self.experiment_id, run_name=self.run_name)
        self._run_id = run.info.run_id
        self.client.set_tag(self._run_id, HEARTBEAT_TAG, utc_now())

    # ---- logging
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._active or not metrics:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = []
        for k in mlflow_metric_keys(metrics):
            f = to_float(metrics[k])
            if f is not None:
                ms.append(Metric(sanitize_key(k), f, ts, int(step)))
        for i, chunk in enumerate(in_batches(ms, MAX_METRICS_PER_BATCH)):
            beat = heartbeat_tags() if i == 0 else []  # rides along: no extra request
            if not self._call("log_batch(metrics) failed", self.client.log_batch, self._run_id, metrics=list(chunk),
                              tags=beat):
                return
        # an evaluation's objective: its figures as the runs table's rounded, distinctly named columns
        self.set_tags(display_tags(metrics))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self._active or not params:
            return
        from mlflow.entities import Param

        flat = flatten_config(params)
        new: list[Any] = []
        changed: dict[str, str] = {}
        for k, v in flat.items():
            key = sanitize_key(k)
            val = truncate(v, MAX_PARAM_VAL_LENGTH)
            old = self._existing_params.get(key)
            if old is None:
                new.append(Param(key, val))
            elif old != val:  # MLflow params are immutable; record the change as a tag
                changed[f"param_changed.{key}"] = val
        for chunk in in_batches(new, MAX_PARAMS_TAGS_PER_BATCH):
            if not self._call("log_batch(params) failed", self.client.log_batch, self._run_id, params=list(chunk)):
                return
        for p in new:
            self._existing_params[p.key] = p.value
        if changed:
            self.set_tags(changed)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self._active or not tags:
            return
        from mlflow.entities import RunTag

        ts = [RunTag(sanitize_key(k), truncate(param_str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in in_batches(ts, MAX_PARAMS_TAGS_PER_BATCH):
            if not self._call("log_batch(tags) failed", self.client.log_batch, self._run_id, tags=list(chunk)):
                return

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file (or a directory's contents) under ``artifact_path``."""
        if not self._active:
            return
        p = Path(path)
        if not p.exists():  # caller bug, not a store outage: skip without disabling
            warnings.warn(f"log_artifact: {str(p)!r} does not exist; skipped.", RuntimeWarning, stacklevel=2)
            return
        if p.is_dir():
            self._call("log_artifacts failed", self.client.log_artifacts, self._run_id, str(p), artifact_path)
        else:
            self._call("log_artifact failed", self.client.log_artifact, self._run_id, str(p), artifact_path)

    def _log_generated(self, name: str, write: Any) -> None:
        """Write a file named ``basename(name)`` via ``write(path)`` in a temp dir, then upload
        it under ``dirname(name)``."""
        if not self._active:
            return
        name = name.replace("\\", "/").strip("/")
        sub, base = os.path.split(name)
        with tempfile.TemporaryDirectory(prefix="dflash-artifact-") as td:
            local = os.path.join(td, base)
            try:
                write(local)
            except Exception as e:  # local serialisation problem: skip, keep tracking on
                warnings.warn(f"could not write artifact {name!r}: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
                return
            self.log_artifact(local, sub or None)

    def log_text(self, text: str, name: str) -> None:
        """Upload ``text`` as artifact file ``name`` (may contain sub-dirs, e.g. ``"eval/samples.txt"``)."""

        def write(p: str) -> None:
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)

        self._log_generated(name, write)

    def log_dict(self, d: Mapping[str, Any], name: str) -> None:
        """Upload ``d`` as JSON (or YAML if ``name`` ends in .yaml/.yml)."""

        def write(p: str) -> None:
            with open(p, "w", encoding="utf-8") as f:
                if p.endswith((".yaml", ".yml")):
                    import yaml

                    yaml.safe_dump(json.loads(json.dumps(d, default=json_default)), f, sort_keys=False)
                else:
                    json.dump(d, f, indent=2, default=json_default)

        self._log_generated(name, write)

    def log_figure(self, fig: Any, name: str) -> None:
        """Save a matplotlib figure as PNG (``.png`` appended if missing) and upload it."""
        if not name.lower().endswith(".png"):
            name = name + ".png"
        self._log_generated(name, lambda p: fig.savefig(p, format="png", dpi=120, bbox_inches="tight"))

    def close(self, status: str = "FINISHED") -> None:
        if self._closed:
            return
        status = str(status).upper()
        if status not in _VALID_STATUSES:
            status = "FINISHED"
        if self._sysmon is not None:  # its last samples before the run ends (it stops on a closed run)
            from dflash.tracking.sysmetrics import stop_system_metrics
            stop_system_metrics(self._sysmon)
            self._sysmon = None
        if self._active:
            self._call("set_terminated failed", self.client.set_terminated, self._run_id, status)
        elif self._run_id is not None and self._local_store:
            # disabled mid-run by a failed write (a full disk): one more small write, so that the run does not stay
            # RUNNING when there is room again (the failed checkpoint's temp file is gone); a remote store is not
            # asked again, it would cost its timeouts
            try:
                self.client.set_terminated(self._run_id, status)
            except Exception:  # noqa: BLE001 - still full: a resume takes the RUNNING run over
                pass
        self._closed = True

    @property
    def _local_store(self) -> bool:
        return self.tracking_uri.startswith(("sqlite:", "file:")) or "://" not in self.tracking_uri
