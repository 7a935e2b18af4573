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
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable

from dflash.tracking.logger_base import Logger, TrackingConfig
from dflash.tracking.mlflow_logger import MLflowLogger
from dflash.tracking.records import METRICS_FILE, read_metric_records, write_mlflow_record
from dflash.tracking.run_info import (fmt_duration, fmt_num, fmt_rate, param_str, to_float,
                                      command_line, default_run_name, flatten_config, git_sha, mlflow_ui_hint,
                                      quiet_library_logs, run_params, source_tags, NOTE)
from dflash.tracking.ui_view import result_note, with_result


def read_jsonl_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl`, oldest first ([] when absent; a torn line is skipped)."""
    return read_metric_records(run_dir)


def merge_json(p: Path, d: Mapping[str, Any]) -> None:
    """Merge `d` (values as strings) into the JSON object file `p` (a run folder's params.json / tags.json), whole."""
    cur: dict[str, Any] = {}
    if p.exists():
        try:
            cur = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            cur = {}
    cur.update({str(k): param_str(v) for k, v in d.items()})
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(cur, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, p)


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
            f = to_float(v)
            rec[str(k)] = f if f is not None else (v if isinstance(v, str) else str(v))
        if self._f is None or self._f.closed:
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def _merge_json(self, name: str, d: Mapping[str, Any]) -> None:
        merge_json(self.run_dir / name, d)

    def log_params(self, params: Mapping[str, Any]) -> None:
        if params:
            self._merge_json("params.json", flatten_config(params))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self._merge_json("tags.json", tags)

    def close(self, status: str = "FINISHED") -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()


class ConsoleLogger(Logger):
    """One progress line per ``log`` call, e.g.

    ``step 120/1000 | loss 2.314 | acc 0.412 | anchor streak 1.83 | τ rounds 1.62 | 12.3k tok/s | buf 14/20 | ETA 3m12s``

    From ``train/loss``, ``train/acc``, ``train/anchor_streak``, ``train/tau_rounds``, ``perf/drafter_tok_s`` (else
    ``perf/pipeline_tok_s``), ``buffer/total``, ``buffer/max_depth``, plus the ``eval/tau*``
    τ keys (``| eval tau_vanilla 2.1 tau_tree_16 2.6``). Missing keys are skipped; a call with none of
    these keys (e.g. only ``sys/*``) prints nothing. ETA uses the wall-clock step rate
    since the first ``log`` call, or the rate of ``train/time_progress`` (a time budget's share spent) where that
    ends the run sooner; a line without ``train/time_progress`` after one had it (an in-training evaluation's) carries
    the budget's last ETA forward.
    """

    def __init__(self, total_steps: int | None = None, file: Any = None):
        self.total_steps = int(total_steps) if total_steps else 0
        self.file = file  # None -> sys.stdout at print time
        self._t0: float | None = None
        self._s0: int | None = None
        self._p0: float | None = None  # the first train/time_progress seen, and when
        self._tp = 0.0
        self._time_eta: tuple[float, float] | None = None  # the last time-budget ETA, and when it was computed

    def format(self, metrics: Mapping[str, float], step: int, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        if self._t0 is None:
            self._t0, self._s0 = now, int(step)
        m = {k: f for k, v in metrics.items() if (f := to_float(v)) is not None}
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
            parts.append(f"{fmt_rate(tok_s)} tok/s")
        if "buffer/total" in m:
            buf = f"buf {int(m['buffer/total'])}"
            if "buffer/max_depth" in m:
                buf += f"/{int(m['buffer/max_depth'])}"
            parts.append(buf)
        ev = [f"{k[len('eval/'):]} {fmt_num(v)}" for k, v in m.items()
              if k.startswith(("eval/tau", "eval/subset/tau")) and "_ci_" not in k]
        if ev:
            parts.append("eval " + " ".join(ev))
        if not parts:
            return None
        head = f"step {int(step)}/{self.total_steps}" if self.total_steps else f"step {int(step)}"
        line = " | ".join([head, *parts])
        done = int(step) - (self._s0 or 0)
        elapsed = now - self._t0
        etas = []
        if self.total_steps and done > 0 and elapsed > 0:
            etas.append((self.total_steps - int(step)) * elapsed / done)
        p = m.get("train/time_progress", 0.0)  # trainer.schedule_by_time: the time budget may end the run first
        if p > 0:
            if self._p0 is None:
                self._p0, self._tp = p, now
            elif p > self._p0:
                self._time_eta = ((1.0 - p) * (now - self._tp) / (p - self._p0), now)
                etas.append(self._time_eta[0])
        elif self._time_eta is not None:
            # a line without train/time_progress (an in-training evaluation's) in a time-budgeted run: the budget's
            # last ETA, less the time since, not the max_steps estimate the budget makes meaningless ("ETA 1128h")
            eta, at = self._time_eta
            etas.append(max(0.0, eta - (now - at)))
        if etas:
            line += f" | ETA {fmt_duration(min(etas))}"
        return line

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        line = self.format(metrics, step)
        if line is not None:
            print(line, flush=True, file=self.file if self.file is not None else sys.stdout)


class MultiLogger(Logger):
    """Fans every call out to ``loggers`` (in order). Errors from a logger propagate
    (jsonl disk errors must not be silent); ``close`` closes all before re-raising. An evaluation that logs the
    objective (`eval/tau_served`) puts its result at the top of the run's Description (`note`: the command line
    the run was made with, which stays below it), in MLflow and in the folder's tags.json alike."""

    def __init__(self, loggers: Iterable[Logger], note: str = ""):
        self.loggers: list[Logger] = list(loggers)
        self._note = note

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)
        result = result_note(metrics)
        if result:
            self.set_tags({NOTE: with_result(self._note, result)})

    def log_params(self, params: Mapping[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_params(params)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if NOTE in tags:
            self._note = str(tags[NOTE])
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

    ml = MLflowLogger(cfg, params, all_tags, run_id=run_id) if cfg.enabled else None
    if ml is not None:  # the folder says what MLflow shows: a reopened run (resume, a sweep trial's pre-made child
        # with the trial's command) keeps the Description it was made with, not this process's command line
        all_tags.update(ml.kept_tags)
    jsonl = JsonlLogger(run_dir)
    jsonl.log_params(params)
    jsonl.set_tags(all_tags)
    loggers: list[Logger] = [jsonl]
    if ml is not None:
        loggers.append(ml)
        if ml.run_id is not None:
            info = {
                "tracking_uri": cfg.tracking_uri,
                "experiment": cfg.experiment,
                "experiment_id": ml.experiment_id,
                "run_id": ml.run_id,
                "run_name": ml.run_name,
            }
            write_mlflow_record(run_dir, info)
    if cfg.console:
        loggers.append(ConsoleLogger(total_steps))
        print(start_banner(run_dir, ml), flush=True)
    return MultiLogger(loggers, note=str(all_tags.get(NOTE, "")))


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
