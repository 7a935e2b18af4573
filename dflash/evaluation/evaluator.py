"""The trainer's evaluator and the multi-suite evaluation (docs/evaluation.md).

`evaluate_suites(drafter, target, cfg)`: the objective suite (`eval.suite`) and every `eval.extra_suites`
entry, each on its own cached ground truth at its own continuation length, at each setting of
`protocol.truth_specs` (the served one, `eval.sampling`; greedy beside it); metrics = each setting's objective
figures under `eval/<label>/...`, every suite's summary under `eval/suite/<name>/<label>/...`, and the objective
`eval/tau_served` (what sweeps and the promotion gate read; `protocol` module doc).

`make_evaluator(cfg)` -> `SuiteEvaluator`, called by the trainer as
`evaluator(drafter, target, step, final, logger=None) -> {eval/...: float}`:
- `final=False`: the first `eval.subset` prompts of the objective suite at the served setting (simulated only, no
  artifacts), logged under `eval/subset/...` (`subset_key`): a subset figure never shares a name, a chart line
  or the pruner's and the sweep's reading with the full suite's `eval/...`;
- `final=True`: every suite in full at every setting (real decoding if `eval.real_decode`), console tables
  printed, artifacts logged and written to `out_dir` where `protocol.table_places` puts them (the served
  setting's under `eval/served/...`, greedy's beside it under `eval/t0/...`).
- The generalization gap: after `use_train_sequences(seqs)` (the trainer calls it with its training
  sequences), both kinds of call also simulate `eval.train_tasks` prompts cut from sequences the run trains
  on (prompt = the first half of the sequence, at most 128 tokens; continuation = the target's at the served
  setting): `eval/<label>/tau_train` and `eval/<label>/tau_train_gap` = that − `eval/tau_served`. When the gap
  grows while `eval/tau_served` falls between two in-training evals, a warning is logged.
"""
from __future__ import annotations

import logging
import os
from collections import abc
from pathlib import Path
from typing import Sequence

from dflash.evaluation import EvalConfig
from dflash.evaluation.engines import is_dflash2, other_policy, resolve_policy
from dflash.evaluation.ground_truth import TaskTruth, TruthSpec, cache_key, load_or_build_ground_truth
from dflash.evaluation.protocol import labelled, objective_metrics, served_label, table_places, truth_specs
from dflash.evaluation.prompts import DATA_SUITES, Suite, Task, objective_suite, resolve_suite
from dflash.evaluation.headroom import SUMMARY_HEAD, summary_cells
from dflash.evaluation.report import EvalReport, end_counts, evaluate

log = logging.getLogger(__name__)

TRAIN_PROMPT_MAX_TOKENS = 128
SUBSET_PREFIX = "eval/subset/"


def subset_key(metric: str) -> str:
    """The name an `eval/...` metric has in the in-training subset evaluation (`eval/tau_served` ->
    `eval/subset/tau_served`, `eval/t1/tau_vanilla` -> `eval/subset/t1/tau_vanilla`); other metrics
    (`train/loss`) keep their name."""
    if not metric.startswith("eval/") or metric.startswith(SUBSET_PREFIX):
        return metric
    return SUBSET_PREFIX + metric[len("eval/"):]


def config_suites(cfg: EvalConfig, tasks: Sequence[Task] | None = None) -> list[Suite]:
    """[objective, *extra] as resolved Suites (`tasks` replaces the objective's tasks)."""
    return [objective_suite(cfg, tasks), *(resolve_suite(s, cfg) for s in cfg.extra_suites)]


class TruthMemo:
    """Ground truth per (target, suite, length, protocol), built or loaded from the disk cache once per process (its
    tokens pinned under `truth_dir` when set: `eval.truth_dir`)."""

    def __init__(self, cache_dir: str, truth_dir: str = ""):
        self.cache_dir = cache_dir
        self.truth_dir = truth_dir
        self._memo: dict[str, list[TaskTruth]] = {}

    def get(self, target, suite: Suite, spec: TruthSpec | None = None) -> list[TaskTruth]:
        """`spec`: the setting, with the suite's own code stop rule put in (`TruthSpec.for_suite`); None: the
        legacy protocol (fixed length)."""
        spec = TruthSpec() if spec is None else spec.for_suite(suite)
        key = cache_key(target, suite.tasks, suite.max_new_tokens, "", spec)
        if key not in self._memo:
            self._memo[key], _ = load_or_build_ground_truth(target, suite.tasks, suite.max_new_tokens,
                                                            self.cache_dir, self.truth_dir, suite.name, spec)
        return self._memo[key]


def evaluate_suites(drafter, target, cfg: EvalConfig, suites: Sequence[Suite] | None = None,
                    memo: TruthMemo | None = None, real_decode: bool | None = None) -> list[EvalReport]:
    """One report per (setting, suite): the served setting's suites first (its objective first), then greedy's
    when beside it (`protocol.truth_specs`); `merged_metrics(reports)` flattens them under each setting's label."""
    suites = list(suites) if suites is not None else config_suites(cfg)
    memo = memo or TruthMemo(cfg.cache_dir, cfg.truth_dir)
    reports = []
    for j, spec in enumerate(truth_specs(cfg, target)):
        reports += [evaluate(drafter, target, cfg, truths=memo.get(target, s, spec), suite=s, spec=spec,
                             real_decode=real_decode if i == 0 and j == 0 else False) for i, s in enumerate(suites)]
        if j == 0 and not spec.sampling.greedy and cfg.both_policies:  # the other policy beside it, same truths
            other = other_policy(resolve_policy(cfg.engine, cfg.proposal, is_dflash2(drafter)))
            reports.append(evaluate(drafter, target, cfg, truths=memo.get(target, suites[0], spec), suite=suites[0],
                                    spec=spec, real_decode=False, policy=other))
    return reports


def merged_metrics(reports: Sequence[EvalReport]) -> dict[str, float]:
    """Every report's figures under its setting's label (`protocol.labelled`): the first suite of each setting
    as `eval/<label>/...`, every suite's summary as `eval/suite/<name>/<label>/...`; then the objective
    (`eval/tau_served`), from the first report (the served setting's objective suite)."""
    out: dict[str, float] = {}
    seen: set[str] = set()
    for r in reports:
        label = r.info.get("setting", "t0")
        if label not in seen:  # a setting's first report is its objective suite
            seen.add(label)
            out.update(labelled(r.all_metrics(), label))
        out.update(labelled(r.suite_metrics(), label))
    first = reports[0]
    out.update(objective_metrics(out, first.sampling, first.info.get("setting"), first.info.get("policy")))
    return out


def summary_table(metrics: dict[str, float], level: float = 0.95) -> str:
    """One markdown row per suite and setting (`eval/suite/<name>/<label>/...`): τ vanilla and prompt lookup's
    with their intervals, the paired Δ, the ground truth's degeneracy, and at T = 0 every tree budget's τ with
    its verify cost (nodes per round), and how many continuations ended by which rule (EOS, stop sequence, dedent,
    length cap). The served setting's rows come first."""
    import math
    import re
    rows = [(m[1], m[2]) for k in metrics if (m := re.match(r"^eval/suite/([^/]+)/(.+)/tau_vanilla$", k))]
    served = served_label(metrics)
    rows.sort(key=lambda r: (r[1] != served, r[1], r[0]))
    budgets = sorted({int(m[1]) for k in metrics if (m := re.match(r"^eval/t0/tau_tree_(\d+)$", k))})

    def ci(pre: str, key: str, sign: str = "") -> str:
        v = metrics.get(pre + key, math.nan)
        lo, hi = metrics.get(f"{pre}{key}_ci_low", math.nan), metrics.get(f"{pre}{key}_ci_high", math.nan)
        if math.isnan(v):
            return "-"
        return f"{v:{sign}.3f}" + ("" if math.isnan(lo) else f" [{lo:{sign}.3f}, {hi:{sign}.3f}]")
    pct = f"{100 * level:g}%"
    head = ["suite", "setting", "prompts", f"τ vanilla [{pct} CI]", "τ prompt-lookup", "Δ vs prompt-lookup", "ratio",
            "GT 4-gram rep.", "GT in rep. 16-gram", "GT cycles", "human in rep. 16-gram", "human τ prompt-lookup",
            "GT ends"]
    head += SUMMARY_HEAD  # headroom: the oracle τ, the gap closed, the target's entropy
    head += [f"τ tree-{b} nodes (nodes/round; T=0 only)" for b in budgets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f3 = lambda v: "-" if math.isnan(v) else f"{v:.3f}"  # noqa: E731
    for s, label in rows:
        pre = f"eval/suite/{s}/{label}/"
        g = lambda k: metrics.get(pre + k, math.nan)  # noqa: E731
        cells = [s, label + (" (served)" if label == served else ""), f"{g('num_prompts'):.0f}",
                 ci(pre, "tau_vanilla"), ci(pre, "tau_prompt_lookup"), ci(pre, "delta_prompt_lookup", "+"),
                 f3(g("tau_over_prompt_lookup")), f3(g("gt_repeat4")), f3(g("gt_in_repeat16")),
                 f3(g("gt_cycle_share")), f3(g("human_in_repeat16")), f3(g("human_tau_prompt_lookup")),
                 end_counts(metrics, pre) if pre + "gt_end_length" in metrics else "-"]
        cells += summary_cells(g, lambda k: ci(pre, k))
        cells += [f"{ci(pre, f'tau_tree_{b}')} ({g(f'tree_nodes_{b}'):.1f})" if label == "t0" else "-"
                  for b in budgets]
        lines.append("| " + " | ".join(cells) + " |")
    if f"eval/{served}/tau_train" in metrics:
        lines.append(f"\neval/{served}/tau_train {metrics[f'eval/{served}/tau_train']:.3f} (gap to the objective's τ "
                     f"{metrics[f'eval/{served}/tau_train_gap']:+.3f})")
    if "eval/tau_served" in metrics:
        lines.append(f"\nobjective eval/tau_served = τ at {served} on the objective suite: "
                     f"{ci('eval/', 'tau_served')}")
    return "\n".join(lines)


def train_tasks(sequences: Sequence, tokenizer, count: int) -> list[Task]:
    """`count` prompts from training sequences spread over the list (deterministic)."""
    if count <= 0 or not sequences:
        return []
    step = max(1, len(sequences) // count)
    out = []
    for i in range(0, len(sequences), step)[:count]:
        ids = [int(t) for t in sequences[i]]
        text = tokenizer.decode(ids[:max(1, min(len(ids) // 2, TRAIN_PROMPT_MAX_TOKENS))])
        if text.strip():
            out.append(Task(f"train{i}", text))
    return out


class SuiteEvaluator:
    def __init__(self, cfg: EvalConfig, tasks: Sequence[Task] | None = None,
                 out_dir: str | os.PathLike | None = None):
        self.cfg = cfg
        self.suites = config_suites(cfg, tasks)
        self.out_dir = Path(out_dir) if out_dir else None
        self.memo = TruthMemo(cfg.cache_dir, cfg.truth_dir)
        self._train_sequences: Sequence = ()
        self._train_suite: Suite | None = None
        self._history: list[tuple[int, float, float]] = []  # (step, tau_train, tau_served), in-training evals
        self.note = ""  # printed under the final summary table (e.g. where the training responses came from)

    def add_suites(self, suites: Sequence[Suite], note: str = "") -> None:
        """The trainer's hook: suites of the training data's own distribution (a chat dataset's held-out split),
        evaluated at the end beside the configured ones (eval/suite/<name>/...), and a line for the summary."""
        given = {s.name: s for s in suites}
        # a configured data suite (eval.suite=chat_heldout: an empty placeholder until now) takes the data's
        self.suites = [given.pop(s.name) if s.name in given and not s.tasks else s for s in self.suites]
        names = {s.name for s in self.suites}
        self.suites += [s for s in given.values() if s.name not in names]
        for s in self.suites:
            if not s.tasks:
                raise ValueError(f"eval suite {s.name!r} has no prompts: the run's data gave none (it is built by "
                                 f"{DATA_SUITES.get(s.name, 'the data')})")
        self.note = note

    def use_train_sequences(self, sequences: Sequence) -> None:
        """The trainer's hook: sequences the run trains on, for `eval/<served>/tau_train`."""
        # kept as given: a prompt pool's TokenLists made into a list would be a list of Python lists again
        self._train_sequences = sequences if isinstance(sequences, abc.Sequence) else list(sequences)
        self._train_suite = None

    def train_suite(self, tokenizer) -> Suite | None:
        """The prompts of `eval/<served>/tau_train` (`eval.train_tasks` cut from the training sequences), or None
        without any; `dflash.app.write_ahead` builds their ground truth once for the runs of a campaign."""
        if self._train_suite is None:
            tasks = train_tasks(self._train_sequences, tokenizer, self.cfg.train_tasks)
            if tasks:
                self._train_suite = Suite("train", tasks, self.suites[0].max_new_tokens)
        return self._train_suite

    def served_spec(self, target) -> TruthSpec:
        return truth_specs(self.cfg, target)[0]

    def _train_metrics(self, drafter, target, step: int, final: bool, tau_heldout: float) -> dict[str, float]:
        if self.train_suite(target.tokenizer) is None:
            return {}
        spec = self.served_spec(target)
        rep = evaluate(drafter, target, self.cfg, truths=self.memo.get(target, self._train_suite, spec),
                       suite=self._train_suite, real_decode=False, spec=spec)
        tau_train = rep.metrics["eval/tau_vanilla"]
        label = rep.info["setting"]
        out = {f"eval/{label}/tau_train": tau_train, f"eval/{label}/tau_train_gap": tau_train - tau_heldout}
        if not final:
            self._warn_on_gap(step, tau_train, tau_heldout)
        return out

    def _warn_on_gap(self, step: int, tau_train: float, tau_heldout: float) -> None:
        if self._history:
            s0, tr0, ho0 = self._history[-1]
            if tau_heldout < ho0 and tau_train - tau_heldout > tr0 - ho0:
                log.warning("eval: the generalization gap grows while held-out τ falls (step %d → %d: "
                            "eval/tau_served %.3f → %.3f, τ on training prompts − eval/tau_served %.3f → %.3f); "
                            "the drafter may be memorizing its training sequences", s0, step, ho0,
                            tau_heldout, tr0 - ho0, tau_train - tau_heldout)
        self._history.append((step, tau_train, tau_heldout))

    def __call__(self, drafter, target, step: int, final: bool, logger=None) -> dict[str, float]:
        cfg = self.cfg
        if not final:
            obj, spec = self.suites[0], self.served_spec(target)
            rep = evaluate(drafter, target, cfg, truths=self.memo.get(target, obj, spec), suite=obj,
                           limit=cfg.subset, real_decode=False, spec=spec)
            metrics = labelled(rep.all_metrics(), rep.info["setting"])
            metrics.update(objective_metrics(metrics, spec.sampling, rep.info["setting"], rep.info["policy"]))
        else:
            reports = evaluate_suites(drafter, target, cfg, self.suites, self.memo, cfg.real_decode)
            metrics = merged_metrics(reports)
            for rep, (prefix, folder) in zip(reports, table_places(reports)):
                print(f"eval at step {step} ({len(rep.table)} tasks):\n{rep.console_table()}", flush=True)
                if logger is not None:
                    rep.log_artifacts(logger, prefix)
                if self.out_dir:
                    rep.save(self.out_dir / folder)
        if self._train_sequences and cfg.train_tasks > 0:
            metrics.update(self._train_metrics(drafter, target, step, final, metrics["eval/tau_served"]))
        if not final:
            metrics = {subset_key(k): v for k, v in metrics.items()}
        if final:
            note = f"\n{self.note}" if self.note else ""
            print(f"eval summary at step {step}:\n{summary_table(metrics, cfg.ci_level)}{note}", flush=True)
        return metrics


def make_evaluator(cfg: EvalConfig, tasks: Sequence[Task] | None = None,
                   out_dir: str | os.PathLike | None = None) -> SuiteEvaluator | None:
    """For the trainer (module doc). Returns None when `cfg.enabled` is False."""
    if not cfg.enabled:
        return None
    return SuiteEvaluator(cfg, tasks, out_dir)
