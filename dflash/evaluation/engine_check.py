"""An engine's rounds against the evaluator's simulated rounds on the engine's own tokens (docs/engines.md).

llama.cpp's policy (`common/speculative.cpp`): DFlash 1 proposes the drafter's argmax at every position and every
temperature, DFlash 2 the selector's best path (the greedy walk); a draft token is accepted when it equals the
target's token at that position (its argmax at T=0, its sample at T > 0). On the engine's own token stream that is
exactly the evaluator's greedy rule (`acceptance.simulate_task` at T=0: argmax drafts, or the walk's greedy path,
matched against the path's tokens), so the simulation here is `simulate_task` itself on a truth made of the
engine's tokens (`acceptance.BatchedDrafterProposer`: the same proposals as the sequential drafter, tested).

Where the two may part, and only there:
- **the engine's end-of-budget rule**: llama-server drafts at most `n_remaining − 1` tokens (`get_n_draft_max`), so
  a round never commits past the request's budget, and it stops drafting when one token is left. A request that
  ended at its budget is simulated on its tokens less the last one: the evaluator's clip (a round accepts at most
  the tokens left after its anchor) is then the engine's draft limit, and its rounds stop where the engine's do.
- **the engine's stop rule**: a request that ended at an end-of-generation token may, in its last round, have
  accepted draft tokens past that token (counted in its statistics, never returned); the simulation cannot see them.
- **numeric near-ties**: the drafter's and the target's forwards in llama.cpp (GGUF, float32) and in torch round
  differently, so a top-2 near-tie can flip. Allowed at most `MAX_MISMATCH_RATE` of the engine's rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash.evaluation.acceptance import Proposer, simulate_task
from dflash.evaluation.ground_truth import truths_from_tokens
from dflash.evaluation.prompts import Task
from dflash.target.sampling import GREEDY, Sampling

MAX_MISMATCH_RATE = 1e-3  # rounds the simulation does not reproduce, beyond the end rules (module doc)


@dataclass
class EngineRequest:
    """One request as the engine served it: its generated tokens and its verification rounds."""
    name: str
    prompt_ids: list[int]
    tokens: list[int]  # the generated token ids, the first one the target's token after the prompt
    rounds: list[tuple[int, int]]  # (accepted, drafted) per verification round, in order
    budget: int  # the request's n_predict
    ended_at_budget: bool  # the budget ended it (llama-server's stop_type "limit"), not a stop token


@dataclass
class RequestCheck:
    name: str
    engine: list[int]  # accepted draft tokens per engine round
    simulated: list[int]  # per simulated round
    mismatched: list[int] = field(default_factory=list)  # engine rounds (indices) the simulation does not have
    end_rule: bool = False  # the last round accepted past the stop token (allowed: module doc)
    draft_limit_errors: list[str] = field(default_factory=list)  # engine drafts other than the budget rule's


@dataclass
class CheckResult:
    setting: Sampling
    requests: list[RequestCheck]

    @property
    def rounds(self) -> int:
        return sum(len(r.engine) for r in self.requests)

    @property
    def mismatched(self) -> int:
        return sum(len(r.mismatched) for r in self.requests)

    @staticmethod
    def _tau(rounds: list[list[int]]) -> float:
        n = sum(len(r) for r in rounds)
        return 1.0 + sum(sum(r) for r in rounds) / n if n else math.nan

    @property
    def tau_engine(self) -> float:
        """Accepted tokens per verification round + 1, as llama-server reports it (its `mean len`)."""
        return self._tau([r.engine for r in self.requests])

    @property
    def tau_simulated(self) -> float:
        return self._tau([r.simulated for r in self.requests])

    @property
    def allowed(self) -> int:
        return math.floor(MAX_MISMATCH_RATE * self.rounds)

    @property
    def agrees(self) -> bool:
        return self.mismatched <= self.allowed and not any(r.draft_limit_errors for r in self.requests)


def _starts(accepted: list[int], start: int = 0) -> list[int]:
    """Each round's start position (its anchor's index in the generated tokens)."""
    out, p = [], start
    for m in accepted:
        out.append(p)
        p += m + 1
    return out


def compare_request(req: EngineRequest, simulated: list[int], block_size: int) -> RequestCheck:
    """The engine's rounds that the simulation has identically (same start, same accepted count); the last
    round of a request that stopped at a stop token may accept more (module doc)."""
    engine = [m for m, _ in req.rounds]
    out = RequestCheck(req.name, engine, simulated)
    sim = set(zip(_starts(simulated), simulated))
    n_tokens = len(req.tokens)
    for i, (p, m) in enumerate(zip(_starts(engine), engine)):
        if (p, m) in sim:
            continue
        last = i == len(engine) - 1
        if last and not req.ended_at_budget and m > n_tokens - 1 - p and (p, n_tokens - 1 - p) in sim:
            out.end_rule = True  # accepted past the stop token; the simulation accepted all it could see
            continue
        out.mismatched.append(i)
    for i, (p, (_, d)) in enumerate(zip(_starts(engine), req.rounds)):
        want = min(block_size - 1, req.budget - (p + 1) - 1)  # get_n_draft_max: n_remaining − 1
        if d != want:
            out.draft_limit_errors.append(f"round {i} at {p}: drafted {d}, the budget rule says {want}")
    return out


def simulate_requests(target, proposer: Proposer, block_size: int, requests: list[EngineRequest],
                      setting: Sampling) -> CheckResult:
    """The evaluator's rounds (argmax / best-path drafts matched against the path) on each request's tokens, less
    the last one where the budget ended it, compared with the engine's rounds."""
    tasks = [Task(r.name, "") for r in requests]
    conts = [r.tokens[:-1] if r.ended_at_budget else r.tokens for r in requests]
    keep = [i for i, c in enumerate(conts) if len(c) >= 2]  # a round needs a token after its anchor
    truths = truths_from_tokens(target, [tasks[i] for i in keep], [requests[i].prompt_ids for i in keep],
                                [conts[i] for i in keep], source="llama-server", sampling=setting)
    simulated = {t.name: [tau - 1 for tau in simulate_task(t, proposer, block_size, sampling=GREEDY).taus_vanilla]
                 for t in truths}
    return CheckResult(setting, [compare_request(r, simulated.get(r.name, []), block_size) for r in requests])


def format_results(results: list[CheckResult]) -> str:
    """The printed table: engine τ beside simulated τ per setting, with their agreement."""
    lines = ["| setting | requests | rounds | τ engine | τ simulated | rounds not reproduced (allowed) | "
             "stop-token last rounds | agree |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.setting.describe()} | {len(r.requests)} | {r.rounds} | {r.tau_engine:.4f} | "
                     f"{r.tau_simulated:.4f} | {r.mismatched} ({r.allowed}) | "
                     f"{sum(q.end_rule for q in r.requests)} | {'yes' if r.agrees else 'NO'} |")
    for r in results:
        for q in r.requests:
            if q.mismatched or q.draft_limit_errors:
                lines.append(f"{r.setting.label} {q.name}: engine rounds {q.engine}, simulated {q.simulated}"
                             + (f"; {'; '.join(q.draft_limit_errors)}" if q.draft_limit_errors else ""))
    return "\n".join(lines)
