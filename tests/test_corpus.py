"""The pretraining corpus: scopes (stdlib / installed), content dedup, split, token cache."""
import shutil
import sysconfig
from pathlib import Path

import pytest

from dflash.data import corpus as corpus_mod
from dflash.data.corpus import (CorpusConfig, load_corpus, split_of, tokenize_corpus, tokenizer_sample,
                                train_tokenizer)

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture()
def two_roots(tmp_path, monkeypatch):
    """'installed' scope over two fake roots: a 'stdlib' and a 'site-packages' with a copy of one file."""
    std, site = tmp_path / "std", tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    std.mkdir()
    for name in ("bisect.py", "colorsys.py", "keyword.py", "fnmatch.py", "glob.py", "heapq.py", "shlex.py"):
        shutil.copy(STDLIB / name, std / name)
    shutil.copy(STDLIB / "textwrap.py", site / "pkg" / "wrap.py")
    shutil.copy(STDLIB / "heapq.py", site / "pkg" / "heap_copy.py")  # same content: dropped
    (site / "pkg" / "tests").mkdir()
    (site / "pkg" / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    monkeypatch.setitem(corpus_mod.CORPUS_SCOPES, "installed", lambda: [std, site])
    return std, site


def test_installed_scope_reads_every_root_and_drops_duplicates(two_roots):
    cfg = CorpusConfig(scope="installed", heldout_per_10k=3000)
    c = load_corpus(cfg)
    paths = [d.path for d in c.train + c.heldout]
    assert "pkg/wrap.py" in paths and "heapq.py" in paths and "pkg/heap_copy.py" not in paths
    assert "pkg/tests/test_a.py" not in paths and c.skipped["duplicate"] == 1
    assert c.stats()["roots"] == [str(r.resolve()) for r in two_roots] and c.stats()["scope"] == "installed"
    for d in c.test:  # a file's split is the same function of its relative path in every scope
        assert split_of(d.path, cfg.heldout_per_10k, cfg.salt) == "test"
    std_only = load_corpus(CorpusConfig(root=str(two_roots[0]), heldout_per_10k=3000))
    assert {d.path for d in std_only.test} <= {d.path for d in c.test}
    assert c.fingerprint != load_corpus(CorpusConfig(scope="installed", heldout_per_10k=3000, dedup=False)).fingerprint


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="corpus.scope"):
        load_corpus(CorpusConfig(scope="everything"))
    with pytest.raises(FileNotFoundError, match="corpus.root"):
        load_corpus(CorpusConfig(root="/nonexistent/dir"))


def test_token_cache_hit_and_corrupt_rebuild(two_roots, tmp_path):
    c = load_corpus(CorpusConfig(scope="installed", heldout_per_10k=3000))
    tok = train_tokenizer(tokenizer_sample(c, 0), vocab_size=400)
    s1, s2, s3 = {}, {}, {}
    a = tokenize_corpus(c, tok, tmp_path / "tok", s1)
    b = tokenize_corpus(c, tok, tmp_path / "tok", s2)
    assert s1["cache"] == "miss" and s2["cache"] == "hit"
    assert all(a[k].equal(b[k]) for k in a) and s1["train_tokens"] == a["train"].numel() > 0
    assert s1["train_files"] == len(c.train)
    eos = tok.token_to_id("<|endoftext|>")
    assert int((a["train"] == eos).sum()) == len(c.train)  # one separator per file
    (f,) = list((tmp_path / "tok").glob("*.tokens"))
    f.write_bytes(f.read_bytes()[:-10])  # truncated: rebuilt, not trusted
    d = tokenize_corpus(c, tok, tmp_path / "tok", s3)
    assert s3["cache"] == "miss" and d["train"].equal(a["train"])


def test_tokenizer_sample_is_bounded_and_deterministic(two_roots):
    c = load_corpus(CorpusConfig(scope="installed", heldout_per_10k=3000))
    full = tokenizer_sample(c, 0)
    assert sorted(full) == sorted(c.texts("train"))
    part = tokenizer_sample(c, 20_000)
    assert part == tokenizer_sample(c, 20_000) and 0 < len(part) < len(full)
    assert sum(len(t) for t in part[:-1]) < 20_000


def test_split_newlines_tokenizer_ends_tokens_at_newlines(two_roots):
    c = load_corpus(CorpusConfig(scope="installed", heldout_per_10k=3000))
    tok = train_tokenizer(tokenizer_sample(c, 0), vocab_size=500, split_newlines=True)
    code = 'def f(x):\n    """Doc."""\n    return x\n\n\nclass A:\n        pass\n'
    enc = tok.encode(code)
    assert tok.decode(enc.ids) == code
    pieces = [code[a:b] for a, b in enc.offsets]
    assert all("\n" not in p or p == "\n" for p in pieces)  # a newline never shares a token
    glued = train_tokenizer(tokenizer_sample(c, 0), vocab_size=500)
    assert any("\n" in code[a:b] and code[a:b] != "\n" for a, b in glued.encode(code).offsets)
