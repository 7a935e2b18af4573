"""Serving format (DESIGN §6): export → load_drafter gives identical logits; the folder loads by name,
strictly, into an independent re-implementation of the reference `DFlashDraftModel` forward built from
transformers' Qwen3 pieces and gives the same block hidden states; export is atomic; errors name files."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dflash.safe_load import MANIFEST
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.app.export import export_drafter
from dflash.serving.export import load_drafter, read_serving_config, save_drafter, write_serving_folder

H, V, MASK, LAYER_IDS, N_TARGET = 32, 50, 49, [1, 3, 4], 6


def _drafter(seed: int = 0, bs: int = 5) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                        block_size=bs, rope_theta=10_000.0)
    d = DFlashDrafter(cfg, H, N_TARGET, MASK, LAYER_IDS)
    with torch.no_grad():  # norms away from 1 so that a swapped norm name would show
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    d.attach_target_head(torch.randn(V, H), torch.randn(V, H))
    return d.eval()


def _inputs(T: int = 20, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, T, len(LAYER_IDS), H, generator=g)
    tokens = torch.randint(0, V - 1, (2, T), generator=g)
    anchors = torch.tensor([[1, 6, 11], [3, 9, 14]])
    return feats, tokens, anchors


def _outputs(d: DFlashDrafter, feats, tokens, anchors):
    with torch.no_grad():
        train = d.logits(d(feats, anchors, tokens.gather(1, anchors)))
        cache = d.new_cache()
        d.extend_context(cache, feats[:, :12], start=0)
        infer = d.logits(d.draft_hidden(cache, tokens[:, 12]))
    return train, infer


def _with_head(loaded: DFlashDrafter, src: DFlashDrafter) -> DFlashDrafter:
    loaded.attach_target_head(src.embed_VH, src.lm_head_VH)
    return loaded.eval()


def _run_dir(tmp_path: Path, d: DFlashDrafter) -> Path:
    run = tmp_path / "run"
    save_drafter(d, run / "final", extra={"target": "tiny_random", "loss": "soft_kl"})
    return run


# --------------------------------------------------------------------------------- round trip
def test_export_then_import_gives_identical_logits(tmp_path):
    d = _drafter()
    out = export_drafter(_run_dir(tmp_path, d), tmp_path / "served", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 5
    assert cfg["num_target_layers"] == N_TARGET and cfg["vocab_size"] == V
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}
    assert cfg["dflash_training"]["loss"] == "soft_kl"
    back = _with_head(load_drafter(out), d)
    inputs = _inputs()
    for a, b in zip(_outputs(d, *inputs), _outputs(back, *inputs)):
        assert torch.equal(a, b)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "config.json", "model.safetensors"]


def test_export_bfloat16(tmp_path):
    d = _drafter()
    out = export_drafter(_run_dir(tmp_path, d), tmp_path / "served")  # default dtype: bfloat16
    assert read_serving_config(out)["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    back = _with_head(load_drafter(out), d)
    inputs = _inputs()
    for a, b in zip(_outputs(d, *inputs), _outputs(back, *inputs)):
        assert torch.allclose(a, b, atol=0.1, rtol=0.05)


def test_export_from_training_checkpoint(tmp_path):
    d = _drafter()
    run = _run_dir(tmp_path, d)
    (run / "checkpoints").mkdir()
    other = _drafter(seed=7)  # the checkpoint's weights differ from final/
    torch.save({"step": 4, "drafter": other.state_dict(),
                "config": {"drafter": dataclasses.asdict(other.cfg), "target": {"name": "tiny_random"},
                           "loss": {"name": "hard_ce"}}},
               run / "checkpoints" / "step_00000004.pt")
    out = export_drafter(run / "checkpoints" / "step_00000004.pt", tmp_path / "from_pt", dtype="float32")
    cfg = read_serving_config(out)
    assert cfg["dflash_training"] == {"source_checkpoint": "step_00000004.pt", "step": 4,
                                      "target": "tiny_random", "loss": "hard_ce"}
    back = _with_head(load_drafter(out), other)
    inputs = _inputs()
    for a, b in zip(_outputs(other, *inputs), _outputs(back, *inputs)):
        assert torch.equal(a, b)


def test_export_from_checkpoint_without_final_reads_target_config(tmp_path):
    """No final/ yet (run interrupted): target facts come from the saved config (tiny random target)."""
    from dflash.target.model import ByteTokenizer, TinyTargetSpec
    spec = TinyTargetSpec(hidden_size=H, num_layers=N_TARGET)
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                                    block_size=4), H, N_TARGET, ByteTokenizer.mask_token_id, [1, 2])
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"step": 2, "drafter": d.state_dict(),
                "config": {"drafter": dataclasses.asdict(d.cfg),
                           "target": {"name": "tiny_random", "random": dataclasses.asdict(spec),
                                      "layer_ids": [1, 2]}}},
               run / "checkpoints" / "step_00000002.pt")
    out = export_drafter(run, tmp_path / "served", dtype="float32")  # run dir → latest checkpoint
    cfg = read_serving_config(out)
    assert cfg["vocab_size"] == spec.vocab_size and cfg["num_target_layers"] == N_TARGET
    assert cfg["dflash_config"] == {"mask_token_id": ByteTokenizer.mask_token_id, "target_layer_ids": [1, 2]}
    back = load_drafter(out)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))


# ---------------------------------------------------------------------------------- atomicity
def test_export_replaces_whole_and_failure_keeps_old(tmp_path, monkeypatch):
    import dflash.serving.export as ex
    out = tmp_path / "served"
    write_serving_folder(_drafter(seed=0), out, dtype=torch.float32, vocab_size=V)
    (out / "stale.txt").write_text("from an older export")
    write_serving_folder(_drafter(seed=1), out, dtype=torch.float32, vocab_size=V)
    assert not (out / "stale.txt").exists()  # the folder was replaced whole, not merged into
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_serving_folder(_drafter(seed=2), out, dtype=torch.float32, vocab_size=V)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # no temp folder left behind

    monkeypatch.undo()
    monkeypatch.setattr(ex, "_exchange", lambda a, b: False)  # the two-rename fallback
    write_serving_folder(_drafter(seed=3), out, dtype=torch.float32, vocab_size=V)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]
    assert torch.equal(load_drafter(out).fc.weight, _drafter(seed=3).fc.weight)


def test_export_refuses_to_replace_a_foreign_folder(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("x")
    with pytest.raises(FileExistsError, match="not a serving folder"):
        write_serving_folder(_drafter(), foreign, vocab_size=V)
    assert (foreign / "thesis.tex").exists()


# ------------------------------------------------------------------------------- import errors
def test_load_errors_name_the_file(tmp_path):
    out = write_serving_folder(_drafter(), tmp_path / "f", dtype=torch.float32, vocab_size=V)
    (out / MANIFEST).unlink()  # as a published folder: no manifest, so its structure is what is checked
    cfg_file = out / "config.json"
    good = json.loads(cfg_file.read_text())

    with pytest.raises(FileNotFoundError, match=r"nope.*not a folder"):
        load_drafter(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/config\.json: missing"):
        load_drafter(empty)

    def broken(change, match, exc=ValueError):
        cfg_file.write_text(change if isinstance(change, str) else json.dumps(change))
        with pytest.raises(exc, match=match):
            load_drafter(out)
        cfg_file.write_text(json.dumps(good))

    broken("{not json", r"config\.json: not valid JSON")
    broken({**good, "architectures": ["Qwen3ForCausalLM"]}, r"config\.json: architectures=.*DFlashDraftModel")
    broken({k: v for k, v in good.items() if k != "num_key_value_heads"}, r"missing .*num_key_value_heads")
    broken({**good, "dflash_config": {"mask_token_id": 1}}, r"config\.json: missing dflash_config\.target_layer_ids")
    broken({**good, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported")
    broken({**good, "intermediate_size": 64}, r"model\.safetensors: tensor 'layers\.0\.mlp\.gate_proj\.weight' "
                                              r"has shape \(48, 32\).*\(64, 32\)")
    broken({**good, "num_hidden_layers": 3}, r"11 missing, e\.g\. \['layers\.2\.")
    broken({**good, "num_hidden_layers": 1}, r"11 unexpected, e\.g\. \['layers\.1\.")
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"model\.safetensors: unreadable safetensors"):
        load_drafter(out)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_drafter(out)
    weights.write_bytes(data)
    load_drafter(out)


def test_cli(tmp_path, capsys):
    from experiments.export import main
    d = _drafter()
    out = main([str(_run_dir(tmp_path, d)), "--out", str(tmp_path / "served"), "--dtype", "float32"])
    assert "block 5" in capsys.readouterr().out and (out / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "no such run directory" in capsys.readouterr().err
    bogus = tmp_path / "bogus.pt"
    torch.save({"weights": 1}, bogus)
    with pytest.raises(SystemExit):
        main([str(bogus), "--out", str(tmp_path / "x")])
    assert "not a dflash training checkpoint" in capsys.readouterr().err


# ------------------------------------------------- the published DFlashDraftModel, from scratch
modeling_qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
Qwen3Config, Qwen3MLP = modeling_qwen3.Qwen3Config, modeling_qwen3.Qwen3MLP
Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half = (modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3RotaryEmbedding,
                                                   modeling_qwen3.rotate_half)


class RefAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=c.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=c.rms_norm_eps)

    def forward(self, h, target_hidden, cos, sin):
        B, Q, _ = h.shape
        kv_in = torch.cat([target_hidden, h], dim=1)  # K/V from context then block
        S = kv_in.shape[1]
        q = self.q_norm(self.q_proj(h).view(B, Q, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, S, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -Q:, :] + rotate_half(q) * sin[..., -Q:, :]  # queries: the block's positions
        k = k * cos + rotate_half(k) * sin  # keys: [ctx..., block...]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class RefLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = RefAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, h, target_hidden, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), target_hidden, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class RefDFlashDraftModel(nn.Module):
    """Written from the description of z-lab's DFlashDraftModel forward: module names, config fields
    (num_target_layers, block_size, dflash_config.target_layer_ids) and math as published."""

    def __init__(self, c):
        super().__init__()
        self.target_layer_ids = c.dflash_config["target_layer_ids"]
        self.block_size = c.block_size
        self.num_target_layers = c.num_target_layers
        self.layers = nn.ModuleList(RefLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        self.fc = nn.Linear(len(self.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, noise_embedding, target_hidden, position_ids):
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, target_hidden, cos, sin)
        return self.norm(h)


def _reference(folder: Path) -> RefDFlashDraftModel:
    c = Qwen3Config.from_pretrained(str(folder))
    ref = RefDFlashDraftModel(c)
    ref.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)  # names must match
    return ref.eval()


def test_reference_dflash_model_loads_folder_and_matches(tmp_path):
    d = _drafter().double()
    d.attach_target_head(torch.randn(V, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64))
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float64)
    ref = _reference(out).double()
    assert ref.block_size == d.block_size and ref.num_target_layers == N_TARGET
    assert ref.target_layer_ids == LAYER_IDS
    feats, tokens, anchors = _inputs(T=24)
    feats = feats.double()
    bs = d.block_size

    def ref_block(b: int, ctx_len: int, anchor_token) -> torch.Tensor:
        ids = torch.full((1, bs), MASK)
        ids[0, 0] = anchor_token
        noise = F.embedding(ids, d.embed_VH)
        target_hidden = feats[b:b + 1, :ctx_len].flatten(2)  # cat of the selected layers' features
        pos = torch.arange(ctx_len + bs)[None]
        with torch.no_grad():
            return ref(noise, target_hidden, pos)[0]  # [bs, H]

    with torch.no_grad():  # inference path: the whole context cached, block right after it
        cache = d.new_cache()
        d.extend_context(cache, feats[:, :17], start=0)
        ours = d.draft_hidden(cache, tokens[:, 17])
    for b in range(2):
        theirs = ref_block(b, 17, tokens[b, 17])
        assert torch.allclose(ours[b], theirs[1:], atol=1e-10)

    with torch.no_grad():  # training path: block n sees exactly the context before its anchor
        train = d(feats, anchors, tokens.gather(1, anchors))
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            assert torch.allclose(train[b, n], ref_block(b, a, tokens[b, a])[1:], atol=1e-10), (b, a)


# ------------------------------------------- what the engines read (DESIGN §6): target facts, windows, auto_map
from dflash.serving.export import MODELING_FILE, TargetFacts, check_folder_against_target  # noqa: E402

WINDOWED = ["sliding_attention", "full_attention"]
FACTS = TargetFacts(hidden_size=H, num_layers=N_TARGET, vocab_size=V, max_position_embeddings=262_144,
                    rope_theta=10_000_000.0, mask_token="<|MASK|>")


def _windowed(seed: int = 0, bs: int = 4, window: int = 6) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                        block_size=bs, rope_theta=0.0, layer_types=WINDOWED, sliding_window=window)
    d = DFlashDrafter(cfg.for_target(FACTS.rope_theta), H, N_TARGET, MASK, LAYER_IDS)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    d.attach_target_head(torch.randn(V, H), torch.randn(V, H))
    return d.eval()


def test_export_writes_what_the_engines_read(tmp_path):
    d = _windowed()
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 262_144  # the target's, not 32768
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, "mask_token": "<|MASK|>"}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS]
    assert cfg["layer_types"] == WINDOWED and cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert cfg["rope_theta"] == 1e7 and cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and cfg["vocab_size"] == V
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "config.json", "model.safetensors", MODELING_FILE]
    src = (Path(__file__).parents[1] / "dflash" / "serving" / MODELING_FILE).read_text()
    assert (out / MODELING_FILE).read_text() == src and "import dflash" not in src and "from dflash" not in src
    back = _with_head(load_drafter(out, target=FACTS), d)  # reads it all back
    assert back.cfg.layer_types == WINDOWED and back.cfg.sliding_window == 6 and back.cfg.rope_theta == 1e7
    inputs = _inputs()
    for a, b in zip(_outputs(d, *inputs), _outputs(back, *inputs)):
        assert torch.equal(a, b)
    again = export_drafter(out, tmp_path / "again", dtype="float32")  # a complete folder keeps its facts
    assert json.loads((again / "config.json").read_text()) == cfg


def test_qwen3_config_reads_the_window_back(tmp_path):
    """vLLM and z-lab read `sliding_window` through transformers' Qwen3Config, which drops it unless
    use_sliding_window is true."""
    out = write_serving_folder(_windowed(), tmp_path / "served", dtype=torch.float32, target=FACTS)
    c = Qwen3Config.from_pretrained(str(out))
    assert c.layer_types == WINDOWED and c.sliding_window == 6 and c.max_position_embeddings == 262_144


def test_export_from_checkpoint_without_final_writes_target_facts(tmp_path):
    """An interrupted run's checkpoint, a drafter with rope_theta 0: theta, context length from the target."""
    from dflash.target.model import ByteTokenizer, TinyTargetSpec
    spec = TinyTargetSpec(hidden_size=H, num_layers=N_TARGET)
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, block_size=4,
                        rope_theta=0.0, layer_types=WINDOWED, sliding_window=8)
    d = DFlashDrafter(cfg.for_target(1.0), H, N_TARGET, ByteTokenizer.mask_token_id, [1, 2])
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"step": 2, "drafter": d.state_dict(),
                "config": {"drafter": dataclasses.asdict(cfg),
                           "target": {"name": "tiny_random", "random": dataclasses.asdict(spec), "layer_ids": [1, 2]}}},
               run / "checkpoints" / "step_00000002.pt")
    out = export_drafter(run, tmp_path / "served", dtype="float32")
    sc = read_serving_config(out)
    from dflash.target.model import tiny_hf_config
    t = tiny_hf_config(spec)
    assert sc["max_position_embeddings"] == t.max_position_embeddings
    assert sc["rope_theta"] == t.rope_parameters["rope_theta"] and sc["layer_types"] == WINDOWED
    assert "mask_token" not in sc["dflash_config"]  # the byte tokenizer has no token strings
    assert (out / MODELING_FILE).is_file() and sc["auto_map"]


def test_read_target_facts_of_the_reference_target():
    from dflash.serving.export import read_target_facts
    from dflash.target.model import TargetConfig
    facts = read_target_facts(TargetConfig(name="reference", path="builtin:reference_target", mask_token_id=2))
    shipped = json.loads((Path(__file__).parents[1] / "dflash/assets/reference_target/config.json").read_text())
    assert facts.max_position_embeddings == shipped["max_position_embeddings"]
    assert facts.rope_theta == shipped["rope_parameters"]["rope_theta"] and facts.mask_token == "<|mask|>"
    assert (facts.hidden_size, facts.num_layers, facts.vocab_size) == (384, 8, 4096)


def test_load_refuses_fields_that_disagree(tmp_path):
    out = write_serving_folder(_windowed(), tmp_path / "f", dtype=torch.float32, target=FACTS)
    (out / MANIFEST).unlink()  # as a published folder: its fields are what is checked
    cfg_file = out / "config.json"
    good = json.loads(cfg_file.read_text())

    def refused(change, match, target=None):
        cfg_file.write_text(json.dumps(change))
        with pytest.raises(ValueError, match=match):
            load_drafter(out, target=target)
        cfg_file.write_text(json.dumps(good))

    d = good["dflash_config"]
    refused({**good, "dflash_config": {**d, "block_size": 8}},
            r"config\.json: block_size=4 but dflash_config\.block_size=8")
    refused({**good, "eagle_aux_hidden_state_layer_ids": LAYER_IDS}, r"eagle_aux_hidden_state_layer_ids=\[1, 3, 4\]")
    refused({**good, "num_target_layers": 4}, r"target_layer_ids=\[1, 3, 4\] lie outside num_target_layers=4")
    refused({**good, "layer_types": ["sliding_attention"]}, r"layer_types has 1 entries but num_hidden_layers=2")
    refused({**good, "layer_types": ["sliding_attention", "chunked"]}, r"layer_types has \['chunked'\]")
    refused({**good, "sliding_window": None}, r"sliding_window=None")
    refused({**good, "sliding_window": 2}, r"config\.json: drafter\.sliding_window=2")
    refused({**good, "is_causal": False}, r"is_causal=False is not supported")
    # against the target: the error names the field
    refused(good, r"config\.json: hidden_size=32 but the target's is 64",
            dataclasses.replace(FACTS, hidden_size=64))
    refused(good, r"num_target_layers=6 but the target has 64", dataclasses.replace(FACTS, num_layers=64))
    refused(good, r"vocab_size=50 but the target's is 51", dataclasses.replace(FACTS, vocab_size=51))
    refused({**good, "max_position_embeddings": 32768},
            r"max_position_embeddings=32768 is below the target's context length 262144", FACTS)
    refused(good, r"dflash_config\.mask_token='<\|MASK\|>' but the target tokenizer's mask token is '<\|mask\|>'",
            dataclasses.replace(FACTS, mask_token="<|mask|>"))
    load_drafter(out, target=FACTS)
    with pytest.raises(ValueError, match=r"hidden_size=32 but the target's is 64"):
        write_serving_folder(_windowed(), tmp_path / "g", target=dataclasses.replace(FACTS, hidden_size=64))
    assert check_folder_against_target(good, FACTS, cfg_file) is None


# ---------------------------- the Transformers path: AutoModel + trust_remote_code, in an interpreter without dflash
# Which sys.path entries are the repository's own source: its root and folders under it, but not an environment's
# packages (a venv made inside the clone, `python -m venv .venv`, holds torch and transformers there)
REPO_SOURCE = r'''
def repo_source(p, repo):
    inside = p in ("", ".") or p == repo or p.startswith(repo.rstrip("/") + "/")
    return inside and "site-packages" not in p and "dist-packages" not in p
'''
_FRESH = REPO_SOURCE + r'''
import sys, importlib.abc
repo = sys.argv[1]
sys.path[:] = [p for p in sys.path if not repo_source(p, repo)]

class NoDflash(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dflash" or name.startswith("dflash."):
            raise ImportError("dflash is blocked in this interpreter")
        return None

sys.meta_path.insert(0, NoDflash())
try:
    import dflash  # noqa: F401
    raise SystemExit("dflash was importable")
except ImportError:
    pass
import torch
import torch.nn.functional as F
from transformers import AutoModel, DynamicCache
folder, inputs, out = sys.argv[2:5]
x = torch.load(inputs)
model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
assert type(model).__name__ == "DFlashDraftModel", type(model)
C, bs = x["C"], model.block_size
ids = torch.full((x["anchor"].shape[0], bs), model.mask_token_id)
ids[:, 0] = x["anchor"]
noise = F.embedding(ids, x["embed"])
with torch.no_grad():
    h = model(position_ids=torch.arange(C + bs)[None], noise_embedding=noise, target_hidden=x["ctx"][:, :C])
    cache, c1 = DynamicCache(), C // 2  # z-lab's loop: context in two chunks, the cache cropped after each block
    model(position_ids=torch.arange(c1 + bs)[None], noise_embedding=noise, target_hidden=x["ctx"][:, :c1],
          past_key_values=cache, use_cache=True)
    cache.crop(-bs)  # drop the block: the cache keeps the c1 context positions
    h_cached = model(position_ids=torch.arange(c1, C + bs)[None], noise_embedding=noise,
                     target_hidden=x["ctx"][:, c1:C], past_key_values=cache, use_cache=True)
torch.save({"logits": model.compute_logits(h[:, 1:], x["lm_head"]),
            "logits_cached": model.compute_logits(h_cached[:, 1:], x["lm_head"]),
            "sys_path": list(sys.path)}, out)
'''


def test_automodel_trust_remote_code_in_a_fresh_interpreter_matches_ours(tmp_path):
    import os
    import subprocess
    import sys
    repo = str(Path(__file__).resolve().parents[1])
    d = _windowed(window=5)
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    feats, tokens, _ = _inputs(T=20)
    C = 13  # beyond the window (5): the windowed layer's cache is cropped on our side, masked on theirs
    with torch.no_grad():
        cache = d.new_cache()
        d.extend_context(cache, feats[:, :C], start=0)
        ours = d.logits(d.draft_hidden(cache, tokens[:, C]))
    assert cache.k[0].shape[2] < C  # the crop happened
    torch.save({"C": C, "anchor": tokens[:, C], "ctx": feats.flatten(2), "embed": d.embed_VH,
                "lm_head": d.lm_head_VH}, tmp_path / "inputs.pt")
    script = tmp_path / "fresh.py"
    script.write_text(_FRESH)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, str(script), repo, str(out), str(tmp_path / "inputs.pt"),
                        str(tmp_path / "theirs.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    theirs = torch.load(tmp_path / "theirs.pt")
    scope: dict = {}
    exec(REPO_SOURCE, scope)
    assert not any(scope["repo_source"](s, repo) for s in theirs["sys_path"])
    torch.testing.assert_close(theirs["logits"].float(), ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs["logits_cached"].float(), ours, rtol=1e-5, atol=1e-5)


def test_training_run_writes_a_complete_folder_for_a_windowed_drafter(fast_cfg):
    """The trainer's final/ carries the target's facts; rope_theta 0 trained with the target's theta."""
    from dflash.serving.export import read_target_facts
    from dflash.app.run import train
    cfg = fast_cfg("+tracking=off", "drafter.num_layers=2", "drafter.layer_types=[sliding_attention,full_attention]",
                   "drafter.sliding_window=16", "drafter.rope_theta=0.0", "trainer.max_steps=2",
                   "trainer.checkpoint_every=2")
    final = train(cfg).run_dir / "final"
    facts = read_target_facts(cfg.target)
    sc = read_serving_config(final)
    assert sc["auto_map"] and (final / MODELING_FILE).is_file() and sc["sliding_window"] == 16
    assert sc["max_position_embeddings"] == facts.max_position_embeddings and sc["rope_theta"] == facts.rope_theta
    assert load_drafter(final, target=facts).cfg.layer_types == ["sliding_attention", "full_attention"]


def test_cli_target_gives_a_bare_source_the_targets_facts(tmp_path, capsys):
    from experiments.export import main
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32,
                                    block_size=4), 384, 8, 2, [1, 3, 5])  # the reference target's shape
    save_drafter(d, tmp_path / "bare")  # no target facts: a bare folder
    out = main([str(tmp_path / "bare"), "--out", str(tmp_path / "served"), "--target", "builtin:reference_target"])
    assert "context 4096" in capsys.readouterr().out
    sc = read_serving_config(out)
    assert sc["dflash_config"]["mask_token"] == "<|mask|>" and sc["vocab_size"] == 4096 and sc["auto_map"]
    with pytest.raises(SystemExit) as e:  # a drafter that does not fit the named target: refused, by field
        main([str(_run_dir(tmp_path, _drafter())), "--out", str(tmp_path / "x"),
              "--target", "builtin:reference_target"])
    assert e.value.code == 2 and "hidden_size=32 but the target's is 384" in capsys.readouterr().err


def _tiny_qwen3_target(seed=0):
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    c = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=N_TARGET,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                    tie_word_embeddings=False)
    return Qwen3ForCausalLM(c).eval()


def _greedy(target, ids, n):
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("oracle", [False, True])
def test_folder_spec_generate_is_the_targets_greedy_output(tmp_path, monkeypatch, oracle):
    """z-lab's Transformers loop on the folder's model: lossless whatever the drafter proposes (random weights,
    or the true continuation with one wrong token every other block: full and partial acceptance)."""
    from transformers import AutoModel
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    target = _tiny_qwen3_target()
    d = _windowed()
    d.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    out = write_serving_folder(d, tmp_path / "served", dtype=torch.float32, target=FACTS)
    model = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    prompt = torch.randint(0, V - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    truth = _greedy(target, prompt, 30)
    rounds = []
    if oracle:
        def hook(module, args, kwargs):
            rounds.append(kwargs["position_ids"].shape[1] - model.block_size + 1)  # L: the anchor's position + 1

        model.register_forward_pre_hook(hook, with_kwargs=True)

        def propose(hidden, head):
            L = rounds[-1]
            want = torch.cat([truth[0, L:L + model.block_size - 1],
                              torch.zeros(model.block_size, dtype=torch.long)])[:model.block_size - 1].clone()
            if len(rounds) % 2:
                want[1] = (want[1] + 1) % V  # a wrong second draft token: one accepted, then the bonus
            return F.one_hot(want, V).float()[None]

        monkeypatch.setattr(model, "compute_logits", propose)
    got = model.spec_generate(target=target, input_ids=prompt, max_new_tokens=30)
    assert torch.equal(got, truth)
    if oracle:  # 30 tokens in fewer rounds than tokens: whole blocks were accepted
        assert len(rounds) < 30 / 2
