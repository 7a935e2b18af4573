"""Headroom beside every τ (docs/evaluation.md, "Headroom: the oracle, reach and the target's entropy").

- **The oracle τ** (`eval.oracle.samples` > 0): a drafter that proposes, at block position k of the round anchored
  at p, the target's own marginal of token p+k given the true prefix up to p: q_k(v) = E_x[p(v | y_≤p, x_<k)] over
  the target's own continuations x at the setting, estimated from `samples` of them (the mean of their warped
  distributions: q_1 is exact, later positions average the target's conditionals). It is scored by the same rule,
  coins and ground truth as the drafter (`acceptance.simulate`), under the `proposal` policy: `sampled` (accepted
  by min(1, q/p) coins on the path's token) or `argmax` (the draft is argmax q_k, accepted iff it is the path's
  token). At T = 0 the marginal is a point mass on the target's greedy tokens, which the ground truth is: the
  oracle proposes the path and τ is the whole block (clipped), with no target forward.
  What it bounds: τ of any drafter that, like DFlash, drafts a block in one pass from the prefix alone (position
  k never sees the drafts before it), scored by this rule, up to the estimate's noise (finitely many samples
  flatten q_k toward the tokens they drew). What it does not bound: a drafter that conditions on its own earlier
  drafts (autoregressive drafting, DFlash 2's selector walk, trees), which can beat the marginal; nor wall-clock
  speed (no drafter cost is counted).
- **Reach per position**: the share of the drafter's rounds that reach block position k (`eval/reach_posNN`).
- **The target's entropy along the ground truth**: the entropy (nats) of the target's distribution at every
  continuation token, warped by the setting when it samples, its plain softmax (T = 1) at T = 0 (greedy's warped
  distribution is a point mass): mean, median and share below 0.1 nats.
- **The gap closed**: (τ − τ_prompt_lookup) / (τ_oracle − τ_prompt_lookup).

The oracle's rounds and the entropies depend on the target, the ground truth, the setting, the samples, the seed,
the block size and the proposal policy, not on the drafter: they are cached as JSON under
`<eval.cache_dir>/headroom/<key>.json` (atomic write), so a campaign computes them once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Sequence

import torch

from dflash.evaluation.acceptance import Proposal, TaskResult, simulate
from dflash.evaluation.ground_truth import TaskTruth
from dflash.target.sampling import Sampling, warp

log = logging.getLogger(__name__)

PROPOSALS = ("sampled", "argmax")
LOW_ENTROPY_NATS = 0.1
FORMAT = 1


class MarginalOracle:
    """The oracle drafter as a proposer `(truth, p) -> Proposal` (module doc)."""

    def __init__(self, target, sampling: Sampling, samples: int, block_size: int, seed: int,
                 proposal: str = "sampled", memo: dict | None = None):
        """`memo`: a dict that oracles of one target and one ground truth share, so that a round anchored where
        another policy's oracle already anchored one reuses its marginals (they do not depend on the policy)."""
        if proposal not in PROPOSALS:
            raise ValueError(f"eval.proposal={proposal!r}; expected one of {', '.join(PROPOSALS)}")
        self.target, self.sampling, self.samples = target, sampling, max(1, int(samples))
        self.K, self.seed, self.proposal = block_size - 1, int(seed), proposal
        self.memo = memo

    def _path(self, truth: TaskTruth, p: int) -> list[int]:
        toks = truth.tokens.tolist()
        return [toks[p + k] if p + k < len(toks) else 0 for k in range(1, self.K + 1)]

    @torch.no_grad()
    def marginals(self, truth: TaskTruth, p: int) -> torch.Tensor:
        """q [K, V]: the mean of the target's warped distributions at positions p+1..p+K over `samples` of its own
        continuations of tokens[:p+1] (seeded by seed, task and p)."""
        key = (truth.name, p, self.samples, self.K, self.seed, self.sampling)
        if self.memo is not None and key in self.memo:
            return self.memo[key]
        from dflash.data.writing import write_continuations
        prefix = truth.tokens[:p + 1].tolist()
        gen = torch.Generator(device=self.target.device)
        gen.manual_seed(int.from_bytes(hashlib.sha256(f"{self.seed}:{truth.name}:{p}".encode()).digest()[:7], "big"))
        rows = [prefix] * self.samples
        seq = (write_continuations(self.target, rows, p + self.K, self.sampling, gen, decode="cache")
               if self.K > 1 else torch.tensor(rows))
        logits = self.target.logits(seq)[:, p:p + self.K]
        q = warp(logits, self.sampling).mean(0)
        if self.memo is not None:
            self.memo[key] = q
        return q

    def __call__(self, truth: TaskTruth, p: int) -> Proposal:
        path = self._path(truth, p)
        if self.sampling.greedy:  # the greedy marginal is the target's greedy path: the ground truth itself
            return Proposal(path, [[0.0]] * self.K, [[t] for t in path], None)
        q = self.marginals(truth, p).cpu()
        arg = q.argmax(-1)
        inside = [p + k < truth.tokens.numel() for k in range(1, self.K + 1)]
        path_q = [float(q[k, t]) if inside[k] else 0.0 for k, t in enumerate(path)]
        top = q.gather(-1, arg[:, None]).clamp_min(1e-30).log()
        return Proposal(arg.tolist(), top.tolist(), arg[:, None].tolist(),
                        path_q if self.proposal == "sampled" else None)


def entropy_profile(target, truths: Sequence[TaskTruth], sampling: Sampling) -> list[float]:
    """The target's entropy (nats) at every continuation token of `truths` (module doc)."""
    at = sampling if not sampling.greedy else Sampling(1.0, 1.0, 0)
    out: list[float] = []
    with torch.no_grad():
        for t in truths:
            logits = target.logits(t.tokens[None])[0, t.prompt_len - 1:-1]
            probs = warp(logits, at)
            out += (-(probs * probs.clamp_min(1e-30).log()).sum(-1)).cpu().tolist()
    return out


def headroom_key(gt_key: str, sampling: Sampling, samples: int, seed: int, block_size: int, proposal: str) -> str:
    payload = {"format": FORMAT, "ground_truth": gt_key, "sampling": sampling.as_dict(), "samples": int(samples),
               "seed": int(seed), "block_size": int(block_size), "proposal": proposal}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _results_json(results: Sequence[TaskResult]) -> list[dict]:
    return [{"name": r.name, "prompt_len": r.prompt_len, "n_new": r.n_new, "group": r.group, "taus": r.taus_vanilla,
             "reached": r.reached, "accepted": r.accepted} for r in results]


def _results_from(items: list[dict]) -> list[TaskResult]:
    return [TaskResult(d["name"], d["prompt_len"], d["n_new"], taus_vanilla=d["taus"], reached=d["reached"],
                       accepted=d["accepted"], group=d["group"]) for d in items]


def oracle_and_entropy(target, truths: Sequence[TaskTruth], sampling: Sampling, samples: int, seed: int,
                       block_size: int, proposal: str, gt_key: str, cache_dir: str = "",
                       memo: dict | None = None) -> tuple[list[TaskResult], list[float], float]:
    """(the oracle's rounds per truth, [] when `samples` is 0; the entropies; seconds spent, 0 on a cache hit),
    through the cache file (module doc). `memo`: shared marginals (`MarginalOracle`), e.g. between the two
    policies' oracles on one ground truth."""
    path = Path(cache_dir) / "headroom" / f"{headroom_key(gt_key, sampling, samples, seed, block_size, proposal)}.json" \
        if cache_dir else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return _results_from(data["oracle"]), [float(x) for x in data["entropy"]], 0.0
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("eval headroom cache %s is unreadable (%s); computing it again", path, e)
    t0 = time.perf_counter()
    oracle = simulate(truths, MarginalOracle(target, sampling, samples, block_size, seed, proposal, memo), block_size,
                      (), sampling, seed) if samples > 0 else []
    entropy = entropy_profile(target, truths, sampling)
    seconds = time.perf_counter() - t0
    if path is not None:
        from dflash.atomic import atomic_write_text
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"oracle": _results_json(oracle), "entropy": entropy,
                                            "seconds": seconds, "device": str(getattr(target, "device", "?"))}))
    return oracle, entropy, seconds


def reach_metrics(results: Sequence[TaskResult], block_size: int, prefix: str = "eval/") -> dict[str, float]:
    """`<prefix>reach_posNN`: the share of rounds that reach block position k = 1..bs-1."""
    rounds = sum(len(r.taus_vanilla) for r in results)
    return {f"{prefix}reach_pos{k + 1:02d}": sum(r.reached[k] for r in results) / rounds if rounds else math.nan
            for k in range(block_size - 1)}


def entropy_metrics(entropy: Sequence[float]) -> dict[str, float]:
    if not entropy:
        return {}
    xs = sorted(entropy)
    n = len(xs)
    median = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return {"eval/target_entropy_mean": sum(xs) / n, "eval/target_entropy_median": median,
            "eval/target_entropy_below_0.1": sum(x < LOW_ENTROPY_NATS for x in xs) / n}


def gap_closed(tau: float, tau_prompt_lookup: float, tau_oracle: float) -> float:
    """(τ − τ_PL) / (τ_oracle − τ_PL); NaN when the oracle does not beat prompt lookup."""
    den = tau_oracle - tau_prompt_lookup
    return (tau - tau_prompt_lookup) / den if den > 0 else math.nan


def oracle_tau(results: Sequence[TaskResult], level: float, n_boot: int):
    """The oracle's τ pooled over its rounds and its interval over prompts (the evaluator's `pooled_ci`)."""
    from dflash.evaluation.report import _sums
    from dflash.evaluation.stats import pooled_ci
    s, n = _sums(results)
    return sum(s) / max(sum(n), 1), pooled_ci(s, n, level, n_boot)


def headroom_figures(target, truths: Sequence[TaskTruth], results: Sequence[TaskResult], tau: float,
                     stats: dict[str, float], block_size: int, cfg, sampling: Sampling,
                     gt_key: str, policy: str = "sampled") -> dict[str, float]:
    """The evaluation's headroom figures (module doc; `cfg`: the EvalConfig; `policy`: the proposal policy the
    drafter was scored under, `engines.resolve_policy`, so the oracle proposes alike):
    reach per position, the entropy profile and, with `eval.oracle.samples`, the oracle τ with its interval over
    prompts, the oracle's own reach and the share of the prompt-lookup-to-oracle gap the drafter closes."""
    samples = cfg.oracle.samples
    oracle, entropy, seconds = oracle_and_entropy(target, truths, sampling, samples, cfg.seed, block_size,
                                                  policy, gt_key, cfg.cache_dir)
    out = {**reach_metrics(results, block_size), **entropy_metrics(entropy)}
    if oracle:
        tau_oracle, ci = oracle_tau(oracle, cfg.ci_level, cfg.bootstrap)
        out.update({"eval/tau_oracle": tau_oracle, "eval/tau_oracle_ci_low": ci.low,
                    "eval/tau_oracle_ci_high": ci.high, "eval/oracle_samples": float(samples),
                    "eval/oracle_seconds": seconds, **reach_metrics(oracle, block_size, "eval/oracle/")})
        if "eval/tau_prompt_lookup" in stats:
            out["eval/oracle_gap_closed"] = gap_closed(tau, stats["eval/tau_prompt_lookup"], tau_oracle)
    return out


def headline_part(st: dict[str, float]) -> str:
    """The headline's headroom clause: oracle τ and the gap closed, reach of positions 1-4, the entropy profile."""
    out = ""
    if "eval/tau_oracle" in st:
        out += (f"; oracle τ {st['eval/tau_oracle']:.3f} [{st['eval/tau_oracle_ci_low']:.3f}, "
                f"{st['eval/tau_oracle_ci_high']:.3f}] ({st['eval/oracle_samples']:.0f} samples a round)")
        if not math.isnan(st.get("eval/oracle_gap_closed", math.nan)):
            out += f", {100 * st['eval/oracle_gap_closed']:.0f}% of the prompt-lookup-to-oracle gap closed"
    reach = [st[k] for k in sorted(st) if k.startswith("eval/reach_pos")]
    if reach:
        out += "; rounds reaching position " + ", ".join(f"{k + 1}: {100 * r:.1f}%" for k, r in enumerate(reach[:4]))
    if "eval/target_entropy_mean" in st:
        out += (f"; target entropy {st['eval/target_entropy_mean']:.2f} nats mean, "
                f"{st['eval/target_entropy_median']:.2f} median, "
                f"{100 * st['eval/target_entropy_below_0.1']:.0f}% of tokens < {LOW_ENTROPY_NATS} nats")
    return out


def reach_row(st: dict[str, float], positions: int) -> str:
    """The per-position table's row of the share of rounds reaching each position."""
    cells = [st.get(f"eval/reach_pos{k + 1:02d}", math.nan) for k in range(positions)]
    return "| share of rounds | " + " | ".join("-" if math.isnan(c) else f"{c:.3f}" for c in cells) + " |"


SUMMARY_HEAD = ["τ oracle", "gap closed", "target entropy mean / median / < 0.1 nats"]


def summary_cells(g, ci) -> list[str]:
    """The summary table's headroom cells of one suite and setting (`g(key)`: its figure or NaN; `ci(key)`: the
    figure with its interval)."""
    gap = g("oracle_gap_closed")
    ent = "-" if math.isnan(g("target_entropy_mean")) else (
        f"{g('target_entropy_mean'):.2f} / {g('target_entropy_median'):.2f} / {g('target_entropy_below_0.1'):.2f}")
    return [ci("tau_oracle"), "-" if math.isnan(gap) else f"{gap:.2f}", ent]
