"""Data-parallel training under torchrun (2 CPU processes, gloo): ranks split the data, replicas stay
identical through DDP, rank 0 alone writes the run, and a checkpoint resumes on the same world size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(args, tmp_path, nproc=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "experiments.run", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_ranks_train_one_run(tmp_path):
    run_dir = tmp_path / "ddp"
    db = tmp_path / "mlflow.db"
    args = [*FAST, "trainer.device=cpu", "target.device=cpu", f"run_dir={run_dir}",
            f"tracking.tracking_uri=sqlite:///{db}", "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    out = _torchrun(args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert [r for r in rows if "perf/world_size" in r][-1]["perf/world_size"] == 2
    assert rows[-1]["sys/setup_s"] > 0 and rows[-1]["sys/loop_s"] > 0  # where the run's wall time went
    ckpt = torch.load(run_dir / "checkpoints" / "step_00000004.pt", weights_only=False)
    assert len(ckpt["ranks"]) == 2
    keys = [set(k for _, k in r["pending_keys"]) for r in ckpt["ranks"]]
    assert all(k % 2 == rank for rank, ks in enumerate(keys) for k in ks), "rank r takes items g ≡ r (mod 2)"
    runs = MlflowClient(f"sqlite:///{db}").search_runs(["1"])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # resume on the same world size continues; the replicas restored from one file stay in step
    out = _torchrun([f"resume={run_dir}", "trainer.max_steps=6"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6
