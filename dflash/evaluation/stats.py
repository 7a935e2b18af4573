"""Uncertainty of τ: percentile bootstrap over prompts (docs/evaluation.md).

τ is pooled over rounds: τ = Σ_i s_i / Σ_i n_i, where prompt i ran n_i rounds whose τ sum to s_i. Rounds
of one prompt are not independent (a prompt that a drafter finds easy gives it long streaks all along), so
the unit that is resampled is the prompt: each bootstrap replicate draws the prompts with replacement and
recomputes the pooled ratio (Efron & Tibshirani 1993, ch. 13, percentile interval).

A paired comparison of two proposers on the SAME ground truth (same prompts, same target continuation)
resamples the same prompt indices for both and takes the difference of the two pooled ratios per
replicate: the prompt-to-prompt difficulty cancels, which is what makes Δτ of 0.05 measurable on a suite
where each τ alone has a CI of ± 0.2. A proposer compared with itself gives Δ = 0 in every replicate, an
interval of zero width.

The replicates are drawn from a generator seeded by `seed` (default 0), so a report is reproducible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Interval:
    value: float  # the point estimate on the full sample
    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low


def _check(sums: Sequence[float], counts: Sequence[float], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(list(sums), dtype=torch.float64)
    n = torch.as_tensor(list(counts), dtype=torch.float64)
    if s.shape != n.shape or s.ndim != 1 or s.numel() == 0:
        raise ValueError(f"{what}: need one (sum, count) per prompt, got {s.numel()} sums and {n.numel()} counts")
    if bool((n < 0).any()) or float(n.sum()) <= 0:
        raise ValueError(f"{what}: round counts must be >= 0 with at least one round")
    return s, n


def _indices(num: int, n_boot: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, num, (int(n_boot), num), generator=g)


def _ratio(s: torch.Tensor, n: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    den = n[idx].sum(1)
    return torch.where(den > 0, s[idx].sum(1) / den.clamp_min(1e-300), torch.full_like(den, math.nan))


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


def pooled_ci(sums: Sequence[float], counts: Sequence[float], level: float = 0.95, n_boot: int = 2000,
              seed: int = 0) -> Interval:
    """Pooled τ = Σs / Σn with its percentile-bootstrap interval over prompts (n_boot = 0: low = high = nan)."""
    check_level(level, n_boot)
    s, n = _check(sums, counts, "pooled_ci")
    value = float(s.sum() / n.sum())
    if n_boot == 0:
        return Interval(value, math.nan, math.nan)
    low, high = _percentiles(_ratio(s, n, _indices(s.numel(), n_boot, seed)), level)
    return Interval(value, low, high)


def paired_delta_ci(sums_a: Sequence[float], counts_a: Sequence[float], sums_b: Sequence[float],
                    counts_b: Sequence[float], level: float = 0.95, n_boot: int = 2000,
                    seed: int = 0) -> Interval:
    """Δ = τ_A − τ_B over the same prompts (index i of A and of B is the same prompt), resampled together."""
    check_level(level, n_boot)
    sa, na = _check(sums_a, counts_a, "paired_delta_ci (A)")
    sb, nb = _check(sums_b, counts_b, "paired_delta_ci (B)")
    if sa.numel() != sb.numel():
        raise ValueError(f"paired_delta_ci: A has {sa.numel()} prompts, B has {sb.numel()}; a paired "
                         f"comparison needs the same prompts")
    value = float(sa.sum() / na.sum() - sb.sum() / nb.sum())
    if n_boot == 0:
        return Interval(value, math.nan, math.nan)
    idx = _indices(sa.numel(), n_boot, seed)
    low, high = _percentiles(_ratio(sa, na, idx) - _ratio(sb, nb, idx), level)
    return Interval(value, low, high)


__all__ = ["Interval", "pooled_ci", "paired_delta_ci", "check_level"]
