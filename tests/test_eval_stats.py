"""Bootstrap intervals over prompts (dflash.evaluation.stats) and the prompt-lookup proposer
(dflash.evaluation.prompt_lookup) against a brute-force implementation."""
from __future__ import annotations

import random

import pytest
import torch

from dflash.evaluation.acceptance import simulate_task
from dflash.evaluation.ground_truth import TaskTruth
from dflash.evaluation.prompt_lookup import PromptLookupProposer, lookup_draft, ngram_index
from dflash.evaluation.stats import paired_delta_ci, pooled_ci


def _synthetic_suite(g: torch.Generator, prompts: int, true_tau: float):
    """Per prompt: a difficulty around the true mean, 20 rounds of τ = 1 + Binomial(6, q_i)."""
    q = (true_tau - 1.0) / 6.0
    qi = (q + 0.15 * (torch.rand(prompts, generator=g) - 0.5) * 2).clamp(0.01, 0.99)
    taus = 1 + torch.binomial(torch.full((prompts, 20), 6.0), qi[:, None].expand(prompts, 20), generator=g)
    return taus.sum(1).tolist(), [20] * prompts


def test_interval_covers_the_true_mean_at_about_the_nominal_rate():
    g = torch.Generator().manual_seed(1)
    true_tau, trials, hits = 2.8, 300, 0
    for t in range(trials):
        sums, counts = _synthetic_suite(g, 40, true_tau)
        ci = pooled_ci(sums, counts, level=0.95, n_boot=800, seed=t)
        assert ci.low <= ci.value <= ci.high
        hits += ci.low <= true_tau <= ci.high
    assert 0.90 <= hits / trials <= 0.99  # nominal 0.95; the percentile bootstrap runs a little narrow


def test_wider_level_and_fewer_prompts_widen_the_interval():
    g = torch.Generator().manual_seed(2)
    sums, counts = _synthetic_suite(g, 100, 2.5)
    w95 = pooled_ci(sums, counts, 0.95).width
    assert pooled_ci(sums, counts, 0.99).width > w95 > pooled_ci(sums, counts, 0.5).width
    assert pooled_ci(sums[:10], counts[:10], 0.95).width > w95
    assert pooled_ci(sums, counts, n_boot=0).low != pooled_ci(sums, counts, n_boot=0).low  # nan: no interval


def test_paired_delta_of_a_drafter_with_itself_is_zero_with_zero_width():
    g = torch.Generator().manual_seed(3)
    sums, counts = _synthetic_suite(g, 50, 3.0)
    d = paired_delta_ci(sums, counts, sums, counts)
    assert d.value == 0.0 and d.low == 0.0 and d.high == 0.0


def test_paired_delta_is_tighter_than_the_unpaired_intervals_and_finds_a_small_gain():
    g = torch.Generator().manual_seed(4)
    sums, counts = _synthetic_suite(g, 100, 2.5)
    better = [s + 3 for s in sums]  # +3 accepted tokens over 20 rounds: Δτ = 0.15 on every prompt
    d = paired_delta_ci(better, counts, sums, counts)
    assert d.value == pytest.approx(0.15) and d.low > 0.1
    a, b = pooled_ci(better, counts), pooled_ci(sums, counts)
    assert a.low < b.high  # unpaired intervals overlap: unpaired, the gain would look like noise
    with pytest.raises(ValueError, match="same prompts"):
        paired_delta_ci(sums, counts, sums[:-1], counts[:-1])
    with pytest.raises(ValueError, match="ci_level"):
        pooled_ci(sums, counts, level=1.5)


# -- prompt lookup -----------------------------------------------------------------------------------
def _brute(tokens, p, k, min_n, max_n):
    ctx = tokens[:p + 1]
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ctx):
            continue
        suffix = ctx[len(ctx) - n:]
        for j in range(len(ctx) - n - 1, -1, -1):  # most recent earlier start first
            if ctx[j:j + n] == suffix:
                return ctx[j + n:j + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_prompt_lookup_matches_brute_force(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
    min_n = rng.randint(1, 2)
    max_n = rng.randint(min_n, 4)
    index = ngram_index(tokens, min_n, max_n)
    for p in range(len(tokens)):
        want = _brute(tokens, p, 3, min_n, max_n)
        assert lookup_draft(tokens, p, 3, min_n, max_n, index) == want
        assert lookup_draft(tokens, p, 3, min_n, max_n) == want  # the scan agrees with the index


def test_prompt_lookup_longest_n_first_and_never_reads_the_future():
    toks = [5, 1, 2, 9, 7, 1, 2, 3, 8, 2]  # suffix [.., 2]: 1-gram [2] last at 6 → 3; no 2-gram [8, 2]
    assert lookup_draft(toks, 9, 3, 1, 3) == [3, 8, 2]
    toks = [1, 2, 4, 0, 2, 6, 1, 2]  # 2-gram [1, 2] at 0 → [4, 0, 2] beats 1-gram [2] at 4 → [6, 1, 2]
    assert lookup_draft(toks, 7, 3, 1, 2) == [4, 0, 2] and lookup_draft(toks, 7, 3, 1, 1) == [6, 1, 2]
    assert lookup_draft([3, 4, 3], 2, 5, 1, 2) == [4, 3]  # clipped to the committed context
    assert lookup_draft([1, 2, 3], 2, 3, 1, 2) == []


def test_prompt_lookup_through_the_simulator():
    """A repeated continuation: once the pattern has been seen, prompt lookup copies it exactly."""
    pattern = [10, 11, 12, 13, 14, 15, 16, 17]
    ids = torch.tensor(pattern * 4)
    P = 8
    tr = TaskTruth("rep", ids[:P], ids[P:], torch.zeros(len(ids), 1, 1))
    r = simulate_task(tr, PromptLookupProposer(block_size=4, min_n=1, max_n=3), 4, budgets=[16])
    assert r.taus_vanilla == [4] * 6  # every round copies 3 tokens (24 new tokens, the last round clipped to 3)
    assert r.taus_tree[16] == r.taus_vanilla  # a single chain: tree τ = vanilla τ
    none = TaskTruth("none", torch.arange(8), torch.arange(8, 20), torch.zeros(20, 1, 1))
    assert simulate_task(none, PromptLookupProposer(4), 4).taus_vanilla == [1] * 11
