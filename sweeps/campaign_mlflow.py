"""A campaign's summary rebuilt from the MLflow store it wrote, as `summary.json` holds it: what the ablation
notebook (`notebooks/ablation.ipynb`) renders with `sweeps.campaign_report.render_report`, from the store alone."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sweeps.campaign_report import stage_call
from sweeps.campaign_spec import best_option, record_winner_lr, stage_cells
from sweeps.cells import cell_result, config_key

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
