"""The seed × prompt × sample bootstrap (`dflash.evaluation.stats.hierarchical_ci`, docs/evaluation.md "Intervals and
baselines"): the same interval as a slow plain reference, and an interval that covers an option's effect over training
seeds at its nominal rate where the old flat bootstrap over rows does not."""
from __future__ import annotations

import math
import random

import pytest

from dflash.evaluation.stats import Rows, flat_rows, hierarchical_ci, small_sample_factor


def _reference(keys, sums, counts, n_boot: int, level: float, rng: random.Random) -> tuple[float, float]:
    """The hierarchical percentile interval by explicit loops: seeds, then prompts within each drawn seed, then
    samples within each drawn prompt, all with replacement; widened as `hierarchical_ci` widens it."""
    tree: dict = {}
    for i, (s, p) in enumerate(keys):
        tree.setdefault(s, {}).setdefault(p, []).append(i)
    seeds = list(tree)
    reps = []
    for _ in range(n_boot):
        num = den = 0.0
        for s in rng.choices(seeds, k=len(seeds)):
            prompts = list(tree[s])
            for p in rng.choices(prompts, k=len(prompts)):
                for i in rng.choices(tree[s][p], k=len(tree[s][p])):
                    num, den = num + sums[i], den + counts[i]
        reps.append(num / den)
    reps.sort()
    a = (1 - level) / 2
    lo, hi = reps[int(a * (n_boot - 1))], reps[int((1 - a) * (n_boot - 1))]
    value = sum(sums) / sum(counts)
    f = small_sample_factor(len(seeds) if len(seeds) > 1 else len({p for _, p in keys}), level)
    return value - f * (value - lo), value + f * (hi - value)


def _unbalanced(rng: random.Random):
    """Three seeds; a seed missing some prompts, prompts with 1–3 samples: the layout a least-degenerate subset has."""
    keys, sums, counts = [], [], []
    for s in range(3):
        for p in range(12 - 2 * s):
            for _ in range(1 + (p + s) % 3):
                n = rng.randint(3, 9)
                keys.append((s, f"p{p}"))
                counts.append(n)
                sums.append(n * (1.3 + 0.2 * s + 0.1 * (p % 4) + rng.gauss(0, 0.15)))
    return keys, sums, counts


def test_matches_the_plain_reference():
    rng = random.Random(3)
    keys, sums, counts = _unbalanced(rng)
    iv = hierarchical_ci(Rows(keys, sums, counts), n_boot=6000, seed=1)
    lo, hi = _reference(keys, sums, counts, 6000, 0.95, rng)
    assert iv.value == pytest.approx(sum(sums) / sum(counts))
    assert iv.low == pytest.approx(lo, abs=0.08 * (hi - lo)) and iv.high == pytest.approx(hi, abs=0.08 * (hi - lo))
    # one seed: prompt-then-sample, widened by the prompts' count
    one = [i for i, k in enumerate(keys) if k[0] == 0]
    k1, s1, c1 = [keys[i] for i in one], [sums[i] for i in one], [counts[i] for i in one]
    iv1 = hierarchical_ci(Rows(k1, s1, c1), n_boot=6000, seed=1)
    lo1, hi1 = _reference(k1, s1, c1, 6000, 0.95, rng)
    assert iv1.low == pytest.approx(lo1, abs=0.08 * (hi1 - lo1)) and iv1.high == pytest.approx(hi1, abs=0.08 * (hi1 - lo1))


def test_paired_delta_resamples_both_alike_and_checks_keys():
    rng = random.Random(0)
    keys, sums, counts = _unbalanced(rng)
    same = hierarchical_ci(Rows(keys, sums, counts), Rows(keys, sums, counts), n_boot=200)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)  # an option against itself: zero width
    with pytest.raises(ValueError, match="keys differ"):
        hierarchical_ci(Rows(keys, sums, counts), Rows(list(reversed(keys)), sums, counts), n_boot=10)


def test_small_sample_factor_is_t_over_z():
    # t_{2, 0.975} = 4.3027, t_{1, 0.975} = 12.7062 (any table of Student's t); z = 1.95996
    assert small_sample_factor(3, 0.95) == pytest.approx(4.3027 / 1.95996 * math.sqrt(1.5), rel=1e-4)
    assert small_sample_factor(2, 0.95) == pytest.approx(12.7062 / 1.95996 * math.sqrt(2), rel=1e-4)
    assert small_sample_factor(1, 0.95) == 1.0


def _synthetic_delta(rng: random.Random, effect: float, seeds: int = 3, prompts: int = 16, samples: int = 2):
    """Per-row task tables of two options, A = B + the effect, where a training seed moves A's effect by a seed-level
    term (sd 0.06) far larger than prompt (sd 0.02) and round noise: the served campaign's situation."""
    keys, sa, sb, counts = [], [], [], []
    difficulty = [rng.gauss(1.5, 0.3) for _ in range(prompts)]
    for s in range(seeds):
        seed_effect = effect + rng.gauss(0, 0.06)
        for p in range(prompts):
            prompt_effect = rng.gauss(0, 0.02)
            for _ in range(samples):
                n = 10
                b = difficulty[p] + rng.gauss(0, 0.05)
                keys.append((s, p))
                counts.append(n)
                sb.append(n * b)
                sa.append(n * (b + seed_effect + prompt_effect + rng.gauss(0, 0.01)))
    return keys, sa, sb, counts


def test_covers_the_true_effect_at_its_nominal_rate_where_the_flat_bootstrap_does_not():
    """200 synthetic replications with a known effect (+0.05): the hierarchical interval of the paired Δ covers it
    within a binomial band of 95% (3 sd of 200 draws); the old flat bootstrap over rows, blind to the seed level,
    covers it far less often."""
    rng = random.Random(7)
    reps, effect = 200, 0.05
    hier = flat = 0
    for r in range(reps):
        keys, sa, sb, counts = _synthetic_delta(rng, effect)
        iv = hierarchical_ci(Rows(keys, sa, counts), Rows(keys, sb, counts), n_boot=400, seed=r)
        hier += iv.low <= effect <= iv.high
        fa, fb = flat_rows(sa, counts), flat_rows(sb, counts)
        fl = hierarchical_ci(fa, fb, n_boot=400, seed=r)
        flat += fl.low <= effect <= fl.high
    band = 3 * math.sqrt(0.95 * 0.05 / reps)
    assert abs(hier / reps - 0.95) <= band, (hier, flat)
    assert flat / reps < 0.95 - band, (hier, flat)
