"""Simulated speculative rounds on the ground truth (docs/DESIGN.md, "Evaluation and the gate"): vanilla τ, DDTree τ,
per-position acceptance.

A round: the committed prefix ends at position p (first round p = prompt length, anchor = the target's
first greedy token, at p). The proposer sees the context before p and the anchor and returns draft logits
for positions p+1..p+bs−1. Vanilla: the draft is the argmax per position; accepted = the longest prefix
equal to the ground truth; τ = accepted + 1 (the target's bonus token); p += τ. DDTree: the tree of
`tree.build_tree` per budget (computed by `tree.tree_round`); τ = 1 + depth of the deepest matching node. Rounds
run while a ground-truth token remains after the anchor (p − P < N − 1); a round can accept at most the
N − 1 − (p − P) tokens left (the last round is clipped). Each method runs its own rounds (a tree decoder
advances by its own τ).

The proposer is pluggable: `(truth, p) -> logits [bs−1, V]`, or a ready `Proposal` (a proposer without
logits, e.g. prompt lookup). The drafter's two (`eval.proposer`, `DRAFTER_PROPOSERS`):
- `BatchedDrafterProposer` ("batched", the default): every position's proposal of a task from a few
  training forwards (all anchors at once, chunked), reduced on the device, one transfer per chunk;
- `DrafterProposer` ("sequential"): one incremental drafter call per round on a drafter KV cache, as the
  real decoding loop drafts (`speculative.py`); the reference the batched one is tested against.
A proposal at p depends only on the features before p and the anchor token at p, so both give the same
proposals (up to float rounding: tested at 1e-4 in fp32). Tests also use an oracle that copies the target
(τ = bs) or an always-wrong one (τ = 1).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dflash.drafter.model import greedy_draft
from dflash.evaluation.ground_truth import TaskTruth
from dflash.evaluation.speculative import drafter_autocast
from dflash.evaluation.tree import tree_round
from dflash.registry import Registry
from dflash.target.sampling import GREEDY, Sampling, warp

Proposer = Callable[[TaskTruth, int], "torch.Tensor | Proposal"]


class DrafterProposer:
    """Runs the drafter on the ground truth's target features; one drafter KV cache per task, extended
    or cropped to the round's committed length (extend_context crops, then appends)."""

    def __init__(self, drafter, autocast: bool | None = None, sampling: Sampling = GREEDY):
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
        self.autocast = autocast
        self.sampling = sampling  # DFlash 2 at T > 0: its proposals carry the walk's q of the path's tokens
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
        if getattr(d, "candidate_selector", None) is not None:  # DFlash 2: the selector walk's greedy path (no trees)
            walk = d.draft(hidden, anchor)
            q, order = walk.q()[0].sort(dim=-1, descending=True)
            path_q = None
            if not self.sampling.greedy:
                K = d.block_size - 1
                pos = torch.arange(p + 1, p + 1 + K, device=self.device)[None]
                path_q = selector_path_probs(d, hidden, d.logits(hidden), pos[:, 0] - 1,  # the anchor's position
                                             pos, truth.tokens.to(self.device), self.sampling)[0].tolist()
            return Proposal(walk.tokens[0].tolist(), q.log().tolist(), walk.candidates[0].gather(-1, order).tolist(),
                            path_q)
        return d.logits(hidden)[0]


@dataclass
class Proposal:
    tokens: list[int]  # argmax per block position 1..bs-1
    topk_logp: list[list[float]]  # [bs-1][k], descending
    topk_idx: list[list[int]]
    # at a sampled setting: q_k(y_k), the proposal's warped probability of the ground-truth path's token at each
    # position (0.0 past the path's end); None: a point mass on `tokens` (prompt lookup, greedy drafts)
    path_q: list[float] | None = None


def proposal_width(budgets: Sequence[int]) -> int:
    """The top-k a proposal needs for these tree budgets (a budget-b tree uses at most b children a node)."""
    return max([1, *budgets])


def packed_topk(logits_RV: torch.Tensor, k: int) -> torch.Tensor:
    """[R, V] logits → [R, 1 + 2k] float32 on their device: argmax, the k largest log-softmax values
    (descending), their token ids. One tensor so that the host gets it in one transfer; ids are exact as
    float32 (below 2^24, any vocabulary)."""
    logits = logits_RV.float()
    k = max(1, min(k, logits.shape[-1]))
    logp = torch.log_softmax(logits, dim=-1)
    vals, idx = logp.topk(k, dim=-1)
    arg = logits.argmax(-1)
    return torch.cat([arg[:, None].float(), vals, idx.float()], dim=1)


def unpack_topk(packed_RX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`packed_topk`'s result → (argmax [R] long, top-k log-probs [R, k], top-k ids [R, k] long)."""
    k = (packed_RX.shape[-1] - 1) // 2
    return packed_RX[..., 0].long(), packed_RX[..., 1:1 + k], packed_RX[..., 1 + k:].long()


def reduce_logits(logits_KV: torch.Tensor, k: int, path_q: list[float] | None = None) -> Proposal:
    arg_K, logp_Kk, idx_Kk = unpack_topk(packed_topk(logits_KV, k).cpu())  # one transfer
    return Proposal(arg_K.tolist(), logp_Kk.tolist(), idx_Kk.tolist(), path_q)


class BatchedDrafterProposer:
    """Every round position's proposal of a task from the drafter's training forward (`DFlashDrafter.forward`),
    whose mask shows the block at anchor a the context before a and its own block: what the sequential
    cache path shows it, full and windowed layers alike (tested equal).

    On a task's first call: anchors p = P .. P+N−2 (every position a round can start at, since rounds run
    while p − P < N − 1), `anchor_chunk` per forward (memory: the logits are anchor_chunk·(bs−1)·V floats);
    logits, argmax and top-`k` log-probs on the device, one transfer per chunk. The top-k stay CPU tensors;
    the `Proposal` for p is built when a round asks for it. One task is held at a time: `simulate_task`
    asks for one task's positions (vanilla pass, then each tree budget) before the next task's."""

    def __init__(self, drafter, autocast: bool | None = None, k: int = 1, anchor_chunk: int = 64,
                 sampling: Sampling = GREEDY):
        if anchor_chunk < 1:
            raise ValueError(f"anchor_chunk must be >= 1, got {anchor_chunk}")
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
        self.autocast = autocast
        self.k = int(k)
        self.anchor_chunk = int(anchor_chunk)
        self.sampling = sampling  # at T > 0 each proposal also carries q_k of the path's tokens (`Proposal.path_q`)
        self._truth: TaskTruth | None = None
        self._table: tuple[torch.Tensor, ...] | None = None

    def __call__(self, truth: TaskTruth, p: int) -> Proposal:
        i = p - truth.prompt_len
        if not 0 <= i < truth.n_new - 1:
            raise ValueError(f"{truth.name}: no round starts at position {p}; rounds start at "
                             f"{truth.prompt_len}..{truth.prompt_len + truth.n_new - 2}")
        if truth is not self._truth:
            self._table, self._truth = self.propose_all(truth), truth
        arg_NK, logp_NKk, idx_NKk = self._table[:3]
        q = self._table[3][i].tolist() if len(self._table) > 3 else None
        return Proposal(arg_NK[i].tolist(), logp_NKk[i].tolist(), idx_NKk[i].tolist(), q)

    @torch.no_grad()
    def propose_all(self, truth: TaskTruth) -> tuple[torch.Tensor, ...]:
        """(argmax [N−1, bs−1], top-k log-probs [N−1, bs−1, k], top-k ids [N−1, bs−1, k]) on the CPU, row i
        for the round starting at prompt_len + i; at a sampled setting also q of the path's tokens [N−1, bs−1]."""
        d, P = self.drafter, truth.prompt_len
        feats_TLH = truth.features.to(self.device)
        tokens_T = truth.tokens.to(self.device)
        anchors = torch.arange(P, P + truth.n_new - 1)
        K = d.block_size - 1
        offsets_K = torch.arange(1, K + 1, device=self.device)
        packed, path_q = [], []
        for chunk in anchors.split(self.anchor_chunk):
            last = int(chunk[-1])  # its block sees the context before it: the chunk needs features < last
            chunk_n = chunk.to(self.device)
            with drafter_autocast(d, self.autocast):
                hidden_1nKH = d(feats_TLH[None, :last], chunk_n[None], tokens_T[chunk_n][None])
            logits_nKV = d.logits(hidden_1nKH[0])  # outside autocast, float32 (as DrafterProposer)
            top = packed_topk(logits_nKV.flatten(0, 1), self.k)
            selector = getattr(d, "candidate_selector", None)
            if selector is not None:  # DFlash 2: the draft is the selector walk's greedy path
                top[:, 0] = greedy_draft(d, hidden_1nKH[0], tokens_T[chunk_n]).flatten().float()
            packed.append(top.cpu())  # one transfer per chunk
            if not self.sampling.greedy:
                pos_nK = chunk_n[:, None] + offsets_K
                path_q.append((selector_path_probs(d, hidden_1nKH[0], logits_nKV, chunk_n, pos_nK, tokens_T,
                                                   self.sampling) if selector is not None else
                               path_token_probs(logits_nKV, pos_nK, tokens_T, self.sampling)).cpu())
        table = tuple(x.reshape(len(anchors), K, *x.shape[1:]) for x in unpack_topk(torch.cat(packed)))
        return table + (torch.cat(path_q),) if path_q else table


def path_token_probs(logits_nKV: torch.Tensor, pos_nK: torch.Tensor, tokens_T: torch.Tensor,
                     sampling: Sampling) -> torch.Tensor:
    """q[n, k]: the warped probability `logits_nKV[n, k]` gives the path token at position pos_nK[n, k] (0 past
    the path's end)."""
    T = tokens_T.numel()
    inside = pos_nK < T
    want = tokens_T[pos_nK.clamp(max=T - 1)]
    q = warp(logits_nKV, sampling).gather(-1, want[..., None])[..., 0]
    return torch.where(inside, q, torch.zeros_like(q))


def selector_path_probs(drafter, hidden_nKH: torch.Tensor, logits_nKV: torch.Tensor, anchors_n: torch.Tensor,
                        pos_nK: torch.Tensor, tokens_T: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """DFlash 2's q[n, k] of the path token at pos_nK[n, k] (`anchors_n`: the blocks' anchor positions): the sampled selector walk's probability of it after
    the path's previous token (`CandidateSelector.path_probs`, q = softmax(scores / T) over the k candidates;
    top_p / top_k warp the target's p only); 0 past the path's end."""
    T = tokens_T.numel()
    path = tokens_T[pos_nK.clamp(max=T - 1)]
    q = drafter.candidate_selector.path_probs(hidden_nKH, logits_nKV, tokens_T[anchors_n], path, sampling.temperature)
    return torch.where(pos_nK < T, q, torch.zeros_like(q))


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
    group: str = ""  # the prompt it continues (sampled truths: several tasks a prompt; CIs resample prompts)

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
                  budgets: Sequence[int] = (), sampling: Sampling = GREEDY, seed: int = 0) -> TaskResult:
    """Vanilla rounds (and tree rounds per budget) on `truth`. At a sampled setting (`sampling`, with the truth's
    `path_p`) a drafted position is accepted by a coin of probability min(1, q(y)/p(y)) for the path's token y
    (`rejection` module doc: the real loop's law), seeded by (`seed`, task name); a point-mass proposal (prompt
    lookup) is accepted when its token is y, as at T = 0. Trees are verified greedily only: no budgets at T > 0."""
    P, N, K = truth.prompt_len, truth.n_new, block_size - 1
    tokens = truth.tokens.tolist()
    kmax = proposal_width(budgets)
    memo: dict[int, Proposal] = {}
    sampled = not sampling.greedy
    if sampled and truth.path_p is None:
        raise ValueError(f"{truth.name}: a sampled evaluation needs the ground truth's path probabilities")
    if sampled and budgets:
        raise ValueError("tree budgets are verified greedily only: simulate them at T = 0")
    path_p = truth.path_p.tolist() if sampled else []
    coins = random.Random(f"{seed}:{truth.name}")

    def propose(p: int) -> Proposal:
        if p not in memo:
            out = proposer(truth, p)
            got = len(out.tokens) if isinstance(out, Proposal) else out.shape[0]
            if got != K:
                raise ValueError(f"proposer returned {got} positions, expected block_size-1={K}")
            if isinstance(out, Proposal):
                memo[p] = out
            else:
                q = None
                if sampled:
                    pos = torch.arange(p + 1, p + 1 + K, device=out.device)
                    q = path_token_probs(out, pos, truth.tokens.to(out.device), sampling).tolist()
                memo[p] = reduce_logits(out, kmax, q)
        return memo[p]

    def target_after(p: int) -> list[int]:
        avail = N - 1 - (p - P)
        return tokens[p + 1:p + 1 + min(K, avail)]

    def accepted(prop: Proposal, p: int, want: list[int]) -> int:
        if not sampled or prop.path_q is None:
            return _matched(prop.tokens, want)
        m = 0
        for k in range(len(want)):
            py = path_p[p + 1 + k - P]
            if not coins.random() < min(1.0, prop.path_q[k] / py if py > 0 else 1.0):
                break
            m += 1
        return m

    res = TaskResult(truth.name, P, N, reached=[0] * K, accepted=[0] * K, group=truth.group)
    p = P
    while p - P < N - 1:
        prop, want = propose(p), target_after(p)
        m = accepted(prop, p, want)
        for k in range(min(m + 1, len(want))):  # positions reached: all before matched
            res.reached[k] += 1
            res.accepted[k] += int(k < m)
        res.taus_vanilla.append(m + 1)
        p += m + 1
    for b in budgets:
        taus, p, n_nodes = [], P, 0
        while p - P < N - 1:
            prop, want = propose(p), target_after(p)
            depth, nodes = tree_round(prop.topk_logp, prop.topk_idx, want, b)
            taus.append(depth + 1)
            n_nodes += nodes
            p += depth + 1
        res.taus_tree[int(b)] = taus
        res.nodes_tree[int(b)] = n_nodes
    return res


def simulate(truths: Sequence[TaskTruth], proposer: Proposer, block_size: int,
             budgets: Sequence[int] = (), sampling: Sampling = GREEDY, seed: int = 0) -> list[TaskResult]:
    return [simulate_task(t, proposer, block_size, budgets, sampling, seed) for t in truths]


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


# eval.proposer: how the drafter's proposals are computed for the simulated rounds. Each entry builds a
# proposer from (drafter, k), k = `proposal_width(budgets)`.
DRAFTER_PROPOSERS: Registry[Callable[..., Proposer]] = Registry("eval.proposer", {
    "batched": lambda drafter, k, sampling=GREEDY: BatchedDrafterProposer(drafter, k=k, sampling=sampling),
    # logits: simulate_task reduces them to k (and to the path's q at a sampled setting)
    "sequential": lambda drafter, k, sampling=GREEDY: DrafterProposer(drafter, sampling=sampling),
})
