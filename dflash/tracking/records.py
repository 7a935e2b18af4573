"""The two files a run's loggers keep in its folder, by name, with their readers and writer: `metrics.jsonl`
(every logged step, the log of record) and `mlflow_run.json` (where the run is tracked). The loggers write them;
`dflash/run_dir.py` (the run folder's layout) and the CLIs read them through these functions."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from dflash.atomic import atomic_write_text

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
MLFLOW_FILE = "mlflow_run.json"


def read_metric_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl`, oldest first ([] when absent; a torn line is skipped)."""
    try:
        lines = (Path(run_dir) / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def split_jobs(records: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], bool]]:
    """A run's metric records by job (a resumed run has one job per process): (records, ended). A job that ended
    logged its `sys/loop_s`; records after the last such one that hold a step window (`perf/consumed_tok_s`) are a
    job cut before its end, and records that hold none (what the end logs after its loop) belong to the job
    before them."""
    jobs: list[tuple[list[dict[str, Any]], bool]] = []
    cur: list[dict[str, Any]] = []
    for rec in records:
        if jobs and not cur and "perf/consumed_tok_s" not in rec and "sys/loop_s" not in rec:
            jobs[-1][0].append(rec)  # logged after the last job's loop, before the next job's first window
            continue
        cur.append(rec)
        if "sys/loop_s" in rec:
            jobs.append((cur, True))
            cur = []
    if cur:
        jobs.append((cur, False))
    return jobs


def read_mlflow_record(run_dir: str | os.PathLike) -> dict:
    """`<run_dir>/mlflow_run.json` as a dict: {} when absent; an unreadable file warns and reads as absent."""
    f = Path(run_dir) / MLFLOW_FILE
    if not f.is_file():
        return {}
    try:
        info = json.loads(f.read_text())
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        log.warning("%s is unreadable; treated as an untracked run", f)
        return {}


def write_mlflow_record(run_dir: str | os.PathLike, info: Mapping[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / MLFLOW_FILE, json.dumps(dict(info), indent=1))
