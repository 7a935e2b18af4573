import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
torch.set_num_threads(1)  # tiny models: threads cost more than they give on 2 shared cores


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Overrides that make a run take seconds on CPU (the real model classes, tiny sizes).
FAST = [
    "+target=tiny_random", "+eval=off",
    "target.random.hidden_size=64", "target.random.num_layers=4", "target.random.intermediate_size=128",
    "target.random.head_dim=16", "target.random.linear_head_dim=16", "target.layer_ids=[0,1,2]",
    "drafter.num_layers=1", "drafter.head_dim=16", "drafter.intermediate_size=128", "drafter.block_size=8",
    "data.num_sequences=24", "data.min_len=24", "data.max_len=72", "trainer.num_anchors=4",
    "trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.checkpoint_every=3",
    "buffer.min_ready=2", "buffer.max_depth=4", "buffer.timeout_s=60", "tracking.log_every=1",
    "tracking.console=false", "tracking.system_metrics=false",
]


@pytest.fixture
def fast_cfg(tmp_path):
    """compose_config with FAST overrides, a temp run dir and a temp sqlite MLflow store."""
    from experiments.config import compose_config

    def make(*overrides, run="run"):
        return compose_config(FAST + [f"run_dir={tmp_path / run}",
                                      f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                      *overrides])
    return make


@pytest.fixture(scope="session")
def reference_target():
    """The library's default `TargetConfig()` on the CPU: a tiny random hybrid qwen3_5 (not the shipped reference
    target, which runs compose: `target.path=builtin:reference_target`), built once for the whole session
    (read-only use)."""
    import warnings

    from dflash.target.model import Target, TargetConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Target(TargetConfig(device="cpu"))


@pytest.fixture(scope="session")
def byte_target():
    """A tiny random hybrid target over a byte tokenizer (readable text, every byte a token), built once for the
    session (read-only use): the sampled-evaluation and stop-rule tests' target."""
    import warnings

    from dflash.target.model import Target, TargetConfig, TinyTargetSpec
    spec = TinyTargetSpec(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                          intermediate_size=128, linear_num_key_heads=1, linear_num_value_heads=2,
                          linear_head_dim=16, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Target(TargetConfig(device="cpu", random=spec, layer_ids=[0, 2], tokenizer="bytes"))


class LenCache:
    """The cache of a scripted test drafter: only the committed length (DrafterCache's crop contract)."""

    def __init__(self):
        self.length = 0

    def crop(self, n):
        self.length = min(self.length, n)



def resume_rewrites_the_same_data(full_run_dir, shard_dir, make_cfg, tmp_path, losses):
    """Resume a copy of `full_run_dir` cut after its step-3 checkpoint with every shard under `shard_dir` deleted
    (the resumed run writes its data again): steps 4-6 give the uninterrupted run's losses. Returns the result."""
    from dflash.app.run import train
    ref = losses(full_run_dir)
    part = interrupted_copy(full_run_dir, 3, tmp_path / "part")
    for shard in shard_dir.rglob("*.pt"):
        shard.unlink()
    res = train(make_cfg(f"resume={part}", run="ignored"))
    got = losses(res.run_dir)
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), (s, got, ref)
    return res


def interrupted_copy(run_dir, step: int, dest):
    """`dest` as `run_dir` stood right after its step-`step` checkpoint (an interrupted run to resume):
    that checkpoint and the config, pointed at `dest`."""
    from pathlib import Path
    run_dir, dest = Path(run_dir), Path(dest)
    (dest / "checkpoints").mkdir(parents=True)
    name = f"step_{step:08d}.pt"
    (dest / "checkpoints" / name).write_bytes((run_dir / "checkpoints" / name).read_bytes())
    (dest / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(str(run_dir), str(dest)))
    return dest
