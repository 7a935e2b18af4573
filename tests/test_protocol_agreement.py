"""The served protocol's report pieces (sweeps/protocol_agreement.py): the greedy table beside the served one, the
ground truth's degeneracy line, and the rank agreement of T = 0 and of an earlier (old-protocol) campaign with the
served order, on hand-written task tables whose orders are known."""
from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

from sweeps.campaign_spec import load_campaign
from sweeps.protocol_agreement import agreement_row, agreement_section, greedy_section, ground_truth_lines

TASKS = [f"mod.f{i}" for i in range(6)]


def _table(tau: float, setting: str | None, trees: bool = False, key: str = "gt") -> dict:
    """A task table whose every prompt has τ near `tau` (10 rounds a prompt, a small spread)."""
    rows = []
    for i, t in enumerate(TASKS):
        r = {"task": t, "rounds": 10, "tau_sum_vanilla": 10 * (tau + 0.01 * (i % 3)),
             "tau_sum_prompt_lookup": 10 * 1.3, "rounds_prompt_lookup": 10}
        if trees:
            r |= {"tau_sum_tree_4": 10 * (tau + 0.2), "rounds_tree_4": 10}
        rows.append(r)
    info = {"suite": "heldout", "suite_label": "heldout", "ground_truth_key": f"{key}-{setting}"}
    metrics = {"eval/gt_repeat4": 0.12, "eval/gt_in_repeat16": 0.05, "eval/gt_cycle_share": 0.02,
               "eval/gt_mean_tokens": 180.0, "eval/human_repeat4": 0.14, "eval/human_in_repeat16": 0.04,
               "eval/human_cycle_share": 0.0, "eval/human_tau_prompt_lookup": 1.31}
    if setting is not None:
        info |= {"setting": "t1" if setting == "served" else "t0", "sampling": "sampled at T=1, top_p=1, top_k=off"}
    return {"info": info, "metrics": metrics, "tasks": rows}


def _cell(root: Path, option: str, seed: int, served: float | None, greedy: float, trees: bool = True) -> dict:
    run = root / f"{option}-{seed}"
    for setting, tau in (("served", served), ("t0", greedy)):
        if tau is None:  # an old-protocol run: its one greedy table in eval/
            (run / "eval").mkdir(parents=True, exist_ok=True)
            (run / "eval" / "tasks.json").write_text(json.dumps(_table(greedy, None, trees, key="old")))
            break
        (run / "eval" / setting).mkdir(parents=True, exist_ok=True)
        (run / "eval" / setting / "tasks.json").write_text(json.dumps(_table(tau, setting, trees and setting == "t0")))
    return {"option": option, "seed": seed, "stage": 0, "run_dir": str(run)}


def _kendall_by_hand(x, y):
    pairs = list(combinations(range(len(x)), 2))
    s = sum((x[i] - x[j]) * (y[i] - y[j]) > 0 for i, j in pairs) - sum((x[i] - x[j]) * (y[i] - y[j]) < 0
                                                                      for i, j in pairs)
    return s / len(pairs)  # no ties in these orders


def test_agreement_row_names_the_changed_winner_and_the_kendall_tau():
    served = {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.5}
    greedy = {"a": 2.0, "b": 3.0, "c": 1.0, "d": 0.4}  # a and b swap: the winner changes, the loser holds
    row = agreement_row("t0", greedy, served)
    keys = sorted(served)
    assert abs(row["kendall_tau_b"] - _kendall_by_hand([greedy[k] for k in keys], [served[k] for k in keys])) < 1e-12
    assert (row["winner"], row["loser"], row["agrees"]) == ("b", "d", "loser only")
    assert agreement_row("same", served, served)["agrees"] == "yes"
    assert "kendall_tau_b" not in agreement_row("one", {"a": 1.0, "z": 2.0}, served)  # one option in common: no order


def test_report_shows_greedy_beside_served_and_ranks_against_the_old_protocol(tmp_path):
    c = load_campaign("served")
    served_cells = [_cell(tmp_path / "served", o, s, served=t1, greedy=t0)
                    for s in (0, 1) for o, t1, t0 in (("hard_ce", 2.0, 3.0), ("streak", 2.4, 2.9),
                                                      ("dpace", 2.2, 3.4))]
    old_cells = [_cell(tmp_path / "old", o, s, served=None, greedy=t)
                 for s in (0, 1) for o, t in (("hard_ce", 4.0), ("streak", 3.9), ("dpace", 4.3))]
    # the old campaign's store as the report finds it: its summary in <out>/reference_64m
    (tmp_path / "reference_64m").mkdir()
    (tmp_path / "reference_64m" / "summary.json").write_text(json.dumps(
        {"campaign": "reference_64m", "winners": {}, "cells": [
            {**x, "cell": f"s0-loss-{x['option']}-seed{x['seed']}", "factor": "loss"} for x in old_cells]}))
    text = "\n".join(agreement_section(c, tmp_path, 0, served_cells, "heldout"))
    assert "Served order: streak 2.4" in text
    t0_row = next(line for line in text.splitlines() if line.startswith("| greedy (T=0)"))
    assert "| dpace | streak | no |" in t0_row  # greedy: dpace wins, streak (the served winner) loses
    old_row = next(line for line in text.splitlines() if line.startswith("| `reference_64m`"))
    assert "| 3 |" in old_row and "| dpace | streak | no |" in old_row
    greedy = "\n".join(greedy_section(served_cells, "heldout", "hard_ce", None))
    assert "greedy (T=0)" in greedy and "τ tree 4 nodes" in greedy  # trees at T = 0 only
    assert "tokens in repeated 16-grams 0.050" in "\n".join(ground_truth_lines(served_cells, "heldout"))


def test_a_stage_without_a_counterpart_or_store_says_which(tmp_path):
    c = load_campaign("served")
    cells = [_cell(tmp_path, o, 0, served=t, greedy=t) for o, t in (("hard_ce", 2.0), ("streak", 2.5))]
    loss = "\n".join(agreement_section(c, tmp_path, 0, cells, "heldout"))
    assert "Not compared: `reference_64m`'s loss stage is not in this store" in loss
    drafter = "\n".join(agreement_section(c, tmp_path, 1, cells, "heldout"))  # the old campaign has no drafter stage
    assert "Not compared" not in drafter and "| greedy (T=0), the same runs | 2 | +1.00 |" in drafter
