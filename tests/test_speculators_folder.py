"""`load_drafter` reads speculators' DFlash folders (nested `transformer_layer_config`), written here from its
documented schema (speculators 0.9.0: `DFlashSpeculatorConfig`, `DFlashConverter._build_config`): the same logits
as our own folder, `experiments.eval` takes one, and what this drafter cannot be is refused naming the field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.serving.export import load_drafter, save_drafter
from tests.test_export import LAYER_IDS, MASK, H, V, _drafter, _inputs, _outputs, _with_head

# config.json keys of ours that speculators' converter keeps out of transformer_layer_config
_NON_TRANSFORMER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def speculators_folder(ours: Path, out: Path, **overrides) -> Path:
    """Our serving folder as speculators' DFlash converter saves it: the decoder's fields nested as
    `Qwen3Config.to_diff_dict()` writes them (fields at their defaults left out), the target layers as aux ids (ours + 1), and
    the verifier's embedding and LM head copied in beside the decoder's weights."""
    from transformers import Qwen3Config
    cfg = json.loads((ours / "config.json").read_text())
    layer = Qwen3Config(**{k: v for k, v in cfg.items() if k not in _NON_TRANSFORMER_KEYS}).to_diff_dict()
    # transformers 4's to_diff_dict left out every field at Qwen3Config's default (5.x writes them all): the
    # sparse form, the one that needs the defaults filled back in
    default = Qwen3Config().to_dict()
    layer = {k: v for k, v in layer.items() if k == "model_type" or default.get(k, object()) != v}
    d = cfg["dflash_config"]
    spec = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": layer, "draft_vocab_size": cfg["vocab_size"], "block_size": cfg["block_size"],
            "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in d["target_layer_ids"]],
            "mask_token_id": d["mask_token_id"], "sliding_window_non_causal": False, "sample_from_anchor": False,
            "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": cfg["block_size"] - 1}],
                                   "verifier": {"name_or_path": "/models/target", "architectures": []}},
            "speculators_version": "0.9.0", **overrides}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(spec, indent=2))
    weights = load_file(ours / "model.safetensors")
    vocab = cfg["vocab_size"] or V
    weights.update({"embed_tokens.weight": torch.randn(vocab, H), "lm_head.weight": torch.randn(vocab, H)})
    save_file(weights, out / "model.safetensors")
    return out


def test_a_speculators_folder_loads_with_the_same_logits(tmp_path):
    d = _drafter()
    ours = save_drafter(d, tmp_path / "ours")
    spec = speculators_folder(ours, tmp_path / "spec")
    layer = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
    assert "num_hidden_layers" in layer and "hidden_act" not in layer  # a default is left out, as speculators does
    back = load_drafter(spec)
    assert back.target_layer_ids == LAYER_IDS and back.mask_token_id == MASK and back.block_size == 5
    inputs = _inputs()
    for a, b in zip(_outputs(d, *inputs), _outputs(_with_head(back, d), *inputs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overrides, field", [
    ({"sample_from_anchor": True}, "sample_from_anchor"),
    ({"draft_vocab_size": 32}, "draft_vocab_size"),
    ({"aux_hidden_state_layer_ids": [0, 2]}, "aux_hidden_state_layer_ids"),
    ({"target_hidden_size": 64}, "target_hidden_size"),
    ({"speculators_model_type": "eagle3"}, "speculators_model_type"),
    ({"mask_token_id": None}, "mask_token_id"),
])
def test_what_this_drafter_cannot_be_is_refused_naming_the_field(tmp_path, overrides, field):
    ours = save_drafter(_drafter(), tmp_path / "ours")
    spec = speculators_folder(ours, tmp_path / "spec", **overrides)
    with pytest.raises(ValueError, match=rf"config\.json: .*{field}"):
        load_drafter(spec)


def test_a_sliding_window_speculator_bidirectional_in_the_block_is_refused(tmp_path):
    from dflash.drafter.model import DFlashDrafter, DrafterConfig
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, block_size=4,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    d = DFlashDrafter(cfg, H, 6, MASK, LAYER_IDS, V)
    ours = save_drafter(d, tmp_path / "ours")
    causal = load_drafter(speculators_folder(ours, tmp_path / "causal"))
    assert causal.cfg.layer_types == ["sliding_attention", "full_attention"] and causal.cfg.sliding_window == 8
    with pytest.raises(ValueError, match="sliding_window_non_causal"):
        load_drafter(speculators_folder(ours, tmp_path / "bidir", sliding_window_non_causal=True))


@pytest.mark.slow
def test_experiments_eval_takes_a_speculators_folder(tmp_path):
    """The same τ as our own folder of the same weights, on the same ground truth."""
    pytest.importorskip("hydra")
    from dflash.target.model import TargetConfig
    from experiments import eval as eval_cli
    from tests.test_eval_cli import _drafter_folder
    (tmp_path / "suite.json").write_text(json.dumps([{"name": "sq", "prompt": "def sq(x):\n"}]))
    ours = tmp_path / "ours"
    _drafter_folder(ours, TargetConfig())
    spec = speculators_folder(ours, tmp_path / "spec")
    args = ["+target=tiny_random", "tracking.enabled=false", "target.device=cpu", f"eval.suite={tmp_path / 'suite.json'}",
            "eval.max_new_tokens=6", "eval.tree_budgets=[2]", f"eval.cache_dir={tmp_path / 'gt'}"]
    mine = eval_cli.main([str(ours), *args])
    theirs = eval_cli.main([str(spec), *args])
    assert theirs["eval/tau_served"] == mine["eval/tau_served"] and theirs["eval/t0/tau_vanilla"] == \
        mine["eval/t0/tau_vanilla"]
    shutil.rmtree(spec)
