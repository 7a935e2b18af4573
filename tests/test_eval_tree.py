"""DDTree builder (dflash.evaluation.tree) against brute-force enumeration."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from dflash.evaluation.tree import build_tree, node_score, tree_accept_depth


def _random_logp(rng: random.Random, depth: int, k: int) -> list[list[float]]:
    rows = []
    for _ in range(depth):
        w = [rng.random() ** 3 + 1e-9 for _ in range(k + rng.randint(0, 3))]
        z = sum(w)
        rows.append(sorted((math.log(x / z) for x in w), reverse=True)[:k])
    return rows


def _all_nodes(depth: int, k: int):
    for d in range(1, depth + 1):
        yield from itertools.product(range(k), repeat=d)


@pytest.mark.parametrize("seed", range(40))
def test_best_first_equals_top_budget_by_brute_force(seed):
    rng = random.Random(seed)
    depth, k, budget = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 12)
    logp = _random_logp(rng, depth, k)
    nodes = build_tree(logp, budget)
    allnodes = sorted(_all_nodes(depth, k), key=lambda n: -node_score(logp, n))
    want = allnodes[:budget]
    assert len(nodes) == min(budget, len(allnodes)) == len(set(nodes))
    assert set(nodes) == set(want)  # continuous random scores: no ties
    # prefix-closed, and pops come in non-increasing score order
    assert all(n[:-1] == () or n[:-1] in set(nodes) for n in nodes)
    scores = [node_score(logp, n) for n in nodes]
    assert all(a >= b - 1e-12 for a, b in zip(scores, scores[1:]))


def test_sibling_and_child_pushes_by_hand():
    # depth-1 ranks: 0 (-0.1), 1 (-1.0), 2 (-3.0); depth-2 ranks: 0 (-0.2), 1 (-2.5)
    logp = [[-0.1, -1.0, -3.0], [-0.2, -2.5]]
    assert build_tree(logp, 1) == [(0,)]
    assert build_tree(logp, 2) == [(0,), (0, 0)]  # child -0.3 beats sibling -1.0
    assert build_tree(logp, 4) == [(0,), (0, 0), (1,), (1, 0)]  # then -1.0, -1.2
    whole = build_tree(logp, 100)
    assert set(whole) == {n for n in itertools.product(range(3), repeat=1)} | {
        (a, b) for a in range(3) for b in range(2)}
    assert len(whole) == 3 + 3 * 2  # the whole tree, then the heap runs dry
    assert build_tree(logp, 0) == []


def test_accept_depth_follows_the_matching_path():
    logp = [[-0.1, -1.0], [-0.2, -2.0], [-0.3, -0.4]]
    idx = [[10, 11], [20, 21], [30, 31]]
    full = build_tree(logp, 100)
    assert tree_accept_depth(full, idx, [11, 21, 31]) == 3
    assert tree_accept_depth(full, idx, [11, 22, 31]) == 1
    assert tree_accept_depth(full, idx, [12]) == 0
    assert tree_accept_depth(full, idx, [10, 20]) == 2  # truth clipped to 2 tokens
    small = build_tree(logp, 2)  # (0,), (0,0)
    assert tree_accept_depth(small, idx, [10, 20, 30]) == 2
    assert tree_accept_depth(small, idx, [11, 20, 30]) == 0


@pytest.mark.parametrize("seed", range(300))
def test_tree_round_equals_the_tuple_tree_and_its_accept_depth(seed):
    """`tree_round` (no tuples, early stop, rows not cut to the budget) gives exactly what the evaluation got from
    `build_tree` + `tree_accept_depth` on rows cut to the budget: with ties (log-probs on a coarse grid), truth
    paths that end by a missing token, by an unpopped node or by running out, and ids repeated in a row."""
    from dflash.evaluation.tree import tree_round
    rng = random.Random(seed)
    depth, width, budget = rng.randint(1, 6), rng.randint(1, 9), rng.randint(1, 40)
    logp = _random_logp(rng, depth, width)
    logp = [row + [row[-1]] * (width - len(row)) for row in logp]  # equal widths, as the top-k rows are
    if seed % 3 == 0:  # ties
        logp = [sorted((round(x * 2) / 2 for x in row), reverse=True) for row in logp]
    vocab = width + (0 if seed % 7 == 0 else 5)  # seed % 7 == 0: a row may repeat an id
    idx = [rng.sample(range(vocab), width) if seed % 7 else [rng.randrange(vocab) for _ in range(width)]
           for _ in range(depth)]
    truth = [row[min(width - 1, int(rng.expovariate(1.0)))] if rng.random() < 0.8 else vocab + 1 for row in idx]
    truth = truth[:rng.randint(0, depth)]
    k = min(budget, width)
    nodes = build_tree([row[:k] for row in logp], budget)
    want = (tree_accept_depth(nodes, [row[:k] for row in idx], truth), len(nodes))
    assert tree_round(logp, idx, truth, budget) == want
