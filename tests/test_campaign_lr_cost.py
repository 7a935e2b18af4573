"""A campaign stage's learning-rate axis (`lr_grid`: each option at its own best lr) and each cell's cost beside its
τ (sweeps/cost.py), on the campaign tests' fake cells: task tables and records written by the test."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.config import ConfigError
from sweeps.campaign_spec import at_best_lr, best_lrs, best_option, parse_campaign, stage_cells

RAW = {"name": "lr", "experiment": "e", "budget_tokens": 1000, "max_steps": 10, "objective": "eval/tau_vanilla",
       "base": [], "seeds": [0, 1],
       "stages": [{"factor": "drafter", "options": {"adamw": [], "muon": ["trainer.optimizer=muon"]},
                   "lr_grid": {"muon": [0.0003, 0.001]}},
                  {"factor": "loss", "options": ["hard_ce"], "on_best": ["drafter"]}]}


def _table(sums: list[float], rounds: int = 10) -> dict:
    return {"info": {"ground_truth_key": "gt", "suite_label": "heldout"},
            "tasks": [{"task": f"p{i // 2}#s{i % 2}", "tau_sum_vanilla": s, "rounds": rounds} for i, s in enumerate(sums)]}


def _cell(tmp_path: Path, cell, sums: list[float], **record) -> dict:
    d = tmp_path / cell.id
    (d / "eval").mkdir(parents=True)
    (d / "eval" / "tasks.json").write_text(json.dumps(_table(sums)))
    return {**cell.labels(), "run_dir": str(d), "value": sum(sums) / (10 * len(sums)), **record}


def test_an_option_with_an_lr_grid_gets_a_cell_per_lr_and_seed():
    c = parse_campaign(RAW, "lr.yaml")
    cells = stage_cells(c, 0, {})
    assert [x.id for x in cells] == ["s0-drafter-adamw-seed0", "s0-drafter-adamw-seed1",
                                     "s0-drafter-muon-lr0.0003-seed0", "s0-drafter-muon-lr0.0003-seed1",
                                     "s0-drafter-muon-lr0.001-seed0", "s0-drafter-muon-lr0.001-seed1"]
    muon = cells[2]
    assert muon.overrides[-2:] == ["trainer.optimizer=muon", "trainer.lr=0.0003"] and muon.labels()["lr"] == 0.0003
    # a later stage built on the winner trains at the lr it won at
    later = stage_cells(c, 1, {"drafter": "muon"}, {"drafter": 0.001})[0]
    i = later.overrides.index("trainer.optimizer=muon")
    assert later.overrides[i + 1] == "trainer.lr=0.001" and later.overrides[-1] == "+loss=hard_ce"
    assert parse_campaign({k: v for k, v in RAW.items() if k != "seeds"}, "x").seeds == [0, 1, 2]  # the default


@pytest.mark.parametrize("grid, match", [({"sgd": [0.1]}, "'sgd' is not an option"),
                                         ({"muon": []}, "non-empty list"), ({"muon": [0.1, -1]}, "positive"),
                                         ({"muon": [0.1, 0.1]}, "distinct"), ([0.1], "expected a mapping")])
def test_a_bad_lr_grid_names_the_key(grid, match):
    raw = json.loads(json.dumps(RAW))
    raw["stages"][0]["lr_grid"] = grid
    with pytest.raises(ConfigError, match=r"stages\[0\]\.lr_grid.*" + match if match != "'sgd' is not an option"
                       else match):
        parse_campaign(raw, "lr.yaml")


def test_each_option_is_compared_at_its_own_best_lr(tmp_path):
    """muon at lr 0.001 beats adamw; at 0.0003 it trails it. The stage picks muon's best lr by its mean objective
    over seeds, compares it there (the call's order and ties), and the report and summary say so."""
    from sweeps.campaign_report import lr_lines, stage_call
    from sweeps.results_summary import render_summary
    c = parse_campaign(RAW, "lr.yaml")
    grid = stage_cells(c, 0, {})
    base = [15, 25, 20, 30, 18, 22, 26, 24]
    shift = {"adamw": 0, "muon-lr0.0003": -3, "muon-lr0.001": 4}
    cells = []
    for cell in grid:
        key = cell.option + ("" if cell.lr is None else f"-lr{cell.lr:g}")
        cells.append(_cell(tmp_path, cell, [s + shift[key] + cell.seed for s in base]))
    assert best_lrs(cells) == {"adamw": None, "muon": 0.001} and best_option(cells) == "muon"
    assert {(x["option"], x.get("lr")) for x in at_best_lr(cells)} == {("adamw", None), ("muon", 0.001)}
    call = stage_call(cells, "eval/tau_vanilla", "muon")
    assert call["order"] == "muon > adamw" and call["tied"] == []  # +0.4 on every row: separated even at 2 seeds
    said = "\n".join(lr_lines(c.stages[0], cells))
    assert "muon at lr 0.001 of {0.0003, 0.001} (0.0003: 2.000, 0.001: 2.700)" in said
    assert "At the edge of its grid: muon (largest)" in said and "next best" not in said
    # with the objective's suite: the best lr's paired Δ against the next best, under the tie rule
    said = "\n".join(lr_lines(c.stages[0], cells, "heldout"))
    assert "muon 0.001 − 0.0003: 0.700 [0.700, 0.700] better" in said and "adamw" not in said.split("next best")[1]
    summary = {"cells": cells, "winners": {"drafter": "muon"}, "calls": {"drafter": call}}
    line = next(x for x in render_summary(c, summary) if x.startswith("- Stage 0"))
    assert "**muon** τ 2.700 [" in line and "muon each at its best of lr ∈ {0.0003, 0.001}" in line


def _metrics(d: Path, points: list[tuple[int, float, float]], evals: dict[int, float]) -> None:
    """metrics.jsonl rows (step, wall time, consumed tokens), with the objective at the steps of `evals`."""
    rows = [{"step": s, "time": t, "data/consumed_tokens": tok, **({"eval/tau_vanilla": evals[s]} if s in evals else {})}
            for s, t, tok in points]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_cost_beside_tau_and_the_options_at_equal_gpu_time(tmp_path):
    """A 2-GPU cell: GPU-seconds are its loop's wall time × 2, tokens per second its leg's, τ per GPU-hour from
    them; a slow option compared with a fast one at the fast one's full GPU time reads its mid-run evaluation."""
    from sweeps.cost import cell_cost, cost_lines, equal_gpu_time_lines, gpu_curve
    from sweeps.learning_curves import read_metrics
    fast = {"option": "fast", "value": 1.5, "consumed_tokens": 1000.0, "leg_tokens": 1000.0, "gpus": 2,
            "phases_s": {"loop_s": 100.0}}
    assert cell_cost(fast) == {"gpu_s": 200.0, "tok_s": 10.0, "tau_per_gpu_h": 1.5 / (200 / 3600)}
    resumed = {**fast, "leg_tokens": 500.0, "gpus": 1}  # its last leg trained 500 of its 1000 tokens in 100 s
    assert cell_cost(resumed)["gpu_s"] == 200.0 and cell_cost({**fast, "phases_s": {}}) is None
    cells = []
    for opt, seconds in [("fast", 100.0), ("slow", 400.0)]:
        for seed in (0, 1):
            d = tmp_path / f"{opt}{seed}"
            d.mkdir()
            # four log rows evenly over the loop, an in-training evaluation at the halfway row, the final at the end
            _metrics(d, [(s, 1000.0 + seconds * s / 40, 25.0 * s) for s in (10, 20, 30, 40)],
                     {20: 1.2 if opt == "fast" else 1.6, 40: 1.5 if opt == "fast" else 1.9})
            cells.append({"option": opt, "seed": seed, "run_dir": str(d), "value": 1.5 if opt == "fast" else 1.9,
                          "consumed_tokens": 1000.0, "leg_tokens": 1000.0, "phases_s": {"loop_s": seconds}})
    assert gpu_curve(read_metrics(tmp_path / "slow0"), "eval/tau_vanilla", 400.0) == [(200.0, 1.6), (400.0, 1.9)]
    table = "\n".join(cost_lines(cells))
    assert "| fast | 2 | 100 | 10 | 54.00 |" in table and "| slow | 2 | 400 | 2 | 17.10 |" in table
    view = "\n".join(equal_gpu_time_lines(cells, "eval/tau_vanilla"))
    assert "| GPU-s | fast | slow | leads |" in view
    # at the fast option's full run the slow one has no evaluation yet (its first came at 200 GPU-s)
    assert "| 100 | 1.500 (100 s) | — | fast alone |" in view
    # at the slow option's full run: the fast one's last evaluation (its end) against the slow one's end
    assert "| 400 | 1.500 (100 s) | 1.900 (400 s) | **slow**, ahead on every seed |" in view


def test_equal_gpu_time_names_a_tie_where_the_seeds_disagree(tmp_path):
    """The leader at a budget is ahead on every seed or tied with the options one seed of which reaches it."""
    from sweeps.cost import equal_gpu_time_lines
    cells = []
    for opt, finals in [("a", {0: 1.6, 1: 1.4}), ("b", {0: 1.5, 1: 1.45})]:
        for seed, final in finals.items():
            d = tmp_path / f"{opt}{seed}"
            d.mkdir()
            _metrics(d, [(s, 1000.0 + s, 25.0 * s) for s in (10, 20)], {10: 1.0, 20: final})
            cells.append({"option": opt, "seed": seed, "run_dir": str(d), "value": final, "consumed_tokens": 500.0,
                          "leg_tokens": 500.0, "phases_s": {"loop_s": 20.0}})
    view = "\n".join(equal_gpu_time_lines(cells, "eval/tau_vanilla"))
    assert "| 20 | 1.500 (20 s) | 1.475 (20 s) | a (tied, seed for seed, with b) |" in view


def test_a_cell_renamed_by_a_new_lr_grid_is_its_earlier_run(monkeypatch, tmp_path):
    """A stage that gains an lr grid renames its cells (`s0-drafter-muon-seed0` → `…-muon-lr0.001-seed0`): the grid's
    point at the option's own lr (0.001, the default) composes to the earlier cell's config, so that run is reused
    (labelled for the new cell), also when it was tracked at another store path; the other point trains."""
    import sweeps.campaign as campaign
    import sweeps.cells as sweep_cells
    from sweeps.cells import renamed_runs
    before = parse_campaign({**RAW, "seeds": [0], "stages": [{**RAW["stages"][0], "lr_grid": {}}]}, "lr.yaml")
    old = next(x for x in stage_cells(before, 0, {}) if x.option == "muon")
    old_dir = tmp_path / "lr" / "runs" / old.id
    old_dir.mkdir(parents=True)
    pin = "eval.truth_dir=/pins"  # every launch evaluates on the campaign's pinned ground truth
    record = {**old.labels(), "value": 2.5,
              "overrides": [*old.overrides, "tracking.tracking_uri=sqlite:////x/m.db", pin]}
    (old_dir / "cell.json").write_text(json.dumps(record))
    (tmp_path / "lr" / "runs" / "s0-drafter-adamw-seed0").mkdir()  # a current cell's folder, unfinished: no record
    after = parse_campaign({**RAW, "seeds": [0], "stages": [{**RAW["stages"][0],
                                                             "lr_grid": {"muon": [0.0003, 0.001]}}]}, "lr.yaml")
    done = renamed_runs(after, tmp_path)
    assert [r["cell"] for r in done.values()] == [old.id]
    ran = []

    def fake_run(c_, cell, out, gpu=None, share=0, oom_restarts=0):
        ran.append(cell.id)
        return {**cell.labels(), "value": 1.0, "overrides": cell.overrides}
    monkeypatch.setattr(sweep_cells, "run_cell", fake_run)
    cells = [x for x in stage_cells(after, 0, {})]
    for x in cells:
        x.overrides += ["tracking.tracking_uri=sqlite:////here/m.db", pin]
    by = {r["cell"]: r for r in campaign._run_stage(after, cells, tmp_path, done, None)}
    assert by["s0-drafter-muon-lr0.001-seed0"]["reused_from"] == old.id
    assert by["s0-drafter-muon-lr0.001-seed0"]["value"] == 2.5 and by["s0-drafter-muon-lr0.001-seed0"]["lr"] == 0.001
    assert sorted(ran) == ["s0-drafter-adamw-seed0", "s0-drafter-muon-lr0.0003-seed0"]
    # a folder the campaign still names is its cell's own record, never another cell's source
    assert renamed_runs(before, tmp_path) == {}
