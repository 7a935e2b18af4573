"""`python -m experiments.eval A B` (paired Δτ on one ground truth), the held-out suite, and the trainer's
evaluator with extra suites, eval/tau_train and the generalization-gap warning (issue 19)."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation import EvalConfig, HeldoutSuiteConfig, StopConfig, validate_eval_config
from dflash.evaluation.evaluator import SuiteEvaluator
from dflash.evaluation.heldout import build_heldout_tasks, corpus_config, heldout_tasks
from dflash.evaluation.prompts import Task, resolve_suite
from dflash.serving.export import save_drafter
from dflash.target.model import TargetConfig, read_target_info, resolve_layer_ids, resolve_mask_token

pytest.importorskip("hydra")
from experiments import eval as eval_cli  # noqa: E402

SMALL = HeldoutSuiteConfig(num_prompts=3, max_new_tokens=5, max_prompt_chars=200, source="corpus")


def _drafter(tcfg: TargetConfig, seed: int, bs: int = 4):
    info = read_target_info(tcfg)
    torch.manual_seed(seed)
    return build_drafter(DrafterConfig(block_size=bs), info.hidden_size, info.num_layers,
                         resolve_mask_token(tcfg), resolve_layer_ids(tcfg, info))


def test_heldout_suite_comes_from_heldout_files_and_is_cached(tmp_path):
    from dflash.data.corpus import load_corpus, split_of
    cfg = HeldoutSuiteConfig(num_prompts=12, source="corpus")
    tasks = build_heldout_tasks(cfg)
    assert len(tasks) == 12 and len({t.name for t in tasks}) == 12
    heldout = {d.path.removesuffix(".py").replace("/", ".") for d in load_corpus(corpus_config(cfg)).heldout}
    for t in tasks:
        assert any(t.name.startswith(p + ".") for p in heldout)  # every prompt from a held-out file
        assert t.prompt.lstrip().startswith(("def ", "class ", "async def ", "@"))
        assert cfg.min_prompt_chars <= len(t.prompt) <= cfg.max_prompt_chars
    assert split_of("json/decoder.py", 1000, "dflash-corpus-v1") in ("train", "val", "test")
    cached = heldout_tasks(cfg, str(tmp_path))
    assert cached == tasks and len(list((tmp_path / "suites").glob("heldout-*.json"))) == 1
    assert heldout_tasks(cfg, str(tmp_path)) == tasks  # from the cache file
    s = resolve_suite("heldout", EvalConfig(heldout=cfg, cache_dir=str(tmp_path)))
    assert s.name == "heldout" and s.max_new_tokens == 256 and s.tasks == tasks
    with pytest.raises(ValueError, match="eval.heldout.split"):
        validate_eval_config(EvalConfig(heldout=HeldoutSuiteConfig(split="train")))
    with pytest.raises(ValueError, match="twice"):
        validate_eval_config(EvalConfig(suite="heldout", extra_suites=["heldout"]))


def test_evaluator_extra_suites_and_train_gap(reference_target, tmp_path, caplog):
    """At a sampled setting (T=1, 2 samples a prompt) with greedy beside it: every name says its setting, the
    objective is eval/tau_served, trees are T=0 only, and the CIs count prompts, not samples."""
    from dflash.target.sampling import SamplingConfig
    target = reference_target
    cfg = EvalConfig(max_new_tokens=6, tree_budgets=[2], subset=1, cache_dir=str(tmp_path / "gt"),
                     extra_suites=["heldout"], heldout=SMALL, train_tasks=2, bootstrap=200,
                     sampling=SamplingConfig(1.0, 1.0, 0), samples=2,
                     stop=StopConfig(dedent=[]))  # random bytes leave a body at once: one token, no rounds
    ev = SuiteEvaluator(cfg, tasks=[Task("a", "def a(x):\n"), Task("b", "class B:\n")])
    ev.use_train_sequences([torch.tensor(target.tokenizer.encode("import os\n\ndef f(x):\n    return x\n"))] * 3)
    d = _drafter(target.cfg, 0)
    d.attach_target_head(target.embed_weight(), target.lm_head_weight())
    m = ev(d, target, 1, False)  # in training: the subset at the served setting, under its own names
    assert m["eval/subset/t1/argmax/num_prompts"] == 1 and m["eval/subset/t1/argmax/num_tasks"] == 2
    assert not any(k.startswith(("eval/suite/", "eval/subset/t0/")) for k in m)
    assert m["eval/subset/tau_served"] == m["eval/subset/t1/argmax/tau_vanilla"]
    assert m["eval/subset/t1/argmax/tau_train_gap"] == pytest.approx(m["eval/subset/t1/argmax/tau_train"]
                                                              - m["eval/subset/tau_served"])
    for k in ("eval/subset/t1/argmax/tau_vanilla_ci_low", "eval/subset/t1/argmax/tau_prompt_lookup",
              "eval/subset/t1/argmax/tau_over_prompt_lookup", "eval/subset/t1/argmax/gt_in_repeat16"):
        assert k in m
    assert "eval/subset/t1/argmax/tree_nodes_2" not in m  # trees: T=0 only
    m = ev(d, target, 2, True)
    assert m["eval/t1/argmax/num_prompts"] == 2 and m["eval/suite/heldout/t1/argmax/num_prompts"] == 3
    assert m["eval/suite/heldout/t1/argmax/num_tasks"] == 6 and m["eval/suite/heldout/t0/num_tasks"] == 3
    assert m["eval/suite/coding10/t1/argmax/tau_vanilla"] == m["eval/t1/argmax/tau_vanilla"] == m["eval/tau_served"]
    assert "eval/t0/tree_nodes_2" in m and "eval/t1/argmax/tree_nodes_2" not in m
    assert m["eval/served_temperature"] == 1.0 and "eval/tau_vanilla" not in m
    lo, hi = m["eval/suite/heldout/t1/argmax/tau_vanilla_ci_low"], m["eval/suite/heldout/t1/argmax/tau_vanilla_ci_high"]
    assert lo <= m["eval/suite/heldout/t1/argmax/tau_vanilla"] <= hi
    # the gap warning: in-training held-out τ falls while the train τ holds
    ev._history = [(0, m["eval/t1/argmax/tau_train"], m["eval/tau_served"] + 1.0)]
    with caplog.at_level(logging.WARNING, logger="dflash.evaluation.evaluator"):
        ev._warn_on_gap(3, m["eval/t1/argmax/tau_train"], m["eval/tau_served"])
    assert "generalization gap grows" in caplog.text


def test_compare_two_drafters_on_one_ground_truth(tmp_path):
    tcfg = TargetConfig()
    (tmp_path / "suite.json").write_text(json.dumps([{"name": f"t{i}", "prompt": f"def f{i}(x):\n"}
                                                     for i in range(4)]))
    for name, seed in (("a", 0), ("b", 1)):
        save_drafter(_drafter(tcfg, seed), tmp_path / name)
    common = ["+target=tiny_random", "tracking.enabled=false", "target.device=cpu", "eval.extra_suites=[]",
              f"eval.suite={tmp_path / 'suite.json'}", "eval.max_new_tokens=8", "eval.tree_budgets=[2]",
              "eval.bootstrap=300", f"eval.cache_dir={tmp_path / 'gt'}"]
    same = eval_cli.main([str(tmp_path / "a"), str(tmp_path / "a"), *common, f"--out={tmp_path / 'o1'}"])
    assert same["eval/t0/compare/delta_tau_vanilla"] == 0.0
    assert same["eval/t0/compare/delta_tau_vanilla_ci_low"] == same["eval/t0/compare/delta_tau_vanilla_ci_high"] == 0.0
    other = eval_cli.main([str(tmp_path / "a"), str(tmp_path / "b"), *common, f"--out={tmp_path / 'o2'}"])
    assert other["eval/t0/compare/delta_tau_vanilla_ci_low"] <= other["eval/t0/compare/delta_tau_vanilla"] \
        <= other["eval/t0/compare/delta_tau_vanilla_ci_high"]
    assert "eval/suite/suite/t0/compare/delta_tau_tree_2" in other
    saved = json.loads((tmp_path / "o2" / "report" / "compare.json").read_text())
    assert saved["suites"][0]["prompts"] == 4
    assert "Δ tree-2 nodes" in (tmp_path / "o2" / "report" / "compare.md").read_text()
    # the least-degenerate rows: at least a quarter of the tasks, the same for both drafters (one ground truth)
    assert same["eval/t0/compare/least_degenerate/delta_tau_vanilla"] == 0.0
    ld = saved["suites"][0]["least_degenerate"]
    assert 1 <= ld["tasks"] <= 4 and ld["tau_vanilla"][1] <= ld["tau_vanilla"][0] <= ld["tau_vanilla"][2]
    assert other["eval/t0/compare/least_degenerate/delta_tau_vanilla"] == ld["tau_vanilla"][0]
    assert "least-degenerate rows" in (tmp_path / "o2" / "report" / "compare.md").read_text()


def test_notebook_ci_table_reads_the_interval_keys():
    pd = pytest.importorskip("pandas")
    from dflash.tracking.analysis import ci_table
    runs = pd.DataFrame([{"run_name": "r1", "loss": "hard_ce", "eval/tau_vanilla": 2.1,
                          "eval/tau_vanilla_ci_low": 1.9, "eval/tau_vanilla_ci_high": 2.3,
                          "eval/tau_prompt_lookup": 1.5, "eval/tau_over_prompt_lookup": 1.4,
                          "eval/suite/heldout/tau_vanilla": 1.8, "eval/suite/heldout/tau_vanilla_ci_low": 1.7,
                          "eval/suite/heldout/tau_vanilla_ci_high": 1.95}])
    t = ci_table(runs)
    assert list(t["suite"]) == ["objective", "heldout"]
    assert t.iloc[0]["tau_vanilla"] == "2.10 [1.90, 2.30]" and t.iloc[0]["tau_prompt_lookup"] == "1.50"
    assert t.iloc[0]["tau_over_prompt_lookup"] == "1.40" and t.iloc[1]["tau_vanilla"] == "1.80 [1.70, 1.95]"
