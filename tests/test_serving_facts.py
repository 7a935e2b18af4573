"""The serving folder against the engines' rules and the real target's published facts: the random 27B target
records Qwen3.6-27B's context length and RoPE; the export's check passes against a Qwen3.6-27B config.json
(nested multimodal: text fields under text_config) written here from its published fields; the mask token string
comes from the tokenizer or the export fails; `load_drafter(target=...)` refuses what SGLang refuses."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.serving.export import (check_against_target, check_folder_against_target, load_drafter,
                                   read_target_facts, save_drafter, serving_config)
from dflash.target.model import TargetConfig

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "dflash" / "assets" / "reference_target"

# Qwen3.6-27B's config.json as published: a multimodal (image-text) model whose language model's fields sit
# under text_config (64 layers of 5,120, 3 Gated DeltaNet : 1 gated attention, 262,144 context, RoPE base 1e7
# on a quarter of each head).
QWEN3_6_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "attn_output_gate": True,
        "tie_word_embeddings": False,
        "eos_token_id": 248044,
    },
    "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "out_hidden_size": 5120},
}


def _published_target(tmp_path: Path) -> Path:
    folder = tmp_path / "Qwen3.6-27B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_6_27B, indent=1))
    return folder


def test_random_27b_target_records_qwen3_6_27b_facts():
    from experiments.config import compose_config
    facts = read_target_facts(compose_config(["+target=qwen3_6_27b_random"]).target)
    t = QWEN3_6_27B["text_config"]
    assert facts.max_position_embeddings == t["max_position_embeddings"] == 262144
    assert facts.rope_theta == t["rope_parameters"]["rope_theta"]
    assert (facts.hidden_size, facts.num_layers, facts.vocab_size) == (5120, 64, 248320)
    from dflash.target.model import tiny_hf_config
    rope = tiny_hf_config(compose_config(["+target=qwen3_6_27b_random"]).target.random).to_dict()["rope_parameters"]
    assert rope["partial_rotary_factor"] == t["rope_parameters"]["partial_rotary_factor"]


def test_the_27b_random_export_passes_the_check_against_the_published_config(tmp_path):
    """The drafter an export writes for the random 27B target (its config, built on the meta device: the check
    reads no weights) fits a real Qwen3.6-27B folder: context length, hidden size, layers, vocabulary."""
    from experiments.config import compose_config
    cfg = compose_config(["+target=qwen3_6_27b_random", "+drafter=qwen3_6_27b"])
    random_facts = read_target_facts(cfg.target)
    real = read_target_facts(TargetConfig(name="qwen3_6_27b", path=str(_published_target(tmp_path)),
                                          mask_token_id=cfg.target.mask_token_id))
    assert real.max_position_embeddings == 262144 and real.num_layers == 64 and real.mask_token is None
    with torch.device("meta"):
        d = DFlashDrafter(cfg.drafter.for_target(random_facts.rope_theta), 5120, 64, cfg.target.mask_token_id,
                          list(cfg.target.layer_ids))
    check_against_target(d, real, "drafter for the real target")
    written = serving_config(d, random_facts.vocab_size, torch.bfloat16, random_facts)
    check_folder_against_target(written, real, tmp_path / "served" / "config.json")  # passes
    assert written["max_position_embeddings"] == 262144 and written["rope_theta"] == 1e7
    assert "mask_token" not in written["dflash_config"]  # no tokenizer: no string to vouch for, never "None"


def _reference_copy(tmp_path: Path, drop_tokenizer: bool = False) -> Path:
    folder = tmp_path / "reference"
    shutil.copytree(REFERENCE, folder)
    if drop_tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / f).unlink()
    return folder


def test_mask_token_string_is_the_tokenizers_or_the_export_fails(tmp_path):
    good = read_target_facts(TargetConfig(name="r", path=str(REFERENCE), mask_token_id=2))
    assert good.mask_token == "<|mask|>" and good.mask_token_id == 2
    # a folder without a tokenizer: the string is unknown and stays out (never the text "None")
    bare = read_target_facts(TargetConfig(name="r", path=str(_reference_copy(tmp_path, drop_tokenizer=True)),
                                          mask_token_id=2))
    assert bare.mask_token is None and bare.mask_token_id is None
    # an id the tokenizer has no token for: refused, naming the id
    with pytest.raises(ValueError, match=r"no token at mask_token_id=99999"):
        read_target_facts(TargetConfig(name="r", path=str(REFERENCE), mask_token_id=99999))


def _reference_drafter(mask: int = 2, bs: int = 4) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32,
                                       block_size=bs), 384, 8, mask, [1, 3, 5])


def test_load_drafter_with_target_refuses_what_sglang_refuses(tmp_path):
    from dflash.safe_load import MANIFEST
    facts = read_target_facts(TargetConfig(name="r", path=str(REFERENCE), mask_token_id=2))
    ok = save_drafter(_reference_drafter(), tmp_path / "ok", target=facts)
    load_drafter(ok, target=facts)  # fits
    def edited(name, edit):  # a copy of the good folder with its config.json edited
        folder = tmp_path / name
        shutil.copytree(ok, folder)
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / MANIFEST).unlink()  # a folder edited by hand keeps no manifest: its structure is what is checked
        return folder

    # mask_token_id 3 while the tokenizer's <|mask|> is 2
    wrong = edited("wrong_mask", lambda cfg: cfg["dflash_config"].update(mask_token_id=3))
    with pytest.raises(ValueError, match=r"mask_token_id=3 but the target tokenizer's mask token '<\|mask\|>' is id 2"):
        load_drafter(wrong, target=facts)
    zero = edited("zero_block", lambda cfg: cfg.update(block_size=0))
    with pytest.raises(ValueError, match=r"block_size=0; expected a positive block size"):
        load_drafter(zero, target=facts)
    # the text "None" as the mask string is no token
    none = edited("none_mask", lambda cfg: cfg["dflash_config"].update(mask_token="None"))
    with pytest.raises(ValueError, match=r"mask_token='None' is not a token string"):
        load_drafter(none)
