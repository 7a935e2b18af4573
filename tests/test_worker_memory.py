"""A sweep worker's memory fits the machine (issue 59, row 6: the README's loss_variants example on a CPU, a worker
OOM-killed at 11 GB): the launcher estimates a CPU worker's peak from the run config and lowers `workers` to what
the available memory holds, or stops with exit 2 naming `workers` and the figures; the LM-head logit blocks and the
prompt pool hold what they need and no more on the CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sweeps import launch, memory

ROOT = Path(__file__).resolve().parents[1]


def _smoke_cfg(tmp_path, *overrides):
    from sweeps.space import load_sweep, merge_overrides
    sweep = load_sweep("cpu_smoke")
    return launch.validate(sweep, merge_overrides(sweep.fixed, ["trainer.device=cpu", *overrides]), tmp_path)


def test_a_cpu_sweep_lowers_workers_to_what_fits(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "detect_gpus", lambda: [])
    peak = memory.worker_peak(_smoke_cfg(tmp_path))["peak"]
    monkeypatch.setattr(memory, "available_bytes", lambda: int(2.5 * peak))  # room for two workers
    args = launch.parse_args(["cpu_smoke", "n_trials=4", "workers=4", "trainer.device=cpu"])
    launch.check_memory(args, _sweep(), _smoke_cfg(tmp_path))
    assert args.workers == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "workers=4 lowered to 2" in err and f"{peak / memory.GiB:.1f} GiB" in err
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * peak)  # room enough: untouched, silent
    args = launch.parse_args(["cpu_smoke", "n_trials=4", "workers=4"])
    launch.check_memory(args, _sweep(), _smoke_cfg(tmp_path))
    assert args.workers == 4 and not capsys.readouterr().err
    monkeypatch.setattr(memory, "available_bytes", lambda: 0)
    args = launch.parse_args(["cpu_smoke", "n_trials=4", "workers=4", "memory_check=false"])  # the user's call
    launch.check_memory(args, _sweep(), _smoke_cfg(tmp_path))
    assert args.workers == 4
    monkeypatch.setattr(launch, "detect_gpus", lambda: ["0"])  # trials on a GPU: the host check does not apply
    args = launch.parse_args(["cpu_smoke", "n_trials=4", "workers=4"])
    launch.check_memory(args, _sweep(), _smoke_cfg(tmp_path))
    assert args.workers == 4
    with pytest.raises(launch.SweepError, match=r"workers=4: a worker's estimated peak is .* 0\.0 GiB available"):
        monkeypatch.setattr(launch, "detect_gpus", lambda: [])
        launch.check_memory(launch.parse_args(["cpu_smoke", "n_trials=4", "workers=4"]), _sweep(),
                            _smoke_cfg(tmp_path))


def _sweep():
    from sweeps.space import load_sweep
    return load_sweep("cpu_smoke")


def test_a_worker_that_cannot_fit_is_exit_2_naming_workers_before_any_work(tmp_path):
    """The README's GPU sweep with trial shapes no machine's memory holds: exit 2 in seconds, naming `workers`
    and the figures, with no study, no MLflow store and no trial folder made."""
    out, db = tmp_path / "out", tmp_path / "mlflow.db"
    cmd = [sys.executable, "-m", "sweeps.launch", "loss_variants", "n_trials=2", "workers=2", "trainer.max_steps=10",
           "trainer.device=cpu", "trainer.sequences_per_step=1000000", f"out={out}",
           f"tracking.tracking_uri=sqlite:///{db}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: workers=2: a worker's estimated peak is") and "GiB available" in last
    assert "training step" in last and "cpu_smoke" in last and "Traceback" not in r.stderr
    assert not out.exists() and not db.exists()


def test_the_estimate_follows_the_trial_shapes(tmp_path):
    base = memory.worker_peak(_smoke_cfg(tmp_path))
    wide = memory.worker_peak(_smoke_cfg(tmp_path, "trainer.sequences_per_step=64", "trainer.num_anchors=64"))
    assert wide["training step"] > 100 * base["training step"] > 0
    online = memory.worker_peak(_smoke_cfg(tmp_path, "trainer.online_data=true", "data.online.write_batch=512",
                                                    "data.pool.max_prompt_len=48", "data.pool.chunk_max_len=32"))
    assert online["online writer"] > 0 and "online writer" not in base
    assert base["peak"] == sum(v for k, v in base.items() if k != "peak")


def test_cpu_logits_are_made_in_blocks_of_128_mib():
    """loss.chunk_size / target.lm_head_chunk = 0 on the CPU: [chunk, V] float32 blocks near 128 MiB (the GPU's
    1 GiB blocks made a CPU trial's step 2.1 GiB larger); an explicit size is kept on either."""
    from dflash.target.lm_head import resolve_chunk
    assert resolve_chunk(0, 4096, "cpu") == 8192 and resolve_chunk(0, 4096, "cuda") == 65_536
    assert resolve_chunk(0, 248_320, "cpu") == 128 and resolve_chunk(0, 248_320, "cuda:1") == 1024
    assert resolve_chunk(4096, 4096, "cpu") == 4096


def test_the_prompt_pool_keeps_its_tokens_flat(tmp_path):
    """A pool's prompts are one int32 tensor and offsets, read back from the cache the same, item by item lists."""
    import torch

    from dflash.data.corpus import CorpusConfig, load_corpus
    from dflash.data.pool import PoolConfig, TokenLists, build_prompt_pool
    from dflash.target.model import ByteTokenizer
    from tests.test_online_data import _write_corpus
    _write_corpus(tmp_path / "src")
    corpus = load_corpus(CorpusConfig(root=str(tmp_path / "src"), heldout_per_10k=4000))
    cfg = PoolConfig(max_prompt_len=64, chunk_min_len=8, chunk_max_len=24, cache_dir=str(tmp_path / "cache"))
    pool = build_prompt_pool(corpus, ByteTokenizer(), cfg, "bytes")
    again = build_prompt_pool(corpus, ByteTokenizer(), cfg, "bytes")
    for p in (pool, again):
        assert isinstance(p.prompts, TokenLists) and p.prompts.flat.dtype == torch.int32
        assert p.prompts.flat.numel() == sum(map(len, p.prompts)) == int(p.stats["mean_prompt_len"] * len(p) + .5)
    assert again.prompts == pool.prompts and all(isinstance(x, list) for x in again.prompts)
    assert pool.prompts[-1] == list(pool.prompts)[-1] and pool.prompts[1:3] == [pool.prompts[1], pool.prompts[2]]
    with pytest.raises(IndexError):
        pool.prompts[len(pool)]
