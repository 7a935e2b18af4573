"""Whether a stage's ranking holds on the prompts whose ground truth repeats itself least.

A τ on text that loops measures loop copying (docs/evaluation.md, "Ground truth that ends"). On the reference
target's greedy ground truth, streak beat dpace on the least-degenerate quartile of held-out prompts on both seeds,
while on the most degenerate quartile the order flipped and the seeds disagreed by 1.06 τ. So a campaign report
checks every stage's ranking again on the least-degenerate part of its objective suite.

What counts as least degenerate: the prompt samples (task rows) whose ground truth has the lowest `gt_copy_rate`,
the share of its 8-grams already seen earlier in the prompt or the continuation, which bounds what copying can
accept; at least a quarter of the rows, every row tied at the cut included
(`dflash.evaluation.pairing.least_degenerate_tasks`).

The rows are chosen on each table's own ground truth. The options of a stage evaluate on one pinned ground truth, so
the same rows are kept for each of them, and τ and Δ pair seed for seed and prompt for prompt as the stage table
does (`sweeps.campaign_report._delta`); a run on other ground truth is not paired, as in the stage table.
"""
from __future__ import annotations

from dflash.evaluation.pairing import LEAST_DEGENERATE_SHARE as SHARE
from dflash.evaluation.pairing import least_degenerate_tasks, restricted
from sweeps.campaign_report import _by_option, _delta, _fmt, pooled, shared_seeds
from sweeps.learning_curves import order_agreement


def least_degenerate_options(cells: list[dict], suite: str, reference: str, setting: str = "served",
                             share: float = SHARE) -> dict | None:
    """{"by_option": {option: {seed: restricted table}}, "all": {option: {seed: table}}, "kept", "total", "cut",
    "seeds"} over the seeds every option has, the counts and the cut of the reference's tables; None where the
    tables cannot say (no reference, no shared seed, a table without copy rates)."""
    by_opt = _by_option(cells, suite, setting)
    shared = shared_seeds(by_opt)
    if reference not in by_opt or not shared or len(by_opt) < 2:
        return None
    # each table's rows chosen on its own ground truth: tables on one pinned ground truth keep the same rows (they
    # pair), and a run on another ground truth (an earlier launch's) keeps its own least-degenerate rows
    chosen = {o: {s: least_degenerate_tasks(seeds[s], share) for s in shared} for o, seeds in by_opt.items()}
    if any(v is None for seeds in chosen.values() for v in seeds.values()):
        return None
    sub = {o: {s: restricted(seeds[s], chosen[o][s][0]) for s in shared} for o, seeds in by_opt.items()}
    return {"by_option": sub, "all": {o: {s: seeds[s] for s in shared} for o, seeds in by_opt.items()},
            "kept": sum(len(sub[reference][s]["tasks"]) for s in shared),
            "total": sum(len(by_opt[reference][s].get("tasks") or []) for s in shared),
            "cut": max(chosen[reference][s][1] for s in shared), "seeds": shared}


def _means(by_opt: dict[str, dict[int, dict]]) -> dict[str, float]:
    return {o: pooled(list(seeds.values())).value for o, seeds in by_opt.items()}


def _order_row(d: dict) -> dict | None:
    """The least-degenerate order of `least_degenerate_options` against the order on all rows (`order_agreement`)."""
    return order_agreement(_means(d["by_option"]), _means(d["all"]))


def order_check(cells: list[dict], suite: str, reference: str, setting: str = "served") -> dict | None:
    """The least-degenerate order against the order on all prompts (`order_agreement`, with `words`), plus `kept` /
    `total` rows; None where the tables cannot say."""
    d = least_degenerate_options(cells, suite, reference, setting)
    if d is None:
        return None
    row = _order_row(d)
    return None if row is None else {**row, "words": order_words(row), "kept": d["kept"], "total": d["total"]}


def order_words(row: dict) -> str:
    """What an `order_agreement` row of the least-degenerate order against the order on all rows says, in words."""
    if row["winner_agrees"] and row["loser_agrees"]:
        return "The order holds" if row["kendall_tau_b"] == 1.0 else "The winner and the loser hold"
    if row["loser_agrees"]:
        return f"**The winner changes**, to {row['winner']}"
    if row["winner_agrees"]:
        return f"**The loser changes**, to {row['loser']}"
    return f"**The winner and the loser change**, to {row['winner']} and {row['loser']}"


def setting_words(table: dict, setting: str) -> str:
    """The setting of a task table in words: a table from before sampled evaluation names none (the old protocol's
    greedy ground truth of fixed length)."""
    info = table.get("info") or {}
    if not info.get("setting"):
        return "greedy ground truth of the old protocol"
    return "greedy (T=0)" if setting == "t0" else f"{info.get('sampling') or info['setting']} (the served setting)"


def least_degenerate_section(cells: list[dict], suite: str, reference: str, setting: str = "served") -> list[str]:
    """The stage table of `suite` at `setting` again on its least-degenerate rows: τ, prompt lookup's τ, Δ against the
    reference with its verdict, and whether the order of all prompts holds there; [] where the tables cannot say."""
    d = least_degenerate_options(cells, suite, reference, setting)
    if d is None:
        return []
    sub, everything = d["by_option"], d["all"]
    if any(not t["tasks"] for seeds in sub.values() for t in seeds.values()):
        return []
    has_pl = "tau_sum_prompt_lookup" in sub[reference][d["seeds"][0]]["tasks"][0]
    where = setting_words(everything[reference][d["seeds"][0]], setting)
    lines = [f"On the least-degenerate rows of `{suite}`, {where}: {d['kept']} of {d['total']} prompt samples, those "
             f"whose ground truth repeats at most {d['cut']:.3f} of its 8-grams (at least the {SHARE:.0%} that repeat "
             "least). A ranking should hold here too.", "",
             f"| option | τ vanilla | {'τ prompt-lookup | ' if has_pl else ''}Δτ vanilla vs {reference} | verdict |",
             "|---|---|---|---|" + ("---|" if has_pl else "")]
    for opt, seeds in sub.items():
        tables = list(seeds.values())
        cols = [_fmt(pooled(tables))]
        if has_pl:
            cols.append(_fmt(pooled(tables, "tau_sum_prompt_lookup", "rounds_prompt_lookup")))
        cols += ["—", "reference"] if opt == reference else list(_delta(seeds, sub[reference]))
        lines.append("| " + " | ".join([opt, *cols]) + " |")
    row = _order_row(d)
    if row is not None:
        lines += ["", f"{order_words(row)}: Kendall's τ-b {row['kendall_tau_b']:+.2f} over {row['n']} options, "
                  "against the order on all prompt samples."]
    return [*lines, ""]
