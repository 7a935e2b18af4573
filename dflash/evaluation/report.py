"""`evaluate(drafter, target, cfg) -> EvalReport` and `make_evaluator(cfg)` for the trainer.

Metrics (all floats):
- `eval/tau_vanilla`: mean τ over all rounds of all tasks (pooled); `eval/tau_tree_{b}` per budget;
- `eval/acc_pos{k:02d}`, k = 1..bs−1: P(block position k accepted | reached) in vanilla rounds
  (only the positions some round reached: an unreached position has no acceptance, not 0.0);
- `eval/task/{name}/tau_vanilla`, `eval/task/{name}/tau_tree_{b}`;
- `eval/num_tasks`, `eval/rounds`, `eval/gt_consistency`, `eval/seconds`;
- the ground truth's degeneracy (`eval/gt_repeat4`, `eval/gt_in_repeat16`, `eval/gt_cycle_share`,
  `eval/gt_mean_tokens`; a suite cut from files also its human continuation's, `eval/human_*`) and, where it ends
  (`TruthSpec.ends`), which rule ended its continuations: `eval/gt_end_{eos,stop,dedent,length}` (shares);
- `eval/gt_copy_rate`: the mean over tasks of the fraction of the continuation's 8-grams that already occur
  earlier in prompt + continuation (`prompt_lookup.copy_rate`): how copyable the target's output is, the ceiling
  prompt lookup works against;
- with real decoding: `eval/real/tau`, `eval/real/lossless` (fraction of tasks whose output equals the
  target's greedy output token for token), `eval/real/match_frac` (mean fraction of tokens before the
  first divergence), `eval/real/tau_matches_sim` (fraction of tasks whose real τ sequence equals the
  simulated one; exact with `eval.proposer=sequential`, which drafts through the cache as the loop does — the
  batched proposer rounds differently under bf16 autocast, so a near-tie may flip there),
  `eval/real/tok_s`, `eval/real/greedy_tok_s`, `eval/real/speedup`; at a sampled setting the real loop draws its
  own samples, so it logs `eval/real/tau` with `_ci_low`/`_ci_high` over prompts, `eval/real/tau_in_sim_ci` and
  `eval/real/tok_s` (its losslessness is a law, checked by `tests/test_eval_sampling.py`, not a token match).

Uncertainty and baselines (`EvalReport.stats`; `all_metrics()` = metrics + stats):
- `eval/tau_vanilla_ci_low`, `eval/tau_vanilla_ci_high` (and `eval/tau_tree_{b}_ci_*`): the `eval.ci_level`
  percentile-bootstrap interval over prompts (`dflash.evaluation.stats`; `eval.bootstrap` replicates);
- `eval/tree_nodes_{b}`: tree nodes the target verifies per round at budget b (the verify cost beside τ;
  a vanilla round verifies the block: block_size − 1 drafted tokens);
- `eval/tau_prompt_lookup` (+ CI), `eval/tau_over_prompt_lookup` (ratio) and the paired
  `eval/delta_prompt_lookup` (+ CI): the prompt-lookup baseline on the same rounds' ground truth.

Headroom (`dflash.evaluation.headroom`, in `stats`; not for the in-training subset): `eval/reach_posNN` (share of
rounds reaching block position k), `eval/target_entropy_{mean,median,below_0.1}`, and with `eval.oracle.samples`
the oracle τ `eval/tau_oracle` (+ CI), `eval/oracle/reach_posNN`, `eval/oracle_gap_closed`, `eval/oracle_seconds`.

Losslessness is exact in exact arithmetic and holds token for token in float32 (tested). In bfloat16 a
block-verify forward and a one-token forward round differently, so the target's own greedy output already
depends on how it is chunked (`eval/gt_consistency` < 1 shows it); divergences there sit at near-ties.

Artifacts (`EvalReport.log_artifacts(logger)`): `eval/tasks.json`, `eval/tasks.md`,
`eval/acceptance_per_position.png`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dflash.evaluation import EvalConfig
from dflash.evaluation.acceptance import DRAFTER_PROPOSERS, Proposer, TaskResult, proposal_width, simulate
from dflash.evaluation.prompt_lookup import PromptLookupProposer, copy_rate
from dflash.evaluation.stats import paired_delta_ci, pooled_ci
from dflash.data.degeneracy import summarize
from dflash.data.stops import END_REASONS
from dflash.data.writing import first_end
from dflash.evaluation.ground_truth import TaskTruth, TruthSpec, decoder, end_reasons, load_or_build_ground_truth
from dflash.evaluation.engines import is_dflash2, policy_info, resolve_policy, setting_label
from dflash.evaluation.sampled_decode import sampled_speculative_decode
from dflash.target.sampling import GREEDY, Sampling
from dflash.evaluation.prompts import Suite, Task, objective_suite, suite_label
from dflash.evaluation.speculative import greedy_decode, speculative_decode

log = logging.getLogger(__name__)


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|#~])")


def markdown_escape(text: str) -> str:
    """`text` with markdown's inline markup escaped, so a task named `__future__` reads as itself, not in bold."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


@dataclass
class EvalReport:
    metrics: dict[str, float]
    table: list[dict[str, Any]]  # one row per task
    acc_pos: list[float]  # vanilla P(accepted | reached) per block position 1..bs-1
    reached_pos: list[int]
    block_size: int
    budgets: list[int]
    info: dict[str, Any] = field(default_factory=dict)
    results: list[TaskResult] = field(default_factory=list, repr=False)
    stats: dict[str, float] = field(default_factory=dict)  # CIs, tree verify cost, prompt-lookup baseline
    baseline: list[TaskResult] = field(default_factory=list, repr=False)  # prompt lookup's rounds

    @property
    def sampling(self) -> Sampling:
        """The setting the rounds were verified at (greedy for reports made before sampled evaluation)."""
        d = self.info.get("sampling_setting")
        return Sampling(**d) if d else Sampling()

    def all_metrics(self) -> dict[str, float]:
        return {**self.metrics, **self.stats}

    def suite_metrics(self) -> dict[str, float]:
        """The suite's summary figures under `eval/suite/<suite>/...` (no per-task or per-position keys)."""
        name = self.info.get("suite_label") or self.info.get("suite", "suite")
        skip = ("eval/task/", "eval/acc_pos", "eval/reach_pos", "eval/oracle/", "eval/real/", "eval/seconds")
        return {f"eval/suite/{name}/{k[5:]}": v for k, v in self.all_metrics().items()
                if k.startswith("eval/") and not k.startswith(skip)}

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "tasks": self.table, "acc_pos": self.acc_pos,
                "reached_pos": self.reached_pos, "block_size": self.block_size, "budgets": self.budgets,
                "info": self.info, "stats": self.stats}

    def _rates(self) -> list[str]:
        return [f"{a:.2f}" if n else "-" for a, n in zip(self.acc_pos, self.reached_pos)]

    def _columns(self) -> list[tuple[str, str]]:
        cols = [("task", "task"), ("prompt_tokens", "prompt"), ("rounds", "rounds"),
                # headed by its setting: a table read alone (tasks.md in MLflow) never leaves T=1 and T=0 to guess
                ("tau_vanilla", f"τ {self.info.get('sampling', 'greedy (T=0)')} ({self.block_size - 1} drafted/round)")]
        if self.baseline:
            cols += [("tau_prompt_lookup", "τ prompt-lookup")]
        for b in self.budgets:  # DDTree budgets count tree nodes (liranringel/ddtree)
            cols += [(f"tau_tree_{b}", f"τ tree-{b} nodes"), (f"nodes_tree_{b}", "nodes/round")]
        if any("lossless" in r for r in self.table):  # the greedy real loop, checked token for token
            cols += [("real_tau", "τ real"), ("lossless", "lossless"), ("spec_tok_s", "spec tok/s"),
                     ("greedy_tok_s", "greedy tok/s")]
        elif any("real_tau" in r for r in self.table):  # the sampled real loop: its own samples, lossless in law
            cols += [("real_tau", "τ real (own samples)"), ("spec_tok_s", "spec tok/s")]
        return cols

    def _rows(self) -> list[list[str]]:
        def fmt(v):
            if isinstance(v, bool):
                return "yes" if v else "NO"
            if isinstance(v, float):
                return "nan" if math.isnan(v) else f"{v:.2f}"
            return str(v)
        cols = self._columns()
        rows = [[fmt(r.get(k, "")) for k, _ in cols] for r in self.table]
        m, st = self.metrics, self.stats

        def with_ci(key: str) -> str:
            v = m.get(key, st.get(key, float("nan")))
            lo, hi = st.get(f"{key}_ci_low", math.nan), st.get(f"{key}_ci_high", math.nan)
            return fmt(v) if math.isnan(lo) else f"{fmt(v)} [{fmt(lo)}, {fmt(hi)}]"
        mean = {"task": "ALL (pooled)", "prompt_tokens": "", "rounds": int(m.get("eval/rounds", 0)),
                "tau_vanilla": with_ci("eval/tau_vanilla"), "tau_prompt_lookup": with_ci("eval/tau_prompt_lookup")}
        for b in self.budgets:
            mean[f"tau_tree_{b}"] = with_ci(f"eval/tau_tree_{b}")
            mean[f"nodes_tree_{b}"] = st.get(f"eval/tree_nodes_{b}", float("nan"))
        if "eval/real/lossless" in m:
            mean.update(real_tau=m["eval/real/tau"], lossless=m["eval/real/lossless"] == 1.0,
                        spec_tok_s=m["eval/real/tok_s"], greedy_tok_s=m["eval/real/greedy_tok_s"])
        elif "eval/real/tau" in m:  # sampled: τ of the real loop's own samples, with its CI over prompts
            mean.update(real_tau=f"{fmt(m['eval/real/tau'])} [{fmt(m['eval/real/tau_ci_low'])}, "
                                 f"{fmt(m['eval/real/tau_ci_high'])}]", spec_tok_s=m["eval/real/tok_s"])
        rows.append([fmt(mean.get(k, "")) for k, _ in cols])
        return rows

    def headline(self) -> str:
        """One line: the suite, τ with its interval, and beside it prompt lookup's and the paired Δ."""
        st, lvl = self.stats, self.info.get("ci_level", 0.95)
        out = (f"suite {self.info.get('suite_label', self.info.get('suite', ''))} "
               f"[{self.info.get('setting', 't0')}: {self.info.get('sampling', 'greedy (T=0)')}{self._policy_text()}, "
               f"ends {self.info.get('ends', 'fixed length (legacy)')}]: "
               f"τ vanilla {self.metrics.get('eval/tau_vanilla', math.nan):.3f}")
        if "eval/tau_vanilla_ci_low" in st and not math.isnan(st["eval/tau_vanilla_ci_low"]):
            out += f" ({100 * lvl:.0f}% CI {st['eval/tau_vanilla_ci_low']:.3f}–{st['eval/tau_vanilla_ci_high']:.3f})"
        if "eval/tau_prompt_lookup" in st:
            out += (f"; prompt-lookup {st['eval/tau_prompt_lookup']:.3f}, ratio "
                    f"{st['eval/tau_over_prompt_lookup']:.3f}, Δ {st['eval/delta_prompt_lookup']:+.3f}")
            if not math.isnan(st.get("eval/delta_prompt_lookup_ci_low", math.nan)):
                out += (f" [{st['eval/delta_prompt_lookup_ci_low']:+.3f}, "
                        f"{st['eval/delta_prompt_lookup_ci_high']:+.3f}]")
        from dflash.evaluation.headroom import headline_part
        out += headline_part(st)
        if not math.isnan(self.metrics.get("eval/gt_copy_rate", math.nan)):
            out += f"; the ground truth repeats {100 * self.metrics['eval/gt_copy_rate']:.0f}% of its 8-grams"
        if "eval/gt_in_repeat16" in self.metrics:
            m = self.metrics
            out += (f"; degeneracy: 4-gram repeats {m['eval/gt_repeat4']:.2f}, tokens in repeated 16-grams "
                    f"{m['eval/gt_in_repeat16']:.2f}, {100 * m['eval/gt_cycle_share']:.0f}% end in a cycle")
            if "eval/human_in_repeat16" in m:
                out += (f" (human continuation: {m['eval/human_repeat4']:.2f}, {m['eval/human_in_repeat16']:.2f}, "
                        f"{100 * m['eval/human_cycle_share']:.0f}%, prompt-lookup τ {m['eval/human_tau_prompt_lookup']:.3f})")
        if "eval/gt_end_length" in self.metrics:
            out += f"; ends: {end_counts(self.metrics)}"
        if "eval/real/tau_in_sim_ci" in self.metrics:
            m = self.metrics
            out += (f"; the real loop's τ {m['eval/real/tau']:.3f} [{m['eval/real/tau_ci_low']:.3f}, "
                    f"{m['eval/real/tau_ci_high']:.3f}] on its own samples, inside the simulated τ's CI: "
                    f"{'yes' if m['eval/real/tau_in_sim_ci'] == 1.0 else 'NO'}")
        if not self.budgets and self.info.get("setting", "t0") != "t0":
            out += "; trees: T=0 only (verified greedily)"
        per = self.info.get("samples_per_prompt", 1)
        return out + (f"; {len(self.table) // max(per, 1)} prompts × {per} samples × ≤ "
                      f"{self.info.get('max_new_tokens', '?')} tokens")

    def _policy_text(self) -> str:
        """', engine vllm, argmax drafts (vllm's policy)' at T > 0; '' at T = 0 and in stores without it."""
        if "policy_name" not in self.info or self.info.get("setting", "t0") == "t0":
            return ""
        return f", engine {self.info['engine']}: {self.info['policy_name']}"

    def to_markdown(self) -> str:
        """The task table as markdown, its cells escaped (`markdown_escape`): MLflow renders tasks.md."""
        cols = self._columns()
        lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(map(markdown_escape, r)) + " |" for r in self._rows()]
        lines += ["", markdown_escape(self.headline())]
        lines += ["", "Per-position acceptance (vanilla, P(accepted | reached)):", "",
                  "| position | " + " | ".join(str(k + 1) for k in range(len(self.acc_pos))) + " |",
                  "|---|" + "---|" * len(self.acc_pos),
                  "| rate | " + " | ".join(self._rates()) + " |",
                  "| reached | " + " | ".join(str(n) for n in self.reached_pos) + " |"]
        if any(k.startswith("eval/reach_pos") for k in self.stats):
            from dflash.evaluation.headroom import reach_row
            lines.append(reach_row(self.stats, len(self.acc_pos)))
        return "\n".join(lines) + "\n"

    def console_table(self) -> str:
        cols = self._columns()
        rows = self._rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (_, h) in enumerate(cols)]
        line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(cells, widths)))
        out = [self.headline(), line([h for _, h in cols]), line(["-" * w for w in widths])]
        out += [line(r) for r in rows[:-1]] + [line(["-" * w for w in widths]), line(rows[-1])]
        out.append("acceptance by position (P(accepted | reached); - never reached): "
                   + " ".join(f"{k + 1}:{r}" for k, r in enumerate(self._rates())))
        return "\n".join(out)

    def figure(self):
        import matplotlib
        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
        fig = Figure(figsize=(7, 3.6))
        ax = fig.add_subplot(1, 1, 1)
        ks = list(range(1, len(self.acc_pos) + 1))
        ax.bar(ks, self.acc_pos, color="#4477aa")
        ax.set_xlabel("block position k")
        ax.set_ylabel("P(accepted | reached)")
        ax.set_ylim(0, 1.05)
        ax.set_xticks(ks)
        title = f"τ vanilla {self.metrics.get('eval/tau_vanilla', float('nan')):.2f}"
        title += "".join(f", tree-{b} {self.metrics.get(f'eval/tau_tree_{b}', float('nan')):.2f}"
                         for b in self.budgets)
        ax.set_title(title)
        ax2 = ax.twinx()
        ax2.plot(ks, self.reached_pos, color="#cc6677", marker="o", lw=1)
        ax2.set_ylabel("rounds reaching k", color="#cc6677")
        fig.tight_layout()
        return fig

    def save(self, out_dir: str | os.PathLike) -> dict[str, Path]:
        """Writes tasks.json, tasks.md and acceptance_per_position.png into `out_dir`."""
        from dflash.atomic import atomic_write, atomic_write_text
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "tasks.json", "md": out / "tasks.md", "png": out / "acceptance_per_position.png"}
        atomic_write_text(paths["json"], json.dumps(self.to_dict(), indent=2, default=str))
        atomic_write_text(paths["md"], self.to_markdown())
        fig = self.figure()
        atomic_write(paths["png"], lambda tmp: fig.savefig(tmp, format="png", dpi=120))
        return paths

    def log_artifacts(self, logger, prefix: str = "eval") -> None:
        """Per-task table (JSON + markdown) and the per-position PNG through a `dflash.tracking.loggers.Logger`."""
        logger.log_dict(self.to_dict(), f"{prefix}/tasks.json")
        logger.log_text(self.to_markdown(), f"{prefix}/tasks.md")
        logger.log_figure(self.figure(), f"{prefix}/acceptance_per_position.png")


# -- evaluation --------------------------------------------------------------------------------------
def check_compatible(drafter, target) -> None:
    if list(drafter.target_layer_ids) != list(target.layer_ids):
        raise ValueError(f"drafter expects target layers {list(drafter.target_layer_ids)} but the target "
                         f"gives {list(target.layer_ids)} (set target.layer_ids)")
    if int(drafter.hidden_size) != int(target.hidden_size):
        raise ValueError(f"drafter hidden size {drafter.hidden_size} != target hidden size {target.hidden_size}")
    if drafter.lm_head_VH.numel() == 0:
        drafter.attach_target_head(target.embed_weight(), target.lm_head_weight())


def _real_decode(drafter, target, truths: Sequence[TaskTruth], results: Sequence[TaskResult],
                 table: list[dict]) -> dict[str, float]:
    first = truths[0]
    warm = min(8, first.n_new)
    greedy_decode(target, first.prompt_ids, warm)  # warm-up (allocator, kernels): untimed
    speculative_decode(drafter, target, first.prompt_ids, warm)
    taus, lossless, same_tau, agree = [], 0, 0, 0.0
    spec_s = greedy_s = 0.0
    spec_n = greedy_n = 0
    for truth, res, row in zip(truths, results, table):
        g = greedy_decode(target, truth.prompt_ids, truth.n_new)
        s = speculative_decode(drafter, target, truth.prompt_ids, truth.n_new)
        ok = s.tokens == g.tokens
        div = None if ok else next(i for i, (a, b) in enumerate(zip(s.tokens, g.tokens)) if a != b)
        lossless += ok
        agree += 1.0 if ok else div / len(g.tokens)
        same_tau += s.taus == res.taus_vanilla
        taus += s.taus
        spec_s, greedy_s = spec_s + s.seconds, greedy_s + g.seconds
        spec_n, greedy_n = spec_n + len(s.tokens), greedy_n + len(g.tokens)
        row.update(real_tau=s.mean_tau, lossless=ok, tau_matches_sim=s.taus == res.taus_vanilla,
                   spec_tok_s=s.tokens_per_s, greedy_tok_s=g.tokens_per_s,
                   greedy_matches_truth=g.tokens == truth.continuation.tolist(), diverges_at=div)
        if not ok:
            log.warning("real decoding of %s diverges from greedy decoding at token %d (%s target: "
                        "see eval/gt_consistency for the target's own numerical drift)", truth.name, div,
                        str(getattr(target, "dtype", "")).removeprefix("torch."))
    n = len(truths)
    spec_tok_s, greedy_tok_s = spec_n / max(spec_s, 1e-9), greedy_n / max(greedy_s, 1e-9)
    return {"eval/real/tau": sum(taus) / max(len(taus), 1), "eval/real/lossless": lossless / n,
            "eval/real/match_frac": agree / n,
            "eval/real/tau_matches_sim": same_tau / n, "eval/real/tok_s": spec_tok_s,
            "eval/real/greedy_tok_s": greedy_tok_s, "eval/real/speedup": spec_tok_s / greedy_tok_s}


@torch.no_grad()
def evaluate(drafter, target, cfg: EvalConfig, tasks: Sequence[Task] | None = None, *,
             truths: Sequence[TaskTruth] | None = None, limit: int | None = None,
             proposer: Proposer | None = None, real_decode: bool | None = None,
             suite: Suite | None = None, spec: TruthSpec | None = None, policy: str | None = None) -> EvalReport:
    """Ground truth (cached) → simulated vanilla / DDTree rounds (and prompt lookup's) → metrics, stats,
    per-task table.

    `suite`: the suite to run (default `cfg.suite`, resolved; `tasks` replaces its tasks); `truths`:
    precomputed ground truth (skips the cache); `limit`: only the first `limit` tasks; `proposer`: replaces
    the drafter's (`eval.proposer`; tests); `real_decode`: default `cfg.real_decode`; `spec`: how the ground truth
    is written, its sampling setting the one the rounds are verified at (default: the legacy greedy protocol;
    `protocol.truth_spec` builds the configured ones). `limit` counts prompts (a sampled ground truth has
    several tasks a prompt). `policy`: how drafts are proposed at a sampled setting (`engines`: argmax or sampled;
    default the configured engine's for this drafter kind); the report's setting label then names it
    (`t1/argmax`). The drafter is put in eval mode and restored to its previous mode."""
    t0 = time.perf_counter()
    if suite is None:
        suite = objective_suite(cfg, tasks)
    elif tasks is not None:
        suite = Suite(suite.name, list(tasks), suite.max_new_tokens, suite.stop)
    spec = TruthSpec() if spec is None else spec.for_suite(suite)  # the suite's own code stop rule
    sampling = spec.sampling
    dflash2 = is_dflash2(drafter)
    policy = policy or resolve_policy(cfg.engine, cfg.proposal, dflash2)
    info: dict[str, Any] = {"suite": cfg.suite if suite.name == suite_label(cfg.suite) else suite.name,
                            "suite_label": suite.name, "max_new_tokens": suite.max_new_tokens,
                            "target": str(getattr(target, "identity", "")), "ci_level": cfg.ci_level,
                            "bootstrap": cfg.bootstrap, "setting": setting_label(sampling, policy),
                            "sampling": sampling.describe(), "sampling_setting": sampling.as_dict(),
                            "ends": _ends_text(spec),
                            "samples_per_prompt": spec.per_prompt, **policy_info(cfg, sampling, policy, dflash2)}
    if truths is None:
        truths, hit = load_or_build_ground_truth(target, suite.tasks, suite.max_new_tokens, cfg.cache_dir,
                                                 cfg.truth_dir, suite.name, spec)
        info.update(cache_hit=hit)
    truths = list(truths)[:limit * spec.per_prompt] if limit else list(truths)
    if not truths:
        raise ValueError("evaluate: no tasks")
    info["ground_truth_key"] = ground_truth_key(target, truths)
    # DDTree's tree is verified greedily (the deepest node matching the target's tokens); no lossless rule for a
    # tree at T > 0 is implemented, so trees are reported at T = 0 only (docs/evaluation.md). And DDTree is DFlash 1
    # only: a DFlash 2 draft is its selector's walk, and no tree over selector paths is defined
    budgets = [int(b) for b in cfg.tree_budgets] if sampling.greedy and not dflash2 else []
    if dflash2 and cfg.tree_budgets:
        info["ddtree"] = "not run: DDTree is DFlash 1 only (a DFlash 2 draft is its selector walk)"
    was_training = drafter.training
    drafter.eval()
    try:
        check_compatible(drafter, target)
        bs = drafter.block_size
        # argmax drafts are point masses: matched against the path's tokens, the T = 0 rule on the sampled path
        scored = GREEDY if policy == "argmax" else sampling
        proposer = proposer or DRAFTER_PROPOSERS.build(cfg.proposer, drafter, proposal_width(budgets), scored)
        results = simulate(truths, proposer, bs, budgets, scored, cfg.seed)
        baseline = simulate(truths, PromptLookupProposer(bs, cfg.prompt_lookup.min_n, cfg.prompt_lookup.max_n),
                            bs, (), sampling, cfg.seed) if cfg.prompt_lookup.enabled else []
        table = [_row(tr, r, budgets, base) for tr, r, base in
                 zip(truths, results, baseline or [None] * len(results))]
        metrics = _metrics(results, budgets, bs)
        metrics["eval/gt_consistency"] = sum(t.consistency for t in truths) / len(truths)
        rates = [r for r in (row["gt_copy_rate"] for row in table) if not math.isnan(r)]
        metrics["eval/gt_copy_rate"] = sum(rates) / len(rates) if rates else math.nan
        metrics.update(degeneracy_metrics("eval/gt_", [t.continuation.tolist() for t in truths]))
        if cfg.prompt_lookup.enabled:
            metrics.update(human_metrics(target, suite, truths, bs, cfg, spec))
        metrics["eval/gt_mean_tokens"] = sum(t.n_new for t in truths) / len(truths)
        texts = prompt_texts(suite, truths)
        if spec.ends:  # which rule ended each continuation (a fixed-length ground truth has none)
            why = end_reasons(target, truths, spec, texts)
            for row, w in zip(table, why):
                row["gt_end"] = w
            metrics.update({f"eval/gt_end_{r}": why.count(r) / len(why) for r in END_REASONS})
        if cfg.real_decode if real_decode is None else real_decode:
            if sampling.greedy:
                metrics.update(_real_decode(drafter, target, truths, results, table))
            else:
                metrics.update(_real_sampled(drafter, target, truths, results, spec, suite.max_new_tokens, cfg,
                                             texts, table, policy))
    finally:
        drafter.train(was_training)
    stats = _stats(results, baseline, budgets, cfg)
    if not limit:  # headroom beside τ (the in-training subset goes without): oracle, reach, entropy
        from dflash.evaluation.headroom import headroom_figures
        stats.update(headroom_figures(target, truths, results, metrics["eval/tau_vanilla"], stats, drafter.block_size,
                                      cfg, sampling, info["ground_truth_key"], policy))
    metrics["eval/seconds"] = time.perf_counter() - t0
    acc, reached = _position_acceptance(results, bs)
    info["block_size"] = bs
    return EvalReport(metrics, table, acc, reached, bs, budgets, info, results, stats, baseline)


def _ends_text(spec: TruthSpec) -> str:
    if not spec.ends:
        return "fixed length (legacy)"
    rules = (["at a stop token"] if spec.stop_ids else []) + ([f"at {spec.code_stop.describe()}"] if spec.code_stop
                                                              else [])
    return " or ".join(rules)


def prompt_texts(suite: Suite, truths: Sequence[TaskTruth]) -> list[str] | None:
    """Each truth's prompt string (a sampled truth's is its prompt's); None when a truth's task is not the
    suite's (the prompt tokens are decoded then)."""
    by_name = {t.name: t.prompt for t in suite.tasks}
    texts = [by_name.get(t.group) for t in truths]
    return None if any(x is None for x in texts) else texts


def end_counts(metrics: dict[str, float], pre: str = "eval/") -> str:
    """'5 EOS, 0 stop sequence, 3 dedent, 0 length cap' from a suite's `gt_end_*` shares (their tasks' count)."""
    n = metrics.get(f"{pre}num_tasks", 0.0)
    names = {"eos": "EOS", "stop": "stop sequence", "dedent": "dedent", "length": "length cap"}
    return ", ".join(f"{round(metrics.get(f'{pre}gt_end_{r}', 0.0) * n)} {names[r]}" for r in END_REASONS)


def degeneracy_metrics(prefix: str, continuations) -> dict[str, float]:
    """`dflash.data.degeneracy.summarize` under `prefix`: repeat4, in_repeat16, cycle_share."""
    d = summarize(continuations)
    return {f"{prefix}repeat4": d["repeat4"], f"{prefix}in_repeat16": d["in_repeat16"],
            f"{prefix}cycle_share": d["cycle_share"]}


def human_metrics(target, suite: Suite, truths: Sequence[TaskTruth], bs: int, cfg: EvalConfig,
                  spec: TruthSpec | None = None) -> dict[str, float]:
    """For a suite cut from files (tasks with a `reference`): the human continuation's degeneracy and prompt
    lookup's τ on it (its first max_new_tokens tokens, cut by the suite's code stop rule as the ground truth is),
    beside the target's ground truth: does the target write like a human? Empty for suites without references."""
    names = {t.group for t in truths}
    tasks = [t for t in suite.tasks if t.reference and t.name in names]
    if not tasks:
        return {}
    human = []
    for t in tasks:
        ids = list(target.tokenizer.encode(t.prompt))
        cont = list(target.tokenizer.encode(t.prompt + t.reference))[len(ids):len(ids) + suite.max_new_tokens]
        if spec is not None and spec.code_stop:
            cont = cont[:first_end(cont, 0, (), spec.text_end(t.prompt, decoder(target)))[0]]
        if len(cont) >= 2:
            human.append(TaskTruth(t.name, torch.tensor(ids, dtype=torch.long), torch.tensor(cont, dtype=torch.long),
                                   torch.empty(0)))
    if not human:
        return {}
    out = degeneracy_metrics("eval/human_", [h.continuation.tolist() for h in human])
    pl = simulate(human, PromptLookupProposer(bs, cfg.prompt_lookup.min_n, cfg.prompt_lookup.max_n), bs)
    s, n = _sums(pl)
    out["eval/human_tau_prompt_lookup"] = sum(s) / max(sum(n), 1)
    out["eval/human_prompts"] = float(len(human))
    return out


def _real_sampled(drafter, target, truths: Sequence[TaskTruth], results: Sequence[TaskResult], spec: TruthSpec,
                  max_new_tokens: int, cfg: EvalConfig, texts: Sequence[str] | None = None,
                  table: list[dict] | None = None, policy: str = "sampled") -> dict[str, float]:
    """The real loop at the sampled setting (`sampled_decode`), one seeded run per truth: its τ with the CI over
    prompts, beside the simulated τ (the two have the same law; `eval/real/tau_in_sim_ci` says whether the real
    τ lies inside the simulated τ's interval), and its tokens/s. Each truth's `table` row gets its run's τ."""
    by_group: dict[str, list[int]] = {}
    seconds, tokens = 0.0, 0
    for i, truth in enumerate(truths):
        gen = torch.Generator(device=target.device).manual_seed(int(cfg.seed) * 1_000_003 + 7_919 * i + 1)
        prompt = texts[i] if texts else decoder(target)(truth.prompt_ids.tolist())
        r = sampled_speculative_decode(drafter, target, truth.prompt_ids, max_new_tokens, spec.sampling, gen,
                                       spec.stop_ids, text_end=spec.text_end(prompt, decoder(target)),
                                       proposal=policy)
        by_group.setdefault(truth.group, []).extend(r.taus)
        seconds, tokens = seconds + r.seconds, tokens + len(r.tokens)
        if table is not None:
            table[i].update(real_tau=r.mean_tau, spec_tok_s=r.tokens_per_s)
    sums = [sum(v) for v in by_group.values()]
    counts = [len(v) for v in by_group.values()]
    ci = pooled_ci(sums, counts, cfg.ci_level, cfg.bootstrap)
    s_sim, n_sim = _sums(results)
    sim_ci = pooled_ci(s_sim, n_sim, cfg.ci_level, cfg.bootstrap)
    tau = sum(sums) / max(sum(counts), 1)
    return {"eval/real/tau": tau, "eval/real/tau_ci_low": ci.low, "eval/real/tau_ci_high": ci.high,
            "eval/real/tau_in_sim_ci": float(sim_ci.low <= tau <= sim_ci.high),
            "eval/real/tok_s": tokens / max(seconds, 1e-9)}


def ground_truth_key(target, truths: Sequence[TaskTruth]) -> str:
    """Identity of the exact ground truth the rounds ran on (target, prompt and continuation tokens): two
    reports with the same key are paired prompt for prompt."""
    h = hashlib.sha256(str(getattr(target, "identity", "")).encode())
    for t in truths:
        h.update(f"\0{t.name}\0{t.prompt_ids.tolist()}\0{t.continuation.tolist()}".encode())
    return h.hexdigest()


def _row(tr: TaskTruth, r: TaskResult, budgets: Sequence[int], base: TaskResult | None) -> dict[str, Any]:
    """One task's table row; the `*_sum` / `rounds*` pairs are what a paired comparison resamples."""
    row = {"task": r.name, "prompt_tokens": r.prompt_len, "new_tokens": r.n_new,
           "rounds": len(r.taus_vanilla), "tau_vanilla": r.tau_vanilla, "tau_sum_vanilla": sum(r.taus_vanilla)}
    for b in budgets:
        n = len(r.taus_tree[b])
        row.update({f"tau_tree_{b}": r.tau_tree(b), f"rounds_tree_{b}": n, f"tau_sum_tree_{b}": sum(r.taus_tree[b]),
                    f"nodes_tree_{b}": r.nodes_tree.get(b, 0) / n if n else float("nan")})
    if base is not None:
        row.update(tau_prompt_lookup=base.tau_vanilla, rounds_prompt_lookup=len(base.taus_vanilla),
                   tau_sum_prompt_lookup=sum(base.taus_vanilla))
    row["gt_consistency"] = tr.consistency
    row["gt_copy_rate"] = copy_rate(tr.tokens.tolist(), tr.prompt_len)
    return row


def _sums(results: Sequence[TaskResult], budget: int | None = None) -> tuple[list[int], list[int]]:
    """(τ sums, rounds) per prompt: a sampled ground truth's tasks of one prompt are pooled, so the bootstrap
    resamples prompts (the unit the CI is over), not samples of one prompt."""
    sums: dict[str, list[int]] = {}
    for r in results:
        taus = r.taus_vanilla if budget is None else r.taus_tree[budget]
        acc = sums.setdefault(r.group or r.name, [0, 0])
        acc[0] += sum(taus)
        acc[1] += len(taus)
    return [v[0] for v in sums.values()], [v[1] for v in sums.values()]


def _stats(results: Sequence[TaskResult], baseline: Sequence[TaskResult], budgets: Sequence[int],
           cfg: EvalConfig) -> dict[str, float]:
    lvl, nb = cfg.ci_level, cfg.bootstrap
    out: dict[str, float] = {}

    def put(key: str, sums, counts) -> None:
        if sum(counts) == 0:
            return
        ci = pooled_ci(sums, counts, lvl, nb)
        out[f"{key}_ci_low"], out[f"{key}_ci_high"] = ci.low, ci.high
    put("eval/tau_vanilla", *_sums(results))
    for b in budgets:
        put(f"eval/tau_tree_{b}", *_sums(results, b))
        rounds = sum(len(r.taus_tree[b]) for r in results)
        out[f"eval/tree_nodes_{b}"] = sum(r.nodes_tree.get(b, 0) for r in results) / rounds if rounds else math.nan
    if baseline:
        s_a, n_a = _sums(results)
        s_b, n_b = _sums(baseline)
        if sum(n_b):
            tau_pl = sum(s_b) / sum(n_b)
            out["eval/tau_prompt_lookup"] = tau_pl
            put("eval/tau_prompt_lookup", s_b, n_b)
            out["eval/tau_over_prompt_lookup"] = (sum(s_a) / sum(n_a)) / tau_pl
            d = paired_delta_ci(s_a, n_a, s_b, n_b, lvl, nb)
            out["eval/delta_prompt_lookup"] = d.value
            out["eval/delta_prompt_lookup_ci_low"], out["eval/delta_prompt_lookup_ci_high"] = d.low, d.high
    return out


def _position_acceptance(results: Sequence[TaskResult], bs: int) -> tuple[list[float], list[int]]:
    """Vanilla P(accepted | reached) per block position 1..bs-1 (0.0 where never reached), and the counts."""
    reached = [sum(r.reached[k] for r in results) for k in range(bs - 1)]
    acc = [sum(r.accepted[k] for r in results) / reached[k] if reached[k] else 0.0 for k in range(bs - 1)]
    return acc, reached


def _metrics(results: Sequence[TaskResult], budgets: Sequence[int], bs: int) -> dict[str, float]:
    pooled = [t for r in results for t in r.taus_vanilla]
    m: dict[str, float] = {"eval/tau_vanilla": sum(pooled) / len(pooled) if pooled else float("nan")}
    for b in budgets:
        tt = [t for r in results for t in r.taus_tree[b]]
        m[f"eval/tau_tree_{b}"] = sum(tt) / len(tt) if tt else float("nan")
    acc, reached = _position_acceptance(results, bs)  # a position never reached has no acceptance to log
    m.update({f"eval/acc_pos{k + 1:02d}": a for k, (a, n) in enumerate(zip(acc, reached)) if n})
    for r in results:
        m[f"eval/task/{r.name}/tau_vanilla"] = r.tau_vanilla
        for b in budgets:
            m[f"eval/task/{r.name}/tau_tree_{b}"] = r.tau_tree(b)
    m["eval/num_tasks"] = float(len(results))
    m["eval/num_prompts"] = float(len({r.group or r.name for r in results}))
    m["eval/rounds"] = float(len(pooled))
    return m


Evaluator = Callable[..., dict]


def make_evaluator(cfg: EvalConfig, tasks: Sequence[Task] | None = None,
                   out_dir: str | os.PathLike | None = None):
    """The trainer's evaluator: `dflash.evaluation.evaluator.make_evaluator` (kept here for its callers)."""
    from dflash.evaluation.evaluator import make_evaluator as make
    return make(cfg, tasks, out_dir)
