"""The reference-target recipe on CPU: corpus, tokenizer, a tiny pretraining run, the written folder."""
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from dflash.data.corpus import (MASK_TOKEN, SPECIAL_TOKENS, CorpusConfig, list_files, load_corpus, save_tokenizer,
                           split_of, train_tokenizer)
from dflash.pretrain.recipe import PretrainConfig, compare_grads, estimate_bf16_bytes, lr_at, pretrain, write_folder_atomically
from dflash.target.model import read_target_meta
from dflash.tracking.loggers import TrackingConfig

CODE = ('def f(x: int) -> str:\n    """Docstring: é ü 😀."""\n\tif x  >=  10:\n        return "big"\r\n'
        '    return str(x)\n')
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_FILES = ["bisect.py", "colorsys.py", "keyword.py", "fnmatch.py", "glob.py", "heapq.py", "shlex.py",
               "textwrap.py", "copy.py", "this.py", "stat.py", "abc.py", "numbers.py", "queue.py"]



@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    """A tiny corpus root: a few standard-library modules, one in a `tests` dir that must be skipped."""
    root = tmp_path_factory.mktemp("corpus")
    for name in SMALL_FILES:
        shutil.copy(STDLIB / name, root / name)
    (root / "pkg").mkdir()
    shutil.copy(STDLIB / "string.py", root / "pkg" / "string_mod.py")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("def test_x():\n    assert True\n")
    return root


def test_stdlib_corpus_deterministic_and_split_disjoint():
    a, b = load_corpus(CorpusConfig()), load_corpus(CorpusConfig())
    assert a.fingerprint == b.fingerprint
    assert [d.path for d in a.train] == [d.path for d in b.train] == sorted(d.path for d in a.train)
    train, held = {d.path for d in a.train}, {d.path for d in a.heldout}
    assert held and not train & held and not {d.path for d in a.val} & {d.path for d in a.test}
    assert len(train) > 10 * len(held) / 2  # ~10% held out
    for p in train | held:
        parts = p.split("/")[:-1]
        assert not {"test", "tests", "idlelib", "site-packages"} & set(parts), p
    cfg = CorpusConfig()
    for d in a.test:
        assert split_of(d.path, cfg.heldout_per_10k, cfg.salt) == "test"
    other = load_corpus(CorpusConfig(salt="another"))
    assert other.fingerprint != a.fingerprint and {d.path for d in other.heldout} != held


def test_split_is_per_file_and_fingerprint_tracks_content(small_root, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(small_root, root)
    cfg = CorpusConfig(root=str(root), heldout_per_10k=3000)
    c1 = load_corpus(cfg)
    assert "tests/test_x.py" not in {d.path for d in c1.train + c1.heldout}
    assert [d.path for d in c1.train + c1.heldout] and c1.heldout
    (root / "zz_new.py").write_text("X = 1\n")  # a new file never moves the others between splits
    c2 = load_corpus(cfg)
    for split in ("train", "val", "test"):
        assert {d.path for d in getattr(c1, split)} <= {d.path for d in getattr(c2, split)}
    assert c2.fingerprint != c1.fingerprint
    (root / "zz_new.py").write_text("X = 2\n")
    assert load_corpus(cfg).fingerprint not in (c1.fingerprint, c2.fingerprint)
    assert [r for r, _ in list_files(CorpusConfig(root=str(root), limit_files=3))] == \
        [r for r, _ in list_files(cfg)][:3]


def test_tokenizer_roundtrip_specials_and_autotokenizer(small_root, tmp_path):
    from transformers import AutoTokenizer
    texts = load_corpus(CorpusConfig(root=str(small_root))).texts("train")
    tok = train_tokenizer(texts, vocab_size=600)
    assert tok.to_str() == train_tokenizer(texts, vocab_size=600).to_str()  # deterministic
    assert tok.get_vocab_size() == 600
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    ids = tok.encode(CODE).ids
    assert tok.decode(ids) == CODE and len(ids) < len(CODE.encode())
    save_tokenizer(tok, tmp_path / "tk")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tk"), local_files_only=True)
    assert hf.encode(CODE) == ids and hf.decode(ids) == CODE
    assert hf.mask_token == MASK_TOKEN and hf.mask_token_id == 2 and hf.eos_token_id == 0 and hf.pad_token_id == 1
    assert hf.bos_token_id is None


def test_default_recipe_fits_the_size_limit():
    cfg = PretrainConfig()
    n = estimate_bf16_bytes(cfg)
    assert 30e6 < n < cfg.max_bf16_bytes == 40_000_000


def test_schedule_and_grad_compare():
    cfg = PretrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 0) == pytest.approx(0.1) and lr_at(cfg, 9, 0) == pytest.approx(1.0)
    assert lr_at(cfg, 60, 0) == pytest.approx(0.55) and lr_at(cfg, 110, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 10, 1.0) == pytest.approx(0.1)  # the wall clock ends the cosine too
    g = {"a": torch.ones(3), "b": torch.ones(2)}
    assert compare_grads(g, g)["global_rel_err"] == 0 and compare_grads(g, g)["finite"]
    bad = compare_grads(g, {"a": torch.ones(3), "b": -torch.ones(2)})
    assert bad["worst_param"] == "b" and bad["worst_rel_err"] == pytest.approx(2.0)
    assert not compare_grads(g, {"a": torch.full((3,), float("nan")), "b": torch.ones(2)})["finite"]


def test_folder_write_is_atomic(tmp_path):
    out = tmp_path / "model"
    write_folder_atomically(out, lambda d: (d / "a.txt").write_text("1"))
    with pytest.raises(RuntimeError):
        def boom(d):
            (d / "a.txt").write_text("2")
            raise RuntimeError("killed")
        write_folder_atomically(out, boom)
    assert (out / "a.txt").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    write_folder_atomically(out, lambda d: (d / "b.txt").write_text("3"))
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]


def tiny_cfg(root, tmp_path, **kw) -> PretrainConfig:
    base = dict(corpus=CorpusConfig(root=str(root), heldout_per_10k=2500), vocab_size=384, hidden_size=32,
                num_layers=4, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=2, linear_head_dim=16, seq_len=64, batch_size=6,
                max_steps=24, lr=1e-2, warmup_steps=4, eval_every=8, eval_tokens=1024, final_eval_tokens=2048,
                log_every=4, device="cpu", max_new_tokens=4, out_dir=str(tmp_path / "target"),
                run_dir=str(tmp_path / "run"), results_path=str(tmp_path / "results.md"),
                # MLflow itself is covered by test_tracking; its import + sqlite setup costs ~10 s here
                tracking=TrackingConfig(enabled=False, console=False, system_metrics=False),
                probe_stdlib_v1=False)  # scoring the whole stdlib test split costs minutes on a busy CPU
    base.update(kw)
    return PretrainConfig(**base)


def test_tiny_pretrain_writes_a_loadable_target(small_root, tmp_path):
    from transformers import AutoTokenizer

    from dflash.target.model import Target, TargetConfig
    cfg = tiny_cfg(small_root, tmp_path)
    res = pretrain(cfg, prompts=[("f", "def add(a, b):\n")], command="pytest")
    m, out = res["metrics"], Path(res["out_dir"])
    assert out == (tmp_path / "target").resolve()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "dflash_target.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".target")]  # no temp dirs left
    meta = read_target_meta(out)
    assert meta["mask_token_id"] == 2 and meta["corpus"]["fingerprint"] == load_corpus(cfg.corpus).fingerprint
    assert meta["model"]["layer_types"] == "LLLA" and meta["gdn_kernels"]["choice"] == "torch"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # held-out loss went down over the run (val curve in the jsonl), and beats a unigram model
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [e["eval/val_loss"] for e in evals if "eval/val_loss" in e]
    assert len(val) >= 3 and min(val[1:]) < val[0] - 0.5
    assert m["steps"] == 24 and m["stop_reason"] == "max_steps"
    assert m["test_loss"] < m["unigram_loss"] and m["test_ppl"] < m["unigram_ppl"]
    # the folder loads through the same code as any checkpoint
    target = Target(TargetConfig(path=str(out), mask_token_id=meta["mask_token_id"], layer_ids=[0, 1, 2]))
    assert target.vocab_size == 384 and target.mask_token_id == 2
    ids = torch.tensor([target.tokenizer.encode("import os\n")])
    batch = target.forward_features(ids)
    assert batch.features_BTLH.shape == (1, ids.shape[1], 3, 32)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.mask_token_id == 2 and tok.decode(tok.encode(CODE)) == CODE
    # results: the continuation is the shipped target's own greedy output
    from dflash.data.regen import greedy_generate
    (c,) = res["continuations"]
    want = greedy_generate(target, torch.tensor([target.tokenizer.encode("def add(a, b):\n")]), 4)[0].tolist()
    assert c["continuation_ids"] == want
    md = Path(cfg.results_path).read_text()
    assert "pytest" in md and "unigram" in md and "def add(a, b):" in md


def test_time_budget_is_a_hard_stop_that_still_writes(small_root, tmp_path):
    cfg = tiny_cfg(small_root, tmp_path, max_steps=10 ** 6, time_budget_s=5.0, finalize_reserve_s=1.0,
                   eval_every=0, results_path="")
    res = pretrain(cfg)
    assert res["metrics"]["stop_reason"] == "time budget" and 0 < res["metrics"]["steps"] < 10 ** 6
    assert (Path(res["out_dir"]) / "model.safetensors").is_file()
    assert res["metrics"]["wall_seconds"] < 30


def test_size_limit_is_checked_before_training(small_root, tmp_path):
    cfg = tiny_cfg(small_root, tmp_path, max_bf16_bytes=10_000)
    with pytest.raises(ValueError, match="max_bf16_bytes"):
        pretrain(cfg)
    assert not (tmp_path / "target").exists()


def test_command_line_overrides(tmp_path):
    from experiments.pretrain_target import OverrideError, build_config, eval_prompts
    cfg = build_config(["time_budget_s=600", "batch_size=48", "corpus.heldout_per_10k=500", "keep_best=false",
                        "layer_ids=[1,3,5]", "tracking.enabled=false", "--out", str(tmp_path / "o")])
    assert cfg.time_budget_s == 600.0 and cfg.batch_size == 48 and cfg.corpus.heldout_per_10k == 500
    assert cfg.keep_best is False and cfg.layer_ids == [1, 3, 5] and not cfg.tracking.enabled
    assert cfg.out_dir == str(tmp_path / "o") and cfg.results_path == "benchmarks/reference_target.md"
    for bad in (["nope=1"], ["batch_size=1.5"], ["corpus=3"], ["keep_best=maybe"], ["batch_size"]):
        with pytest.raises(OverrideError):
            build_config(bad)
    prompts = eval_prompts()
    assert prompts and all(isinstance(n, str) and p.strip() for n, p in prompts)


def test_two_resumed_jobs_equal_one_run(small_root, tmp_path):
    """Jobs that resume the run's checkpoint add up to the same training as one job (same weights)."""
    from safetensors.torch import load_file
    one = tiny_cfg(small_root, tmp_path / "one", results_path="", token_cache_dir=str(tmp_path / "tok"))
    r1 = pretrain(one)
    two = tiny_cfg(small_root, tmp_path / "two", results_path="", job_max_steps=10,
                   token_cache_dir=str(tmp_path / "tok"), probes={"bisect": str(STDLIB / "bisect.py")})
    first = pretrain(two)
    assert first["metrics"]["steps"] == 10 and first["metrics"]["stop_reason"] == "job_max_steps"
    second = pretrain(two)
    m = second["metrics"]
    assert m["steps"] == 20 and pretrain(two)["metrics"]["steps"] == 24 and m["jobs"] == 2
    last = pretrain(two)  # a finished run: no more steps, the same folder again
    assert last["metrics"]["steps"] == 24 and last["metrics"]["stop_reason"] == "max_steps"
    w1 = load_file(str(Path(r1["out_dir"]) / "model.safetensors"))
    w2 = load_file(str(Path(last["out_dir"]) / "model.safetensors"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert last["metrics"]["test_loss"] == r1["metrics"]["test_loss"]
    assert last["probes"]["bisect"]["files"] == 1 and last["probes"]["bisect"]["ppl"] > 1
    # a checkpoint of another model shape is refused, naming the key
    with pytest.raises(ValueError, match="hidden_size"):
        pretrain(tiny_cfg(small_root, tmp_path / "two", hidden_size=48, results_path=""))


def test_intermediate_jobs_only_checkpoint_and_the_last_one_finalizes(small_root, tmp_path):
    """finalize_every_job=false: a job that stops early writes its checkpoint and no folder; the job that
    reaches max_steps scores and writes as a one-job run does."""
    cfg = tiny_cfg(small_root, tmp_path, results_path="", job_max_steps=10, finalize_every_job=False,
                   token_cache_dir=str(tmp_path / "tok"))
    first = pretrain(cfg)
    assert first["intermediate"] and first["metrics"]["steps"] == 10
    assert Path(first["checkpoint"]).is_file() and not (Path(cfg.out_dir) / "model.safetensors").exists()
    last = pretrain(tiny_cfg(small_root, tmp_path, results_path="", finalize_every_job=False,
                             token_cache_dir=str(tmp_path / "tok")))
    assert not last.get("intermediate") and last["metrics"]["steps"] == 24 and last["metrics"]["jobs"] == 2
    assert (Path(cfg.out_dir) / "model.safetensors").is_file() and last["metrics"]["test_loss"] > 0


def test_compiled_training_loss_equals_eager_and_bad_modes_are_refused(small_root, tmp_path):
    from dflash.pretrain.config import validate_pretrain_config
    from dflash.pretrain.loop import training_loss_fn
    from dflash.pretrain.model import GdnKernels, build_hf_config, build_model
    with pytest.raises(ValueError, match="pretrain.compile='fast'"):
        validate_pretrain_config(tiny_cfg(small_root, tmp_path, compile="fast"))
    cfg = tiny_cfg(small_root, tmp_path, num_layers=4, seq_len=64)
    GdnKernels("qwen3_5").use_torch()  # what the recipe trains with on CPU
    model = build_model(build_hf_config(cfg, cfg.vocab_size, 1, 0), 0)
    ids = torch.randint(3, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    eager = training_loss_fn(cfg, model, None)(ids)
    compiled = training_loss_fn(tiny_cfg(small_root, tmp_path, compile="default"), model, None)(ids)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_probe_perplexity_carries_a_window_bootstrap_interval(small_root, tmp_path):
    """perplexity_on_texts: the pooled loss of its windows equals evaluate_nll's, and the 95% interval over
    windows brackets the point estimate (a probe of 2 files, 24 windows, is read against a goal with it)."""
    from dflash.pretrain.evaluate import eval_windows, evaluate_nll, perplexity_on_texts, window_nlls
    from dflash.pretrain.model import build_hf_config, build_model
    cfg = tiny_cfg(small_root, tmp_path)
    tok = train_tokenizer([CODE * 20], vocab_size=cfg.vocab_size)
    model = build_model(build_hf_config(cfg, tok.get_vocab_size(), 1, 0), 0)
    texts = [(STDLIB / n).read_text() for n in ("bisect.py", "colorsys.py")]
    p = perplexity_on_texts(model, tok, texts, 64, 4, None, torch.device("cpu"))
    lo, hi = p["ppl_ci"]
    assert p["windows"] > 2 and lo < p["ppl"] < hi
    from dflash.data.corpus import encode_documents
    ids = torch.tensor([t for doc in encode_documents(tok, texts) for t in doc])
    wins = eval_windows(ids, 64, 0)
    per = window_nlls(model, wins, 4, None, torch.device("cpu"))
    s, n = evaluate_nll(model, wins, 3, None, torch.device("cpu"))  # another batching, the same sums
    assert len(per) == len(wins) and n == sum(c for _, c in per)
    assert abs(s - sum(v for v, _ in per)) < 1e-3 * abs(s)


def test_lookup_tau_reports_the_copy_rate_of_the_continuations():
    from dflash.pretrain.evaluate import lookup_tau
    prompt = list(range(20))
    conts = [{"name": "loops", "prompt_ids": prompt, "continuation_ids": list(prompt)},  # the prompt again: all copied
             {"name": "new", "prompt_ids": prompt, "continuation_ids": list(range(100, 120))}]  # nothing copied
    out = lookup_tau(conts, draft_len=15)
    assert out["copy_ngram"] == 8 and out["copy_rate"] == pytest.approx(0.5)
    assert out["per_prompt"]["loops"] > out["per_prompt"]["new"] == 1.0  # copying is what prompt lookup accepts
