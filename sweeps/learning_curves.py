"""Learning curves of a campaign's cells and whether short budgets rank options like the full one.

Every cell of a campaign with `trainer.eval_at_tokens` evaluates its objective at those consumed-token milestones
during training and in full at its end. From each cell's `metrics.jsonl` (the run folder's own record):

- the curve: the objective at each milestone (the first log interval at or past it), per option averaged over
  seeds; where a stage's options train at different budgets (reference_recipe's `budget` stage: 131 M against
  262 M tokens), the milestones they share and each option's `final` (its last evaluation, at its own budget);
- the rank agreement of each budget's ordering of the options with the final budget's (`final` where the budgets
  differ: the largest shared milestone is then mid-schedule for the longer run): Kendall's τ-b (1: the same
  order, −1: reversed), and whether the winner (highest mean) and the loser (lowest mean) are the same;
- the same agreement for the training-time predictors read at the end of training: `train/tau_rounds` (rounds
  simulated on training sequences, pooled over the last `TRAIN_WINDOW` log intervals) and `train/anchor_streak`.

The milestones are points of one run whose LR schedule ends at the full budget, which is what a sweep's pruner
reads mid-run; a separate short run (its schedule ending early) is a different experiment.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

TRAIN_WINDOW = 50  # log intervals at the end of training pooled for the train/ predictors
FINAL = "final"  # an option's last evaluation, at its own budget (a column only where the stage's budgets differ)


def read_metrics(run_dir: Path) -> list[dict]:
    f = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def eval_curve(rows: Sequence[dict], objective: str) -> list[tuple[float, float]]:
    """(consumed tokens, objective) at every step that logged it, in step order. In-training evals log it under
    `eval/subset/...` (with `eval.subset` at least the suite's size the subset is the whole suite); runs of stores
    written before that name logged it under the objective's own name."""
    subset = "eval/subset/" + objective.removeprefix("eval/")
    tokens: dict[int, float] = {}
    out = []
    for r in rows:
        if "data/consumed_tokens" in r:
            tokens[r["step"]] = r["data/consumed_tokens"]
        key = objective if objective in r else subset if subset in r else None
        if key is not None and r["step"] in tokens:
            out.append((tokens[r["step"]], float(r[key])))
    return out


def train_predictors(rows: Sequence[dict], window: int = TRAIN_WINDOW) -> dict[str, float]:
    """The train/ predictors over the last `window` log intervals: tau_rounds pooled over its rounds."""
    probed = [r for r in rows if "train/tau_rounds" in r][-window:]
    streak = [r["train/anchor_streak"] for r in rows if "train/anchor_streak" in r][-window:]
    out = {}
    n = sum(r.get("train/tau_rounds_n", 1.0) for r in probed)
    if n:
        out["train/tau_rounds"] = sum(r["train/tau_rounds"] * r.get("train/tau_rounds_n", 1.0) for r in probed) / n
    if streak:
        out["train/anchor_streak"] = sum(streak) / len(streak)
    return out


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's τ-b of two paired samples (ties in either count as neither concordant nor discordant)."""
    conc = disc = tx = ty = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else float("nan")


def option_curves(cells: Sequence[dict], objective: str) -> dict[str, dict[str, float]]:
    """option -> {budget label: mean over seeds}; budgets are the milestones every seed reached, labelled
    by their token count in millions, plus the train/ predictors."""
    per: dict[str, list[dict[str, float]]] = {}
    for cell in cells:
        rows = read_metrics(Path(cell["run_dir"]))
        if not rows:
            continue
        curve = eval_curve(rows, objective)
        point = {f"{round(t / 1e6):g} M": v for t, v in curve}
        if curve:  # the run's last evaluation and its consumed tokens: where its own budget ended
            point.update({FINAL: curve[-1][1], "final_tokens": curve[-1][0]})
        point.update(train_predictors(rows))
        per.setdefault(cell["option"], []).append(point)
    out = {}
    for opt, seeds in per.items():
        keys = set.intersection(*(set(s) for s in seeds))
        out[opt] = {k: sum(s[k] for s in seeds) / len(seeds) for k in keys}
    return out


def _budgets(curves: dict[str, dict[str, float]]) -> list[str]:
    """The milestones every option reached, then `final` where the options' budgets differ, then the train/
    predictors."""
    keys = set.intersection(*(set(v) for v in curves.values())) if curves else set()
    evals = sorted((k for k in keys if k.endswith(" M")), key=lambda k: float(k[:-2]))
    mixed = FINAL in keys and len({round(v["final_tokens"]) for v in curves.values()}) > 1
    return evals + [FINAL] * mixed + [k for k in ("train/tau_rounds", "train/anchor_streak") if k in keys]


def _reference(budgets: Sequence[str]) -> str | None:
    """The budget whose order the others are compared with: `final` where budgets differ, else the largest."""
    evals = [b for b in budgets if b.endswith(" M") or b == FINAL]
    return evals[-1] if evals else None


def order_agreement(order: dict[str, float], reference: dict[str, float]) -> dict | None:
    """How `order` ({option: mean}) ranks the options against `reference`: Kendall's τ-b over the options both
    have, its winner (highest mean) and loser (lowest), and whether they are the reference's; None below two options
    in common. The one comparison of two orders: a budget against the final one here, a setting or an older
    campaign against the served order (sweeps/protocol_agreement.py)."""
    opts = sorted(set(order) & set(reference))
    if len(opts) < 2:
        return None
    top = lambda d, pick: pick(opts, key=lambda o: d[o])  # noqa: E731
    win, lose = top(order, max), top(order, min)
    return {"n": len(opts), "kendall_tau_b": kendall_tau_b([order[o] for o in opts], [reference[o] for o in opts]),
            "winner": win, "loser": lose, "winner_agrees": win == top(reference, max),
            "loser_agrees": lose == top(reference, min)}


def agrees_word(row: dict) -> str:
    """"yes", "winner only", "loser only" or "no": an `order_agreement` row's winner and loser against the
    reference's."""
    if row["winner_agrees"] and row["loser_agrees"]:
        return "yes"
    return "winner only" if row["winner_agrees"] else "loser only" if row["loser_agrees"] else "no"


def agreement_rows(curves: dict[str, dict[str, float]]) -> list[dict]:
    """Per budget: Kendall's τ-b with the final budget's order, and whether winner / loser agree."""
    budgets = _budgets(curves)
    final = _reference(budgets)
    if len(curves) < 2 or final is None:
        return []
    ref = {o: c[final] for o, c in curves.items()}
    return [{"budget": b, **order_agreement({o: c[b] for o, c in curves.items()}, ref)} for b in budgets]


def smallest_agreeing_budget(rows: Sequence[dict]) -> str | None:
    """The smallest eval budget from which on every budget's winner and loser agree with the final budget's."""
    evals = [r for r in rows if r["budget"].endswith(" M")]
    ok = None
    for r in reversed(evals):
        if not (r["winner_agrees"] and r["loser_agrees"]):
            break
        ok = r["budget"]
    return ok


def curve_section(cells: Sequence[dict], objective: str, factor: str) -> list[str]:
    """Markdown: the learning-curve table and the rank-agreement table of one stage's cells."""
    curves = option_curves(cells, objective)
    budgets = _budgets(curves)
    if sum(b.endswith(" M") for b in budgets) < 2:
        return []  # no milestone evals: nothing beyond the final table
    n_seeds = {o: sum(1 for c in cells if c["option"] == o) for o in curves}
    lines = [f"#### Learning curve of `{objective}` (mean over seeds) and the train/ predictors at the end", "",
             f"| {factor} | seeds | " + " | ".join(budgets) + " |", "|---|---|" + "---|" * len(budgets)]
    final = _reference(budgets)
    for o in sorted(curves, key=lambda o: -curves[o][final]):
        lines.append(f"| {o} | {n_seeds[o]} | " + " | ".join(f"{curves[o][b]:.3f}" for b in budgets) + " |")
    rows = agreement_rows(curves)
    if not rows:  # one option so far (a stage whose other cells have not run): nothing to rank
        return lines + ["", "One option so far: no rank agreement yet.", ""]
    lines += ["", "Rank agreement with the final budget's order (Kendall's τ-b over the options; winner = highest "
              "mean, loser = lowest):", "", "| ordering by | Kendall τ-b | winner | loser | agrees |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']} | {r['kendall_tau_b']:+.2f} | {r['winner']} | {r['loser']} | {agrees_word(r)} |")
    if FINAL in budgets:  # a shared milestone is no short run of the longer option: no smallest budget to read
        return lines + ["", "The options trained at different budgets: `final` is each one's last evaluation, and a "
                        "shared milestone is mid-schedule for the longer run (its LR has not decayed there), so no "
                        "smallest agreeing budget is read from this stage.", ""]
    small = smallest_agreeing_budget(rows)
    lines += ["", f"Smallest budget whose winner and loser agree with the final one: **{small or 'none'}** "
              f"(the means; a difference inside the paired interval of the final table is a tie).", ""]
    return lines
