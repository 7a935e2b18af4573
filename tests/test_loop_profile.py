"""benchmarks/profile_run.py and dflash.bench.loop_profile on a CPU run: the breakdown adds up."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_union_of_intervals():
    from dflash.bench.loop_profile import _union_us
    assert _union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert _union_us([]) == 0.0


def test_profile_run_breaks_the_loop_down(tmp_path, capsys):
    from tests.conftest import FAST
    from profile_run import main
    out = tmp_path / "profile.json"
    main(["--start", "2", "--steps", "3", "--out", str(out), "--", *FAST, f"run_dir={tmp_path / 'run'}",
          f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    import json
    r = json.loads(out.read_text())
    assert r["steps"] == 3 and r["start"] == 2
    parts = r["dflash.next_items_ms_per_step"] + r["dflash.train_step_ms_per_step"]
    assert 0 < parts <= r["wall_ms_per_step"] + 1e-6 and r["other_ms_per_step"] >= -1e-6
    assert r["dflash.train_step_ms_per_step"] > 0 and r["dflash.train_step_top_ops"]
    assert r["gpu_busy_frac"] == 0.0  # a CPU trace has no kernels
    assert "loop profile: 3 steps from step 2" in capsys.readouterr().out
