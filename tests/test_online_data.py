"""Issue 20: the prompt pool, online target-written data (same tokens as the target's greedy decoding, shards,
exact resume), the epoch counter and its warning, the consumed-token budget."""
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from dflash.data.corpus import CorpusConfig, load_corpus, split_of
from dflash.data.online import OnlineConfig, OnlineWriter
from dflash.data.writing import write_continuations
from dflash.data.pool import PoolConfig, PromptPool, build_prompt_pool
from dflash.data.regen import greedy_generate
from dflash.target.model import ByteTokenizer, Target, TargetConfig, TinyTargetSpec
from dflash.app.run import train
from tests.conftest import resume_rewrites_the_same_data


def _rows(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    return {r["step"]: r["train/loss"] for r in _rows(run_dir) if "train/loss" in r}


def _tiny(model_type="qwen3_5"):
    spec = TinyTargetSpec(model_type=model_type, hidden_size=32, num_layers=4, intermediate_size=64, num_heads=2,
                          num_kv_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_head_dim=16)
    return Target(TargetConfig(random=spec, layer_ids=[0, 1, 2], device="cpu"))


@pytest.fixture(scope="module")
def target():
    return _tiny()


def _write_corpus(root: Path, n: int = 16) -> None:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"mod_{i:02d}.py").write_text(
            f"import os\n\n\ndef fn_{i:02d}(x):\n    \"\"\"Doc of fn {i:02d}.\"\"\"\n    return x + {i}\n\n\n"
            f"class Cls{i:02d}:\n    \"\"\"Class doc {i:02d}.\"\"\"\n\n    def method(self):\n        return {i}\n")


def test_prompt_pool_holds_train_headers_with_docstrings_and_train_chunks(tmp_path):
    _write_corpus(tmp_path / "src")
    ccfg = CorpusConfig(root=str(tmp_path / "src"), heldout_per_10k=4000)
    corpus = load_corpus(ccfg)
    held = [d.path for d in corpus.heldout]
    assert held and corpus.train  # the split puts files on both sides
    cfg = PoolConfig(headers_frac=0.5, max_prompt_len=64, chunk_min_len=8, chunk_max_len=24,
                     cache_dir=str(tmp_path / "cache"))
    pool = build_prompt_pool(corpus, ByteTokenizer(), cfg, "bytes")
    tok = ByteTokenizer()
    headers = [tok.decode(p) for p, k in zip(pool.prompts, pool.kinds) if k == "header"]
    chunks = [tok.decode(p) for p, k in zip(pool.prompts, pool.kinds) if k == "chunk"]
    train_ids = sorted(d.path[4:6] for d in corpus.train)
    want = {f'def fn_{i}(x):\n    """Doc of fn {i}."""\n' for i in train_ids} | \
        {f'class Cls{i}:\n    """Class doc {i}."""\n' for i in train_ids}
    assert set(headers) == want  # every train def / class with a docstring, header + docstring, dedented
    assert len(chunks) == len(headers)  # headers_frac 0.5
    train_text = "".join(d.text for d in corpus.train)
    assert all(8 <= len(c) <= 24 and c in train_text for c in chunks)
    for h in held:  # a held-out file reaches neither kind
        i = h[4:6]
        assert all(f"fn_{i}" not in p and f"Cls{i}" not in p and f"return x + {int(i)}\n" not in p
                   for p in headers + chunks)
    assert all(split_of(d.path, 4000, ccfg.salt) == "train" for d in corpus.train)
    again = build_prompt_pool(corpus, ByteTokenizer(), cfg, "bytes")  # read back from the cache
    assert again.prompts == pool.prompts and again.kinds == pool.kinds and again.fingerprint == pool.fingerprint


def test_header_cuts_add_header_body_prompts_counted_as_headers(tmp_path):
    """data.pool.header_cuts: each train header prompt is followed by its cuts into the body (kind header_body);
    they count as headers in headers_frac; a pool without cuts keeps the fingerprint it had before the key."""
    import hashlib
    import json
    from dataclasses import asdict

    from dflash.data.pool import FORMAT_VERSION, pool_fingerprint, validate_pool_config
    _write_corpus(tmp_path / "src")
    corpus = load_corpus(CorpusConfig(root=str(tmp_path / "src"), heldout_per_10k=4000))
    plain = PoolConfig(headers_frac=0.5, max_prompt_len=200, chunk_min_len=8, chunk_max_len=24, cache_dir="")
    cut = PoolConfig(**{**asdict(plain), "header_cuts": 2})
    tok = ByteTokenizer()
    p0, p2 = build_prompt_pool(corpus, tok, plain, "bytes"), build_prompt_pool(corpus, tok, cut, "bytes")
    headers = [tok.decode(p) for p, k in zip(p0.prompts, p0.kinds) if k == "header"]
    assert [tok.decode(p) for p, k in zip(p2.prompts, p2.kinds) if k == "header"] == headers
    bodies = [tok.decode(p) for p, k in zip(p2.prompts, p2.kinds) if k == "header_body"]
    # a class: 3 body lines after its docstring -> cuts after 1 (a blank line: left out) and 2 lines; a function:
    # one body line -> no cut
    assert sorted(bodies) == sorted(h + "\n    def method(self):\n" for h in headers if h.startswith("class"))
    assert p2.kinds.count("chunk") == len(headers) + len(bodies)  # headers_frac 0.5 over both header kinds
    assert p2.stats["header_body_prompts"] == len(bodies) and p2.fingerprint != p0.fingerprint
    old = {k: v for k, v in asdict(plain).items() if k not in ("cache_dir", "header_cuts", "source")}
    assert pool_fingerprint("c", "t", plain) == hashlib.sha256(json.dumps(
        {"format": FORMAT_VERSION, "corpus": "c", "tokenizer": "t", "cfg": old}, sort_keys=True).encode()).hexdigest()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="data.pool.header_cuts"):
            validate_pool_config(PoolConfig(header_cuts=bad))


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_written_sequences_are_the_targets_own_greedy_continuations(model_type):
    target = _tiny(model_type)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7, 5, 3)]
    out = write_continuations(target, prompts, seq_len=14)
    assert out.shape == (4, 14) and out.dtype == torch.long
    for p, row in zip(prompts, out):
        ref = greedy_generate(target, torch.tensor([p]), 14 - len(p), use_cache=False)[0]
        assert row[:len(p)].tolist() == p and torch.equal(row[len(p):], ref), (len(p), row, ref)


def _gqa_tiny():
    """Grouped heads on both sides: 4 value heads per 2 key heads in Gated DeltaNet, 1 KV head for 4 queries."""
    spec = TinyTargetSpec(model_type="qwen3_5", hidden_size=32, num_layers=4, intermediate_size=64, num_heads=4,
                          num_kv_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_head_dim=8)
    return Target(TargetConfig(random=spec, layer_ids=[0, 1, 2], device="cpu"))


@pytest.mark.parametrize("make", [_tiny, _gqa_tiny], ids=["qwen3_5", "qwen3_5-grouped"])
def test_static_decoder_writes_what_transformers_cache_writes(make):
    """The static decoder (dflash.target.static_decode; a CUDA graph on a GPU, op by op here) from position 0
    gives the tokens of transformers' cached decode, and its hidden states match to float32 rounding."""
    from dflash.target.static_decode import static_decoder
    target = make()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 9, 4, 6, 2)]
    cached = write_continuations(target, prompts, seq_len=24, decode="cache")
    static = write_continuations(target, prompts, seq_len=24, decode="static")
    assert torch.equal(static, cached)
    sampled = [write_continuations(target, prompts, 24, 1.3, torch.Generator().manual_seed(2), decode=d)
               for d in ("cache", "static")]
    assert torch.equal(*sampled) and not torch.equal(sampled[0], cached)  # the same draws, and really sampled
    seq = cached[:, :12]
    ref = target.decoder(input_ids=seq, use_cache=False).last_hidden_state
    dec = static_decoder(target, len(prompts), 24, graph=True)  # no GPU: the eager step
    dec.reset()
    for t in range(12):
        torch.testing.assert_close(dec.step(seq[:, t]), ref[:, t:t + 1], rtol=1e-4, atol=1e-5)
    assert int(dec.pos) == 12


def test_static_decode_is_refused_for_a_model_type_without_one():
    target = _tiny("qwen3_next")
    with pytest.raises(ValueError, match="data.online.decode=static.*qwen3_next"):
        write_continuations(target, [[1, 2]], seq_len=6, decode="static")
    assert write_continuations(target, [[1, 2]], seq_len=6).shape == (1, 6)  # auto: transformers' cache
    with pytest.raises(ValueError, match="data.online.decode must be one of"):
        from dflash.data.online import validate_online_config
        validate_online_config(OnlineConfig(decode="fast"), 64, 16)


def test_batches_written_ahead_in_the_background_are_the_same_batches(target, tmp_path):
    """`ahead` (on a GPU): a thread writes batch b+1 while b is consumed; the tokens do not change, a batch is
    written once, and a failure reaches whoever asks for that batch."""
    pool = _pool()
    cfg = OnlineConfig(write_batch=3, shard_dir="")
    plain = OnlineWriter(target, pool, cfg, seq_len=20)
    want = [plain.sequence(g) for g in range(9)]
    ahead = OnlineWriter(target, pool, dataclasses.replace(cfg, ahead=2), seq_len=20)
    ahead.ahead = 2  # (a CPU target writes when asked)
    got = [ahead.sequence(g) for g in range(9)]
    ahead.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ahead.written_batches == 5 and not ahead._pending  # batches 0-2, and 3-4 written ahead
    broken = OnlineWriter(target, pool, cfg, seq_len=20)
    broken.ahead = 1
    broken._load_or_write = lambda b: (_ for _ in ()).throw(RuntimeError(f"disk full at {b}"))
    with pytest.raises(RuntimeError, match="disk full at 0"):
        broken.sequence(0)


def _pool(n=12):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (n,), generator=g)]
    return PromptPool(prompts, ["chunk"] * n, "pool-fp", "corpus-fp")


def test_writer_reuses_shards_rewrites_corrupt_ones_and_seeds_sampling(target, tmp_path):
    pool = _pool()
    cfg = OnlineConfig(write_batch=4, shard_dir=str(tmp_path / "shards"))
    a = OnlineWriter(target, pool, cfg, seq_len=24)
    seqs = [a.sequence(g) for g in range(6)]  # two written batches
    assert a.written_batches == 2 and a.shard_reads == 0 and a.shard_path(1).is_file()
    for g, s in enumerate(seqs):
        p = pool.prompts[a.prompt_index(g)]
        assert s.shape == (24,) and s[:len(p)].tolist() == p
    b = OnlineWriter(target, pool, cfg, seq_len=24)  # a later run / another trial: reads, never writes
    assert all(torch.equal(b.sequence(g), s) for g, s in enumerate(seqs))
    assert b.written_batches == 0 and b.shard_reads == 2
    # the text's digest: the same read as written; None for batches not read here
    assert a.digest(2) is not None and b.digest(2) == a.digest(2) and a.digest(3) is None
    a.shard_path(0).write_bytes(a.shard_path(0).read_bytes()[:-9])  # torn
    c = OnlineWriter(target, pool, cfg, seq_len=24)
    assert torch.equal(c.sequence(1), seqs[1]) and c.written_batches == 1
    hot = OnlineConfig(write_batch=4, temperature=1.5, shard_dir="")
    s1 = [OnlineWriter(target, pool, hot, 24).sequence(g) for g in range(4)]
    s2 = [OnlineWriter(target, pool, hot, 24).sequence(g) for g in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(s1, s2))  # seeded per written batch
    assert any(not torch.equal(x, y) for x, y in zip(s1, seqs))  # and not the greedy continuation
    other_text = OnlineWriter(target, pool, hot, 24)
    other_text.sequence(0)
    assert other_text.digest(1) != a.digest(1)  # other tokens, another digest
    assert OnlineWriter(target, pool, hot, 24).fingerprint != a.fingerprint


def test_reuse_serves_each_written_row_r_times_and_counts_the_views(target):
    """data.online.reuse=R: written batch b serves items b·R·W … (b+1)·R·W − 1, each of its rows R times in a
    seeded order (the same batches R=1 writes: shards are shared); data/epochs never reads below R."""
    from dflash.training.datastream import TrainingData
    pool = _pool()
    one = OnlineWriter(target, pool, OnlineConfig(write_batch=4, shard_dir="", reuse=1), seq_len=20)
    three = OnlineWriter(target, pool, OnlineConfig(write_batch=4, shard_dir="", reuse=3), seq_len=20)
    assert three.fingerprint == one.fingerprint
    batch0 = [one.sequence(g) for g in range(4)]
    views = [three.sequence(g) for g in range(12)]  # written batch 0, three times over
    hits = [sum(torch.equal(v, row) for v in views) for row in batch0]
    assert hits == [3, 3, 3, 3] and three.written_batches == 1
    assert torch.equal(three.sequence(12), [one.sequence(g) for g in range(4, 8)][int(three._reuse_order(1)[0]) % 4])
    again = OnlineWriter(target, pool, OnlineConfig(write_batch=4, shard_dir="", reuse=3), seq_len=20)
    assert all(torch.equal(again.sequence(g), v) for g, v in enumerate(views))  # seeded: a resume sees the same
    assert OnlineWriter(target, pool, OnlineConfig(write_batch=4, shard_dir=""), 20).cfg.reuse == 1  # auto, CPU
    d = TrainingData("online", None, three, 12, 20.0, "fp", "c", 0, reuse=3)
    assert d.epochs(6) == 3.0 and d.distinct_seen(6) == 2 and d.epochs(72) == 6.0 and d.distinct_seen(72) == 12
    with pytest.raises(ValueError, match="data.online.reuse"):
        from dflash.data.online import validate_online_config
        validate_online_config(OnlineConfig(reuse=-1), 64, 16)


def _online(tmp_path, *extra):
    return ("+data=online", "data.corpus.limit_files=20", "data.pool.size=10", "data.pool.max_prompt_len=60",
            "data.pool.chunk_min_len=4", "data.pool.chunk_max_len=16", "data.online.write_batch=4",
            f"data.online.shard_dir={tmp_path / 'shards'}", f"data.pool.cache_dir={tmp_path / 'pool'}", *extra)


@pytest.mark.parametrize("reuse", [1, 3])
def test_online_run_counts_epochs_and_resumes_exactly(fast_cfg, tmp_path, reuse):
    det = ("+buffer=deterministic", "buffer.max_depth=4", "buffer.min_ready=4", "trainer.producer_batch=3")
    full = train(fast_cfg(*_online(tmp_path, f"data.online.reuse={reuse}"), *det, "+loss=streak", run="full"))
    rows = [r for r in _rows(full.run_dir) if "data/epochs" in r]
    last = rows[-1]
    assert last["step"] == 6 and last["data/consumed_sequences"] == 12  # 6 steps x 2 sequences
    if reuse == 1:
        assert last["data/epochs"] == pytest.approx(12 / 10) and last["data/unique_sequences"] == 10
        assert last["data/written_batches"] >= 3  # 12 consumed + the buffer's 4 = 16 items = 4 batches of 4
    else:  # 12 views of 4 written sequences, each seen 3 times
        assert last["data/epochs"] == 3.0 and last["data/unique_sequences"] == 4
        assert last["data/views_per_sequence"] == 3.0 and last["data/written_batches"] == 2  # 16 items / (3 x 4)
    assert last["data/consumed_tokens"] == 12 * 72  # every written sequence is data.max_len long
    tags = json.loads((full.run_dir / "tags.json").read_text())
    assert tags["data.kind"] == "online" and tags["data.over_epoch_limit"] == "false" and tags["data.corpus"] != "-"
    res = resume_rewrites_the_same_data(full.run_dir, tmp_path / "shards", fast_cfg, tmp_path, _losses)
    assert [r for r in _rows(res.run_dir) if "data/epochs" in r][-1]["data/consumed_sequences"] == 12


def test_epoch_counter_and_the_memorization_warning(fast_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash.training.datastream"):
        res = train(fast_cfg("data.num_sequences=4", "data.max_epochs=2", run="over"))
    assert "MEMORIZATION RISK" in caplog.text and "3.0 times" in caplog.text  # 6 steps x 2 / 4 sequences
    tags = json.loads((res.run_dir / "tags.json").read_text())
    assert tags["data.over_epoch_limit"] == "true" and tags["data.planned_epochs"] == "3.000"
    epochs = [r["data/epochs"] for r in _rows(res.run_dir) if "data/epochs" in r]
    assert epochs == pytest.approx([0.5 * s for s in range(1, 7)])
    assert [r["data/unique_sequences"] for r in _rows(res.run_dir) if "data/epochs" in r][-1] == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash.training.datastream"):
        ok = train(fast_cfg("data.num_sequences=4", "data.max_epochs=3", run="ok"))
    assert "MEMORIZATION RISK" not in caplog.text
    assert json.loads((ok.run_dir / "tags.json").read_text())["data.over_epoch_limit"] == "false"


def test_token_budget_stops_at_the_first_interval_past_it(fast_cfg):
    res = train(fast_cfg("trainer.token_budget=200", "trainer.max_steps=50", "tracking.log_every=2"))
    rows = [r for r in _rows(res.run_dir) if "data/consumed_tokens" in r]
    assert rows[-1]["data/consumed_tokens"] >= 200 and all(r["data/consumed_tokens"] < 200 for r in rows[:-1])
    assert rows[-1]["step"] % 2 == 0 and rows[-1]["step"] < 50
    step = rows[-1]["step"]
    assert (res.run_dir / "checkpoints" / f"step_{step:08d}.pt").is_file()
    assert (res.run_dir / "final" / "model.safetensors").is_file()


def test_negative_token_budget_is_rejected(fast_cfg):
    from dflash.config import ConfigError, validate
    with pytest.raises(ConfigError, match="trainer.token_budget"):
        validate(fast_cfg("trainer.token_budget=-1"))


@pytest.mark.gpu
def test_gpu_profile_trains_on_online_data(fast_cfg, tmp_path):
    """`+trainer=gpu` on a GPU: inline producer, online data written on the device (float32: the written rows
    are the target's own greedy continuations there too), data/ metrics logged."""
    res = train(fast_cfg("+trainer=gpu", *_online(tmp_path), "+target=tiny_random", "target.dtype=float32",
                         "trainer.max_steps=6", "trainer.sequences_per_step=4", "trainer.producer_batch=4",
                         "trainer.num_anchors=4", "trainer.compile=false", "tracking.log_every=3"))
    last = [r for r in _rows(res.run_dir) if "data/epochs" in r][-1]
    assert last["data/consumed_sequences"] == 24 and last["perf/write_tok_s"] > 0
    target = Target(TargetConfig(random=TinyTargetSpec(), layer_ids=[0, 1, 2], device="cuda", dtype="float32"))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = write_continuations(target, prompts, seq_len=20)
    for p, row in zip(prompts, out):
        assert torch.equal(row[len(p):], greedy_generate(target, torch.tensor([p]), 20 - len(p))[0])


def test_write_ahead_makes_the_shards_a_run_then_only_reads(fast_cfg, tmp_path):
    """A campaign's shared inputs: the shards every run will claim, written once up front; the run that
    follows writes nothing (the engine's own counters say so)."""
    from dflash.app.write_ahead import write_ahead
    cfg = fast_cfg(*_online(tmp_path), "trainer.producer_batch=3", run="ahead")
    stats = write_ahead(cfg)
    # 6 steps x 2 sequences + a full buffer (4) + one producer batch (3) = 19 items -> 5 batches of 4
    assert stats["data/write_ahead_batches"] == 5 and stats["data/written_batches"] == 5
    assert len(list((tmp_path / "shards").rglob("*.pt"))) == 5
    again = write_ahead(cfg)
    assert again["data/written_batches"] == 0 and again["data/shard_reads"] == 5
    assert len(stats["data/digest"]) == 16 and again["data/digest"] == stats["data/digest"]  # the same text
    res = train(cfg)
    last = [r for r in _rows(res.run_dir) if "data/written_batches" in r][-1]
    assert last["data/written_batches"] == 0 and last["data/shard_reads"] >= 3


def test_write_ahead_pins_the_ground_truth_of_the_train_prompts_the_runs_evaluate(fast_cfg, tmp_path):
    """The shared inputs hold eval/tau_train's ground truth too (the training prompts the runs' evaluators cut
    from the pool): a run after them evaluates on pins that are all there already, and builds none."""
    from dflash.app.write_ahead import write_ahead
    truth = tmp_path / "truth"
    cfg = fast_cfg(*_online(tmp_path), "eval.enabled=true", "eval.suite=coding10", "eval.extra_suites=[]",
                   "eval.subset=2", "eval.max_new_tokens=6", "eval.tree_budgets=[2]", "eval.bootstrap=50",
                   "eval.train_tasks=2", f"eval.cache_dir={tmp_path / 'eval'}", f"eval.truth_dir={truth}",
                   "trainer.eval_every=3", run="ahead")
    stats = write_ahead(cfg)
    pins = sorted(truth.glob("*.json"))
    assert stats["eval/write_ahead_suites"] == 2 and len(pins) == 2  # coding10 and the training prompts
    res = train(cfg)
    assert "eval/t0/tau_train" in res.metrics
    assert sorted(truth.glob("*.json")) == pins


def test_a_write_batch_past_cudas_grid_limit_is_refused_naming_the_key():
    from types import SimpleNamespace

    from dflash.data.writing import check_write_batch
    fake = SimpleNamespace(device=torch.device("cuda"),
                           model=SimpleNamespace(config=SimpleNamespace(linear_num_value_heads=8)))
    check_write_batch(fake, 8191)  # 65,528 blocks: fits
    with pytest.raises(ValueError, match=r"data.online.write_batch=8192.*at most 8191"):
        check_write_batch(fake, 8192)
    check_write_batch(SimpleNamespace(device=torch.device("cpu")), 1 << 20)  # no grid on the CPU


def test_auto_write_batch_fits_memory_and_the_grid(monkeypatch, reference_target):
    """write_batch=0: 1,024 rows on the CPU; on a GPU the largest power of two up to 4,096 whose caches fit half
    the free memory and whose kernels fit CUDA's grid — 4,096 for the reference target, a few dozen for the
    27B shapes after their weights."""
    from types import SimpleNamespace

    from transformers import Qwen3_5TextConfig

    from dflash.data import writing as online
    assert online.auto_write_batch(reference_target, 320) == online.CPU_WRITE_ROWS == 1024
    ref = SimpleNamespace(device=torch.device("cuda"), model=reference_target.model, dtype=torch.bfloat16)
    per_row = online.cache_bytes_per_row(ref, 320)
    cfg = reference_target.model.config
    n_attn = cfg.layer_types.count("full_attention")
    assert per_row > n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * 320 * 2  # + the recurrent states
    free = {"bytes": 80 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 141 << 30))
    assert online.auto_write_batch(ref, 320) == 4096
    free["bytes"] = int(2 * 1000 * per_row)  # half of it holds 1,000 rows: 512
    assert online.auto_write_batch(ref, 320) == 512
    free["bytes"] = 60 << 30  # the 27B shapes (48 GDN layers of 48 x 128 x 128, 16 attention layers) after weights
    big = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, model=SimpleNamespace(config=Qwen3_5TextConfig(
        num_hidden_layers=64, hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_value_heads=48, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)))
    rows = online.auto_write_batch(big, 2048)
    assert rows == 64 and rows * online.cache_bytes_per_row(big, 2048) <= 30 << 30
    free["bytes"] = 1 << 50  # memory to spare: CUDA's grid caps it (8 value heads: 8,191 rows -> 4,096 anyway)
    assert online.auto_write_batch(ref, 320) == 4096


def test_auto_write_batch_is_resolved_before_the_shard_fingerprint(tmp_path, reference_target):
    """The writer records the width it writes at (shards of auto and of an explicit 1,024 are the same shards
    on the CPU), and an explicit width is kept."""
    from dflash.data.online import OnlineConfig, OnlineWriter
    from dflash.data.pool import PromptPool
    pool = PromptPool([[5, 6, 7, 8]] * 3, ["chunk"] * 3, fingerprint="p", corpus_fingerprint="c")
    auto = OnlineWriter(reference_target, pool, OnlineConfig(write_batch=0, shard_dir=str(tmp_path)), seq_len=16)
    fixed = OnlineWriter(reference_target, pool, OnlineConfig(write_batch=1024, shard_dir=str(tmp_path)), seq_len=16)
    assert auto.cfg.write_batch == 1024 and auto.fingerprint == fixed.fingerprint
    assert OnlineWriter(reference_target, pool, OnlineConfig(write_batch=4), seq_len=16).cfg.write_batch == 4


def test_math_pool_is_the_generators_training_problems_and_a_code_pool_is_refused_for_the_math_source(tmp_path):
    """data.pool.source=math: the prompts are the generator's training problems (never a held-out one), the pool is
    cached by a fingerprint of the generator, and online data with data.source=math and a code pool is refused
    before any work (a campaign on the math target trained on its continuations of Python code so)."""
    from dflash.data.math_problems import heldout_problems, take, training_problems
    from dflash.data.pool import pool_fingerprint, pool_for
    from dflash.data.sources import DataConfig, validate_online_data
    tok = ByteTokenizer()
    cfg = DataConfig(source="math", pool=PoolConfig(source="math", size=40, max_prompt_len=400,
                                                    cache_dir=str(tmp_path / "pool")))
    cfg.online.seq_len = 512
    validate_online_data(cfg)
    pool = pool_for(cfg, tok, "bytes")
    want = [p.prompt for p in take(training_problems(0), 40)]
    assert [bytes(p).decode() for p in pool.prompts] == want and set(pool.kinds) == {"math"}
    assert not {p.prompt for p in take(heldout_problems(0), 200)} & set(want)
    assert pool.corpus_fingerprint.startswith("math:") and list((tmp_path / "pool").iterdir())
    again = pool_for(cfg, tok, "bytes")  # from the cache
    assert list(again.prompts) == list(pool.prompts) and again.fingerprint == pool.fingerprint
    # a code pool's fingerprint is what it was before the key existed (its shards stay valid)
    code = PoolConfig()
    legacy = {k: v for k, v in dataclasses.asdict(code).items() if k not in ("cache_dir", "header_cuts", "source")}
    import hashlib
    assert pool_fingerprint("c", "t", code) == hashlib.sha256(json.dumps(
        {"format": 1, "corpus": "c", "tokenizer": "t", "cfg": legacy}, sort_keys=True).encode()).hexdigest()
    with pytest.raises(ValueError, match=r"data.source=math with online data.*data.pool.source=math"):
        validate_online_data(DataConfig(source="math"))
    with pytest.raises(ValueError, match=r"data.pool.source must be one of corpus, math"):
        validate_online_data(DataConfig(source="online", pool=PoolConfig(source="maths")))
