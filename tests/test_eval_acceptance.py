"""Simulated rounds (dflash.evaluation.acceptance) with hand-built proposers on synthetic ground truth."""
from __future__ import annotations

import torch

from dflash.evaluation.acceptance import oracle_proposer, simulate, simulate_task, wrong_proposer
from dflash.evaluation.ground_truth import TaskTruth

V = 50


def _truth(name="t", P=7, N=13, seed=0) -> TaskTruth:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (P + N,), generator=g)
    return TaskTruth(name, ids[:P], ids[P:], torch.randn(P + N, 2, 8, generator=g))


def test_oracle_gives_tau_equal_block_size():
    bs = 4
    tr = _truth(N=3 * bs + 1)  # N-1 = 12 tokens after the first anchor: exactly 3 full rounds
    r = simulate_task(tr, oracle_proposer(bs, V), bs, budgets=[1, 4, 8])
    assert r.taus_vanilla == [bs] * 3
    assert r.taus_tree[4] == [4, 4, 4] and r.taus_tree[8] == [4, 4, 4]
    assert r.taus_tree[1] == [2] * 6  # a budget-1 tree is a single node: τ = 2 per round
    assert r.reached == [3, 3, 3] and r.accepted == [3, 3, 3]


def test_oracle_last_round_is_clipped():
    bs = 4
    tr = _truth(N=9)  # 8 tokens after the first anchor: rounds 4, 4 then nothing left
    assert simulate_task(tr, oracle_proposer(bs, V), bs).taus_vanilla == [4, 4]
    tr = _truth(N=7)  # 6 after the anchor: 4, then only 2 left -> τ = 3 (clipped)
    r = simulate_task(tr, oracle_proposer(bs, V), bs)
    assert r.taus_vanilla == [4, 3]
    assert sum(r.taus_vanilla) == tr.n_new  # the rounds produce exactly the continuation (+ clipped bonus)
    assert r.reached == [2, 2, 1] and r.accepted == [2, 2, 1]


def test_always_wrong_gives_tau_one():
    bs, N = 5, 10
    res = simulate([_truth("a", N=N), _truth("b", N=N, seed=1)], wrong_proposer(bs, V), bs, budgets=[4, 8])
    for r in res:
        assert r.taus_vanilla == [1] * (N - 1)
        assert r.taus_tree[4] == [1] * (N - 1) and r.taus_tree[8] == [1] * (N - 1)
        assert r.reached == [N - 1, 0, 0, 0] and r.accepted == [0, 0, 0, 0]


def test_partial_proposer_and_per_position_rates():
    """Wrong exactly at block position 3: every round accepts 2 (τ = 3), position 3 never accepted."""
    bs = 5
    oracle = oracle_proposer(bs, V)

    def prop(truth, p):
        logits = oracle(truth, p)
        logits[2] = 0
        logits[2, (truth.tokens[p + 3].item() + 1) % V if p + 3 < len(truth.tokens) else 0] = 10.0
        return logits

    tr = _truth(N=3 * 3 + 1)
    r = simulate_task(tr, prop, bs, budgets=[8])
    assert r.taus_vanilla == [3, 3, 3]
    assert r.reached == [3, 3, 3, 0] and r.accepted == [3, 3, 0, 0]
    # the tree's second choice at depth 3 is the zero-logit tie; it may or may not be the truth, but τ ≥ 3
    assert all(t >= 3 for t in r.taus_tree[8])


def test_proposals_are_computed_once_per_position():
    bs, calls = 4, []
    oracle = oracle_proposer(bs, V)

    def counting(truth, p):
        calls.append(p)
        return oracle(truth, p)

    simulate_task(_truth(N=13), counting, bs, budgets=[4, 8, 16])
    assert sorted(calls) == sorted(set(calls))  # vanilla and each tree reuse the memoised proposals
