"""Two campaigns on two targets side by side (sweeps.transfer): ranks, the rank agreement over seeds, which pairs
hold on both, and reach per block position."""
import json
from pathlib import Path

import pytest

from sweeps.transfer import kendall_over_seeds, main, pair_conclusion, transfer_report

CAMPAIGN = """name: {name}
description: two-target test campaign
experiment: t-{name}
budget_tokens: 1000
max_steps: 2
seeds: [0, 1, 2]
objective: eval/tau_served
base: [+target=tiny_random]
stages:
  - factor: loss
    options: [a, b, c]
"""


def _table(taus: list[float], reach2: float) -> dict:
    """A served objective table of 8 prompt samples at 10 rounds each, whose τ on prompt i is taus[i]."""
    return {"info": {"ground_truth_key": "gt", "suite_label": "heldout", "setting": "served"},
            "stats": {"eval/reach_pos02": reach2, "eval/reach_pos04": reach2 / 10},
            "tasks": [{"task": f"p{i}", "tau_sum_vanilla": 10 * t, "rounds": 10} for i, t in enumerate(taus)]}


def _rows(text: str) -> dict[str, str]:
    """Each table row by its first cell, the first row of that name (the τ table's, before the reach table's)."""
    out: dict[str, str] = {}
    for r in text.splitlines():
        if r.startswith("| "):
            out.setdefault(r.split("|")[1].strip(), r)
    return out


def _campaign(tmp_path: Path, name: str, offsets: dict[str, float], reach2: float) -> Path:
    """A finished one-stage campaign under tmp_path/out: option o's τ on every prompt is base + offsets[o], the
    same at every seed up to a small seed shift."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(CAMPAIGN.format(name=name))
    base = [1.2, 1.4, 1.3, 1.5, 1.25, 1.35, 1.45, 1.3]
    cells = []
    for opt, off in offsets.items():
        for seed in (0, 1, 2):
            cell = f"s0-loss-{opt}-seed{seed}"
            run = tmp_path / "out" / name / "runs" / cell
            (run / "eval" / "served").mkdir(parents=True)
            taus = [t + off + 0.01 * seed for t in base]
            (run / "eval" / "served" / "tasks.json").write_text(json.dumps(_table(taus, reach2)))
            cells.append({"cell": cell, "stage": 0, "factor": "loss", "option": opt, "seed": seed,
                          "run_dir": str(run), "value": sum(taus) / len(taus)})
    summary = {"campaign": name, "winners": {"loss": max(offsets, key=offsets.get)}, "cells": cells,
               "complete": True, "stages": []}
    (tmp_path / "out" / name / "summary.json").write_text(json.dumps(summary))
    return spec


def test_pairs_that_hold_on_both_targets_and_one_that_reverses(tmp_path):
    a = _campaign(tmp_path, "code", {"a": 0.3, "b": 0.2, "c": 0.0}, reach2=0.2)
    b = _campaign(tmp_path, "math", {"a": 0.5, "b": 0.0, "c": 0.25}, reach2=0.9)
    text = transfer_report(str(a), str(b), tmp_path / "out", tmp_path / "out")
    rows = _rows(text)
    assert "| 1 |" in rows["a"] and rows["b"].endswith("| 2 | 1.354 [1.255, 1.465] | 3 |"), rows["b"]
    assert "Kendall's τ-b **+0.33**" in text  # (a, b, c) against (a, c, b): two concordant pairs, one discordant
    assert "**holds on both**" in rows["a − b"] and "**holds on both**" in rows["a − c"]
    assert "**reverses**" in rows["b − c"] and "better" in rows["b − c"] and "worse" in rows["b − c"]
    assert "Holds on both targets: a > b; a > c." in text
    reach = [r for r in text.splitlines() if r.startswith("| a | ")]
    assert reach[-2].startswith("| a | A | 20.0% |") and reach[-1].startswith("| a | B | 90.0% |")


def test_a_difference_inside_the_interval_is_a_tie_on_that_target(tmp_path):
    a = _campaign(tmp_path, "code", {"a": 0.3, "b": 0.0, "c": -0.3}, reach2=0.2)
    b = _campaign(tmp_path, "math", {"a": 0.0, "b": 0.0, "c": -0.3}, reach2=0.9)
    rows = _rows(transfer_report(str(a), str(b), tmp_path / "out", tmp_path / "out"))
    assert "on A only (a tie on B)" in rows["a − b"]


def test_rank_agreement_interval_over_seeds():
    same = {"x": {0: 1.5, 1: 1.6, 2: 1.55}, "y": {0: 1.2, 1: 1.3, 2: 1.25}, "z": {0: 1.0, 1: 1.1, 2: 1.05}}
    assert kendall_over_seeds(same, same, ["x", "y", "z"], n_boot=200) == (1.0, 1.0, 1.0)
    flipped = {o: {s: -v for s, v in d.items()} for o, d in same.items()}
    assert kendall_over_seeds(same, flipped, ["x", "y", "z"], n_boot=200) == (-1.0, -1.0, -1.0)
    # y and z swap places at one seed of B: the agreement moves with the seeds drawn
    noisy = {"x": {0: 1.5, 1: 1.6, 2: 1.55}, "y": {0: 1.2, 1: 1.0, 2: 1.25}, "z": {0: 1.0, 1: 1.3, 2: 1.05}}
    point, lo, hi = kendall_over_seeds(same, noisy, ["x", "y", "z"], n_boot=500)
    assert lo < point <= hi == 1.0


@pytest.mark.parametrize("a,b,want", [("better", "better", "**holds on both**"), ("worse", "better", "**reverses**"),
                                      ("better", "tie (within -0.1 … +0.2)", "on A only (a tie on B)"),
                                      ("tie (x)", "tie (y)", "a tie on both")])
def test_pair_conclusion(a, b, want):
    assert pair_conclusion(a, b) == want


def test_write_to_a_missing_file_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["engine", "math_engine", f"out={tmp_path}", f"write={tmp_path / 'nope.md'}"])
    assert e.value.code == 2 and "nope.md: no such markdown file" in capsys.readouterr().err


def test_headroom_section_reads_reach_entropy_and_the_oracle_from_the_tables():
    from sweeps.headroom_section import headroom_section
    stats = {"eval/reach_pos02": 0.3, "eval/reach_pos03": 0.1, "eval/target_entropy_mean": 1.8,
             "eval/target_entropy_median": 1.4, "eval/target_entropy_below_0.1": 0.13}
    by = {"a": {0: {"stats": stats}, 1: {"stats": {**stats, "eval/reach_pos02": 0.5}}}}
    text = "\n".join(headroom_section(by))
    assert "| a | 40.0% | 10.0% | — |" in text and "mean 1.80 nats, median 1.40, 13.0% of tokens" in text
    assert "not measured in this campaign" in text and "gap closed" not in text
    with_oracle = {"a": {0: {"stats": {**stats, "eval/tau_oracle": 3.0, "eval/oracle_gap_closed": 0.25}}}}
    text = "\n".join(headroom_section(with_oracle))
    assert "Oracle τ (the target's own marginals" in text and "3.000" in text and text.count("25.0%") == 1
    assert headroom_section({"a": {0: {"stats": {"eval/tau_vanilla": 1.2}}}}) == []  # evaluated before reach
