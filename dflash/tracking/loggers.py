"""Run tracking: one ``Logger`` interface fanned out to jsonl, MLflow and the console.

Typical use (the trainer)::

    logger = build_loggers(cfg.tracking, run_dir, flatten_config(cfg_dict), tags, total_steps)
    with logger:                                   # close("FAILED"/"KILLED") on exceptions
        for step in ...:
            if step % cfg.tracking.log_every == 0:
                m = {"train/loss": ..., "perf/drafter_tok_s": ...}
                if cfg.tracking.system_metrics:
                    m.update(system_metrics())
                logger.log(m, step)
        logger.log_artifact(run_dir / "final", "checkpoint")   # the exported drafter folder
    # logger.run_id is written to run_dir/mlflow_run.json; a resumed run passes it back as ``run_id``.

Metric key prefixes used by callers: ``train/``, ``eval/``, ``perf/``, ``data/``, ``sys/``, ``buffer/``.

What a run is (its params, tags, name, store paths) and MLflow's limits live in `dflash.tracking.run_info`.

MLflow is used only through ``mlflow.tracking.MlflowClient`` (no fluent/global active
run), so several loggers can coexist in one process (e.g. sweep workers). MLflow
failures never stop training: the ``MLflowLogger`` warns once, then becomes a no-op
while ``metrics.jsonl`` keeps receiving everything. ``mlflow`` is imported lazily, so
``enabled=False`` runs never import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from dflash.run_dir import METRICS_FILE, RunDir
from dflash.tracking.run_info import (MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH,
                                      MAX_TAG_VAL_LENGTH, _WRITE_ONCE_TAGS, _chunks, _fmt_duration, _fmt_num,
                                      _fmt_rate, _json_default, _param_str, _sanitize_key, _to_float,
                                      default_run_name, flatten_config, get_or_create_experiment, git_sha,
                                      mlflow_ui_hint, quiet_library_logs, source_tags, truncate)
from dflash.tracking.transport import HEARTBEAT_TAG, heartbeat_tags, prepare_store, utc_now

_VALID_STATUSES = ("FINISHED", "FAILED", "KILLED")


@dataclass
class TrackingConfig:
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "dflash"
    run_name: str = ""  # empty -> the run folder's name (`<loss>-<noise>-<buffer>-s<seed>-<time>`)
    log_every: int = 10  # steps between metric reads/logs
    console: bool = True
    system_metrics: bool = True  # MLflow's own system-metrics logging (the run's System metrics tab)
    system_metrics_interval_s: float = 10.0  # seconds between samples of that monitor
    enabled: bool = True  # False -> only the jsonl file


# --------------------------------------------------------------------------- loggers


class Logger(ABC):
    """Logging interface. Only ``log`` is required; everything else defaults to a no-op."""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, status: str = "FINISHED") -> None:  # noqa: B027 - optional hook
        pass

    def log_params(self, params: Mapping[str, Any]) -> None:  # noqa: B027
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:  # noqa: B027
        pass

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:  # noqa: B027
        pass

    def log_text(self, text: str, name: str) -> None:  # noqa: B027
        pass

    def log_dict(self, d: Mapping[str, Any], name: str) -> None:  # noqa: B027
        pass

    def log_figure(self, fig: Any, name: str) -> None:  # noqa: B027
        pass

    @property
    def run_id(self) -> str | None:
        return None

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED")
        else:
            self.close("FAILED")


def read_jsonl_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl`, oldest first ([] when absent; a torn line is skipped)."""
    return RunDir(run_dir).metric_records()


class JsonlLogger(Logger):
    """Appends ``{"step", "time", **metrics}`` per ``log`` call to ``run_dir/metrics.jsonl``.

    Each line is flushed. Disk errors propagate (this is the log of record).
    ``log_params``/``set_tags`` merge into ``run_dir/params.json`` / ``run_dir/tags.json``.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        rec: dict[str, Any] = {"step": int(step), "time": time.time()}
        for k, v in metrics.items():
            f = _to_float(v)
            rec[str(k)] = f if f is not None else (v if isinstance(v, str) else str(v))
        if self._f is None or self._f.closed:
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def _merge_json(self, name: str, d: Mapping[str, Any]) -> None:
        p = self.run_dir / name
        cur: dict[str, Any] = {}
        if p.exists():
            try:
                cur = json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                cur = {}
        cur.update({str(k): _param_str(v) for k, v in d.items()})
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(cur, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, p)

    def log_params(self, params: Mapping[str, Any]) -> None:
        if params:
            self._merge_json("params.json", flatten_config(params))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self._merge_json("tags.json", tags)

    def close(self, status: str = "FINISHED") -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()


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
                           if not (k in _WRITE_ONCE_TAGS and self._existing_tags.get(k))})
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
        msg = f"{type(exc).__name__}: {exc}"
        if len(msg) > 600:
            msg = msg[:600] + " ..."
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
        for k, v in metrics.items():
            f = _to_float(v)
            if f is not None:
                ms.append(Metric(_sanitize_key(k), f, ts, int(step)))
        for i, chunk in enumerate(_chunks(ms, MAX_METRICS_PER_BATCH)):
            beat = heartbeat_tags() if i == 0 else []  # rides along: no extra request
            if not self._call("log_batch(metrics) failed", self.client.log_batch, self._run_id, metrics=list(chunk),
                              tags=beat):
                return

    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self._active or not params:
            return
        from mlflow.entities import Param

        flat = flatten_config(params)
        new: list[Any] = []
        changed: dict[str, str] = {}
        for k, v in flat.items():
            key = _sanitize_key(k)
            val = truncate(v, MAX_PARAM_VAL_LENGTH)
            old = self._existing_params.get(key)
            if old is None:
                new.append(Param(key, val))
            elif old != val:  # MLflow params are immutable; record the change as a tag
                changed[f"param_changed.{key}"] = val
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
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

        ts = [RunTag(_sanitize_key(k), truncate(_param_str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(ts, MAX_PARAMS_TAGS_PER_BATCH):
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

                    yaml.safe_dump(json.loads(json.dumps(d, default=_json_default)), f, sort_keys=False)
                else:
                    json.dump(d, f, indent=2, default=_json_default)

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
        self._closed = True


class ConsoleLogger(Logger):
    """One progress line per ``log`` call, e.g.

    ``step 120/1000 | loss 2.314 | acc 0.412 | anchor streak 1.83 | τ rounds 1.62 | 12.3k tok/s | buf 14/20 | ETA 3m12s``

    From ``train/loss``, ``train/acc``, ``train/anchor_streak``, ``train/tau_rounds``, ``perf/drafter_tok_s`` (else
    ``perf/pipeline_tok_s``), ``buffer/total``, ``buffer/max_depth``, plus the ``eval/tau*``
    τ keys (``| eval tau_vanilla 2.1 tau_tree_16 2.6``). Missing keys are skipped; a call with none of
    these keys (e.g. only ``sys/*``) prints nothing. ETA uses the wall-clock step rate
    since the first ``log`` call.
    """

    def __init__(self, total_steps: int | None = None, file: Any = None):
        self.total_steps = int(total_steps) if total_steps else 0
        self.file = file  # None -> sys.stdout at print time
        self._t0: float | None = None
        self._s0: int | None = None

    def format(self, metrics: Mapping[str, float], step: int, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        if self._t0 is None:
            self._t0, self._s0 = now, int(step)
        m = {k: f for k, v in metrics.items() if (f := _to_float(v)) is not None}
        parts: list[str] = []
        for key, label, fmt in (
            ("train/loss", "loss", "{:.3f}"),
            ("train/acc", "acc", "{:.3f}"),
            ("train/anchor_streak", "anchor streak", "{:.2f}"),  # uniform anchors: overstates τ
            ("train/tau_rounds", "τ rounds", "{:.2f}"),  # the round simulation on training sequences
        ):
            if key in m:
                parts.append(f"{label} {fmt.format(m[key])}")
        # what trains: consumed tok/s; the drafter's busy rate only where that is not logged (the
        # campaign's cells printed 73 K here while they consumed 42.5 K)
        tok_s = next((m[k] for k in ("perf/consumed_tok_s", "perf/pipeline_tok_s", "perf/drafter_tok_s") if k in m),
                     None)
        if tok_s is not None:
            parts.append(f"{_fmt_rate(tok_s)} tok/s")
        if "buffer/total" in m:
            buf = f"buf {int(m['buffer/total'])}"
            if "buffer/max_depth" in m:
                buf += f"/{int(m['buffer/max_depth'])}"
            parts.append(buf)
        ev = [f"{k[len('eval/'):]} {_fmt_num(v)}" for k, v in m.items() if k.startswith("eval/tau") and "_ci_" not in k]
        if ev:
            parts.append("eval " + " ".join(ev))
        if not parts:
            return None
        head = f"step {int(step)}/{self.total_steps}" if self.total_steps else f"step {int(step)}"
        line = " | ".join([head, *parts])
        done = int(step) - (self._s0 or 0)
        elapsed = now - self._t0
        if self.total_steps and done > 0 and elapsed > 0:
            eta = (self.total_steps - int(step)) * elapsed / done
            line += f" | ETA {_fmt_duration(eta)}"
        return line

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        line = self.format(metrics, step)
        if line is not None:
            print(line, flush=True, file=self.file if self.file is not None else sys.stdout)


class MultiLogger(Logger):
    """Fans every call out to ``loggers`` (in order). Errors from a logger propagate
    (jsonl disk errors must not be silent); ``close`` closes all before re-raising."""

    def __init__(self, loggers: Iterable[Logger]):
        self.loggers: list[Logger] = list(loggers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_params(params)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for lg in self.loggers:
            lg.set_tags(tags)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        for lg in self.loggers:
            lg.log_artifact(path, artifact_path)

    def log_text(self, text: str, name: str) -> None:
        for lg in self.loggers:
            lg.log_text(text, name)

    def log_dict(self, d: Mapping[str, Any], name: str) -> None:
        for lg in self.loggers:
            lg.log_dict(d, name)

    def log_figure(self, fig: Any, name: str) -> None:
        for lg in self.loggers:
            lg.log_figure(fig, name)

    def close(self, status: str = "FINISHED") -> None:
        first: BaseException | None = None
        for lg in self.loggers:
            try:
                lg.close(status)
            except BaseException as e:  # close the others anyway
                first = first or e
        if first is not None:
            raise first

    @property
    def mlflow(self) -> MLflowLogger | None:
        inner = (getattr(lg, "inner", lg) for lg in self.loggers)  # a BackgroundLogger's MLflowLogger
        return next((lg for lg in inner if isinstance(lg, MLflowLogger)), None)

    @property
    def run_id(self) -> str | None:
        return next((lg.run_id for lg in self.loggers if lg.run_id), None)


def build_loggers(
    cfg: TrackingConfig,
    run_dir: str | os.PathLike,
    params: Mapping[str, Any] | None,
    tags: Mapping[str, Any] | None,
    total_steps: int | None,
    run_id: str | None = None,
) -> MultiLogger:
    """jsonl always; MLflow when ``cfg.enabled``; console when ``cfg.console``.

    ``params`` may be nested (flattened here). Adds tags ``dflash.git_sha``, ``dflash.run_dir`` and MLflow's
    own Source / git commit / Description fields (``source_tags``: the command line) unless given. With
    ``cfg.console`` it prints the run's name, id, folder and the ``mlflow ui`` command first. Writes
    ``run_dir/params.json``, ``run_dir/tags.json`` and, when the MLflow run started,
    ``run_dir/mlflow_run.json`` (tracking_uri, experiment, run_id, run_name).
    Pass ``run_id`` (e.g. from a checkpoint) to reopen that MLflow run on resume. The run's name is
    ``cfg.run_name``, or the run folder's name when that is empty.
    """
    run_dir = Path(run_dir)
    if not cfg.run_name:  # the MLflow run is named like its folder: one string to find both by
        cfg = dataclasses.replace(cfg, run_name=run_dir.resolve().name)
    params = flatten_config(params or {})
    all_tags: dict[str, Any] = dict(tags or {})
    sha = git_sha()
    all_tags.setdefault("dflash.git_sha", sha)
    for k, v in source_tags(run_dir).items():
        all_tags.setdefault(k, v)
    all_tags.setdefault("dflash.run_dir", str(run_dir.resolve()))
    quiet_library_logs()

    jsonl = JsonlLogger(run_dir)
    jsonl.log_params(params)
    jsonl.set_tags(all_tags)
    loggers: list[Logger] = [jsonl]
    if cfg.enabled:
        ml = MLflowLogger(cfg, params, all_tags, run_id=run_id)
        loggers.append(ml)
        if ml.run_id is not None:
            info = {
                "tracking_uri": cfg.tracking_uri,
                "experiment": cfg.experiment,
                "experiment_id": ml.experiment_id,
                "run_id": ml.run_id,
                "run_name": ml.run_name,
            }
            RunDir(run_dir).write_mlflow_info(info)
    if cfg.console:
        loggers.append(ConsoleLogger(total_steps))
        print(start_banner(run_dir, loggers[1] if cfg.enabled else None), flush=True)
    return MultiLogger(loggers)


def start_banner(run_dir: Path, ml: "MLflowLogger | None") -> str:
    """What a researcher needs at the start of a run: which run, where, and how to look at it."""
    lines = [f"run folder: {run_dir.resolve()}"]
    if ml is not None and ml.run_id is not None:
        lines.insert(0, f"mlflow run: {ml.run_name} ({ml.run_id}){' resumed' if ml.resumed else ''}")
        lines.append(f"view: {mlflow_ui_hint(ml.tracking_uri, ml.experiment_id, ml.run_id)}")
    elif ml is not None:
        lines.append("mlflow: not tracking (see the warning above); metrics go to metrics.jsonl")
    return "\n".join(lines)


__all__ = [
    "TrackingConfig",
    "Logger",
    "JsonlLogger",
    "MLflowLogger",
    "ConsoleLogger",
    "MultiLogger",
    "build_loggers",
    "flatten_config",
    "git_sha",
    "default_run_name",
    "run_params",
    "source_tags",
    "command_line",
    "quiet_library_logs",
]
