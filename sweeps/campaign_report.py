"""`python -m sweeps.campaign <campaign> report`: the campaign's tables, from the run folders it wrote.

One table per stage (factor) and suite: τ vanilla and DDTree τ per node budget, each the τ pooled over the
stage's seeds with its bootstrap CI over (seed, prompt) pairs, prompt-lookup's τ on the same ground truth, and
the paired Δτ against the stage's reference option (its first one: hard_ce for the loss stage, the winner
carried in for later stages) — each option's run paired with the reference's run of the same seed, prompt
for prompt. A comparison is a *win* only when its Δ interval excludes 0; otherwise it is a tie bounded by
that interval. Budget, consumed tokens and epochs of data seen are printed with every table.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.atomic import atomic_write_text
from dflash.evaluation.pairing import NotPaired, ground_truth_of, per_task
from dflash.evaluation.stats import paired_delta_ci, pooled_ci

CI_LEVEL = 0.95


def _tables(run_dir: Path) -> dict[str, dict]:
    """{suite label: task table} of a finished run (the objective suite in eval/, the others beside it)."""
    out = {}
    for f in [run_dir / "eval" / "tasks.json", *sorted((run_dir / "eval").glob("*/tasks.json"))]:
        if f.is_file():
            t = json.loads(f.read_text())
            out[str((t.get("info") or {}).get("suite_label") or f.parent.name)] = t
    return out


def _methods(table: dict) -> list[tuple[str, str, str]]:
    """(label, τ-sum column, round-count column) of every method the table carries."""
    row = (table.get("tasks") or [{}])[0]
    out = [("vanilla", "tau_sum_vanilla", "rounds")]
    budgets = sorted(int(k.removeprefix("tau_sum_tree_")) for k in row if k.startswith("tau_sum_tree_"))
    out += [(f"tree {b} nodes", f"tau_sum_tree_{b}", f"rounds_tree_{b}") for b in budgets]
    if "tau_sum_prompt_lookup" in row:
        out.append(("prompt-lookup", "tau_sum_prompt_lookup", "rounds_prompt_lookup"))
    return out


def _stacked(tables: list[dict], sum_col: str, count_col: str) -> tuple[list[float], list[float]]:
    sums, counts = [], []
    for t in tables:
        _, s, c = per_task(t, sum_col, count_col)
        sums += s
        counts += c
    return sums, counts


def _fmt(iv) -> str:
    return f"{iv.value:.3f} [{iv.low:.3f}, {iv.high:.3f}]"


def _verdict(iv) -> str:
    if iv.low > 0:
        return "better"
    if iv.high < 0:
        return "worse"
    return f"tie (within {iv.low:+.3f} … {iv.high:+.3f})"


def stage_table(cells: list[dict], suite: str, reference: str) -> list[str]:
    """Markdown rows for one stage and suite; each option's seeds paired with the reference's seeds."""
    by_opt: dict[str, dict[int, dict]] = {}
    for c in cells:
        t = _tables(Path(c["run_dir"])).get(suite)
        if t is not None:
            by_opt.setdefault(c["option"], {})[int(c["seed"])] = t
    if reference not in by_opt:
        return [f"_no {suite} task tables for the reference option {reference}_"]
    methods = _methods(by_opt[reference][min(by_opt[reference])])
    head = ["option", "n seeds", *[f"τ {m[0]}" for m in methods], "Δτ vanilla vs " + reference, "verdict"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for opt, seeds in by_opt.items():
        common = sorted(set(seeds) & set(by_opt[reference]))
        tables = [seeds[s] for s in common]
        cols = [_fmt(pooled_ci(*_stacked(tables, sc, cc), level=CI_LEVEL)) for _, sc, cc in methods]
        try:
            if any(ground_truth_of(seeds[s]) != ground_truth_of(by_opt[reference][s]) for s in common):
                raise NotPaired("different ground truth")
            delta = paired_delta_ci(*_stacked(tables, "tau_sum_vanilla", "rounds"),
                                    *_stacked([by_opt[reference][s] for s in common], "tau_sum_vanilla", "rounds"),
                                    level=CI_LEVEL)
            dcol, verdict = (_fmt(delta), "reference" if opt == reference else _verdict(delta))
        except NotPaired as e:
            dcol, verdict = "not paired", str(e)
        rows.append("| " + " | ".join([opt, str(len(common)), *cols, dcol, verdict]) + " |")
    return rows


def _budget_line(cells: list[dict]) -> str:
    tok = [c.get("consumed_tokens") or 0 for c in cells]
    ep = [c.get("epochs") for c in cells if c.get("epochs") is not None]
    epochs = f"{min(ep):.2f}–{max(ep):.2f}" if ep else "not logged"
    return (f"consumed tokens per run {min(tok):,.0f}–{max(tok):,.0f}; epochs of data seen {epochs}; "
            f"{len(cells)} runs")


def write_report(c, out: Path, dest: Path | None = None) -> dict[str, Any]:
    """Render `<out>/<campaign>/ABLATIONS.md` (and `dest` when given) from the campaign's summary."""
    summary_f = out / c.name / "summary.json"
    if not summary_f.is_file():
        raise FileNotFoundError(f"{summary_f}: the campaign has not finished a stage yet (run it first)")
    summary = json.loads(summary_f.read_text())
    lines = [f"# Ablation campaign `{c.name}`", "", c.description, "",
             f"Command: `python -m sweeps.campaign {c.name}` (then `… {c.name} report`). Budget: "
             f"{c.budget_tokens:,} consumed training tokens per run, seeds {c.seeds}, objective `{c.objective}`. "
             f"τ: pooled over seeds with its {CI_LEVEL:.0%} bootstrap CI over (seed, prompt) pairs; Δτ paired "
             f"with the reference option's run of the same seed; a tie is a Δ interval containing 0.", ""]
    winners = summary.get("winners", {})
    for i, stage in enumerate(c.stages):
        cells = [x for x in summary["cells"] if x["stage"] == i]
        if not cells:
            continue
        reference = stage.options[0]
        suites = sorted({s for x in cells for s in _tables(Path(x["run_dir"]))})
        lines += [f"## Stage {i}: {stage.factor}" + (f" (on best {', '.join(f'{f}={winners.get(f)}' for f in stage.on_best)})"
                                                     if stage.on_best else ""), "", _budget_line(cells), ""]
        for suite in suites:
            lines += [f"### suite `{suite}`", "", *stage_table(cells, suite, reference), ""]
        lines += [f"Highest mean objective: **{winners.get(stage.factor, '?')}** (a winner only where its Δ "
                  f"interval above excludes 0).", ""]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / c.name / "ABLATIONS.md", text)
    if dest is not None:
        atomic_write_text(dest, text)
    print(text)
    return {"report": str(out / c.name / "ABLATIONS.md"), "winners": winners}
