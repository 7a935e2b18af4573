"""What a run reports and how it is read back.

- `loggers`: one logging interface over console, `metrics.jsonl` and MLflow (`TrackingConfig`,
  `build_loggers`, key prefixes `train/ eval/ perf/ data/ sys/`).
- `background`: MLflow calls on a worker thread, so a slow or dead store costs training nothing (`in_background`).
- `transport`: bounded HTTP timeouts / retries, a connect check, the `dflash.heartbeat` tag.
- `sysmetrics`: host and GPU memory / utilisation (`system_metrics`).
- `analysis`: ablation tables, curves and per-position acceptance from the MLflow store (the notebooks' logic).
"""
