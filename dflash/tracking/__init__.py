"""What a run reports and how it is read back.

- `loggers`: one logging interface over console, `metrics.jsonl` and MLflow (`TrackingConfig`,
  `build_loggers`, key prefixes `train/ eval/ perf/ data/ sys/`); the interface and its config in `logger_base`,
  the MLflow run's logger in `mlflow_logger` (both re-exported by `loggers`).
- `background`: MLflow calls on a worker thread, so a slow or dead store costs training nothing (`in_background`).
- `transport`: bounded HTTP timeouts / retries, a connect check, the `dflash.heartbeat` tag.
- `sysmetrics`: MLflow's own system-metrics monitor on a run (the System metrics tab: CPU / GPU utilisation,
  memory) and `sys/` keys for metrics.jsonl (`start_system_metrics`, `system_metrics`).
- `analysis`: runs from the MLflow store, ablation tables that compare like with like (`ablation_table`,
  `varying_keys`, `describe_comparison`), per-position acceptance (the notebooks' logic).
- `figures`: the analysis' figures (one colour per run in every panel, one legend naming every run).
"""
