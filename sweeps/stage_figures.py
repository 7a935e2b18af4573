"""The data of each stage's figure (`dflash.tracking.stage_figure.plot_stage`) from a campaign summary, the report's
(`load_summary`) or the notebook's (`summary_from_mlflow`): the same runs, the same numbers as the report's tables.

Curves: each cell's in-training evaluations from its run folder's metrics.jsonl (`sweeps.learning_curves`) and its
final objective at its consumed tokens. Δs: each option against the stage's winner, paired seed for seed and
prompt for prompt over the seeds every option has, with the report's verdict (`campaign_report._delta`).
"""
from __future__ import annotations

from pathlib import Path

from dflash.evaluation.pairing import ground_truth_of, metric_columns
from sweeps.campaign_report import _by_option, _delta, paired_ci, pooled, shared_seeds
from sweeps.campaign_spec import at_best_lr
from sweeps.learning_curves import eval_curve, read_metrics
from sweeps.results_summary import PL_COLUMNS, stage_answer


def stage_figure_data(c, summary: dict, i: int):
    """The figure data of stage `i`, or None where the stage has no called or leading option yet."""
    from dflash.tracking.stage_figure import StageFigureData
    a = stage_answer(c, summary, i)
    if "winner" not in a:
        return None
    stage = c.stages[i]
    cells = at_best_lr([x for x in summary["cells"] if x["stage"] == i and not x.get("failed")])
    curves = {}
    for x in cells:
        pts = eval_curve(read_metrics(Path(x["run_dir"])), c.objective)
        if x.get("consumed_tokens") and x.get("value") is not None:
            pts = [p for p in pts if p[0] < x["consumed_tokens"]] + [(float(x["consumed_tokens"]), float(x["value"]))]
        curves[(x["option"], int(x["seed"]))] = pts
    cols = metric_columns(c.objective)
    by_opt = _by_option(cells, a["suite"])
    shared = shared_seeds(by_opt)
    won = {s: by_opt[a["winner"]][s] for s in shared}
    deltas = []
    for opt in stage.options:
        if opt == a["winner"]:
            continue
        mine = {s: by_opt[opt][s] for s in shared}
        same = [s for s in shared if ground_truth_of(mine[s]) == ground_truth_of(won[s])]
        if not same:
            continue  # not paired: no point to draw
        iv = paired_ci([mine[s] for s in same], [won[s] for s in same], (cols.sum_col, cols.count_col),
                    (cols.sum_col, cols.count_col))
        verdict = _delta(mine, won, cols.sum_col, cols.count_col)[1]
        deltas.append((opt, iv.value, iv.low, iv.high, verdict.startswith("tie")))
    tables = list(won.values())
    pl = None
    if PL_COLUMNS[0] in (tables[0].get("tasks") or [{}])[0]:
        iv = pooled(tables, *PL_COLUMNS)
        pl = (iv.value, iv.low, iv.high)
    seeds = ("seed " if len(shared) == 1 else "seeds ") + ", ".join(map(str, shared))
    return StageFigureData(title=f"{c.name}, stage {i}: {stage.factor} ({a['suite']}; {seeds})",
                           options=list(stage.options), curves=curves,
                           winner=a["winner"], deltas=deltas, prompt_lookup=pl, objective=c.objective)


def stage_figures(c, summary: dict) -> dict[int, object]:
    """{stage index: its figure} for every stage with an option to draw."""
    from dflash.tracking.stage_figure import plot_stage
    out = {}
    for i in range(len(c.stages)):
        data = stage_figure_data(c, summary, i)
        if data is not None:
            out[i] = plot_stage(data)
    return out


def save_stage_figures(c, summary: dict, folder: Path) -> dict[int, str]:
    """Write each stage's figure as `<folder>/stage<i>_<factor>.png`; {stage index: file name}."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {}
    for i, fig in stage_figures(c, summary).items():
        names[i] = f"stage{i}_{c.stages[i].factor}.png"
        fig.savefig(folder / names[i], dpi=110)
    return names
