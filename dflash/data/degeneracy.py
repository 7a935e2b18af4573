"""How degenerate a continuation is (docs/evaluation.md, "Ground truth that ends"): a target that loops makes τ a
measure of its loops, and training data that loops teaches them.

Three figures, over the continuation's own tokens (the prompt is not counted):
- `repeat4`: the share of its 4-grams that already occurred earlier in the same continuation (a human's Python
  continuation: ~0.14; the reference target's greedy one: 0.84);
- `in_repeat16`: the share of its tokens inside a 16-gram that occurs at least twice in it (human ~0.05);
- `ends_in_cycle`: whether it ends in an exact cycle: from some position to its end it is periodic with a period
  L, covering at least CYCLE_MIN_REPEATS·L and CYCLE_MIN_TOKENS tokens. A continuation that stopped at its end
  token does not end in a cycle by construction.
`summarize` averages them over continuations (the cycle figure as a share of continuations).
"""
from __future__ import annotations

from typing import Iterable, Sequence

CYCLE_MIN_REPEATS = 3
CYCLE_MIN_TOKENS = 24


def repeat_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the n-grams of `tokens` that already start earlier in `tokens` (NaN without a whole n-gram)."""
    seen: set[tuple[int, ...]] = set()
    rep = total = 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        total += 1
        rep += g in seen
        seen.add(g)
    return rep / total if total else float("nan")


def in_repeat_share(tokens: Sequence[int], n: int = 16) -> float:
    """Share of `tokens` covered by an n-gram that occurs at least twice in `tokens` (0.0 when shorter than n)."""
    if not tokens:
        return float("nan")
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        counts[g] = counts.get(g, 0) + 1
    covered = [False] * len(tokens)
    for i in range(len(tokens) - n + 1):
        if counts[tuple(tokens[i:i + n])] > 1:
            for j in range(i, i + n):
                covered[j] = True
    return sum(covered) / len(tokens)


def cycle_start(tokens: Sequence[int]) -> int | None:
    """The earliest position from which `tokens` is periodic to its end with a period covering the module doc's
    minimums (the smallest such period's), or None when it does not end in a cycle."""
    n = len(tokens)
    best = None
    for L in range(1, n // CYCLE_MIN_REPEATS + 1):
        s = n - L  # walk back while tokens[i] == tokens[i + L]
        while s > 0 and tokens[s - 1] == tokens[s - 1 + L]:
            s -= 1
        if n - s >= max(CYCLE_MIN_REPEATS * L, CYCLE_MIN_TOKENS):
            best = s if best is None else min(best, s)
    return best


def summarize(continuations: Iterable[Sequence[int]]) -> dict[str, float]:
    """{repeat4, in_repeat16, cycle_share, cycle_start_median, count} over `continuations`."""
    r4, r16, starts, n = [], [], [], 0
    for c in continuations:
        c = [int(t) for t in c]
        n += 1
        v = repeat_share(c, 4)
        if v == v:
            r4.append(v)
        r16.append(in_repeat_share(c, 16) if c else 0.0)
        s = cycle_start(c)
        if s is not None:
            starts.append(s)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    starts.sort()
    return {"repeat4": mean(r4), "in_repeat16": mean(r16), "cycle_share": len(starts) / n if n else float("nan"),
            "cycle_start_median": float(starts[len(starts) // 2]) if starts else float("nan"), "count": float(n)}
