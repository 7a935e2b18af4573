"""benchmarks/gpu/dflash2_speed.sh, dry-run on the CPU at tiny shapes: every stage runs as its own process; the
pipeline stage runs with AdamW on a card of more than 100 GiB, with Muon on an 80 GiB card when ONLY names it, and is
skipped without a card; the short table names DFlash 2's ratio to DFlash 1 at both shapes and the microbenches'
figures."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ("+target=tiny_random +eval=off target.random.hidden_size=64 target.random.num_layers=4 "
        "target.random.intermediate_size=128 target.random.head_dim=16 target.random.linear_head_dim=16 "
        "target.layer_ids=[0,1,2] drafter.head_dim=16 drafter.intermediate_size=128 drafter.block_size=8 "
        "bench.seq_len=48 bench.anchors=4 bench.iters=1 bench.warmup=1 results=")


def test_the_script_runs_each_stage_and_prints_the_ratios(tmp_path):
    tiny = f"{TINY} run_dir={tmp_path / 'run'}"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "BIG": f"{tiny} drafter.num_layers=5",
           "REF": f"{tiny} drafter.num_layers=2", "MICRO": "--small --iters 1", "CONV": "--small --iters 1"}
    env.pop("FORCE_PIPELINE", None)
    # cwd: a folder without wheel folders (wheels.sh installs the ones a GPU call carries, from the cwd)
    p = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/dflash2_speed.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    stages = (tmp_path / "out/dflash2_speed/stages.txt").read_text()
    for name in ("micro", "conv", "drafter_27b", "drafter_reference"):
        assert f"{name}: rc 0" in stages, stages
    assert "pipeline_27b: skipped" in stages
    table = p.stdout.split("DFlash 2 against DFlash 1", 1)[1]
    for shape in ("drafter_27b", "drafter_reference"):
        rows = [line for line in table.splitlines() if line.startswith(f"{shape} drafter tok/s")]
        assert len(rows) == 2 and "[DFlash 2]" in rows[1] and "x the default" in rows[1], table
    assert "pair scores fwd+bwd" in table
    assert "| conv floor (ms) |" in table and "| tiny |" in table


def test_only_runs_the_named_stages(tmp_path):
    """ONLY=micro: the microbench alone, every other stage named as skipped (an H200 job runs ONLY=pipeline_27b)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MICRO": "--small --iters 1", "ONLY": "micro"}
    p = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/dflash2_speed.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    stages = (tmp_path / "out/dflash2_speed/stages.txt").read_text()
    assert "micro: rc 0" in stages, stages
    for name in ("conv", "drafter_27b", "drafter_reference", "pipeline_27b"):
        assert f"{name}: skipped (ONLY=micro)" in stages, stages


def test_an_80_gib_card_runs_the_named_pipeline_with_muon(tmp_path):
    """ONLY=pipeline_27b on a card of 80 GiB (a stand-in `nvidia-smi` says 81,559 MiB): the pipeline stage runs, with
    trainer.optimizer=muon; unnamed, it is skipped."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 81559\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    L = "sliding_attention"
    pipe = (f"{TINY} run_dir={tmp_path / 'run'} drafter.num_layers=2 drafter.architecture=dflash2 "
            f"drafter.layer_types=[{L},{L}] drafter.sliding_window=64 drafter.conv_group_size=16 bench.pipeline_steps=2 bench.pipeline_warmup=1 "
            "bench.pipeline_repeats=1")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PIPE": pipe, "ONLY": "pipeline_27b",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("FORCE_PIPELINE", None)
    p = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/dflash2_speed.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    stages = (tmp_path / "out/dflash2_speed/stages.txt").read_text()
    assert "pipeline_27b: rc 0" in stages, stages + (tmp_path / "out/dflash2_speed/pipeline_27b.txt").read_text()[-3000:]
    assert "pipeline_27b: trainer.optimizer=muon (GPU memory 81559 MiB)" in stages
    assert "of its serial sum" in (tmp_path / "out/dflash2_speed/pipeline_27b.txt").read_text()
    env["ONLY"] = "micro"
    env["MICRO"] = "--small --iters 1"
    p = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/dflash2_speed.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pipeline_27b: skipped (ONLY=micro)" in (tmp_path / "out/dflash2_speed/stages.txt").read_text()
