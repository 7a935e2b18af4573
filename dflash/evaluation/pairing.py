"""Paired comparisons from task tables (docs/evaluation.md): the promotion gate and `experiments.eval A B` compare
two drafters on the SAME ground truth, prompt for prompt.

A task table is `EvalReport.to_dict()` (the `eval/served/tasks.json` artifact, or `eval/suite/<name>/served/tasks.json`,
`t0` for greedy beside it; stores before sampled evaluation: `eval/tasks.json`, `eval/suite/<name>/tasks.json`):
its rows carry, per prompt, the τ sum and the round count of every method (`tau_sum_vanilla` / `rounds`,
`tau_sum_tree_<b>` / `rounds_tree_<b>`, `tau_sum_prompt_lookup` / `rounds_prompt_lookup`), and its
`info.ground_truth_key` names the exact ground truth (target, prompt and continuation tokens). Two tables
are paired only when their keys and task names agree; otherwise `NotPaired` says why.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dflash.evaluation.stats import Interval, Rows, hierarchical_ci

_METRIC = re.compile(r"^eval/(?:suite/(?P<suite>[A-Za-z0-9_.\-]+)/)?(?:(?P<setting>served|t\d[A-Za-z0-9_.]*)/)?"
                     r"(?P<what>tau_vanilla|tau_tree_(?P<b>\d+)|tau_prompt_lookup)$")


class NotPaired(ValueError):
    """The two tables cannot be compared prompt for prompt (different ground truth, missing columns)."""


class DifferentGroundTruth(NotPaired):
    """Both tables are complete but ran on different ground truth (target, prompts or lengths)."""


@dataclass(frozen=True)
class MetricColumns:
    artifact: str  # the task table's artifact path in the run
    sum_col: str
    count_col: str
    baseline_metric: str  # the prompt-lookup figure of the same suite


def metric_columns(metric: str) -> MetricColumns | None:
    """Where the per-prompt data of a τ metric lives; None for metrics without a task table. The objective
    `eval/tau_served` reads the served setting's objective table (`eval/served/tasks.json`); `eval/<setting>/...`
    that setting's (a setting that was the served one has its tables under `served`: name it `eval/tau_served`);
    the legacy `eval/tau_vanilla` (greedy, fixed length) the old `eval/tasks.json`."""
    if metric == "eval/tau_served":
        return MetricColumns("eval/served/tasks.json", "tau_sum_vanilla", "rounds", "eval/tau_served_prompt_lookup")
    m = _METRIC.match(metric)
    if m is None:
        return None
    base = f"eval/suite/{m['suite']}/" if m["suite"] else "eval/"
    if m["setting"]:
        base += f"{m['setting']}/"
    if m["b"]:
        cols = (f"tau_sum_tree_{m['b']}", f"rounds_tree_{m['b']}")
    elif m["what"] == "tau_prompt_lookup":
        cols = ("tau_sum_prompt_lookup", "rounds_prompt_lookup")
    else:
        cols = ("tau_sum_vanilla", "rounds")
    return MetricColumns(base + "tasks.json", *cols, base + "tau_prompt_lookup")


def table_file(artifact: str) -> str:
    """The path under a run's eval folder of the task table logged as `artifact` (`eval/served/tasks.json` ->
    `served/tasks.json`, `eval/suite/<name>/served/tasks.json` -> `<name>/served/tasks.json`; legacy
    `eval/tasks.json` -> `tasks.json`, `eval/suite/<name>/tasks.json` -> `<name>/tasks.json`)."""
    rest = artifact.removeprefix("eval/")
    return rest.removeprefix("suite/")


def per_task(table: dict, sum_col: str, count_col: str) -> tuple[list[str], list[float], list[float]]:
    rows = table.get("tasks") or []
    if not rows or any(sum_col not in r or count_col not in r for r in rows):
        raise NotPaired(f"the task table has no per-prompt {sum_col!r} / {count_col!r} columns")
    return ([str(r["task"]) for r in rows], [float(r[sum_col]) for r in rows], [float(r[count_col]) for r in rows])


SAMPLE_MARK = "#s"  # a sampled ground truth's task ids: `<prompt>#s<i>` (ground_truth.expand_tasks)


def prompt_of(task: str) -> str:
    """The prompt a task id is a sample of (`name#s3` -> `name`; a greedy task is its own prompt)."""
    return task.rsplit(SAMPLE_MARK, 1)[0] if SAMPLE_MARK in task else task


def task_rows(table: dict, sum_col: str, count_col: str, seed: int = 0) -> Rows:
    """A task table's rows for `hierarchical_ci`, keyed (seed, prompt): the samples of one prompt are resampled
    within it; `seed`: the training seed of the run the table is of (a campaign stacks several)."""
    names, sums, counts = per_task(table, sum_col, count_col)
    return Rows([(seed, prompt_of(n)) for n in names], sums, counts)


def ground_truth_of(table: dict) -> str:
    return str((table.get("info") or {}).get("ground_truth_key") or "")


LEAST_DEGENERATE_SHARE = 0.25  # the part of a table's rows a ranking is checked on again


def _copy_rate(row: dict) -> float:
    r = row.get("gt_copy_rate")
    return 0.0 if r is None or math.isnan(float(r)) else float(r)


def least_degenerate_tasks(table: dict, share: float = LEAST_DEGENERATE_SHARE) -> tuple[set[str], float] | None:
    """(the task ids of at least `share` of the table's rows whose ground truth repeats itself least, every row tied
    at the cut included; that cut), None for a table whose rows carry no `gt_copy_rate`.

    How much a ground truth repeats itself is its `gt_copy_rate`, the share of its 8-grams already seen earlier in the
    prompt or the continuation (`prompt_lookup.copy_rate`); a continuation too short to hold an 8-gram repeats none.
    A τ on text that loops measures loop copying, so a ranking is checked again on these rows
    (`sweeps/least_degenerate.py`, `experiments.eval A B`). Ties at the cut are all kept, so the rows never depend on
    the order they were listed in. Tables on one ground truth keep the same rows, so they still pair."""
    rows = table.get("tasks") or []
    if not rows or any("gt_copy_rate" not in r for r in rows):
        return None
    rates = sorted(_copy_rate(r) for r in rows)
    cut = rates[max(1, math.ceil(share * len(rows))) - 1]
    return {str(r["task"]) for r in rows if _copy_rate(r) <= cut}, cut


def restricted(table: dict, tasks: set[str]) -> dict:
    """The table with only the rows of `tasks`, in their order (two restricted tables still pair by position)."""
    return {**table, "tasks": [r for r in table.get("tasks") or [] if str(r["task"]) in tasks]}


def paired_delta(table_a: dict, table_b: dict, cols_a: tuple[str, str], cols_b: tuple[str, str],
                 level: float = 0.95, n_boot: int = 2000) -> Interval:
    """Δ = τ_A − τ_B over the prompts both tables ran, on one ground truth; raises NotPaired otherwise."""
    ka, kb = ground_truth_of(table_a), ground_truth_of(table_b)
    if not ka or not kb:
        raise NotPaired("a task table without info.ground_truth_key (written before tables recorded it)")
    if ka != kb:
        raise DifferentGroundTruth("the two evaluations ran on different ground truth (target, prompts or continuation "
                        f"length differ: {ka[:12] or 'none'} vs {kb[:12] or 'none'})")
    a, b = task_rows(table_a, *cols_a), task_rows(table_b, *cols_b)
    if per_task(table_a, *cols_a)[0] != per_task(table_b, *cols_b)[0]:
        raise NotPaired("the two task tables list different prompts")
    return hierarchical_ci(a, b, level, n_boot)


@dataclass(frozen=True)
class LeastDegenerateDelta:
    delta: Interval  # A − B on those rows alone
    rows: int  # how many rows
    copy_rate_at_most: float  # the cut


def least_degenerate_delta(table_a: dict, table_b: dict, cols_a: tuple[str, str], cols_b: tuple[str, str],
                           level: float = 0.95, n_boot: int = 2000) -> LeastDegenerateDelta | None:
    """`paired_delta` on the least-degenerate rows of A's ground truth (`least_degenerate_tasks`; B, on the same
    ground truth, keeps the same rows); None where A's rows carry no copy rate. Raises NotPaired as `paired_delta`."""
    chosen = least_degenerate_tasks(table_a)
    if chosen is None:
        return None
    tasks, cut = chosen
    d = paired_delta(restricted(table_a, tasks), restricted(table_b, tasks), cols_a, cols_b, level, n_boot)
    return LeastDegenerateDelta(d, len(tasks), cut)


__all__ = ["MetricColumns", "NotPaired", "DifferentGroundTruth", "metric_columns", "per_task", "paired_delta",
           "prompt_of", "task_rows",
           "ground_truth_of", "table_file"]
