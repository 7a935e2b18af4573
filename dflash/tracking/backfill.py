"""On resume, MLflow gets what `metrics.jsonl` has.

`metrics.jsonl` is written (and flushed) on the step loop's thread; MLflow's calls run on a worker thread
(dflash/tracking/background.py), so a kill -9 loses the MLflow steps still in flight while the local file has
them. A resumed run sends those (step, key) values before training goes on: the run's MLflow history then has
every step its log of record has, each once, with the time it was first logged.
"""
from __future__ import annotations

import os
from typing import Any

from dflash.tracking.records import read_metric_records
from dflash.tracking.run_info import MAX_METRICS_PER_BATCH, in_batches, sanitize_key, to_float


def missing_in_mlflow(client: Any, run_id: str, records: list[dict]) -> list[Any]:
    """The `Metric`s of `records` (metrics.jsonl's, oldest first) whose (key, step) the run's history lacks; for a
    (key, step) logged twice locally, the first value (the one a resumed run keeps, `SkipLogged`)."""
    from mlflow.entities import Metric
    by_key: dict[str, dict[int, tuple[float, int]]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        ts = int(float(rec.get("time", 0.0)) * 1000)
        for k, v in rec.items():
            f = to_float(v) if k not in ("step", "time") else None
            if f is not None:
                by_key.setdefault(sanitize_key(k), {}).setdefault(step, (f, ts))
    missing = []
    for key, steps in by_key.items():
        have = {m.step for m in client.get_metric_history(run_id, key)}
        missing += [Metric(key, f, ts, step) for step, (f, ts) in sorted(steps.items()) if step not in have]
    return missing


def backfill_mlflow(ml: Any, run_dir: str | os.PathLike) -> int:
    """Send `ml`'s (an MLflowLogger's) run the metrics of `run_dir/metrics.jsonl` it lacks; the number sent (0
    when tracking is off or down: a failure disables the logger with its one warning, as any MLflow call)."""
    if not ml.healthy or ml.run_id is None:
        return 0
    try:
        missing = missing_in_mlflow(ml.client, ml.run_id, read_metric_records(run_dir))
    except Exception as e:  # noqa: BLE001 - a store outage: the usual one warning, training goes on
        ml._disable("reading the run's metric history failed", e)
        return 0
    for chunk in in_batches(missing, MAX_METRICS_PER_BATCH):
        if not ml._call("log_batch(backfill) failed", ml.client.log_batch, ml.run_id, metrics=list(chunk)):
            return 0
    return len(missing)
