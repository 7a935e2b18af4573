"""What a researcher sees in MLflow after one short run: its name, its param count and its System metrics tab.

    python benchmarks/gpu/system_metrics_check.py +trainer=gpu trainer.max_steps=200      # one H200, ~2 min
    python benchmarks/gpu/system_metrics_check.py +target=tiny_random +eval=off trainer.max_steps=4  # CPU

Trains in a temporary folder with its own sqlite store (`tracking.system_metrics_interval_s=2`), then prints
the run's name and params count and one line per `system/` metric: samples, mean, last. On a GPU machine
with `nvidia-ml-py`, `system/gpu_0_utilization_percentage` must be among them (MLflow's GPU monitor).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(overrides: list[str]) -> int:
    from mlflow.tracking import MlflowClient

    from dflash.app.run import train
    from experiments.config import compose_config

    with tempfile.TemporaryDirectory(prefix="dflash-sysmetrics-") as d:
        uri = f"sqlite:///{Path(d) / 'mlflow.db'}"
        cfg = compose_config([f"tracking.tracking_uri={uri}", f"run_dir={Path(d) / 'run'}",
                              "tracking.system_metrics_interval_s=2", *overrides])
        res = train(cfg)
        c = MlflowClient(uri)
        run = c.get_run(res.run_id)
        keys = sorted(k for k in run.data.metrics if k.startswith("system/"))
        print(f"\nrun {run.info.run_name}: {len(run.data.params)} params, {len(keys)} system metrics")
        print(f"{'system metric':48s} {'samples':>7s} {'mean':>10s} {'last':>10s}")
        for k in keys:
            vals = [m.value for m in c.get_metric_history(res.run_id, k)]
            print(f"{k:48s} {len(vals):7d} {sum(vals) / len(vals):10.2f} {vals[-1]:10.2f}")
        gpu = [k for k in keys if k.startswith("system/gpu_")]
        print("GPU utilisation logged" if any("utilization" in k for k in gpu) else
              "no GPU metrics (no CUDA device, or nvidia-ml-py not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
