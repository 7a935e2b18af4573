"""Prompt-lookup decoding (Saxena 2023; vLLM's and SGLang's `ngram` speculative method): the zero-cost
baseline a trained drafter must beat (docs/evaluation.md).

At a round whose committed context is `tokens[0..p]` (the anchor at p included), take the longest suffix
of the context of length n, n from `max_n` down to `min_n`, that also occurs earlier in the context; the
draft is the tokens that followed its earliest occurrence (as vLLM v1's `NgramProposer` picks it), up to
`block_size − 1` of them and never past the committed context. No match for any n: no draft (τ = 1 for that round).

It runs through the same simulator as the drafter (`acceptance.simulate`): it returns a `Proposal` (one
token per position, a single chain; a position without a draft carries the id −1, which never matches),
so its tree τ equals its vanilla τ and only the vanilla figure is reported.

Lookups use a per-task index {n-gram: sorted start positions} over the task's tokens, built once; a
query at p considers only starts before the suffix's own start (an occurrence may overlap the suffix), so
no token after p is ever read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing dflash.evaluation stays cheap: EvalConfig holds PromptLookupConfig
    from dflash.evaluation.acceptance import Proposal
    from dflash.evaluation.ground_truth import TaskTruth

NO_TOKEN = -1


@dataclass
class PromptLookupConfig:
    enabled: bool = True  # report eval/tau_prompt_lookup beside the drafter's τ
    min_n: int = 1  # shortest n-gram matched (vLLM prompt_lookup_min)
    max_n: int = 4  # longest n-gram matched, tried first (vLLM prompt_lookup_max)


COPY_NGRAM = 8  # long enough that a match is a copy, not a common idiom (`self.`, `return `, indentation)


def copy_rate(tokens: list[int], start: int, n: int = COPY_NGRAM) -> float:
    """Fraction of the n-grams starting at or after `start` (the continuation) that already start earlier in
    `tokens`: how much of what the target wrote repeats text before it, which bounds what prompt lookup can
    accept. On the reference target's held-out continuations it was 0.89 (prompt lookup τ 6.7, ABLATIONS.md).
    NaN when the continuation holds no whole n-gram."""
    seen: set[tuple[int, ...]] = set()
    copied = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        if i >= start:
            total += 1
            copied += gram in seen
        seen.add(gram)
    return copied / total if total else float("nan")


def validate_prompt_lookup(cfg: PromptLookupConfig) -> None:
    if not 1 <= cfg.min_n <= cfg.max_n:
        raise ValueError(f"eval.prompt_lookup.min_n/max_n must satisfy 1 <= min_n <= max_n, got "
                         f"{cfg.min_n}/{cfg.max_n}")


def lookup_draft(tokens: list[int], p: int, k: int, min_n: int, max_n: int,
                 index: dict[tuple[int, ...], list[int]] | None = None) -> list[int]:
    """Draft of up to `k` tokens after position p from the context tokens[0..p]; [] when nothing matches.
    `index` (from `ngram_index(tokens, min_n, max_n)`) makes it O(max_n · log L); without it, a scan."""
    ctx_end = p + 1  # tokens[:ctx_end] is committed
    for n in range(min(max_n, ctx_end - 1), min_n - 1, -1):
        suffix = tuple(tokens[ctx_end - n:ctx_end])
        first = _first_start(tokens, suffix, ctx_end - n, index)
        if first is not None:
            start = first + n
            return tokens[start:min(start + k, ctx_end)]
    return []


def _first_start(tokens, suffix, before: int, index) -> int | None:
    """Smallest start j < `before` with tokens[j:j+n] == suffix."""
    if index is not None:
        starts = index.get(suffix, ())
        return starts[0] if starts and starts[0] < before else None
    n = len(suffix)
    for j in range(before):
        if tuple(tokens[j:j + n]) == suffix:
            return j
    return None


def ngram_index(tokens: list[int], min_n: int, max_n: int) -> dict[tuple[int, ...], list[int]]:
    index: dict[tuple[int, ...], list[int]] = {}
    for n in range(min_n, max_n + 1):
        for j in range(len(tokens) - n + 1):
            index.setdefault(tuple(tokens[j:j + n]), []).append(j)  # j ascending: sorted
    return index


class PromptLookupProposer:
    """A `Proposer` for `acceptance.simulate`: `(truth, p) -> Proposal`."""

    def __init__(self, block_size: int, min_n: int = 1, max_n: int = 4):
        validate_prompt_lookup(PromptLookupConfig(True, min_n, max_n))
        self.k, self.min_n, self.max_n = block_size - 1, min_n, max_n
        self._index: dict[str, tuple[list[int], dict]] = {}

    def __call__(self, truth: "TaskTruth", p: int) -> "Proposal":
        from dflash.evaluation.acceptance import Proposal
        if truth.name not in self._index:
            toks = truth.tokens.tolist()
            self._index[truth.name] = (toks, ngram_index(toks, self.min_n, self.max_n))
        toks, index = self._index[truth.name]
        draft = lookup_draft(toks, p, self.k, self.min_n, self.max_n, index)
        draft = draft + [NO_TOKEN] * (self.k - len(draft))
        return Proposal(draft, [[0.0] for _ in draft], [[t] for t in draft])
