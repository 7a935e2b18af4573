"""The DFlash 2 serving folder: export → load_drafter round trip; an independent re-implementation of the
DFlash2DraftModel forward, written here from its description (docs/dflash2.md), loads our folder strictly and
gives our logits within 1e-4; a folder with z-lab's / the trainers' field names loads; mismatched block size or
mask id are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.safe_load import MANIFEST
from dflash.serving.export import TargetFacts, load_drafter, read_serving_config, write_serving_folder
from tests.test_export import Qwen3Config, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, RefAttention

H, V, MASK, LAYER_IDS, N_TARGET, BS = 32, 50, 49, [1, 3, 4], 6, 5
FACTS = TargetFacts(hidden_size=H, num_layers=N_TARGET, vocab_size=V, max_position_embeddings=4096,
                    rope_theta=10_000.0, mask_token="<|MASK|>", mask_token_id=MASK)


def _drafter(seed=0, bs=BS) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, block_size=bs,
                        rope_theta=10_000.0, architecture="dflash2", layer_types=["sliding_attention"] * 2,
                        sliding_window=64, sliding_causal=False, conv_group_size=8, selector_rank=6,
                        selector_top_k=4, output_multiplier=0.8, final_logit_softcapping=4.0)
    d = DFlashDrafter(cfg, H, N_TARGET, MASK, LAYER_IDS, vocab_size=V)
    with torch.no_grad():  # away from the identity start and from 1-valued norms, so a swapped name would show
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "base_kernel" in name or "kernel_projection" in name:
                p.normal_(std=0.3)
    d.attach_target_head(torch.randn(V, H), torch.randn(V, H))
    return d.eval()


class RefConv(nn.Module):
    """The grouped dynamic causal conv from its description, position by position."""

    def __init__(self, hidden, K, G):
        super().__init__()
        self.K, self.G = K, G
        self.base_kernel = nn.Parameter(torch.zeros(2, K, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * K * hidden // G, bias=False)

    def kernel(self, x_bH, which):
        dyn = self.kernel_projection(x_bH).view(x_bH.shape[0], 2, self.K, -1)[:, which]
        return self.base_kernel[which] + dyn.repeat_interleave(self.G, dim=-1)  # [bs, K, H]

    def apply(self, v_bH, w_bKH):
        out = torch.zeros_like(v_bH)
        for t in range(v_bH.shape[0]):
            for j in range(self.K):
                if t - (self.K - 1 - j) >= 0:
                    out[t] += w_bKH[t, j] * v_bH[t - (self.K - 1 - j)]
        return out


class RefSelector(nn.Module):
    def __init__(self, hidden, vocab, rank):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Parameter(torch.zeros(hidden, rank))


class RefLayer2(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.dflash_config
        self.self_attn = RefAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.attn_conv = RefConv(c.hidden_size, d["conv_kernel_size"], d["conv_group_size"])
        self.mlp_conv = RefConv(c.hidden_size, d["conv_kernel_size"], d["conv_group_size"])

    def sub(self, conv, fn, x):  # one block [1, bs, H]
        w0, w1 = conv.kernel(x[0], 0), conv.kernel(x[0], 1)
        y = fn(conv.apply(x[0], w0)[None])
        return conv.apply(y[0], w1)[None]

    def forward(self, h, target_hidden, cos, sin):
        h = h + self.sub(self.attn_conv, lambda x: self.self_attn(x, target_hidden, cos, sin), self.input_layernorm(h))
        return h + self.sub(self.mlp_conv, self.mlp, self.post_attention_layernorm(h))


class RefDFlash2DraftModel(nn.Module):
    """DFlash2DraftModel as described: DFlash's KV-injection layers (non-causal in the block: is_causal false,
    window beyond the context here), a dynamic conv around each sublayer, logits = softcap(multiplier · h·W)."""

    def __init__(self, c):
        super().__init__()
        d = c.dflash_config
        self.d = d
        self.layers = nn.ModuleList(RefLayer2(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        self.fc = nn.Linear(len(d["target_layer_ids"]) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.selector = RefSelector(c.hidden_size, c.vocab_size, d["selector_rank"])

    def forward(self, noise_embedding, target_hidden, position_ids, lm_head):
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, target_hidden, cos, sin)
        logits = self.d["output_multiplier"] * (self.norm(h) @ lm_head.T)
        cap = self.d["final_logit_softcapping"]
        return cap * torch.tanh(logits / cap)


def test_reference_dflash2_model_loads_our_folder_strictly_and_matches(tmp_path):
    d = _drafter()
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * 2
    assert {"block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id",
            "target_layer_ids", "output_multiplier", "final_logit_softcapping"} <= set(cfg["dflash_config"])
    assert not (out / "modeling_dflash.py").exists() and "auto_map" not in cfg
    state = load_file(str(out / "model.safetensors"))
    assert "selector.predecessor_codebook" in state and "layers.0.attn_conv.base_kernel" in state
    ref = RefDFlash2DraftModel(Qwen3Config.from_pretrained(str(out)))
    ref.load_state_dict(state, strict=True)
    ref.eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 20, len(LAYER_IDS), H, generator=g)
    tokens = torch.randint(0, V - 1, (1, 20), generator=g)
    for a in (3, 11, 15):
        ids = torch.full((1, BS), MASK)
        ids[0, 0] = tokens[0, a]
        with torch.no_grad():
            theirs = ref(F.embedding(ids, d.embed_VH), feats[:, :a].flatten(2), torch.arange(a + BS)[None],
                         d.lm_head_VH)[0, 1:]
            cache = d.new_cache()
            d.extend_context(cache, feats[:, :a], 0)
            ours = d.logits(d.draft_hidden(cache, tokens[:, a]))[0]
            train = d.logits(d(feats, torch.tensor([[a]]), tokens[:, a:a + 1]))[0, 0]
        assert (ours - theirs).abs().max() < 1e-4 and (train - theirs).abs().max() < 1e-4, a


def test_export_then_load_gives_the_same_drafts(tmp_path):
    d = _drafter()
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    back = load_drafter(out, target=FACTS)
    back.attach_target_head(d.embed_VH, d.lm_head_VH)
    assert back.cfg.architecture == "dflash2" and back.cfg.sliding_causal is False
    hidden = torch.randn(3, BS - 1, H)
    anchors = torch.tensor([1, 2, 3])
    a, b = d.draft(hidden, anchors), back.eval().draft(hidden, anchors)
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.scores, b.scores)


def _zlab_folder(tmp_path: Path, **dflash_config) -> Path:
    """A folder as z-lab / the trainers write it: their field names, block_size only in dflash_config."""
    d = _drafter()
    out = write_serving_folder(d, tmp_path / "zlab", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("block_size")
    cfg.pop("dflash_training", None)
    cfg["dflash_config"].update(dflash_config)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / MANIFEST).unlink()  # theirs carry no checksum manifest (ours is checked when present)
    return out


def test_load_reads_a_zlab_style_folder(tmp_path):
    out = _zlab_folder(tmp_path)
    d = load_drafter(out)
    assert d.block_size == BS and d.cfg.selector_top_k == 4 and d.cfg.final_logit_softcapping == 4.0


@pytest.mark.parametrize("field,value,match", [
    ("block_size", 8, r"block_size=.*dflash_config\.block_size"),
    ("mask_token_id", 7, r"mask_token_id=.*dflash_config\.mask_token_id"),
])
def test_load_refuses_a_mismatched_block_size_or_mask_id_by_name(tmp_path, field, value, match):
    out = _zlab_folder(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg[field] = cfg["dflash_config"][field]  # said twice, then changed in one place
    cfg["dflash_config"][field] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        read_serving_config(out)


def test_load_refuses_a_mask_id_the_target_does_not_have(tmp_path):
    out = _zlab_folder(tmp_path, mask_token_id=7)
    with pytest.raises(ValueError, match=r"dflash_config\.mask_token_id=7"):
        load_drafter(out, target=FACTS)


def test_load_refuses_a_dflash2_folder_without_its_selector_fields(tmp_path):
    out = _zlab_folder(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]["selector_rank"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"dflash_config\.selector_rank"):
        load_drafter(out)


def test_export_cli_refuses_a_mismatched_folder_with_exit_2(tmp_path, capsys):
    from experiments.export import main
    out = _zlab_folder(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["block_size"] = 16
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main([str(out), "--out", str(tmp_path / "again")])
    assert e.value.code == 2 and "dflash_config.block_size" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
