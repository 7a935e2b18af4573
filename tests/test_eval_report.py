"""evaluate() metrics and report, make_evaluator() for the trainer (dflash.evaluation.report)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation import EvalConfig, validate_eval_config
from dflash.evaluation.acceptance import oracle_proposer, wrong_proposer
from dflash.evaluation.prompts import Task
from dflash.evaluation.report import evaluate, make_evaluator
from dflash.tracking.loggers import Logger

TASKS = [Task("one", "def one():\n"), Task("two", "def two(x):\n    return"), Task("three", "x = [\n")]
BS = 4



@pytest.fixture(scope="module")
def target(reference_target):
    return reference_target


@pytest.fixture
def drafter(target):
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig(block_size=BS), target.hidden_size, target.info.num_layers,
                      target.mask_token_id, target.layer_ids)
    return d  # no target head attached: evaluate attaches it


@pytest.fixture
def cfg(tmp_path_factory):
    return EvalConfig(max_new_tokens=9, tree_budgets=[2, 4], subset=2,
                      cache_dir=str(tmp_path_factory.getbasetemp() / "gt-cache"))


class FakeLogger(Logger):
    def __init__(self):
        self.calls = []

    def log(self, metrics, step):
        self.calls.append(("log", dict(metrics), step))

    def log_dict(self, d, name):
        json.dumps(d)  # serialisable
        self.calls.append(("log_dict", d, name))

    def log_text(self, text, name):
        self.calls.append(("log_text", text, name))

    def log_figure(self, fig, name):
        import io
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        assert buf.getvalue().startswith(b"\x89PNG")
        self.calls.append(("log_figure", fig, name))


def test_evaluate_metric_keys_and_table(target, drafter, cfg):
    drafter.train()
    rep = evaluate(drafter, target, cfg, TASKS, real_decode=True)
    assert drafter.training  # mode restored
    m = rep.metrics
    want = {"eval/tau_vanilla", "eval/tau_tree_2", "eval/tau_tree_4", "eval/num_tasks", "eval/rounds",
            "eval/gt_consistency", "eval/gt_copy_rate", "eval/seconds", "eval/real/tau", "eval/real/lossless",
            "eval/real/tau_matches_sim", "eval/real/match_frac", "eval/real/tok_s", "eval/real/greedy_tok_s",
            "eval/real/speedup", "eval/num_prompts", "eval/gt_repeat4", "eval/gt_in_repeat16", "eval/gt_cycle_share",
            "eval/gt_mean_tokens"}
    want |= {f"eval/acc_pos{k:02d}" for k in range(1, BS) if rep.reached_pos[k - 1]}  # reached positions only
    want |= {f"eval/task/{t.name}/{s}" for t in TASKS for s in ("tau_vanilla", "tau_tree_2", "tau_tree_4")}
    assert set(m) == want
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    assert 1.0 <= m["eval/tau_vanilla"] <= BS and m["eval/num_tasks"] == 3
    assert m["eval/real/lossless"] == 1.0 and m["eval/real/tau_matches_sim"] == 1.0
    assert m["eval/real/tau"] == pytest.approx(m["eval/tau_vanilla"])
    assert [r["task"] for r in rep.table] == [t.name for t in TASKS]
    assert all(r["lossless"] and r["tau_matches_sim"] for r in rep.table)
    text = rep.console_table()
    assert "ALL (pooled)" in text and "τ tree-4" in text and "one" in text
    md = rep.to_markdown()
    assert md.startswith("| task |") and "Per-position acceptance" in md
    assert "| τ greedy (T=0) (" in md.splitlines()[0]  # the τ column is headed by its setting, never "τ vanilla"


def test_task_tables_escape_markdown():
    """tasks.md is rendered by MLflow: a task named `__future__` reads as itself, not in bold."""
    from dflash.evaluation.report import markdown_escape
    assert markdown_escape("__future__ *x* [a]|b") == r"\_\_future\_\_ \*x\* \[a\]\|b"


def test_copy_rate_counts_the_continuations_repeated_ngrams():
    from dflash.evaluation.prompt_lookup import copy_rate
    prompt = list(range(10))
    assert copy_rate(prompt + list(range(100, 120)), 10, n=4) == 0.0  # all new
    assert copy_rate(prompt + prompt + prompt, 10, n=4) == 1.0  # the prompt, twice more
    # a continuation that starts new and then repeats itself: its 4-grams at 10..23 are 14; the later 7 copy
    loop = [50, 51, 52, 53, 54, 55, 56]
    assert copy_rate(prompt + loop + loop + loop[:3], 10, n=4) == pytest.approx(7 / 14)
    assert math.isnan(copy_rate(prompt + [1, 2], 10, n=4))  # no whole n-gram in the continuation


def test_evaluate_with_oracle_and_wrong_proposers(target, drafter, cfg):
    # max_new_tokens = 9: 8 tokens after the first anchor = 2 full rounds of bs = 4 for the oracle
    rep = evaluate(drafter, target, cfg, TASKS, proposer=oracle_proposer(BS, target.vocab_size))
    assert rep.metrics["eval/tau_vanilla"] == BS and rep.metrics["eval/tau_tree_4"] == BS
    assert rep.acc_pos == [1.0] * (BS - 1)
    rep = evaluate(drafter, target, cfg, TASKS, proposer=wrong_proposer(BS, target.vocab_size))
    assert rep.metrics["eval/tau_vanilla"] == 1.0 and rep.metrics["eval/tau_tree_2"] == 1.0
    assert rep.metrics["eval/acc_pos01"] == 0.0 and rep.reached_pos[1:] == [0] * (BS - 2)


def test_make_evaluator_subset_then_final_with_artifacts(target, drafter, cfg, tmp_path):
    ev = make_evaluator(cfg, tasks=TASKS, out_dir=tmp_path / "eval")
    drafter.train()
    lg = FakeLogger()
    m = ev(drafter, target, 10, False, lg)
    assert drafter.training
    # the subset has its own names: one metric name never carries two prompt sets; every name says its setting
    # (a random target recommends greedy: t0 is the served setting, so no second setting beside it)
    assert m["eval/subset/t0/num_tasks"] == cfg.subset and not lg.calls  # cheap: no artifacts
    assert all(k.startswith("eval/subset/") for k in m) and "eval/subset/t0/tau_vanilla" in m
    assert m["eval/subset/tau_served"] == m["eval/subset/t0/tau_vanilla"]
    assert "eval/subset/t0/task/three/tau_vanilla" not in m and "eval/subset/t0/real/tau" not in m
    m = ev(drafter, target, 20, True, lg)
    assert drafter.training
    assert m["eval/t0/num_tasks"] == 3 and "eval/t0/task/three/tau_vanilla" in m
    assert m["eval/tau_served"] == m["eval/t0/tau_vanilla"] and m["eval/served_temperature"] == 0.0
    assert "eval/tau_vanilla" not in m  # the legacy name (greedy, fixed length) is never written again
    assert not any(k.startswith("eval/subset/") for k in m)
    names = {c[2]: c[0] for c in lg.calls}
    assert names == {"eval/served/tasks.json": "log_dict", "eval/served/tasks.md": "log_text",
                     "eval/served/acceptance_per_position.png": "log_figure"}
    table = next(c[1] for c in lg.calls if c[0] == "log_dict")
    assert [r["task"] for r in table["tasks"]] == ["one", "two", "three"]
    assert (tmp_path / "eval" / "served" / "acceptance_per_position.png").read_bytes().startswith(b"\x89PNG")
    # the trainer's current 4-argument call works too (no logger: no artifacts)
    assert ev(drafter, target, 30, False)["eval/subset/t0/num_tasks"] == cfg.subset
    assert make_evaluator(EvalConfig(enabled=False)) is None


def test_incompatible_drafter_is_refused(target, cfg):
    d = build_drafter(DrafterConfig(block_size=BS), target.hidden_size, target.info.num_layers,
                      target.mask_token_id, [1, 2])
    with pytest.raises(ValueError, match="target layers"):
        evaluate(d, target, cfg, TASKS)


def test_validate_eval_config():
    validate_eval_config(EvalConfig())
    for bad, match in [(dict(max_new_tokens=1), "max_new_tokens"), (dict(subset=0), "subset"),
                       (dict(tree_budgets=[4, 0]), "tree_budgets"), (dict(tree_budgets=[4, 4]), "duplicates"),
                       (dict(device="tpu"), "eval.device"), (dict(proposer="fast"), "eval.proposer")]:
        with pytest.raises(ValueError, match=match):
            validate_eval_config(EvalConfig(**bad))
    with pytest.raises(FileNotFoundError, match="eval.suite"):
        validate_eval_config(EvalConfig(suite="/no/such/file.json"))
