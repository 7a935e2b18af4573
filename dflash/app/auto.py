"""Every "auto" setting of a run resolved once, when the run is composed and before anything is logged.

A 0 or "auto" in the config means "what this machine and target make of it": the online writer's batch width
and views per sequence, the LM head's chunk size, the drafter's RoPE base, the trainer's device, autocast and
producer mode. `resolve_auto` turns them into the values that run; the run's components read only those, and
MLflow's params show them with the requested value beside it (`<key>.requested`). config.yaml and the checkpoints
keep what was requested, so a resume on another machine resolves again for that machine.
"""
from __future__ import annotations

import dataclasses

from dflash.config import RunConfig, to_dict
from dflash.data.online import resolve_online_config
from dflash.target.lm_head import resolve_chunk
from dflash.tracking.run_info import flatten_config
from dflash.training.datastream import uses_online
from dflash.training.pipeline import PRODUCER_MODES


def resolve_auto(cfg: RunConfig, target, device, target_rope_theta: float) -> tuple[RunConfig, dict[str, str]]:
    """(the config that runs on `device` against the loaded `target`, {key: requested value} for every key
    that resolving changed)."""
    r = dataclasses.replace
    vocab = int(target.lm_head_weight().shape[0])
    t = cfg.trainer
    trainer = r(t, device=str(device),
                autocast=("bf16" if device.type == "cuda" else "off") if t.autocast == "auto" else t.autocast,
                producer_mode=("inline" if PRODUCER_MODES[t.producer_mode](device, target.device) else "thread")
                if t.producer_mode == "auto" else t.producer_mode)
    data = cfg.data
    if uses_online(cfg):
        seq_len = data.online_seq_len()
        data = r(data, online=r(resolve_online_config(data.online, target, seq_len), seq_len=seq_len))
    ran = r(cfg, trainer=trainer, data=data,
            drafter=cfg.drafter.for_target(target_rope_theta),
            loss=r(cfg.loss, chunk_size=resolve_chunk(cfg.loss.chunk_size, vocab, device)),
            target=r(cfg.target, lm_head_chunk=resolve_chunk(cfg.target.lm_head_chunk, vocab, target.device)))
    asked, runs = flatten_config(to_dict(cfg)), flatten_config(to_dict(ran))
    return ran, {k: v for k, v in asked.items() if runs.get(k) != v}


def params_with_requested(params: dict[str, str], requested: dict[str, str]) -> dict[str, str]:
    """`params` (what ran) with `<key>.requested` beside each logged key that was resolved from "auto"."""
    out = dict(params)
    out.update({f"{k}.requested": v for k, v in requested.items() if k in params})
    return out
