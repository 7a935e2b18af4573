"""speculators' DFlash folders (vllm-project/speculators, `DFlashSpeculatorConfig`): what `load_drafter` reads
from a drafter trained or converted with speculators, as its `DFlashConverter` and `save_pretrained` write it
(speculators 0.9.0; `src/speculators/models/dflash/config.py` and `convert/dflash/converter.py`).

config.json:
- `speculators_model_type: "dflash"`, `architectures: ["DFlashSpeculator"]`, `speculators_config` (the proposal
  method and the verifier's name);
- `transformer_layer_config`: the draft decoder's Qwen3 config as `PretrainedConfig.to_diff_dict()` writes it
  (transformers 4 left out every field at Qwen3Config's default: filled here from transformers' own Qwen3Config);
- `block_size`, `mask_token_id`;
- `aux_hidden_state_layer_ids`: the target hidden states the drafter reads, counted as speculators counts them
  (0 is the embedding output, k the output of decoder layer k - 1): z-lab's and our `target_layer_ids` + 1;
- `draft_vocab_size` (with a vocabulary of its own the checkpoint carries `t2d` / `d2t` maps), `target_hidden_size`,
  `sliding_window_non_causal`, `sample_from_anchor`.
Weights: z-lab's names for the decoder (`layers.*`, `fc`, `hidden_norm`, `norm`), which ours mirror, and the
verifier's `embed_tokens` / `lm_head` copied in; a drafter here borrows those from its target, so they are not read.
What this drafter cannot be (a draft vocabulary, the anchor slot predicting, sliding-window layers bidirectional in
the block, a drafter wider than its target) is refused, naming the field.
"""
from __future__ import annotations

# tensors of a speculators checkpoint that belong to the verifier (or its vocabulary maps), not to the drafter
VERIFIER_TENSORS = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                              "verifier_norm.weight", "t2d", "d2t"})


def is_speculators(cfg: dict) -> bool:
    """A config.json that speculators wrote (its own keys, not the engines' flat Qwen3 fields)."""
    return "speculators_model_type" in cfg or "transformer_layer_config" in cfg


def _decoder_fields(layer: dict) -> dict:
    """transformer_layer_config with the fields `to_diff_dict` left out at Qwen3Config's defaults."""
    from transformers import Qwen3Config
    given = {k: v for k, v in layer.items() if k not in ("model_type", "transformers_version", "architectures")}
    return {**Qwen3Config(**given).to_dict(), **given}


def serving_config_from_speculators(cfg: dict, where: str) -> dict:
    """A speculators DFlash config.json as the serving config `load_drafter` reads (Qwen3 fields at the top level,
    `dflash_config`); ValueError naming `where` and the field for what this drafter cannot be."""
    kind = cfg.get("speculators_model_type")
    if kind != "dflash":
        raise ValueError(f"{where}: speculators_model_type={kind!r}; only speculators' DFlash drafters (\"dflash\") "
                         f"are read here")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: transformer_layer_config is {type(layer).__name__}; expected the draft "
                         f"decoder's Qwen3 config (an object)")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or any(isinstance(i, bool) or not isinstance(i, int) or i < 1
                                                   for i in aux):
        raise ValueError(f"{where}: aux_hidden_state_layer_ids={aux!r}; expected the target layers the drafter "
                         f"reads, as ids >= 1 (speculators' 0 is the embedding output)")
    if cfg.get("sample_from_anchor"):
        raise ValueError(f"{where}: sample_from_anchor=true (the anchor slot predicts too) is not supported: this "
                         f"drafter proposes block_size - 1 tokens after the anchor")
    fields = _decoder_fields(layer)
    if cfg.get("sliding_window_non_causal") and "sliding_attention" in (fields.get("layer_types") or []):
        raise ValueError(f"{where}: sliding_window_non_causal=true is not supported (this drafter's sliding_attention "
                         f"layers are causal in the block, speculators' default)")
    vocab, draft_vocab = fields.get("vocab_size"), cfg.get("draft_vocab_size", fields.get("vocab_size"))
    if draft_vocab != vocab:
        raise ValueError(f"{where}: draft_vocab_size={draft_vocab} but transformer_layer_config.vocab_size={vocab}: "
                         f"a draft vocabulary (t2d / d2t) is not supported; this drafter predicts the target's")
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is not None and target_hidden != fields.get("hidden_size"):
        raise ValueError(f"{where}: target_hidden_size={target_hidden} but transformer_layer_config.hidden_size="
                         f"{fields.get('hidden_size')}: this drafter has its target's width")
    out = {k: v for k, v in fields.items() if k not in ("architectures", "auto_map", "block_size", "dflash_config")}
    out.update(architectures=["DFlashDraftModel"], speculators_model_type=kind,
               speculators_config=cfg.get("speculators_config"), block_size=cfg.get("block_size"),
               dflash_config={"mask_token_id": cfg.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux]})
    if out["block_size"] is None:
        raise ValueError(f"{where}: missing block_size (the drafter's block: speculative tokens + 1)")
    return out
