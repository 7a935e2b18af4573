"""How each serving engine proposes a DFlash draft at a sampled setting, and so which τ it serves
(docs/evaluation.md, "The engine's proposal policy").

At T > 0 two proposal policies exist, and they give different τ from the same drafter on the same text:
- `argmax`: the draft is the drafter's most likely token at each block position (DFlash 2: the selector walk's
  best path, the greedy walk). The target verifies it as a point mass: the draft token x is accepted with
  probability p(x), which on a path drawn from the target is "accepted iff x equals the path's token".
- `sampled`: the draft token is drawn from the drafter's warped q_k (DFlash 2: the walk samples each step from
  the selector's softmax over its K candidates) and accepted with probability min(1, p/q), the textbook
  speculative sampling of Leviathan et al. / Chen et al.
Both are lossless; at T = 0 they are the same rule (the draft is the argmax, accepted when it is the target's).

What each engine does, read in its source (`ENGINES`, `EngineRule.source`):
- vLLM V1 proposes argmax drafts for DFlash 1 at every temperature (`vllm/v1/spec_decode/dflash.py`,
  `DFlashProposer._propose_block_drafting` returns `logits.argmax(dim=-1)`; its shared-EAGLE mode inherits the
  EAGLE proposer's argmax, "Always use argmax for sampling draft tokens", vllm PR #16899); its DFlash 2 loader
  walks the selector by sampling and verifies with the walk's q.
- SGLang proposes argmax drafts for DFlash 1 (`python/sglang/srt/speculative/dflash_worker.py`,
  `_greedy_sample_from_vocab_parallel_head`); its DFlash 2 loader walks the selector by sampling.
- llama.cpp proposes the drafter's top choice for DFlash 1 and the selector's best path for DFlash 2 at every
  temperature, and accepts a draft token when it equals the target's sample (`src/models/dflash.cpp`,
  `common/speculative.cpp`, as vendored in llama-cpp-python 0.3.36); `experiments.serve_check` runs it.
- z-lab's reference `dflash_generate` proposes argmax and accepts a draft while it equals the target's sample
  (an open pull request, e423446, would sample the drafts at the temperature instead); its mlx path moved from
  per-position sampling to argmax in z-lab/dflash PR #169 (sampling collapsed acceptance on a 30B target: 1.16
  accepted a step against 2.96). It has no DFlash 2 path.
- `textbook`: drafts sampled from q for both kinds, no engine's policy for DFlash 1: the evaluator's rule before
  `eval.engine` existed, kept to read and reproduce those figures.
"""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("argmax", "sampled")
AUTO = "auto"


@dataclass(frozen=True)
class EngineRule:
    dflash1: str  # the proposal policy for a DFlash 1 drafter at T > 0
    dflash2: str | None  # DFlash 2: argmax = the best-path (greedy) walk, sampled = the sampled walk; None: none served
    source: str  # where the policy was read


ENGINES: dict[str, EngineRule] = {
    "vllm": EngineRule("argmax", "sampled",
                       "vllm-project/vllm vllm/v1/spec_decode/dflash.py @ da4dbe38 (DFlashProposer: logits.argmax); "
                       "argmax drafts at every temperature since vllm PR #16899"),
    "sglang": EngineRule("argmax", "sampled",
                         "sgl-project/sglang python/sglang/srt/speculative/dflash_worker.py @ 7f151c5e "
                         "(_greedy_sample_from_vocab_parallel_head)"),
    "llamacpp": EngineRule("argmax", "argmax",
                           "llama.cpp @ 0c1e570 src/models/dflash.cpp, common/speculative.cpp (the copy vendored in "
                           "llama-cpp-python 0.3.36); checked end to end by experiments.serve_check"),
    "zlab": EngineRule("argmax", None,
                       "z-lab/dflash dflash/model.py @ 44947fb: dflash_generate drafts sample(draft_logits) at "
                       "temperature 0 (argmax) and accepts while they equal sample(target logits, T); no DFlash 2 "
                       "path there; its mlx path moved to argmax in z-lab/dflash PR #169"),
    "textbook": EngineRule("sampled", "sampled",
                           "drafts sampled from q, accepted with min(1, p/q) (Leviathan et al. 2023): the "
                           "evaluator's rule before eval.engine; no engine serves DFlash 1 this way"),
}


def is_dflash2(drafter) -> bool:
    return getattr(drafter, "candidate_selector", None) is not None


def resolve_policy(engine: str, proposal: str, dflash2: bool) -> str:
    """The proposal policy a drafter is scored under at T > 0: `proposal` when set (argmax / sampled),
    else the engine's for that drafter kind. Raises ValueError naming the key."""
    if engine not in ENGINES:
        raise ValueError(f"eval.engine={engine!r}; expected one of {sorted(ENGINES)}")
    if proposal != AUTO:
        if proposal not in POLICIES:
            raise ValueError(f"eval.proposal={proposal!r}; expected auto (the engine's), argmax or sampled")
        return proposal
    rule = ENGINES[engine]
    if dflash2 and rule.dflash2 is None:
        raise ValueError(f"eval.engine={engine!r} serves no DFlash 2 drafter ({rule.source}); use one of "
                         f"{sorted(k for k, r in ENGINES.items() if r.dflash2)} or set eval.proposal")
    return rule.dflash2 if dflash2 else rule.dflash1


def other_policy(policy: str) -> str:
    return POLICIES[1 - POLICIES.index(policy)]


def policy_name(policy: str, dflash2: bool) -> str:
    """How a table names the policy for the drafter kind."""
    if dflash2:
        return "best-path walk" if policy == "argmax" else "sampled walk"
    return "argmax drafts" if policy == "argmax" else "drafts sampled from q"


def serving_identity(engine: str, proposal: str) -> str:
    """What two evaluations must share for their τ to be compared (the promotion gate): the engine, and the
    override when one was set. Two drafter kinds under one engine compare (each under that engine's policy)."""
    return engine if proposal == AUTO else f"{engine}, eval.proposal={proposal}"


def setting_label(sampling, policy: str) -> str:
    """A report's setting in metric names: the sampling label, and at T > 0 the proposal policy after it
    (`t1/argmax`, `t1/sampled`); `t0` alone at T = 0, where both policies are the same rule."""
    return sampling.label if sampling.greedy else f"{sampling.label}/{policy}"


def policy_info(cfg, sampling, policy: str, dflash2: bool) -> dict:
    """What a report records of the policy it was scored under (its `info`; tables and the gate read it)."""
    if sampling.greedy:
        return {"engine": cfg.engine, "policy": "argmax", "policy_name": "greedy (the same for every engine)",
                "serving": serving_identity(cfg.engine, cfg.proposal)}
    rule = ENGINES[cfg.engine]
    engines_own = rule.dflash2 if dflash2 else rule.dflash1
    who = f"{cfg.engine}'s policy" if policy == engines_own else f"not {cfg.engine}'s policy"
    return {"engine": cfg.engine, "policy": policy, "policy_name": f"{policy_name(policy, dflash2)} ({who})",
            "serving": serving_identity(cfg.engine, cfg.proposal)}
