"""Uncertainty of τ: a seed × prompt × sample hierarchical bootstrap (docs/evaluation.md, "Intervals and baselines").

τ is pooled over rounds: τ = Σ_i s_i / Σ_i n_i, where row i (one prompt sample of one training seed's run) ran n_i
rounds whose τ sum to s_i. Rows are not independent: the samples of one prompt share its difficulty, and every row
of one training seed shares that seed's drafter (the same config moves 0.04–0.09 τ between seeds). So a replicate
resamples the way the rows came about (Davison & Hinkley 1997, §3.8): the training seeds with replacement, then,
within each drawn seed, its prompts with replacement, then, within each drawn prompt, its samples with replacement,
and recomputes the pooled ratio. With one seed that is prompt-then-sample; with one sample a prompt, prompts alone.

The percentile interval of a mean over few top-level units (3 seeds) is too narrow twice over: the bootstrap's
spread is sqrt((S−1)/S) of the sampling spread, and a normal quantile stands where Student's t with S−1 degrees of
freedom belongs (Hesterberg 2015, "What teachers should know about the bootstrap": the "narrowness bias"). The
interval is therefore widened about the estimate by t_{S−1}/z · sqrt(S/(S−1)) (`small_sample_factor`; ≈ 1.01 for
128 prompts, 2.69 for 3 seeds, 9.2 for 2), which is what makes it cover an option's effect over training seeds at
its nominal rate (tests/test_hierarchical_ci.py).

A paired comparison of two proposers on the SAME ground truth (same seeds, prompts, same target continuation)
resamples the same seed, prompt and sample indices for both and takes the difference of the two pooled ratios per
replicate: the prompt-to-prompt difficulty cancels, which is what makes Δτ of 0.05 measurable on a suite
where each τ alone has a CI of ± 0.2. A proposer compared with itself gives Δ = 0 in every replicate, an
interval of zero width.

The replicates are drawn from a generator seeded by `seed` (default 0), so a report is reproducible.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch


@dataclass(frozen=True)
class Interval:
    value: float  # the point estimate on the full sample
    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low


@dataclass(frozen=True)
class Rows:
    """Per-row τ sums and round counts with where each row came from: `keys[i]` = (training seed, prompt) of row i;
    rows that share a key are samples of that prompt. Two Rows are paired when their keys agree row for row."""
    keys: Sequence[tuple[Hashable, Hashable]]
    sums: Sequence[float]
    counts: Sequence[float]


def flat_rows(sums: Sequence[float], counts: Sequence[float]) -> Rows:
    """Rows of one seed in which every row is its own prompt (the old flat bootstrap over rows)."""
    return Rows([(0, i) for i in range(len(sums))], sums, counts)


def _check(sums: Sequence[float], counts: Sequence[float], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(list(sums), dtype=torch.float64)
    n = torch.as_tensor(list(counts), dtype=torch.float64)
    if s.shape != n.shape or s.ndim != 1 or s.numel() == 0:
        raise ValueError(f"{what}: need one (sum, count) per prompt, got {s.numel()} sums and {n.numel()} counts")
    if bool((n < 0).any()) or float(n.sum()) <= 0:
        raise ValueError(f"{what}: round counts must be >= 0 with at least one round")
    return s, n


def _percentiles(reps: torch.Tensor, level: float) -> tuple[float, float]:
    reps = reps[~torch.isnan(reps)]
    if reps.numel() == 0:
        return math.nan, math.nan
    a = (1.0 - level) / 2.0
    q = torch.quantile(reps, torch.tensor([a, 1.0 - a], dtype=reps.dtype))
    return float(q[0]), float(q[1])


def check_level(level: float, n_boot: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"eval.ci_level must lie in (0, 1), got {level}")
    if n_boot < 0:
        raise ValueError(f"eval.bootstrap must be >= 0 (0 = no interval), got {n_boot}")


def _t_mass(theta: float, df: int) -> float:
    """P(0 ≤ T ≤ sqrt(df)·tan θ) for Student's t with `df` degrees of freedom: with x = sqrt(df)·tan θ its
    density becomes c·cos^(df−1) θ on [0, π/2), integrated by Simpson's rule (no scipy in the library)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    steps = 2000
    h = theta / steps
    f = [math.cos(h * i) ** (df - 1) for i in range(steps + 1)]
    return c * h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


@functools.lru_cache(maxsize=64)
def small_sample_factor(units: int, level: float) -> float:
    """How much wider than the percentile bootstrap's an interval over `units` top-level units must be (module doc):
    t_{units−1} / z · sqrt(units / (units − 1)); 1 for a single unit (nothing to correct: no spread to widen)."""
    if units < 2:
        return 1.0
    z = math.sqrt(2) * float(torch.special.erfinv(torch.tensor(level, dtype=torch.float64)))
    lo, hi = 0.0, math.pi / 2
    for _ in range(60):  # bisection on θ: the t quantile is sqrt(df)·tan θ where the mass reaches level / 2
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_mass(mid, units - 1) < level / 2 else (lo, mid)
    t = math.sqrt(units - 1) * math.tan((lo + hi) / 2)
    return t / z * math.sqrt(units / (units - 1))


@dataclass(frozen=True)
class _Layout:
    """Row indices laid out as [seed, prompt slot, sample slot] (−1 past a seed's prompts or a prompt's samples)."""
    rows: torch.Tensor  # [S, P, K] long
    prompts: torch.Tensor  # [S] prompts per seed
    samples: torch.Tensor  # [S, P] samples per prompt (0 past the seed's prompts)


def _layout(keys: Sequence[tuple[Hashable, Hashable]]) -> _Layout:
    tree: dict[Hashable, dict[Hashable, list[int]]] = {}
    for i, (seed, prompt) in enumerate(keys):
        tree.setdefault(seed, {}).setdefault(prompt, []).append(i)
    n_p = max(len(p) for p in tree.values())
    n_k = max(len(rows) for p in tree.values() for rows in p.values())
    rows = torch.full((len(tree), n_p, n_k), -1, dtype=torch.long)
    samples = torch.zeros((len(tree), n_p), dtype=torch.long)
    for a, prompts in enumerate(tree.values()):
        for b, idx in enumerate(prompts.values()):
            rows[a, b, :len(idx)] = torch.tensor(idx)
            samples[a, b] = len(idx)
    return _Layout(rows, torch.tensor([len(p) for p in tree.values()]), samples)


@functools.lru_cache(maxsize=4)
def _weights(keys: tuple[tuple[Hashable, Hashable], ...], n_boot: int, seed: int) -> torch.Tensor:
    """[n_boot, rows]: how often each row is drawn in each hierarchical replicate (seeds, then prompts within
    each drawn seed, then samples within each drawn prompt, all with replacement). Drawn in chunks so a large suite
    never holds more than a few million draws at once; kept for the next interval on the same keys (a report's
    options share their seeds and prompts: every Δ of a stage resamples them alike)."""
    lay, n_rows = _layout(keys), len(keys)
    g = torch.Generator().manual_seed(int(seed))
    n_s, n_p, n_k = lay.rows.shape
    out = torch.zeros((n_boot, n_rows + 1), dtype=torch.float64)  # the last column collects the padding
    chunk = max(1, 4_000_000 // (n_s * n_p * n_k))
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        sd = torch.randint(0, n_s, (b, n_s), generator=g)
        pj = (torch.rand((b, n_s, n_p), generator=g) * lay.prompts[sd][..., None]).long()
        kk = (torch.rand((b, n_s, n_p, n_k), generator=g)
              * lay.samples[sd[..., None], pj][..., None]).long()
        live = (torch.arange(n_p) < lay.prompts[sd][..., None])[..., None] \
            & (torch.arange(n_k) < lay.samples[sd[..., None], pj][..., None])
        row = lay.rows[sd[..., None, None], pj[..., None], kk]
        row = torch.where(live, row, torch.full_like(row, n_rows))
        out[start:start + b].scatter_add_(1, row.reshape(b, -1), torch.ones(row.reshape(b, -1).shape,
                                                                              dtype=torch.float64))
    return out[:, :n_rows]


def _widened(value: float, low: float, high: float, factor: float) -> tuple[float, float]:
    return value - factor * (value - low), value + factor * (high - value)


def hierarchical_ci(a: Rows, b: Rows | None = None, level: float = 0.95, n_boot: int = 2000,
                    seed: int = 0) -> Interval:
    """Pooled τ of `a` (Σs / Σn), or with `b` the paired Δ = τ_a − τ_b (the same keys row for row, resampled
    together), with its seed × prompt × sample bootstrap interval widened for few top-level units (module doc).
    n_boot = 0: low = high = nan."""
    check_level(level, n_boot)
    sa, na = _check(a.sums, a.counts, "hierarchical_ci (A)")
    if len(a.keys) != sa.numel():
        raise ValueError(f"hierarchical_ci: {len(a.keys)} keys for {sa.numel()} rows")
    value = float(sa.sum() / na.sum())
    if b is not None:
        sb, nb = _check(b.sums, b.counts, "hierarchical_ci (B)")
        if list(b.keys) != list(a.keys):
            raise ValueError(f"hierarchical_ci: A has {sa.numel()} rows, B {sb.numel()}, or their (seed, prompt) "
                             f"keys differ; a paired comparison needs the same seeds and prompts, row for row")
        value -= float(sb.sum() / nb.sum())
    if n_boot == 0:
        return Interval(value, math.nan, math.nan)
    w = _weights(tuple(tuple(k) for k in a.keys), int(n_boot), int(seed))

    def ratio(s: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        den = w @ n
        return torch.where(den > 0, (w @ s) / den.clamp_min(1e-300), torch.full_like(den, math.nan))
    reps = ratio(sa, na) if b is None else ratio(sa, na) - ratio(sb, nb)
    low, high = _percentiles(reps, level)
    # the top level is the seeds; with one seed, its prompts
    seeds = {k[0] for k in a.keys}
    units = len(seeds) if len(seeds) > 1 else len({k[1] for k in a.keys})
    return Interval(value, *_widened(value, low, high, small_sample_factor(units, level)))


def pooled_ci(sums: Sequence[float], counts: Sequence[float], level: float = 0.95, n_boot: int = 2000,
              seed: int = 0, keys: Sequence[tuple[Hashable, Hashable]] | None = None) -> Interval:
    """Pooled τ = Σs / Σn with its `hierarchical_ci`; without `keys`, every row is its own prompt of one seed."""
    rows = flat_rows(sums, counts) if keys is None else Rows(keys, sums, counts)
    return hierarchical_ci(rows, None, level, n_boot, seed)


def paired_delta_ci(sums_a: Sequence[float], counts_a: Sequence[float], sums_b: Sequence[float],
                    counts_b: Sequence[float], level: float = 0.95, n_boot: int = 2000,
                    seed: int = 0, keys: Sequence[tuple[Hashable, Hashable]] | None = None) -> Interval:
    """Δ = τ_A − τ_B over the same rows (index i of A and of B is the same prompt sample), resampled together by
    `hierarchical_ci`; without `keys`, every row is its own prompt of one seed."""
    if len(sums_a) != len(sums_b):
        raise ValueError(f"paired_delta_ci: A has {len(sums_a)} prompts, B has {len(sums_b)}; a paired "
                         f"comparison needs the same prompts")
    a = flat_rows(sums_a, counts_a) if keys is None else Rows(keys, sums_a, counts_a)
    return hierarchical_ci(a, Rows(a.keys, sums_b, counts_b), level, n_boot, seed)


__all__ = ["Interval", "Rows", "flat_rows", "hierarchical_ci", "pooled_ci", "paired_delta_ci", "check_level",
           "small_sample_factor"]
