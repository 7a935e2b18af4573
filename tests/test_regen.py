"""Target-regenerated drafter data: batched greedy generation, the fingerprinted cache, corrupt files."""
import pytest
import torch

import dflash.data.regen as regen
from dflash.data.regen import greedy_generate, regen_cache_path, regenerate_sequences
from dflash.target.model import Target, TargetConfig, TinyTargetSpec



@pytest.fixture(scope="module")
def target():
    spec = TinyTargetSpec(hidden_size=32, num_layers=4, intermediate_size=64, num_heads=2, num_kv_heads=1,
                          head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_head_dim=16)
    return Target(TargetConfig(random=spec, layer_ids=[0, 1, 2], device="cpu"))


def corpus_seqs(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 14, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g) for k in lengths]


def test_cached_generation_matches_full_recompute(target):
    prompts = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(1))
    a = greedy_generate(target, prompts, 8)
    assert a.shape == (3, 8) and a.dtype == torch.long
    assert torch.equal(a, greedy_generate(target, prompts, 8, use_cache=False))
    assert torch.equal(a[1], greedy_generate(target, prompts[1], 8)[0])  # batching changes nothing


def test_regen_keeps_prompts_and_lengths_and_is_deterministic(target, tmp_path):
    seqs = corpus_seqs()
    out = regenerate_sequences(target, seqs, prompt_len=6, batch_size=3, cache_dir=tmp_path / "a")
    assert [len(s) for s in out] == [len(s) for s in seqs]
    for s, r in zip(seqs, out):
        assert r.dtype == torch.long and torch.equal(r[:6], s[:6])
    for s, r in list(zip(seqs, out))[:2]:  # batched rows equal one-at-a-time generation
        assert torch.equal(r[6:], greedy_generate(target, s[None, :6], len(s) - 6)[0])
    again = regenerate_sequences(target, seqs, prompt_len=6, batch_size=5, cache_dir=None)
    assert all(torch.equal(x, y) for x, y in zip(out, again))
    fixed = regenerate_sequences(target, seqs, prompt_len=6, gen_len=3, batch_size=4, cache_dir=None)
    assert all(len(r) == 9 and torch.equal(r, o[:9]) for r, o in zip(fixed, out))
    texts = regenerate_sequences(target, ["def f(x):\n    return x\n"], prompt_len=8, gen_len=4, cache_dir=None)
    assert texts[0][:8].tolist() == list(b"def f(x)") and len(texts[0]) == 12


def test_regen_cache_hit_miss_and_corrupt_file(target, tmp_path, monkeypatch):
    seqs, cache = corpus_seqs(), tmp_path / "regen"
    st = {}
    first = regenerate_sequences(target, seqs, prompt_len=6, batch_size=4, cache_dir=cache,
                                 corpus_fingerprint="fp1", stats=st)
    assert st["hit"] is False and regen_cache_path(cache, st["key"]).is_file()
    calls = []
    real_build = regen.build_regen
    monkeypatch.setattr(regen, "build_regen", lambda *a, **k: calls.append(1) or real_build(*a, **k))
    st2 = {}
    hit = regenerate_sequences(target, seqs, prompt_len=6, batch_size=2, cache_dir=cache,
                               corpus_fingerprint="fp1", stats=st2)
    assert st2["hit"] is True and not calls and all(torch.equal(x, y) for x, y in zip(first, hit))
    # anything that decides the result is in the fingerprint: each change is a miss
    for kw in ({"prompt_len": 5, "gen_len": 2}, {"corpus_fingerprint": "fp2", "gen_len": 2}, {"gen_len": 3}):
        args = {"prompt_len": 6, "corpus_fingerprint": "fp1", **kw}
        s = {}
        regenerate_sequences(target, seqs, batch_size=8, cache_dir=cache, stats=s, **args)
        assert s["hit"] is False and s["key"] != st["key"]
    s = {}
    regenerate_sequences(target, seqs[:-1], prompt_len=6, gen_len=2, cache_dir=cache, corpus_fingerprint="fp1",
                         stats=s)
    assert s["hit"] is False
    # a corrupt or truncated file is rebuilt, never trusted
    path = regen_cache_path(cache, st["key"])
    raw = path.read_bytes()
    for broken in (raw[: len(raw) // 2], raw[:-5] + b"xxxxx"):
        path.write_bytes(broken)
        s = {}
        again = regenerate_sequences(target, seqs, prompt_len=6, batch_size=8, cache_dir=cache,
                                     corpus_fingerprint="fp1", stats=s)
        assert s["hit"] is False and all(torch.equal(x, y) for x, y in zip(first, again))
        assert path.read_bytes() == raw  # rewritten whole
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp files left


def test_regen_rejects_bad_settings(target):
    for kw in ({"prompt_len": 0}, {"gen_len": 0}, {"batch_size": 0}):
        with pytest.raises(ValueError):
            regenerate_sequences(target, corpus_seqs(2), cache_dir=None, **kw)
