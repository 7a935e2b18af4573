"""What a run reports and how it is read back.

- `loggers`: one logging interface over console, `metrics.jsonl` and MLflow (`TrackingConfig`,
  `build_loggers`, key prefixes `train/ eval/ perf/ data/ sys/`).
- `sysmetrics`: host and GPU memory / utilisation (`system_metrics`).
- `analysis`: ablation tables, curves and per-position acceptance from the MLflow store (the notebooks' logic).
"""
