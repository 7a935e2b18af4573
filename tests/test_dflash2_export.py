"""The DFlash 2 serving folder: export → load_drafter round trip; the tensor names of the published DFlash 2
checkpoints; a re-implementation of z-lab's DFlash2DraftModel (z-lab/dflash `dflash/model.py` at 07ebd93: its conv
offsets, selector modules and the key mapping its from_pretrained applies), written here, loads our folder strictly
and gives our logits and selector scores within 1e-4 and our greedy walk; a folder with z-lab's / the trainers'
field names loads; mismatched block size or mask id are refused by name."""
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
    """The grouped dynamic causal conv as z-lab's reference computes it (z-lab/dflash `dflash/model.py` at
    07ebd93), written again here: offset 0 the position itself, offset o the input o positions back, one
    dynamic value per channel group, both halves projected from the prepared input."""

    def __init__(self, hidden, K, G):
        super().__init__()
        self.K, self.G = K, G
        self.base_kernel = nn.Parameter(torch.zeros(2, K, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * K * hidden // G, bias=False)

    def convolve(self, v_bH, dyn_bKg, base_KH):
        out = torch.zeros_like(v_bH)
        for t in range(v_bH.shape[0]):
            for o in range(self.K):
                if t - o >= 0:
                    out[t] += (base_KH[o] + dyn_bKg[t, o].repeat_interleave(self.G)) * v_bH[t - o]
        return out

    def prepare(self, x_bH):
        dyn = self.kernel_projection(x_bH).view(x_bH.shape[0], 2, self.K, -1)
        return self.convolve(x_bH, dyn[:, 0], self.base_kernel[0]), dyn[:, 1]

    def finish(self, y_bH, dyn_bKg):
        return self.convolve(y_bH, dyn_bKg, self.base_kernel[1])


class RefSelector(nn.Module):
    """z-lab's candidate selector: embedding codebooks (stored without `.weight`, read through a key mapping as
    its `from_pretrained` does), a Linear hidden projection, the walk from the block's anchor."""

    def __init__(self, hidden, vocab, rank, top_k):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def select(self, hidden_bH, logits_bV, anchor):
        unary, cand = logits_bV.topk(self.top_k, dim=-1)
        proj = self.hidden_projection(hidden_bH)
        prev, path, scores = torch.tensor(anchor), [], []
        for t in range(hidden_bH.shape[0]):
            s = unary[t] + (self.predecessor_codebook(prev) * proj[t] * self.successor_codebook(cand[t])).sum(-1)
            prev = cand[t, s.argmax()]
            path.append(int(prev))
            scores.append(dict(zip(cand[t].tolist(), s.tolist())))
        return path, scores


class RefLayer2(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.dflash_config
        self.self_attn = RefAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.attention_conv = RefConv(c.hidden_size, d["conv_kernel_size"], d["conv_group_size"])
        self.mlp_conv = RefConv(c.hidden_size, d["conv_kernel_size"], d["conv_group_size"])

    def sub(self, conv, fn, x):  # one block [1, bs, H]
        prepared, dyn = conv.prepare(x[0])
        return conv.finish(fn(prepared[None])[0], dyn)[None]

    def forward(self, h, target_hidden, cos, sin):
        attend = lambda x: self.self_attn(x, target_hidden, cos, sin)  # noqa: E731
        h = h + self.sub(self.attention_conv, attend, self.input_layernorm(h))
        return h + self.sub(self.mlp_conv, self.mlp, self.post_attention_layernorm(h))


class RefDFlash2DraftModel(nn.Module):
    """DFlash2DraftModel as z-lab's reference builds it: DFlash's KV-injection layers (non-causal in the block:
    is_causal false, the window beyond the context here), a dynamic conv around each sublayer, logits =
    softcap(multiplier · h·W), the candidate selector over block positions 1..bs-1."""

    def __init__(self, c):
        super().__init__()
        d = c.dflash_config
        self.d = d
        self.layers = nn.ModuleList(RefLayer2(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        self.fc = nn.Linear(len(d["target_layer_ids"]) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.candidate_selector = RefSelector(c.hidden_size, c.vocab_size, d["selector_rank"], d["selector_top_k"])

    def load_checkpoint(self, state):
        """Strict, after mapping the codebooks' stored names onto their embeddings' `.weight`."""
        books = {f"candidate_selector.{n}" for n in ("predecessor_codebook", "successor_codebook")}
        self.load_state_dict({(k + ".weight" if k in books else k): v for k, v in state.items()}, strict=True)

    def hidden(self, noise_embedding, target_hidden, position_ids):
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, target_hidden, cos, sin)
        return self.norm(h)

    def compute_logits(self, h, lm_head):
        logits = self.d["output_multiplier"] * (h @ lm_head.T)
        cap = self.d["final_logit_softcapping"]
        return cap * torch.tanh(logits / cap)


# the published DFlash 2 checkpoint's tensor names, per layer and outside the layers (z-lab's Qwen3.8-27B drafter,
# its safetensors header): what an engine's strict load of our export needs
PUBLISHED_LAYER_KEYS = {
    "attention_conv.base_kernel", "attention_conv.kernel_projection.weight", "input_layernorm.weight",
    "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight", "post_attention_layernorm.weight", "self_attn.k_norm.weight",
    "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight",
    "self_attn.v_proj.weight"}
PUBLISHED_TOP_KEYS = {"candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                      "candidate_selector.successor_codebook", "fc.weight", "hidden_norm.weight", "norm.weight"}


def test_export_has_the_published_checkpoints_tensor_names_and_shapes(tmp_path):
    d = _drafter()
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    state = load_file(str(out / "model.safetensors"))
    want = PUBLISHED_TOP_KEYS | {f"layers.{i}.{k}" for i in range(2) for k in PUBLISHED_LAYER_KEYS}
    assert set(state) == want
    K, G, r = 2, 8, 6  # _drafter's conv_kernel_size, conv_group_size, selector_rank
    # the published shapes' rules (hidden 6,656: base_kernel [2, 2, 6656], kernel_projection [1664, 6656],
    # hidden_projection [256, 6656], codebooks [V, 256])
    assert state["layers.0.attention_conv.base_kernel"].shape == (2, K, H)
    assert state["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * K * H // G, H)
    assert state["candidate_selector.hidden_projection.weight"].shape == (r, H)
    assert state["candidate_selector.successor_codebook"].shape == (V, r)


def test_reference_dflash2_model_loads_our_folder_strictly_and_matches(tmp_path):
    d = _drafter()
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * 2
    assert {"block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id",
            "target_layer_ids", "output_multiplier", "final_logit_softcapping"} <= set(cfg["dflash_config"])
    assert not (out / "modeling_dflash.py").exists() and "auto_map" not in cfg
    ref = RefDFlash2DraftModel(Qwen3Config.from_pretrained(str(out)))
    ref.load_checkpoint(load_file(str(out / "model.safetensors")))
    ref.eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 20, len(LAYER_IDS), H, generator=g)
    tokens = torch.randint(0, V - 1, (1, 20), generator=g)
    for a in (3, 11, 15):
        ids = torch.full((1, BS), MASK)
        ids[0, 0] = tokens[0, a]
        with torch.no_grad():
            h_ref = ref.hidden(F.embedding(ids, d.embed_VH), feats[:, :a].flatten(2), torch.arange(a + BS)[None])
            theirs = ref.compute_logits(h_ref, d.lm_head_VH)[0, 1:]
            cache = d.new_cache()
            d.extend_context(cache, feats[:, :a], 0)
            hidden = d.draft_hidden(cache, tokens[:, a])
            ours = d.logits(hidden)[0]
            train = d.logits(d(feats, torch.tensor([[a]]), tokens[:, a:a + 1]))[0, 0]
            path, scores = ref.candidate_selector.select(h_ref[0, 1:], theirs, int(tokens[0, a]))
            walk = d.draft(hidden, tokens[:, a])
        assert (ours - theirs).abs().max() < 1e-4 and (train - theirs).abs().max() < 1e-4, a
        assert walk.tokens[0].tolist() == path, a  # the greedy selector walk picks the reference's path
        for t, by_token in enumerate(scores):
            got = dict(zip(walk.candidates[0, t].tolist(), walk.scores[0, t].tolist()))
            assert got.keys() == by_token.keys()
            assert max(abs(got[k] - by_token[k]) for k in got) < 1e-4, (a, t)


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


def test_load_reads_a_folder_laid_out_as_the_published_checkpoints(tmp_path):
    """config.json with exactly the published DFlash 2 drafter's fields (its Qwen3.8-27B config, dimensions
    scaled down): transformers-5 `rope_parameters` only, `dtype`, everything DFlash 2 in `dflash_config`."""
    d = _drafter()
    out = write_serving_folder(d, tmp_path / "published", dtype=torch.float32)
    c = d.cfg
    published = {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "is_causal": False,
        "dflash_config": {"block_size": BS, "conv_group_size": c.conv_group_size,
                          "conv_kernel_size": c.conv_kernel_size, "final_logit_softcapping": 4.0,
                          "mask_token_id": MASK, "output_multiplier": 0.8, "selector_rank": c.selector_rank,
                          "selector_top_k": c.selector_top_k, "target_layer_ids": LAYER_IDS},
        "dtype": "float32", "eos_token_id": 1, "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "layer_types": ["sliding_attention"] * 2, "max_position_embeddings": 4096, "max_window_layers": 2,
        "model_type": "qwen3", "num_attention_heads": c.num_heads, "num_hidden_layers": 2,
        "num_key_value_heads": c.num_kv_heads, "num_target_layers": N_TARGET, "pad_token_id": 2,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": {"rope_theta": 10_000.0, "rope_type": "default"},
        "sliding_window": 64, "tie_word_embeddings": False, "transformers_version": "5.15.0", "use_cache": False,
        "use_sliding_window": True, "vocab_size": V}
    (out / "config.json").write_text(json.dumps(published))
    (out / MANIFEST).unlink()
    back = load_drafter(out, target=FACTS)
    back.attach_target_head(d.embed_VH, d.lm_head_VH)
    assert back.block_size == BS and back.cfg.sliding_causal is False and back.cfg.rope_theta == 10_000.0
    hidden = torch.randn(3, BS - 1, H)
    anchors = torch.tensor([1, 2, 3])
    assert torch.equal(d.draft(hidden, anchors).tokens, back.eval().draft(hidden, anchors).tokens)
