"""Every "auto" setting is resolved once, when the run is composed: the components get the resolved values and
MLflow's params show what ran with the requested value beside it; config.yaml keeps what was requested."""
from __future__ import annotations

import yaml
from mlflow.tracking import MlflowClient

from dflash.app.run import train
from dflash.data.writing import auto_write_batch
from dflash.target.lm_head import resolve_chunk
from tests.test_online_data import _online


def test_resolve_auto_gives_what_runs_and_what_was_asked(fast_cfg, tmp_path):
    import torch

    from dflash.app.auto import resolve_auto
    from dflash.target.model import Target
    cfg = fast_cfg(*_online(tmp_path), "data.online.write_batch=0", "data.online.reuse=0", "drafter.rope_theta=0")
    target = Target(cfg.target)
    ran, asked = resolve_auto(cfg, target, torch.device("cpu"), 1234.0)
    seq_len = cfg.data.online_seq_len()
    assert ran.data.online.write_batch == auto_write_batch(target, seq_len) > 0
    assert ran.data.online.reuse == 1 and ran.data.online.seq_len == seq_len  # CPU: one view each
    assert ran.loss.chunk_size == resolve_chunk(0, target.lm_head_weight().shape[0], "cpu")
    assert ran.drafter.rope_theta == 1234.0 and ran.trainer.device == "cpu" and ran.trainer.autocast == "off"
    assert ran.trainer.producer_mode == "thread"  # a CPU drafter: auto never runs the target inline
    assert asked["data.online.write_batch"] == "0" and asked["data.online.reuse"] == "0"
    assert asked["loss.chunk_size"] == "0" and asked["trainer.device"] == "auto"
    again, none = resolve_auto(ran, target, torch.device("cpu"), 1234.0)
    assert again == ran and none == {}  # resolved values pass through: resolving twice changes nothing


def test_mlflow_params_carry_what_ran_and_the_request_beside_it(fast_cfg, tmp_path):
    cfg = fast_cfg(*_online(tmp_path), "data.online.write_batch=0", "trainer.max_steps=2")
    res = train(cfg)
    p = MlflowClient(cfg.tracking.tracking_uri).get_run(res.run_id).data.params
    written = int(p["data.online.write_batch"])
    assert written > 0 and p["data.online.write_batch.requested"] == "0"
    assert p["data.online.reuse"] == "1" and p["data.online.reuse.requested"] == "0"
    assert int(p["loss.chunk_size"]) >= 64 and p["loss.chunk_size.requested"] == "0"
    assert p["trainer.device"] == "cpu" and p["trainer.device.requested"] == "auto"
    assert "loss.temperature.requested" not in p  # only what was resolved
    saved = yaml.safe_load((res.run_dir / "config.yaml").read_text())
    assert saved["data"]["online"]["write_batch"] == 0 and saved["loss"]["chunk_size"] == 0  # as requested
