"""The DFlash 2 serving folder (`DFlash2DraftModel`, docs/serving.md and docs/dflash2.md): what `save_drafter`
writes for a `drafter.architecture=dflash2` drafter and what `load_drafter` reads back from ours, z-lab's or a
trainer's folder.

config.json beyond DFlash 1's Qwen3 fields:
- `architectures: ["DFlash2DraftModel"]` (SGLang's entry class; vLLM and llama.cpp key on it too);
- top-level `is_causal: false`: vLLM otherwise serves `sliding_attention` layers causally inside the block;
- `layer_types` (all `sliding_attention` in z-lab's checkpoints), `sliding_window`, `use_sliding_window`;
- `dflash_config`: `block_size`, `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`,
  `mask_token_id`, `target_layer_ids`, `output_multiplier`, `final_logit_softcapping` (+ `mask_token` when known).
Weights: the same names as DFlash 1 plus `layers.i.attention_conv.{base_kernel, kernel_projection.weight}`,
`layers.i.mlp_conv.…` and `candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`
(no `.weight` on the codebooks): the published checkpoints' names (z-lab/dflash `dflash/model.py` at 07ebd93). No modelling file: the engines carry DFlash2DraftModel themselves.
"""
from __future__ import annotations

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config key → DrafterConfig field (the same names), with what each must be
_FIELDS = {"conv_kernel_size": int, "conv_group_size": int, "selector_rank": int, "selector_top_k": int,
           "output_multiplier": float, "final_logit_softcapping": float}


def is_dflash2(cfg: dict) -> bool:
    """A serving config.json that describes a DFlash 2 drafter."""
    return ARCHITECTURE in (cfg.get("architectures") or [])


def dflash2_serving_fields(drafter, cfg: dict) -> dict:
    """`cfg` (DFlash 1's serving config of this drafter) turned into DFlash 2's, in place and returned."""
    c = drafter.cfg
    cfg["architectures"] = [ARCHITECTURE]
    cfg["is_causal"] = bool(c.sliding_causal and "sliding_attention" in c.layer_types)
    d = cfg["dflash_config"]
    d["block_size"] = drafter.block_size
    d.update({key: cast(getattr(c, key)) for key, cast in _FIELDS.items()})
    cfg.pop("auto_map", None)  # no modelling file for DFlash 2: the engines' own class serves it
    return cfg


def dflash2_config_fields(cfg: dict, where: str) -> dict:
    """The DrafterConfig keys a DFlash 2 config.json gives (architecture, conv, selector, logits, causality);
    ValueError naming `where` and the field when one is missing or not a number."""
    d = cfg.get("dflash_config") or {}
    out: dict = {"architecture": "dflash2", "sliding_causal": bool(cfg.get("is_causal", False))}
    for key, cast in _FIELDS.items():
        value = d.get(key, cfg.get(key))
        if value is None:
            if key == "final_logit_softcapping":  # absent or null: no cap
                value = 0.0
            elif key == "output_multiplier":
                value = 1.0
            else:
                raise ValueError(f"{where}: DFlash2DraftModel without dflash_config.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: dflash_config.{key}={value!r} is not a number")
        out[key] = cast(value)
    return out
