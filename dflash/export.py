"""The serving format (DESIGN §6): a folder with `config.json` (`DFlashDraftModel`, Qwen3 decoder fields,
`block_size`, `num_target_layers`, `dflash_config`) and `model.safetensors` whose tensor names are those
of the reference implementation (z-lab/dflash `dflash/model.py`), which our module names mirror.
z-lab / SGLang / vLLM load such a folder; `load_drafter` reads it back (ours or a published one).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.checkpoint import atomic_write, atomic_write_text
from dflash.drafter import DFlashDrafter, DrafterConfig


def serving_config(drafter: DFlashDrafter, vocab_size: int, dtype: torch.dtype) -> dict:
    c = drafter.cfg
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": drafter.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": 32768,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": drafter.block_size,
        "num_target_layers": drafter.num_target_layers,
        "dflash_config": {"mask_token_id": drafter.mask_token_id,
                          "target_layer_ids": list(drafter.target_layer_ids)},
    }


def save_drafter(drafter: DFlashDrafter, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 extra: dict | None = None) -> Path:
    """Writes config.json + model.safetensors atomically (each file replaced whole)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or next(drafter.parameters()).dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    cfg = serving_config(drafter, int(drafter.lm_head_VH.shape[0]) if drafter.lm_head_VH.numel() else 0, dtype)
    if extra:
        cfg["dflash_training"] = extra
    atomic_write_text(out / "config.json", json.dumps(cfg, indent=2))
    return out


def drafter_config_from_serving(cfg: dict) -> DrafterConfig:
    return DrafterConfig(
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], block_size=int(cfg.get("block_size", 16)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)))


def load_drafter(folder: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Loads a serving-format folder (ours or a published DFlash drafter)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a DFlash serving folder)")
    cfg = json.loads((folder / "config.json").read_text())
    dcfg = cfg.get("dflash_config", {})
    layer_ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if layer_ids is None or mask is None:
        raise ValueError(f"{folder}/config.json lacks dflash_config.target_layer_ids / mask_token_id")
    drafter = DFlashDrafter(drafter_config_from_serving(cfg), cfg["hidden_size"],
                            int(cfg.get("num_target_layers", max(layer_ids) + 1)), int(mask), layer_ids)
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match DFlashDraftModel (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    return drafter.to(device=device, dtype=dtype)
