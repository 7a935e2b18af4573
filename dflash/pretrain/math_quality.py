"""The math target's quality bar (docs/target.md), measured on a written target folder at its served setting
(its generation_config.json):

- held-out final-answer accuracy: the target's own sampled solutions to the frozen held-out suite, the first
  "Answer: n" of each against the suite's answer;
- the entropy profile along those samples: the entropy (nats) of the target's T = 1 next-token distribution at every
  token it wrote, its mean, median and the share below 0.1 nats;
- the ground truth's degeneracy (`dflash.data.degeneracy`: tokens in repeated 16-grams, continuations ending in a
  cycle) and whether each sample ends with EOS right after its answer line;
- the marginal oracle's τ at block size 16 (`marginal_oracle_tau`).

The marginal oracle is the best a one-pass drafter can do: it drafts position k of a block from the target's
marginal distribution of the k-th next token given the committed prefix, without seeing its own earlier drafts,
and the target verifies the block by exact speculative sampling (`dflash.evaluation.rejection.accept_round`), so
it pays for every fork in the target's text. The marginals are estimated from `rollouts` sampled continuations of
the prefix: each draft is the k-th token of a rollout chosen at random, and its q is that empirical distribution
(the rejection step uses exactly the q the draft came from, so the loop stays lossless at any `rollouts`).
`dflash.evaluation.oracle` is another oracle: it proposes the target's own greedy continuation, so its τ is the
block size by construction and says nothing about the target.
"""
from __future__ import annotations

import math
import statistics

import torch

from dflash.data.degeneracy import summarize
from dflash.data.math_problems import ANSWER_RE
from dflash.data.writing import ends_at_stop, write_continuations
from dflash.evaluation.rejection import accept_round
from dflash.target.sampling import Sampling, warp

LOW_ENTROPY_NATS = 0.1
# the quality bar: what `check_bar` holds the figures to
# mean_entropy: [low, high] nats. Qwen3-8B's solutions: over half the tokens near zero, the 80th percentile at 0.67
# nats (Wang et al. 2025, arXiv 2506.01939), so a mean of a few tenths; below 0.05 the target is a lookup table (the
# first math target read 0.000), above 1.0 it is the code target's regime (1.81 along its own T = 1 samples).
BAR = {"accuracy": 0.90, "share_below_0.1": 0.5, "mean_entropy": (0.05, 1.0), "in_repeat16": 0.10,
       "cycle_share": 0.05, "eos_after_answer": 0.95, "oracle_tau": 6.0}
QWEN3_8B_P80_NATS = 0.672  # the 80th percentile of Qwen3-8B's token entropy on its chain of thought (the paper above)


def load_target(folder: str, device: str = "cpu"):
    """The written folder through `dflash.target.model.Target`, as every run loads a target."""
    from dflash.target.model import Target, TargetConfig, read_target_meta
    meta = read_target_meta(folder)
    return Target(TargetConfig(name=meta.get("name", "target"), path=str(folder), mask_token_id=meta["mask_token_id"],
                               layer_ids=list(meta["layer_ids"]), device=device))


def _pad_right(rows: list[list[int]], pad: int) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


@torch.no_grad()
def sample_solutions(target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                     generator: torch.Generator, batch_size: int) -> list[list[int]]:
    """Each prompt's continuation at `sampling`, cut after its first EOS (kept) or at `max_new_tokens`."""
    eos = target.tokenizer.eos_token_id
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        seq = write_continuations(target, chunk, max(len(p) for p in chunk) + max_new_tokens, sampling, generator)
        for p, row in zip(chunk, seq.tolist()):
            cont = row[len(p):len(p) + max_new_tokens]
            out.append(cont[:ends_at_stop(cont, 0, [eos])])
    return out


@torch.no_grad()
def entropies(target, prompts: list[list[int]], continuations: list[list[int]], batch_size: int) -> list[float]:
    """The entropy (nats) of the target's T = 1 distribution at every continuation token, over all continuations."""
    out: list[float] = []
    pairs = [(p, c) for p, c in zip(prompts, continuations) if c]
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        ids = _pad_right([p + c for p, c in chunk], target.tokenizer.pad_token_id or 0)
        logp = torch.log_softmax(target.logits(ids).float(), -1)
        ent = -(logp.exp() * logp).sum(-1).cpu()  # [B, T]: position t predicts token t + 1
        for r, (p, c) in enumerate(chunk):  # causal: padding after a row never reaches its positions
            out.extend(ent[r, len(p) - 1:len(p) + len(c) - 1].tolist())
    return out


def answer_of(text: str) -> int | None:
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None


def ends_after_answer(target, cont: list[int]) -> bool:
    """Whether the continuation ends with EOS directly after its answer line ("Answer: n", then EOS)."""
    if not cont or cont[-1] != target.tokenizer.eos_token_id:
        return False
    text = target.tokenizer.decode(cont[:-1])
    m = ANSWER_RE.search(text)
    return m is not None and not text[m.end():].strip()


@torch.no_grad()
def marginal_oracle_tau(target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                        generator: torch.Generator, block_size: int = 16, rollouts: int = 64) -> dict:
    """τ of the marginal oracle (module doc) over `prompts`, each decoded to EOS or `max_new_tokens`; every round
    of all prompts still decoding is one batch of rollouts. τ per round = tokens committed (the last round clipped
    at the end, as the evaluation clips it); τ = tokens / rounds over all prompts."""
    eos, K = target.tokenizer.eos_token_id, block_size - 1
    committed = [[] for _ in prompts]
    taus: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        prefixes = [prompts[i] + committed[i] for i in active]
        rows = [p for p in prefixes for _ in range(rollouts)]
        # transformers' cache: one prefill of the shortest prefix, then one step per token (not the static decoder's
        # walk from position 0, which would cost a whole prefix of steps every round)
        roll = write_continuations(target, rows, max(len(p) for p in prefixes) + K, sampling, generator, decode="cache")
        drafts, qs = [], []
        for a, p in enumerate(prefixes):
            block = roll[a * rollouts:(a + 1) * rollouts, len(p):len(p) + K]  # [R, K]
            q = torch.zeros(K, target.vocab_size)
            q.scatter_add_(1, block.T, torch.ones(K, rollouts))
            pick = torch.randint(0, rollouts, (K,), generator=generator, device=generator.device).cpu()
            drafts.append(block[pick, torch.arange(K)])
            qs.append(q / rollouts)
        logits = target.logits(_pad_right([p + d.tolist() for p, d in zip(prefixes, drafts)], 0)).float()
        still = []
        for a, i in enumerate(active):
            n = len(prefixes[a])
            p_K1V = warp(logits[a, n - 1:n + K], sampling)
            m, last = accept_round(p_K1V, drafts[a], qs[a].to(p_K1V.device), generator)
            new = drafts[a][:m].tolist() + [last]
            end = ends_at_stop(new, 0, [eos])
            new = new[:min(end, max_new_tokens - len(committed[i]))]
            committed[i] += new
            taus[i].append(len(new))
            if committed[i][-1] != eos and len(committed[i]) < max_new_tokens:
                still.append(i)
        active = still
    rounds = [t for per in taus for t in per]
    return {"tau": sum(rounds) / len(rounds), "block_size": block_size, "rollouts": rollouts, "rounds": len(rounds),
            "tokens": sum(rounds), "prompts": len(prompts)}


def quality_bar(target, tasks: list[dict], sampling: Sampling, max_new_tokens: int = 160, seed: int = 0,
                batch_size: int = 64, oracle_prompts: int = 16, rollouts: int = 64, block_size: int = 16) -> dict:
    """The module doc's figures on `tasks` ({"prompt", "answer"} each; the frozen held-out suite) at `sampling`."""
    gen = torch.Generator(device=target.device).manual_seed(seed)
    enc = target.tokenizer.encode
    prompts = [list(enc(t["prompt"])) for t in tasks]
    conts = sample_solutions(target, prompts, max_new_tokens, sampling, gen, batch_size)
    texts = [target.tokenizer.decode(c) for c in conts]
    correct = [answer_of(x) == int(t["answer"]) for x, t in zip(texts, tasks)]
    ent = entropies(target, prompts, conts, batch_size)
    degeneracy = summarize(conts)
    oracle = (marginal_oracle_tau(target, prompts[:oracle_prompts], max_new_tokens, sampling, gen, block_size,
                                  rollouts) if oracle_prompts > 0 else None)  # 0: the cheap figures alone
    return {"sampling": sampling.as_dict(), "problems": len(tasks), "seed": seed, "max_new_tokens": max_new_tokens,
            "accuracy": sum(correct) / len(correct),
            "entropy": {"tokens": len(ent), "mean": statistics.fmean(ent) if ent else math.nan,
                        "median": statistics.median(ent) if ent else math.nan,
                        "p80": statistics.quantiles(ent, n=5)[-1] if len(ent) > 1 else math.nan,
                        "share_below_0.1": sum(e < LOW_ENTROPY_NATS for e in ent) / max(len(ent), 1)},
            "degeneracy": {"in_repeat16": degeneracy["in_repeat16"], "cycle_share": degeneracy["cycle_share"],
                           "eos_after_answer": sum(ends_after_answer(target, c) for c in conts) / len(conts),
                           "mean_tokens": statistics.fmean(len(c) for c in conts)},
            "oracle": oracle, "examples": [{"prompt": t["prompt"], "sample": x, "answer": t["answer"]}
                                           for t, x in list(zip(tasks, texts))[:3]]}


def check_bar(q: dict) -> dict[str, bool]:
    """Which of the bar's lines the figures meet."""
    return {"accuracy": q["accuracy"] >= BAR["accuracy"],
            "share_below_0.1": q["entropy"]["share_below_0.1"] > BAR["share_below_0.1"],
            "mean_entropy": BAR["mean_entropy"][0] <= q["entropy"]["mean"] <= BAR["mean_entropy"][1],
            "in_repeat16": q["degeneracy"]["in_repeat16"] <= BAR["in_repeat16"],
            "cycle_share": q["degeneracy"]["cycle_share"] <= BAR["cycle_share"],
            "eos_after_answer": q["degeneracy"]["eos_after_answer"] >= BAR["eos_after_answer"],
            **({"oracle_tau": q["oracle"]["tau"] >= BAR["oracle_tau"]} if q["oracle"] else {})}


def format_bar(q: dict) -> str:
    ok = check_bar(q)
    mark = lambda k: "met" if ok[k] else "NOT met"  # noqa: E731
    e, d, o = q["entropy"], q["degeneracy"], q["oracle"]
    return "\n".join([
        f"quality bar at {q['sampling']} over {q['problems']} held-out problems (seed {q['seed']}):",
        f"  final-answer accuracy {q['accuracy']:.3f} (>= {BAR['accuracy']}: {mark('accuracy')})",
        f"  entropy along its own samples ({e['tokens']} tokens): mean {e['mean']:.3f} nats (in "
        f"[{BAR['mean_entropy'][0]}, {BAR['mean_entropy'][1]}]: {mark('mean_entropy')}), median {e['median']:.3f}, "
        f"80th percentile {e.get('p80', math.nan):.3f} (Qwen3-8B's: {QWEN3_8B_P80_NATS}), share below "
        f"{LOW_ENTROPY_NATS} nats {e['share_below_0.1']:.3f} (> {BAR['share_below_0.1']}: {mark('share_below_0.1')})",
        f"  ground truth: tokens in repeated 16-grams {d['in_repeat16']:.3f} (<= {BAR['in_repeat16']}: "
        f"{mark('in_repeat16')}), cycles {d['cycle_share']:.3f} (<= {BAR['cycle_share']}: {mark('cycle_share')}), "
        f"EOS right after the answer {d['eos_after_answer']:.3f} ({mark('eos_after_answer')}), "
        f"{d['mean_tokens']:.1f} tokens per solution",
        f"  marginal oracle tau at block size {o['block_size']}: {o['tau']:.2f} over {o['prompts']} problems, "
        f"{o['rounds']} rounds, {o['rollouts']} rollouts (>= {BAR['oracle_tau']}: {mark('oracle_tau')})"
        if o else "  marginal oracle: not measured"])


def suite_tasks(n: int) -> list[dict]:
    """The first `n` problems of the frozen held-out suite (dflash/evaluation/suites/math_heldout.json)."""
    import json
    from importlib import resources
    text = (resources.files("dflash.evaluation") / "suites" / "math_heldout.json").read_text(encoding="utf-8")
    return json.loads(text)[:n]


def record_quality_bar(folder: str, problems: int, oracle_prompts: int, rollouts: int, max_new_tokens: int = 160,
                       device: str = "auto", results_path: str = "", command: str = "") -> dict:
    """The bar on a written folder at its served setting: printed, stored as `quality_bar` in its dflash_target.json
    (rewritten atomically) and appended to `results_path` when given."""
    import json
    from pathlib import Path
    from dflash.atomic import atomic_write_text
    from dflash.devices import resolve_device
    from dflash.target.model import TARGET_META
    from dflash.target.sampling import read_generation_config
    target = load_target(folder, str(resolve_device(device)))
    q = quality_bar(target, suite_tasks(problems), read_generation_config(folder), max_new_tokens,
                    oracle_prompts=oracle_prompts, rollouts=rollouts)
    q["met"] = check_bar(q)
    q["command"] = command
    text = format_bar(q)
    print(text)
    meta_path = Path(folder) / TARGET_META
    meta = json.loads(meta_path.read_text())
    meta["quality_bar"] = q
    atomic_write_text(meta_path, json.dumps(meta, indent=1, default=str) + "\n")
    if results_path and Path(results_path).is_file():
        atomic_write_text(results_path, Path(results_path).read_text() + "\n## Quality bar\n\n```\n" + text + "\n```\n")
    return q
