"""The engine's proposal policy (docs/evaluation.md, "The engine's proposal policy"): which policy each engine
serves per drafter kind, argmax drafts scored as the engines verify them, both policies side by side, the metric
names, the real loop under argmax drafts, and the gate refusing to compare two engines' τ."""
from __future__ import annotations

import random

import pytest
import torch

from dflash.evaluation import EvalConfig, validate_eval_config
from dflash.evaluation.acceptance import simulate_task
from dflash.evaluation.engines import ENGINES, resolve_policy, serving_identity, setting_label
from dflash.evaluation.ground_truth import TaskTruth
from dflash.target.sampling import GREEDY, Sampling, SamplingConfig

from tests.test_eval_sampling import ALPHA, SupportDrafter, _drafter, _exact_law, _pvalue


def test_each_engine_names_its_policy_per_drafter_kind():
    assert resolve_policy("vllm", "auto", dflash2=False) == "argmax"
    assert resolve_policy("vllm", "auto", dflash2=True) == "sampled"
    assert resolve_policy("sglang", "auto", dflash2=False) == "argmax"
    assert resolve_policy("llamacpp", "auto", dflash2=True) == "argmax"
    assert resolve_policy("textbook", "auto", dflash2=False) == "sampled"
    with pytest.raises(ValueError, match="serves no DFlash 2"):
        resolve_policy("zlab", "auto", dflash2=True)
    assert resolve_policy("llamacpp", "sampled", dflash2=True) == "sampled"  # the override wins
    assert all(rule.source for rule in ENGINES.values())
    assert setting_label(Sampling(1.0), "argmax") == "t1/argmax" and setting_label(GREEDY, "sampled") == "t0"
    assert serving_identity("vllm", "auto") != serving_identity("vllm", "argmax")


@pytest.mark.parametrize("key,value,needle", [("engine", "tgi", "eval.engine"), ("proposal", "top2", "eval.proposal")])
def test_bad_engine_or_proposal_names_the_key(key, value, needle):
    cfg = EvalConfig(**{key: value})
    with pytest.raises(ValueError, match=needle):
        validate_eval_config(cfg)


class ScriptedProposer:
    """Fixed logits per round start: position k's argmax is the path's token when `hit[p][k]`, else another."""

    def __init__(self, truth: TaskTruth, bs: int, vocab: int, seed: int):
        self.rng, self.bs, self.vocab, self.truth = random.Random(seed), bs, vocab, truth

    def __call__(self, truth, p):
        toks = truth.tokens.tolist()
        out = torch.randn(self.bs - 1, self.vocab, generator=torch.Generator().manual_seed(p))
        for k in range(1, self.bs):
            if p + k < len(toks) and self.rng.random() < 0.7:
                out[k - 1, toks[p + k]] = 20.0
        return out


def _plain_argmax_taus(truth: TaskTruth, logits_at: dict[int, torch.Tensor], bs: int) -> list[int]:
    """The engines' rule written out: argmax drafts, accepted while each equals the path's next token."""
    toks, P, N = truth.tokens.tolist(), truth.prompt_len, truth.n_new
    taus, p = [], P
    while p - P < N - 1:
        draft = logits_at[p].argmax(-1).tolist()
        left = min(bs - 1, N - 1 - (p - P))
        m = 0
        while m < left and draft[m] == toks[p + 1 + m]:
            m += 1
        taus.append(m + 1)
        p += m + 1
    return taus


def test_argmax_policy_matches_a_plain_reference_on_a_sampled_path():
    """At T = 1 under argmax drafts the simulated rounds are the engines' rule: no acceptance coins, a draft
    kept iff it is the sampled path's token (the path's p does not enter)."""
    bs, vocab = 5, 50
    g = torch.Generator().manual_seed(0)
    cont = torch.randint(0, vocab, (60,), generator=g)
    truth = TaskTruth("t", torch.tensor([1, 2, 3]), cont, torch.empty(0), path_p=torch.rand(60, generator=g))
    prop = ScriptedProposer(truth, bs, vocab, seed=1)
    seen: dict[int, torch.Tensor] = {}

    def recording(tr, p):
        seen[p] = prop(tr, p)
        return seen[p]
    res = simulate_task(truth, recording, bs, sampling=GREEDY)  # the evaluator scores argmax with the T = 0 rule
    assert res.taus_vanilla == _plain_argmax_taus(truth, seen, bs)
    assert 1 < res.tau_vanilla < bs  # drafts both kept and cut


@torch.no_grad()
def test_argmax_drafts_are_lossless_in_the_real_loop(byte_target):
    """The real loop proposing argmax drafts at T = 1 (verified as point masses) commits the target's own law."""
    from dflash.evaluation.sampled_decode import sampled_speculative_decode
    s, prompt, n = Sampling(1.0, 1.0, 2), [5, 17, 33, 2, 9], 3
    law = _exact_law(byte_target, prompt, s, n)
    likely = sorted({t for seq in law for t in seq})
    drafter = SupportDrafter(likely[:1], byte_target.vocab_size, bs=4)  # argmax: always the same likely token
    counts = dict.fromkeys(law, 0)
    taus = []
    for seed in range(250):
        r = sampled_speculative_decode(drafter, byte_target, prompt, n, s, torch.Generator().manual_seed(seed),
                                       proposal="argmax")
        counts[tuple(r.tokens)] += 1
        taus += r.taus
    keys = sorted(law)
    assert _pvalue([counts[k] for k in keys], [law[k] for k in keys]) > ALPHA
    assert 1 < sum(taus) / len(taus) < n


def _cfg(**kw) -> EvalConfig:
    return EvalConfig(max_new_tokens=12, tree_budgets=[], samples=2, cache_dir="", bootstrap=200,
                      sampling=SamplingConfig(1.0, 1.0, 0), train_tasks=0, extra_suites=[], **kw)


def _tasks():
    from dflash.evaluation.prompts import Task
    return [Task(f"p{i}", text) for i, text in enumerate(["def f(x):", "import os\n", "class A:\n  ", "x = [1, 2"])]


@torch.no_grad()
def test_both_policies_side_by_side_and_the_objective_is_the_engines(byte_target):
    from dflash.evaluation.evaluator import evaluate_suites, merged_metrics, summary_table
    from dflash.evaluation.prompts import Suite
    from dflash.evaluation.protocol import OBJECTIVE, served_label
    drafter = _drafter(byte_target, bs=4, seed=5)
    suite = Suite("mini", _tasks(), 12)
    reports = evaluate_suites(drafter, byte_target, _cfg(), [suite])
    settings = [r.info["setting"] for r in reports]
    assert settings == ["t1/argmax", "t1/sampled", "t0"]
    assert reports[0].info["engine"] == "vllm" and "argmax drafts (vllm's policy)" in reports[0].headline()
    assert "drafts sampled from q (not vllm's policy)" in reports[1].headline()
    m = merged_metrics(reports)
    assert m[OBJECTIVE] == m["eval/t1/argmax/tau_vanilla"] and m["eval/served_proposal"] == 1.0
    assert "eval/t1/sampled/tau_vanilla" in m and "eval/t1/tau_vanilla" not in m
    assert served_label(m) == "t1/argmax"
    assert reports[0].info["ground_truth_key"] == reports[1].info["ground_truth_key"]  # the same paths
    table = summary_table(m)
    assert "t1/argmax" in table and "t1/sampled" in table
    # the textbook rule is the old objective: drafts sampled from q
    old = merged_metrics(evaluate_suites(drafter, byte_target, _cfg(engine="textbook", both_policies=False), [suite]))
    assert old[OBJECTIVE] == m["eval/t1/sampled/tau_vanilla"] and old["eval/served_proposal"] == 0.0


def test_the_gate_refuses_two_engines_but_compares_two_kinds_under_one():
    from dflash.serving.promotion import policy_mismatch
    vllm_d1 = {"info": {"setting": "t1/argmax", "serving": "vllm"}}
    vllm_d2 = {"info": {"setting": "t1/sampled", "serving": "vllm"}}
    llama = {"info": {"setting": "t1/argmax", "serving": "llamacpp"}}
    old = {"info": {"setting": "t1"}}  # before eval.engine: drafts sampled from q
    assert policy_mismatch(vllm_d1, vllm_d2) == ""
    assert "llamacpp" in policy_mismatch(llama, vllm_d1)
    assert "textbook" in policy_mismatch(vllm_d1, old)
    assert policy_mismatch({"info": {"setting": "t0", "serving": "vllm"}}, {"info": {"setting": "t0"}}) == ""


def test_eval_pairs_two_kinds_under_their_engines_policies():
    from experiments.eval import report_pairs

    class R:
        def __init__(self, suite, setting):
            self.info = {"suite_label": suite, "setting": setting, "engine": "vllm"}
    a = [R("heldout", "t1/argmax"), R("coding10", "t1/argmax"), R("heldout", "t1/sampled"), R("heldout", "t0")]
    b = [R("heldout", "t1/sampled"), R("coding10", "t1/sampled"), R("heldout", "t1/argmax"), R("heldout", "t0")]
    got = [(ra.info["setting"], rb.info["setting"], label) for ra, rb, label in report_pairs(a, b)]
    assert got == [("t1/argmax", "t1/argmax", "t1/argmax"), ("t1/sampled", "t1/sampled", "t1/sampled"),
                   ("t0", "t0", "t0")]
    b2 = [R("heldout", "t1/sampled"), R("coding10", "t1/sampled"), R("heldout", "t0")]  # no other policy
    got2 = [(ra.info["setting"], rb.info["setting"], label) for ra, rb, label in report_pairs(a[:1] + a[3:], b2)]
    assert got2 == [("t1/argmax", "t1/sampled", "t1/vllm"), ("t0", "t0", "t0")]
