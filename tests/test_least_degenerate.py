"""A stage's ranking checked again on the prompt samples whose ground truth repeats itself least
(sweeps/least_degenerate.py): the rows chosen against a plain count, and a stage whose order flips there (the
drafter that wins by copying loops) said so, in the report's section and in the results summary's stage line."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from dflash.evaluation.pairing import least_degenerate_tasks, restricted
from sweeps.least_degenerate import least_degenerate_section, order_check
from sweeps.results_summary import _least_degenerate_clause


def _plain_cut(rates: list[float], share: float) -> set[int]:
    """The rows to keep, by counting: the smallest cut c such that at least share·n rows have a rate ≤ c."""
    clean = [0.0 if math.isnan(r) else r for r in rates]
    for c in sorted(set(clean)):
        if sum(r <= c for r in clean) >= share * len(clean):
            return {i for i, r in enumerate(clean) if r <= c}
    raise AssertionError


def test_the_least_degenerate_rows_against_a_plain_count():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 30)
        rates = [rng.choice([0.0, 0.0, float("nan"), round(rng.random(), 1)]) for _ in range(n)]
        share = rng.choice([0.1, 0.25, 0.5, 1.0])
        table = {"tasks": [{"task": f"t{i}", "gt_copy_rate": r} for i, r in enumerate(rates)]}
        kept, cut = least_degenerate_tasks(table, share)
        assert kept == {f"t{i}" for i in _plain_cut(rates, share)}, (rates, share)
        assert len(kept) >= share * n and cut == max(0.0 if math.isnan(r) else r for r in
                                                     (rates[int(t[1:])] for t in kept))
    assert least_degenerate_tasks({"tasks": [{"task": "a"}]}) is None  # a table from before the copy rate was kept
    table = {"info": {"k": 1}, "tasks": [{"task": t} for t in "abcd"]}
    assert [r["task"] for r in restricted(table, {"d", "b"})["tasks"]] == ["b", "d"]  # the table's order, to pair


def _cell(root: Path, option: str, seed: int, clean_tau: float, loop_tau: float, key: str = "gt") -> dict:
    """A run whose objective table has 8 prompt samples: 2 with ground truth that repeats nothing (τ `clean_tau`) and
    6 that loop (copy rate 0.6–0.9, τ `loop_tau`); ground truth `key` (the first two rows clean), or another one
    whose last two rows are the clean ones."""
    rows = []
    for i in range(8):
        clean = i < 2 if key == "gt" else i >= 6
        tau = (clean_tau if clean else loop_tau) + 0.02 * (i % 2)
        rows.append({"task": f"p{i}", "rounds": 10, "tau_sum_vanilla": 10 * tau,
                     "tau_sum_prompt_lookup": 10 * (1.2 if clean else 4.0), "rounds_prompt_lookup": 10,
                     "gt_copy_rate": 0.0 if clean else 0.6 + 0.1 * (i % 4)})
    table = {"info": {"suite": "heldout", "suite_label": "heldout", "setting": "t1", "ground_truth_key": f"{key}{seed}",
                      "sampling": "sampled at T=1, top_p=1, top_k=off"},
             "metrics": {}, "tasks": rows}
    run = root / f"{option}-{seed}"
    (run / "eval" / "served").mkdir(parents=True)
    (run / "eval" / "served" / "tasks.json").write_text(json.dumps(table))
    return {"option": option, "seed": seed, "stage": 0, "run_dir": str(run)}


def test_a_ranking_won_on_loops_is_said_to_change_on_the_least_degenerate_rows(tmp_path):
    # `copier` wins overall by copying loops; on the two clean prompt samples of each seed `reader` is far ahead
    cells = [_cell(tmp_path, "reader", s, clean_tau=2.6, loop_tau=3.0) for s in (0, 1)]
    cells += [_cell(tmp_path, "copier", s, clean_tau=1.3, loop_tau=5.0) for s in (0, 1)]
    lines = "\n".join(least_degenerate_section(cells, "heldout", "reader"))
    assert "4 of 16 prompt samples" in lines and "at most 0.000 of its 8-grams" in lines
    copier = next(line for line in lines.splitlines() if line.startswith("| copier"))
    # τ over the clean rows alone (10 rounds each): (13 + 13.2) / 20 per seed, pooled over both seeds
    assert copier.startswith("| copier | 1.310 [") and "| 1.200 [" in copier and copier.endswith("| worse |")
    assert ("**The winner and the loser change**, to reader and copier: Kendall's τ-b -1.00 over 2 options" in lines
            and "greedy" not in lines and "sampled at T=1, top_p=1, top_k=off (the served setting)" in lines)
    check = order_check(cells, "heldout", "reader")
    assert (check["winner"], check["kept"], check["total"]) == ("reader", 4, 16)
    assert "; on the 4 of 16 least-degenerate prompt samples **the winner and the loser change**, to reader and " \
        "copier (Kendall τ-b -1.00)" == _least_degenerate_clause(check)


def test_a_ranking_that_holds_on_the_least_degenerate_rows_says_so(tmp_path):
    cells = [_cell(tmp_path, "a", s, clean_tau=2.6, loop_tau=5.0) for s in (0, 1)]
    cells += [_cell(tmp_path, "b", s, clean_tau=1.8, loop_tau=3.0) for s in (0, 1)]
    assert "The order holds: Kendall's τ-b +1.00 over 2 options, against the order on all prompt samples." in \
        "\n".join(least_degenerate_section(cells, "heldout", "a"))
    assert "samples the order holds (Kendall τ-b +1.00)" in _least_degenerate_clause(order_check(cells, "heldout", "a"))
    # a run on other ground truth (an earlier launch's) keeps its own clean rows, and does not pair
    other = "\n".join(least_degenerate_section([*cells, *(_cell(tmp_path, "c", s, 2.2, 4.0, key="old") for s in (0, 1))],
                                                "heldout", "a"))
    assert "| c | 2.210 [" in other and "| not paired | different ground truth |" in other
    assert least_degenerate_section(cells, "heldout", "a", "t0") == []  # no greedy tables: nothing to say
    assert least_degenerate_section(cells[:2], "heldout", "a") == []  # one option: no ranking
