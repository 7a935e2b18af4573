"""Headroom beside every τ (dflash/evaluation/headroom.py): the oracle that drafts from the target's own marginals,
the share of rounds reaching each block position, the target's entropy along the ground truth, the gap closed."""
from __future__ import annotations

import math

import torch

from dflash.evaluation import EvalConfig, OracleConfig
from dflash.evaluation.ground_truth import TruthSpec, build_ground_truth
from dflash.evaluation.headroom import MarginalOracle, gap_closed, oracle_and_entropy
from dflash.evaluation.prompts import Task
from dflash.evaluation.protocol import stop_ids
from dflash.evaluation.report import evaluate
from dflash.target.sampling import Sampling, SamplingConfig, warp

from tests.test_eval_sampling import _drafter

T1 = Sampling(1.0, 1.0, 0)
TASKS = [Task(f"p{i}", text) for i, text in enumerate(["def f(x):", "import os\n", "class A:\n  "])]


@torch.no_grad()
def test_the_oracles_marginal_is_the_targets_own(byte_target):
    """q_1 is the target's conditional exactly; q_2 from 400 samples lies within sampling noise of the exact marginal
    sum_x p(x | prefix) p(v | prefix, x) over the whole vocabulary, far closer than the conditional at 1 or at 2
    after one sampled token is (T = 0.3 sharpens the tiny random target's distributions)."""
    s = Sampling(0.3, 1.0, 0)
    truth = build_ground_truth(byte_target, TASKS[:1], 8, TruthSpec(s, 1, 0, ()))[0]
    p = truth.prompt_len
    q = MarginalOracle(byte_target, s, 400, 3, seed=1).marginals(truth, p)  # K = 2
    prefix = truth.tokens[:p + 1]
    p1 = warp(byte_target.logits(prefix[None])[0, -1], s)
    assert torch.allclose(q[0], p1, atol=1e-5)
    rows = torch.cat([prefix.expand(p1.numel(), -1), torch.arange(p1.numel())[:, None]], 1)
    cond = warp(byte_target.logits(rows)[:, -1], s)  # p(v | prefix, x) for every x
    exact = (p1[:, None] * cond).sum(0)
    tv = lambda a, b: float(0.5 * (a - b).abs().sum())  # noqa: E731
    one = cond[int(p1.argmax())]  # the conditional after the likeliest first token alone
    assert tv(q[1], exact) < 0.25 * min(tv(p1, exact), tv(one, exact))


def test_the_oracle_is_scored_by_the_rule_and_cached(byte_target, tmp_path):
    truths = build_ground_truth(byte_target, TASKS, 12, TruthSpec(T1, 2, 0, ()))
    oracle, entropy, seconds = oracle_and_entropy(byte_target, truths, T1, 4, 0, 4, "sampled", "gt", str(tmp_path))
    assert seconds > 0 and len(entropy) == sum(t.n_new for t in truths) and min(entropy) >= 0
    for r in oracle:  # q_1 = p_1: the min(1, q/p) coin at position 1 always accepts
        assert r.accepted[0] == r.reached[0] > 0
    again, entropy2, seconds2 = oracle_and_entropy(byte_target, truths, T1, 4, 0, 4, "sampled", "gt", str(tmp_path))
    assert seconds2 == 0.0 and entropy2 == entropy and [r.taus_vanilla for r in again] == [r.taus_vanilla for r in oracle]
    argmax, _, s3 = oracle_and_entropy(byte_target, truths, T1, 4, 0, 4, "argmax", "gt", str(tmp_path))
    assert s3 > 0  # another policy, another cache entry
    for r in argmax:  # argmax: accepted only where the argmax is the path's token, so not every position 1
        assert all(a <= n for a, n in zip(r.accepted, r.reached))
    assert sum(r.accepted[0] for r in argmax) < sum(r.reached[0] for r in argmax)


def test_every_evaluation_reports_its_headroom(byte_target, tmp_path):
    cfg = EvalConfig(max_new_tokens=12, tree_budgets=[], samples=2, cache_dir=str(tmp_path), bootstrap=200,
                     sampling=SamplingConfig(1.0, 1.0, 0), oracle=OracleConfig(samples=4),
                     engine="textbook")  # drafts sampled from q: the oracle's too (argmax of a flat marginal: τ 1)
    rep = evaluate(_drafter(byte_target), byte_target, cfg, TASKS, spec=TruthSpec(T1, 2, 0, stop_ids(byte_target)))
    st, m = rep.stats, rep.metrics
    rounds = m["eval/rounds"]
    assert st["eval/reach_pos01"] == 1.0 and 0 <= st["eval/reach_pos03"] <= st["eval/reach_pos02"] <= 1
    assert st["eval/reach_pos02"] == sum(r.reached[1] for r in rep.results) / rounds
    assert st["eval/tau_oracle_ci_low"] <= st["eval/tau_oracle"] <= st["eval/tau_oracle_ci_high"]
    assert st["eval/tau_oracle"] > st["eval/tau_prompt_lookup"]
    assert math.isclose(st["eval/oracle_gap_closed"], gap_closed(m["eval/tau_vanilla"], st["eval/tau_prompt_lookup"],
                                                                 st["eval/tau_oracle"]))
    assert 0 <= st["eval/target_entropy_below_0.1"] <= 1 and st["eval/target_entropy_mean"] > 0
    assert "oracle τ" in rep.headline() and "share of rounds" in rep.to_markdown()
    assert "eval/reach_pos01" not in rep.suite_metrics()  # per position, as acc_pos: the table's, not the summary's
    greedy = evaluate(_drafter(byte_target), byte_target, cfg, TASKS, spec=TruthSpec(Sampling(), 1, 0, ()))
    # at T = 0 the marginal is the greedy path the ground truth is: every round accepts all it can (K = 3)
    taus = []
    for n in (row["new_tokens"] for row in greedy.table):
        p = 0
        while p < n - 1:
            taus.append(min(3, n - 1 - p) + 1)
            p += taus[-1]
    assert math.isclose(greedy.stats["eval/tau_oracle"], sum(taus) / len(taus))
