"""Learning curves and rank agreement of a campaign's cells (sweeps.learning_curves) from run folders' metrics."""
from __future__ import annotations

import itertools
import json

import pytest

from sweeps.learning_curves import (
    agreement_rows,
    curve_section,
    eval_curve,
    kendall_tau_b,
    option_curves,
    smallest_agreeing_budget,
    train_predictors,
)


def _slow_kendall(x, y):
    """τ-b from its definition: (concordant − discordant) / sqrt((n0 − ties_x)(n0 − ties_y))."""
    pairs = list(itertools.combinations(range(len(x)), 2))
    s = sum(((x[i] > x[j]) - (x[i] < x[j])) * ((y[i] > y[j]) - (y[i] < y[j])) for i, j in pairs)
    tx = sum(x[i] == x[j] for i, j in pairs)
    ty = sum(y[i] == y[j] for i, j in pairs)
    return s / ((len(pairs) - tx) * (len(pairs) - ty)) ** 0.5


@pytest.mark.parametrize("x,y", [([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2, 3, 4], [4, 3, 2, 1]),
                                 ([1, 2, 2, 5, 0], [3, 1, 2, 2, 0]), ([0.3, 0.1, 0.2], [2, 3, 1])])
def test_kendall_tau_b_matches_its_definition(x, y):
    assert kendall_tau_b(x, y) == pytest.approx(_slow_kendall(x, y))


def _cell(tmp_path, option, seed, taus, tau_rounds=2.0, streak=5.0):
    d = tmp_path / f"{option}-{seed}"
    d.mkdir()
    rows = []
    for step, (tokens, tau) in zip((10, 40, 160), zip((4e6, 16e6, 64e6), taus)):
        rows.append({"step": step, "data/consumed_tokens": tokens, "train/tau_rounds": tau_rounds,
                     "train/tau_rounds_n": 10.0, "train/anchor_streak": streak})
        key = "eval/tau_vanilla" if step == 160 else "eval/subset/tau_vanilla"  # in-training evals: the subset's name
        rows.append({"step": step, key: tau})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return {"option": option, "seed": seed, "run_dir": str(d)}


def test_curves_average_seeds_and_rank_agreement_finds_the_reversal(tmp_path):
    cells = [_cell(tmp_path, "a", 0, (2.0, 3.0, 3.5), tau_rounds=4.0), _cell(tmp_path, "a", 1, (2.2, 3.2, 3.7)),
             _cell(tmp_path, "b", 0, (1.5, 2.9, 4.0), tau_rounds=5.0), _cell(tmp_path, "c", 0, (1.0, 2.0, 3.0))]
    rows = [json.loads(line) for line in (tmp_path / "a-0" / "metrics.jsonl").read_text().splitlines()]
    assert eval_curve(rows, "eval/tau_vanilla") == [(4e6, 2.0), (16e6, 3.0), (64e6, 3.5)]
    assert train_predictors(rows) == {"train/tau_rounds": 4.0, "train/anchor_streak": 5.0}
    curves = option_curves(cells, "eval/tau_vanilla")
    assert curves["a"]["4 M"] == pytest.approx(2.1) and curves["b"]["64 M"] == 4.0
    by = {r["budget"]: r for r in agreement_rows(curves)}
    assert by["4 M"]["winner"] == "a" and not by["4 M"]["winner_agrees"] and by["4 M"]["loser_agrees"]
    assert by["64 M"]["kendall_tau_b"] == 1.0 and by["train/tau_rounds"]["winner"] == "b"
    assert smallest_agreeing_budget(list(by.values())) == "64 M"
    text = "\n".join(curve_section(cells, "eval/tau_vanilla", "loss"))
    assert "| b | 1 | 1.500 | 2.900 | 4.000 |" in text and "**64 M**" in text


def test_one_option_has_its_curve_and_no_rank_table(tmp_path):
    """A stage with one option so far (reference_recipe's prompts stage before cuts8 ran) prints its curve, not an
    empty rank table ending in 'smallest budget: none'."""
    text = "\n".join(curve_section([_cell(tmp_path, "a", 0, (2.0, 3.0, 3.5))], "eval/tau_vanilla", "prompts"))
    assert "| a | 1 | 2.000 | 3.000 | 3.500 |" in text
    assert "One option so far: no rank agreement yet." in text
    assert "Kendall" not in text and "Smallest budget" not in text


def test_options_of_different_budgets_rank_against_each_ones_final(tmp_path):
    """reference_recipe's budget stage: t131 ends at 131 M; t262 passes 131 M mid-schedule (behind there) and ends
    ahead at 262 M. The largest shared milestone is not the final order: each option's last evaluation is."""
    def cell(option, points):
        d = tmp_path / option
        d.mkdir()
        rows = []
        for step, (tokens, tau) in enumerate(points, 1):
            rows += [{"step": step, "data/consumed_tokens": tokens}, {"step": step, "eval/tau_vanilla": tau}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return {"option": option, "seed": 0, "run_dir": str(d)}
    cells = [cell("t131", [(16e6, 3.3), (64e6, 7.1), (131e6, 8.2)]),
             cell("t262", [(16e6, 3.4), (64e6, 7.0), (131e6, 7.7), (262e6, 8.5)])]
    curves = option_curves(cells, "eval/tau_vanilla")
    by = {r["budget"]: r for r in agreement_rows(curves)}
    assert list(by) == ["16 M", "64 M", "131 M", "final"]  # no 262 M column: t131 never reached it
    assert by["final"]["winner"] == "t262" and by["131 M"]["kendall_tau_b"] == -1.0
    assert by["16 M"]["winner_agrees"] and smallest_agreeing_budget(list(by.values())) is None
    text = "\n".join(curve_section(cells, "eval/tau_vanilla", "budget"))
    assert "| t262 | 1 | 3.400 | 7.000 | 7.700 | 8.500 |" in text.splitlines()[4]  # ordered by the final column
    assert "trained at different budgets" in text and "Smallest budget" not in text
    # equal budgets: no `final` column, the largest milestone is the final (the reports committed before)
    same = option_curves(cells[:1] + [cell("other", [(16e6, 3.0), (64e6, 6.0), (131e6, 8.0)])], "eval/tau_vanilla")
    assert "final" not in [r["budget"] for r in agreement_rows(same)]
