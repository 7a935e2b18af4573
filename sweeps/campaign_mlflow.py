"""A campaign's summary rebuilt from the MLflow store it wrote, as `summary.json` holds it: what the ablation
notebook (`notebooks/ablation.ipynb`) renders with `sweeps.campaign_report.render_report`, from the store alone."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from sweeps.campaign_report import stage_call
from sweeps.campaign_spec import best_lrs, best_option, record_winner_lr, stage_cells
from sweeps.cells import cell_ids, cell_result, config_key

CELL_NAME = re.compile(r"^s(\d+)-(\w+?)-(.+)-seed(-?\d+)$")  # the run name is the cell id (sweeps.campaign)


def _artifacts_dir(run, tracking_uri: str) -> Path:
    """The run's artifact folder (`dflash.tracking.run_info.local_artifact_dir`: the recorded one, or beside the
    sqlite file when the store was written on another machine and copied here)."""
    from dflash.tracking.run_info import local_artifact_dir
    found = local_artifact_dir(run.info.artifact_uri, tracking_uri, run.info.run_id)
    return found if found is not None else Path(".") / "mlartifacts" / run.info.run_id / "artifacts"


def _as_run_folder(art: Path, dest: Path) -> Path:
    """Copy the run's eval task tables into the layout `_tables` reads (`eval/served/tasks.json`,
    `eval/<suite>/served/…`; legacy `eval/tasks.json`, `eval/<suite>/…`)."""
    import shutil
    (dest / "eval").mkdir(parents=True, exist_ok=True)
    if (art / "eval" / "served" / "tasks.json").is_file():
        (dest / "eval" / "served").mkdir(exist_ok=True)
        shutil.copyfile(art / "eval" / "served" / "tasks.json", dest / "eval" / "served" / "tasks.json")
    for f in sorted((art / "eval" / "suite").glob("*/served/tasks.json")):
        (dest / "eval" / f.parent.parent.name / "served").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest / "eval" / f.parent.parent.name / "served" / "tasks.json")
    if (art / "eval" / "tasks.json").is_file():
        shutil.copyfile(art / "eval" / "tasks.json", dest / "eval" / "tasks.json")
    # artifacts hold the other suites under eval/suite/<name>/, a run folder under eval/<name>/
    for f in sorted([*(art / "eval" / "suite").glob("*/tasks.json"), *(art / "eval").glob("*/tasks.json")]):
        if f.parent.name == "suite":
            continue
        (dest / "eval" / f.parent.name).mkdir(exist_ok=True)
        shutil.copyfile(f, dest / "eval" / f.parent.name / "tasks.json")
    return dest


def _store_run_folder(tracking_uri: str, c, cell_id: str) -> Path | None:
    """The cell's run folder in a packed campaign store, beside its sqlite file (`<store>/<campaign>/runs/<cell>`):
    cells trained before their eval tables were logged as artifacts have them there only."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    folder = Path(tracking_uri.removeprefix("sqlite:///")).parent / c.name / "runs" / cell_id
    return folder if (folder / "eval" / "tasks.json").is_file() else None


def _mlflow_cell(c, cell, run, tracking_uri: str, work_dir: Path) -> dict[str, Any]:
    """A cell's record from its own MLflow run, as `summary.json` holds it (its eval task tables copied under
    `work_dir`, from its artifacts, else from its run folder in the store); `pinned`: it evaluated on the campaign's
    pinned ground truth (`eval.truth_dir` among its params)."""
    art = _artifacts_dir(run, tracking_uri)
    if not (art / "eval" / "tasks.json").is_file():
        art = _store_run_folder(tracking_uri, c, cell.id) or art
    folder = _as_run_folder(art, Path(work_dir) / cell.id)
    m = run.data.metrics
    return {**cell.labels(), "run_dir": str(folder), "value": m.get(c.objective), "run_id": run.info.run_id,
            "consumed_tokens": m.get("data/consumed_tokens"), "epochs": m.get("data/epochs"),
            "target_fingerprint": run.data.tags.get("dflash.target_fingerprint"),
            "pinned": bool(run.data.params.get("eval.truth_dir")), **_cost_fields(tracking_uri, c, cell.id)}


# what sweeps.cost reads of a cell's record, and the leg's wall time the report's speed line reads beside its phases
COST_FIELDS = ("phases_s", "wall_s_this_leg", "leg_tokens", "resumed", "gpus")


def _cost_fields(tracking_uri: str, c, cell_id: str) -> dict[str, Any]:
    """The cost fields of the cell's own record (`cell.json`) in its run folder beside the store, where it is
    there: MLflow's metrics cannot tell a resumed run's legs apart, so without it the notebook shows no cost."""
    if not tracking_uri.startswith("sqlite:///"):
        return {}
    folder = Path(tracking_uri.removeprefix("sqlite:///")).parent / c.name / "runs" / cell_id
    record = cell_result(folder) if (folder / "cell.json").is_file() else None
    return {k: record[k] for k in COST_FIELDS if k in record} if record else {}


def summary_from_mlflow(c, tracking_uri: str, work_dir: Path) -> dict[str, Any]:
    """A summary like `summary.json`, rebuilt from the campaign's MLflow experiment alone: its finished runs
    (named by cell id), their eval task tables (artifacts, copied under `work_dir`), the winners recomputed with
    the campaign's rule, and each cell that had no run of its own (the same config as an earlier cell,
    `sweeps.cells.config_key`) pointed at that cell's run: the earliest one on the pinned ground truth where the
    stage's runs of that seed are pinned, as the campaign chose it (`sweeps.campaign._run_stage`). Before, it was the
    earliest run: the buffer stage's seed-0 reference became the loss stage's run from before the pin, and the
    notebook showed the buffer stage "not paired"."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(c.experiment)
    if exp is None:
        raise ValueError(f"{tracking_uri}: no MLflow experiment {c.experiment!r} (campaign {c.name})")
    runs = {}
    for r in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=10000,
                                order_by=["attributes.start_time ASC"]):
        if CELL_NAME.match(r.info.run_name or ""):
            runs[r.info.run_name] = r  # a cell run again later: its newest run
    summary: dict[str, Any] = {"campaign": c.name, "winners": {}, "cells": [], "complete": True}
    earlier: dict[str, dict] = {}
    earlier_pinned: dict[str, dict] = {}
    for i, stage in enumerate(c.stages):
        if any(f not in summary["winners"] for f in stage.on_best):
            summary["complete"] = False
            break  # its cells' names depend on a winner not called yet (as `with_recorded_cells` reads a store)
        grid = stage_cells(c, i, summary["winners"], summary.get("winner_lrs"))
        keys = {cell.id: config_key(cell.overrides) for cell in grid}
        own = {cell.id: _mlflow_cell(c, cell, runs[cell.id], tracking_uri, work_dir) for cell in grid
               if cell.id in runs}
        for cid, got in own.items():
            earlier.setdefault(keys[cid], got)
            if got["pinned"]:
                earlier_pinned.setdefault(keys[cid], got)
        on_pin = {got["seed"] for got in own.values() if got["pinned"]}
        cells = []
        for cell in grid:
            src = own.get(cell.id) or (earlier_pinned if cell.seed in on_pin else earlier).get(keys[cell.id])
            if src is None:
                summary["complete"] = False
            else:
                cells.append(src if cell.id in own else {**src, **cell.labels(), "reused_from": src["cell"]})
        summary["cells"] += cells
        if len(cells) < len(grid):
            summary["complete"] = False
            continue  # an open stage calls no winner; later stages not built on it still read
        summary["winners"][stage.factor] = best_option(cells)
        record_winner_lr(summary, stage.factor, cells)
        summary.setdefault("calls", {})[stage.factor] = stage_call(cells, c.objective, summary["winners"][stage.factor])
    return summary


STAGE_RUN_TAG = "dflash.campaign_stage"  # "<campaign>/<stage index>": the stage's summary run
ANSWERS = "stage answers"  # the stage summary runs' `stage` tag: one group of the runs table, one row per stage
_INTERVAL = re.compile(r"^([+-]?\d+\.\d+) \[([+-]?\d+\.\d+), ([+-]?\d+\.\d+)\]")


def _interval(text: str) -> tuple[float, float, float] | None:
    """(value, low, high) of a report's "Δ [low, high]" text (`campaign_report._delta`); None where not paired."""
    m = _INTERVAL.match(text)
    return (float(m[1]), float(m[2]), float(m[3])) if m else None


def _with_ci(key: str, value: float, low: float, high: float) -> dict[str, float]:
    return {key: value, f"{key}_ci_low": low, f"{key}_ci_high": high}


def stage_figures(c, summary: dict, i: int, answer: dict) -> tuple[dict[str, str], dict[str, float], dict[str, str]]:
    """A called stage's answer as (its summary run's tags, its metrics, {option: the option's Δ tag text}): the
    winner's τ pooled over the stage's seeds with its CI (under the objective's own key, `eval/tau_served`), its
    paired Δ over the runner-up (`stage/<objective>_delta_runner_up`; a one-option stage: against the earlier
    stages' winners, nearest first), every option's pooled τ (`stage/<objective>/<option>`) and paired Δ against
    the winner (`stage/<objective>_delta/<option>`), each with its CI, all the report's own figures
    (`sweeps.results_summary.stage_answer`, `campaign_report._delta`)."""
    from dflash.evaluation.pairing import metric_columns
    from dflash.tracking.ui_view import STAGE_DELTA_TAG, TAU_TAG, stage_metric
    from sweeps.campaign_report import _by_option, _delta, _fmt, pooled
    from sweeps.campaign_spec import at_best_lr
    from sweeps.results_summary import _delta_words
    stage, winner, shared = c.stages[i], answer["winner"], answer["seeds"]
    cols = metric_columns(c.objective)
    # each option at its best lr where the stage has an lr grid, as the answer compares it (`stage_answer`)
    cells = at_best_lr([x for x in summary["cells"] if x["stage"] == i and not x.get("failed")
                        and int(x["seed"]) in shared])
    by_opt = _by_option(cells, answer["suite"])
    tau = answer["tau"]
    metrics = _with_ci(c.objective, tau.value, tau.low, tau.high)
    if "vs_winners" in answer:
        option = f"{winner} (one option)"
        delta = "; ".join(f"vs {w} ({f}) {_delta_words(d)}" for f, w, d in reversed(answer["vs_winners"]))
        runner_delta = answer["vs_winners"][-1][2] if answer["vs_winners"] else ("not paired", "")
    else:
        option = f"{winner} (winner)"
        runner_delta = answer.get("delta", ("not paired", ""))
        delta = f"vs {answer['runner_up']} (runner-up) {_delta_words(runner_delta)}" if "delta" in answer else ""
        if answer["tied"]:
            delta += f"; tied: {', '.join(answer['tied'])}"
    if (iv := _interval(runner_delta[0])) is not None:
        metrics.update(_with_ci(stage_metric(c.objective, "delta_runner_up"), *iv))
    per_option = {}
    for opt, seeds in by_opt.items():
        t = pooled(list(seeds.values()), cols.sum_col, cols.count_col)
        metrics.update(_with_ci(stage_metric(c.objective, f"/{opt}"), t.value, t.low, t.high))
        if opt == winner:
            per_option[opt] = "the stage's winner" if "vs_winners" not in answer else "one option"
            continue
        text, verdict = _delta(seeds, by_opt[winner], cols.sum_col, cols.count_col)
        per_option[opt] = f"vs {winner} {_delta_words((text, verdict))}"
        if (iv := _interval(text)) is not None:
            metrics.update(_with_ci(stage_metric(c.objective, f"_delta/{opt}"), *iv))
    tags = {"campaign": c.name, "stage": ANSWERS, "option": f"{i} {stage.factor}: {option}",
            "seed": "pooled " + ", ".join(map(str, shared)), TAU_TAG: _fmt(tau), STAGE_DELTA_TAG: delta}
    return tags, metrics, per_option


def log_stage_runs(client, experiment_id: str, c, summary: dict) -> dict[str, dict[str, str]]:
    """One summary run per called stage (tag `dflash.campaign_stage`, `dflash.kind=campaign`: not a training run),
    named for its answer (`stage 1 drafter: dflash2_muon (winner)`), carrying `stage_figures` as tags (the runs
    table's columns; all stages' runs in one group of the key-metrics view, `ANSWERS`) and metrics (the chart view's
    first charts: `dflash.tracking.ui_view.chart_state`), and a saved view of each stage, its compare view
    (`ui_view.stage_view`): the runs of the stage, an earlier stage's run it reuses among them, each showing its
    option and its paired Δ against the winner in the run tag named for the stage ("stage 1 drafter"). Each report
    updates the same runs. Returns {cell run name: the tags that say its option's Δ against its stage's winner},
    for `sweeps.results_summary.label_cell_runs` (the view's `Δτ in stage` and the stage's own tag)."""
    from mlflow.entities import Metric, RunTag

    from dflash.tracking.ui_view import STAGE_DELTA_TAG, TAU_TAG, stage_view
    from sweeps.results_summary import stage_answer
    out: dict[str, dict[str, str]] = {}
    now = int(time.time() * 1000)
    current = cell_ids(c)  # every cell the campaign file makes now
    for i, stage in enumerate(c.stages):
        answer = stage_answer(c, summary, i)
        if "winner" not in answer:
            continue
        tags, metrics, per_option = stage_figures(c, summary, i, answer)
        key = f"{c.name}/{i}"
        found = client.search_runs([experiment_id], f"tags.`{STAGE_RUN_TAG}` = '{key}'", max_results=1)
        name = f"stage {tags['option']}"
        option = tags["option"].split(": ", 1)[1]
        run_id = found[0].info.run_id if found else client.create_run(
            experiment_id, run_name=name, tags={STAGE_RUN_TAG: key, "dflash.kind": "campaign"}).info.run_id
        note = (f"Campaign `{c.name}`, stage {i} ({stage.factor}), objective `{c.objective}`: **{option}** "
                f"τ {tags[TAU_TAG]} pooled over {tags['seed'].removeprefix('pooled ')}; {tags[STAGE_DELTA_TAG]}.")
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                         tags=[RunTag(k, v) for k, v in {**tags, "mlflow.runName": name,
                                                           "mlflow.note.content": note}.items()])
        column = f"stage {i} {stage.factor}"  # the stage's own tag: its compare view's first column
        client.set_tag(run_id, column, f"{option}: {tags[STAGE_DELTA_TAG]}")  # its τ [CI]: the view's τ column
        client.set_terminated(run_id)
        mine = [x for x in summary["cells"] if x["stage"] == i and not x.get("failed")]
        best = best_lrs(mine)
        here = set()
        for x in mine:
            if x["option"] not in per_option:
                continue
            name = x.get("reused_from") or x["cell"]  # a reused run is labelled for this stage too
            here.add(name)
            got = out.setdefault(name, {})
            said = per_option[x["option"]]
            if x.get("lr") != best.get(x["option"]):  # a point of the option's lr grid that the stage does not compare
                said = f"lr {x['lr']:g}: not compared (the stage takes its best lr, {best[x['option']]:g})"
            got[column] = f"{x['option']}: {said}"
            if not x.get("reused_from"):
                got[STAGE_DELTA_TAG] = said
        for run in client.search_runs([experiment_id], max_results=10000):
            name = run.info.run_name or ""
            if name in here or STAGE_RUN_TAG in run.data.tags:
                continue
            if column in run.data.tags:  # labelled by an earlier report, not a run of the stage now: out of its view
                client.delete_tag(run.info.run_id, column)
            m = CELL_NAME.match(name)
            if m is not None and int(m[1]) == i and name not in current:  # no cell of the campaign file is this run
                out.setdefault(name, {}).setdefault(STAGE_DELTA_TAG, NOT_IN_STAGE)
        stage_view(client, experiment_id, i, column, c.objective)
    return out


# a run of the stage's experiment that no cell of its grid is now (its cells renamed, run again): never a result
NOT_IN_STAGE = "not in the stage's result (no cell of the stage's grid now)"
