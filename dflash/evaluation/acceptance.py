"""Simulated speculative rounds on the ground truth (DESIGN §5): vanilla τ, DDTree τ, per-position
acceptance.

A round: the committed prefix ends at position p (first round p = prompt length, anchor = the target's
first greedy token, at p). The proposer sees the context before p and the anchor and returns draft logits
for positions p+1..p+bs−1. Vanilla: the draft is the argmax per position; accepted = the longest prefix
equal to the ground truth; τ = accepted + 1 (the target's bonus token); p += τ. DDTree: the tree of
`tree.build_tree` per budget; τ = 1 + depth of the deepest matching node. Rounds run while a ground-truth
token remains after the anchor (p − P < N − 1); a round can accept at most the N − 1 − (p − P) tokens
left (the last round is clipped). Each method runs its own rounds (a tree decoder advances by its own τ).

The proposer is pluggable: `(truth, p) -> logits [bs−1, V]`, or a ready `Proposal` (a proposer without
logits, e.g. prompt lookup). `DrafterProposer` runs the drafter on the
cached target features; tests use an oracle that copies the target (τ = bs) or an always-wrong one (τ = 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dflash.evaluation.ground_truth import TaskTruth
from dflash.evaluation.speculative import drafter_autocast
from dflash.evaluation.tree import build_tree, tree_accept_depth

Proposer = Callable[[TaskTruth, int], "torch.Tensor | Proposal"]


class DrafterProposer:
    """Runs the drafter on the ground truth's target features; one drafter KV cache per task, extended
    or cropped to the round's committed length (extend_context crops, then appends)."""

    def __init__(self, drafter, autocast: bool | None = None):
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
        self.autocast = autocast
        self._caches: dict[str, object] = {}
        self._feats: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, truth: TaskTruth, p: int) -> torch.Tensor:
        d = self.drafter
        if truth.name not in self._caches:
            self._caches[truth.name] = d.new_cache()
            self._feats[truth.name] = truth.features.to(self.device)
        cache, feats = self._caches[truth.name], self._feats[truth.name]
        with drafter_autocast(d, self.autocast):
            if cache.length > p:
                cache.crop(p)
            if cache.length < p:
                d.extend_context(cache, feats[None, cache.length:p], cache.length)
            anchor = truth.tokens[p:p + 1].to(self.device)
            hidden = d.draft_hidden(cache, anchor)
        return d.logits(hidden)[0]


@dataclass
class Proposal:
    tokens: list[int]  # argmax per block position 1..bs-1
    topk_logp: list[list[float]]  # [bs-1][k], descending
    topk_idx: list[list[int]]


def reduce_logits(logits_KV: torch.Tensor, k: int) -> Proposal:
    logits = logits_KV.float()
    k = max(1, min(k, logits.shape[-1]))
    logp = torch.log_softmax(logits, dim=-1)
    vals, idx = logp.topk(k, dim=-1)
    arg = logits.argmax(-1)
    packed = torch.cat([arg[:, None].float(), vals, idx.float()], dim=1).cpu()  # one transfer
    return Proposal(packed[:, 0].long().tolist(), packed[:, 1:1 + k].tolist(),
                    packed[:, 1 + k:].long().tolist())


@dataclass
class TaskResult:
    name: str
    prompt_len: int
    n_new: int
    taus_vanilla: list[int] = field(default_factory=list)
    taus_tree: dict[int, list[int]] = field(default_factory=dict)
    nodes_tree: dict[int, int] = field(default_factory=dict)  # tree nodes verified, summed over rounds
    reached: list[int] = field(default_factory=list)  # per block position k = 1..bs-1
    accepted: list[int] = field(default_factory=list)

    @staticmethod
    def mean(xs: Sequence[int]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    @property
    def tau_vanilla(self) -> float:
        return self.mean(self.taus_vanilla)

    def tau_tree(self, budget: int) -> float:
        return self.mean(self.taus_tree.get(budget, []))


def _matched(draft: Sequence[int], truth: Sequence[int]) -> int:
    m = 0
    for a, b in zip(draft, truth):
        if int(a) != int(b):
            break
        m += 1
    return m


def simulate_task(truth: TaskTruth, proposer: Proposer, block_size: int,
                  budgets: Sequence[int] = ()) -> TaskResult:
    P, N, K = truth.prompt_len, truth.n_new, block_size - 1
    tokens = truth.tokens.tolist()
    kmax = max([1, *budgets])
    memo: dict[int, Proposal] = {}

    def propose(p: int) -> Proposal:
        if p not in memo:
            out = proposer(truth, p)
            got = len(out.tokens) if isinstance(out, Proposal) else out.shape[0]
            if got != K:
                raise ValueError(f"proposer returned {got} positions, expected block_size-1={K}")
            memo[p] = out if isinstance(out, Proposal) else reduce_logits(out, kmax)
        return memo[p]

    def target_after(p: int) -> list[int]:
        avail = N - 1 - (p - P)
        return tokens[p + 1:p + 1 + min(K, avail)]

    res = TaskResult(truth.name, P, N, reached=[0] * K, accepted=[0] * K)
    p = P
    while p - P < N - 1:
        prop, want = propose(p), target_after(p)
        m = _matched(prop.tokens, want)
        for k in range(min(m + 1, len(want))):  # positions reached: all before matched
            res.reached[k] += 1
            res.accepted[k] += int(k < m)
        res.taus_vanilla.append(m + 1)
        p += m + 1
    for b in budgets:
        taus, p, n_nodes = [], P, 0
        while p - P < N - 1:
            prop, want = propose(p), target_after(p)
            k = min(b, len(prop.topk_logp[0]))
            nodes = build_tree([row[:k] for row in prop.topk_logp], b)
            depth = tree_accept_depth(nodes, [row[:k] for row in prop.topk_idx], want)
            taus.append(depth + 1)
            n_nodes += len(nodes)
            p += depth + 1
        res.taus_tree[int(b)] = taus
        res.nodes_tree[int(b)] = n_nodes
    return res


def simulate(truths: Sequence[TaskTruth], proposer: Proposer, block_size: int,
             budgets: Sequence[int] = ()) -> list[TaskResult]:
    return [simulate_task(t, proposer, block_size, budgets) for t in truths]


def oracle_proposer(block_size: int, vocab_size: int) -> Proposer:
    """Proposes exactly the target's tokens (τ = block_size on every unclipped round)."""
    def f(truth: TaskTruth, p: int) -> torch.Tensor:
        toks = truth.tokens.tolist()
        out = torch.zeros(block_size - 1, vocab_size)
        for k in range(1, block_size):
            if p + k < len(toks):
                out[k - 1, toks[p + k]] = 10.0
        return out
    return f


def wrong_proposer(block_size: int, vocab_size: int) -> Proposer:
    """Always proposes a token different from the target's (τ = 1)."""
    def f(truth: TaskTruth, p: int) -> torch.Tensor:
        toks = truth.tokens.tolist()
        out = torch.zeros(block_size - 1, vocab_size)
        for k in range(1, block_size):
            want = toks[p + k] if p + k < len(toks) else 0
            out[k - 1, (want + 1) % vocab_size] = 10.0
            out[k - 1, want] = -1e4  # never in any top-k either (trees get τ = 1 too)
        return out
    return f
