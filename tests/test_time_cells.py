"""sweeps/time_cells.py: a campaign's cells one after another, each for the same training seconds with its LR
spanning them, then the report pairing each with the first on one ground truth."""
import json
import os
import shutil
from pathlib import Path

import pytest

from dflash.errors import ConfigError
from dflash.tracking.records import read_metric_records
from sweeps.campaign_spec import load_campaign
from sweeps.time_cells import TimeCellsArgs, cell_overrides, main, pick_cells, verdict

ROOT = Path(__file__).resolve().parent.parent


def test_cells_are_the_campaigns_own_with_the_equal_time_settings_last(tmp_path):
    c = load_campaign("served_recipe", [])
    cells = pick_cells(c, ["recipe/d1_dpace", "recipe/d2_dpace_l8"], 1)
    assert [x.id for x in cells] == ["s0-recipe-d1_dpace-seed1", "s0-recipe-d2_dpace_l8-seed1"]
    ov = cell_overrides(c, cells[1], TimeCellsArgs(seconds=180), tmp_path / "r", ["eval.truth_dir=/pins"])
    assert ov[:len(cells[1].overrides)] == cells[1].overrides and "drafter.num_layers=8" in ov
    tail = ov[len(cells[1].overrides):]
    # 390 steps for 8 M tokens: the 500 M cap's steps in that ratio
    assert tail == ["trainer.time_budget_s=180", "trainer.schedule_by_time=true",
                    "trainer.time_budget_counts=training", "trainer.token_budget=500000000",
                    "trainer.max_steps=24375", "trainer.eval_at_tokens=[]", "trainer.eval_every=0",
                    f"run_dir={tmp_path / 'r'}", "eval.truth_dir=/pins"]


def test_unknown_cells_and_seeds_are_refused_naming_what_exists():
    c = load_campaign("served_recipe", [])
    with pytest.raises(ConfigError, match=r"cells=\['recipe/d3'\].*known: \['recipe/d1_dpace'"):
        pick_cells(c, ["recipe/d3"], 0)
    with pytest.raises(ConfigError, match="seed=7: campaign 'served_recipe' has seeds"):
        pick_cells(c, ["recipe/d1_dpace"], 7)
    with pytest.raises(ConfigError, match="cells=.*is empty"):
        pick_cells(c, [], 0)
    with pytest.raises(ConfigError, match="seconds=0"):
        main(["served_recipe", "cells=[recipe/d1_dpace]"])
    with pytest.raises(ConfigError, match="counts=wall: what each cell's seconds count must be training"):
        main(["served_recipe", "cells=[recipe/d1_dpace]", "seconds=10", "counts=wall"])


@pytest.mark.slow
def test_two_cells_train_the_same_seconds_end_decayed_and_pair_in_the_report(tmp_path):
    """cpu_smoke's two loss cells on the tiny random target, 8 s each: both stop on the time budget far short of
    their step cap (2,000 / 40 of the 500 M cap: 10 M steps) with the LR decayed by the clock, and the report pairs
    the second with the first on the one ground truth."""
    out = tmp_path / "out"
    cells = "cells=[loss/hard_ce,loss/soft_kl]"
    # warmup of one step: a loaded machine fits few steps in its seconds, and a step-based warmup still running at the end
    # would leave the LR at its peak whatever the clock says
    args = ["cpu_smoke", cells, "seconds=8", "seed=0", f"out={out}", "tracking.log_every=1", "trainer.warmup_steps=1",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rows = main(args)
        for r in rows:  # the GPU job brings back tables and metrics, no weights: the report reads them alone
            shutil.rmtree(out / "cpu_smoke" / r["cell"] / "final")
        again = main(["cpu_smoke", "report", f"out={out}", cells])
    finally:
        os.chdir(cwd)
    assert [r["cell"] for r in rows] == ["s0-loss-hard_ce-seed0", "s0-loss-soft_kl-seed0"]
    for r in rows:
        assert r["tau"] >= 1.0 and r["pl"] >= 1.0 and r["loop_s"] >= 3 and 5 <= r["steps"] < 10**6
        assert 0 < r["first_step_s"] < r["loop_s"]
        metrics = [json.loads(line) for line in (out / "cpu_smoke" / r["cell"] / "metrics.jsonl").read_text()
                   .splitlines()]
        lrs = [m["train/lr"] for m in metrics if "train/lr" in m]
        assert lrs[-1] < 0.5 * max(lrs)  # decayed by the clock: 10 M steps would leave it at its peak
        assert [m["train/time_progress"] for m in metrics if "train/time_progress" in m][-1] == 1.0
    d = rows[1]["delta"]
    assert d.low <= d.value <= d.high and "delta" not in rows[0]
    assert [r["tau"] for r in again] == [r["tau"] for r in rows]
    text = (out / "cpu_smoke" / "report.md").read_text()
    assert "| s0-loss-soft_kl-seed0 |" in text and "Δ against s0-loss-hard_ce-seed0" in text


@pytest.mark.parametrize("state, cells, taus, delta", [
    ("cold", "cells=[recipe/d2_dpace_l8,recipe/d1_dpace]", [1.817, 1.638], -0.178),
    ("warm", "cells=[recipe/d2_dpace,recipe/d1_dpace]", [1.859, 1.697], -0.162),
    # counts=training: 160 s from each cell's first step (the 8-layer cell on a fresh machine, the others warm)
    ("training", "cells=[recipe/d2_dpace_l8,recipe/d2_dpace,recipe/d1_dpace]", [1.960, 1.886, 1.697], -0.074),
])
def test_the_committed_gpu_cells_give_the_documented_table(tmp_path, state, cells, taus, delta):
    """benchmarks/ablations/time_cells.tar.xz holds what the 160-s GPU cells brought back (metrics and task tables,
    no weights); the report read from it gives benchmarks/ABLATIONS.md's figures."""
    import tarfile
    with tarfile.open(ROOT / "benchmarks" / "ablations" / "time_cells.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    rows = main(["served_recipe", "report", f"out={tmp_path / 'time_cells' / state}", cells])
    assert [round(r["tau"], 3) for r in rows] == taus and rows[0]["pl"] == pytest.approx(1.263, abs=5e-4)
    assert round(rows[1]["delta"].value, 3) == delta and rows[1]["delta"].high < 0
    doc = (ROOT / "benchmarks" / "ABLATIONS.md").read_text(encoding="utf-8")
    assert all(f"{t:.3f}" in doc for t in taus) and f"{delta:.3f}".replace("-", "−") in doc
    lines = verdict(rows)
    assert f"**{rows[0]['cell']}** has the highest τ" in lines[0]
    assert all(", better; least-degenerate quarter" in x and x.endswith("holds") for x in lines if x.startswith("- "))
    assert ("not logged" in lines[1]) == (state != "training")  # the 2026-12-07 counts=loop cells predate the key
    if state == "training":  # each cell's clock counted from its first step and ran the whole 160 s of it
        configs = sorted((tmp_path / "time_cells" / state).glob("*/*/config.yaml"))
        assert len(configs) == 5  # with the 5-layer cell and the 8-layer cell's second seed
        for cfg in configs:
            assert "time_budget_counts: training" in cfg.read_text(encoding="utf-8")
            budget = [r["train/budget_s"] for r in read_metric_records(cfg.parent)
                      if "train/budget_s" in r]
            assert budget and budget[-1] >= 160.0


def test_the_committed_second_seed_and_five_layers_tie_the_eight_layer_cell_and_pool_over_seeds(tmp_path, capsys):
    """The training cells' archive also holds the 5-layer cell (seed 0, a fresh machine) and the 8-layer cell at
    seed 1 (a warm one): with seeds=[0,1] the report has a row a cell and seed, both tie the 8-layer cell at seed 0
    (benchmarks/ABLATIONS.md), and the 8-layer cell's τ pooled over its two seeds; seeds= is the report's alone."""
    import tarfile
    with tarfile.open(ROOT / "benchmarks" / "ablations" / "time_cells.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    out = f"out={tmp_path / 'time_cells' / 'training'}"
    rows = main(["served_recipe", "report", out, "cells=[recipe/d2_dpace_l8,recipe/d2_dpace_l5]", "seeds=[0,1]"])
    assert [r["cell"] for r in rows] == ["s0-recipe-d2_dpace_l8-seed0", "s0-recipe-d2_dpace_l5-seed0",
                                         "s0-recipe-d2_dpace_l8-seed1"]  # l5 has no seed 1: no row, no error
    assert [round(r["tau"], 3) for r in rows] == [1.960, 1.950, 1.964]
    assert all(r["delta"].low < 0 < r["delta"].high for r in rows[1:])  # both ties with the seed-0 8 layers
    text = capsys.readouterr().out
    assert "| recipe/d2_dpace_l8 | 2 | 1.962 [" in text and "| 1.960, 1.964 | 26.2 M, 26.0 M |" in text
    assert "| recipe/d2_dpace_l5 | " not in text  # one seed: not pooled
    doc = (ROOT / "benchmarks" / "ABLATIONS.md").read_text(encoding="utf-8")
    assert all(x in doc for x in ("1.950", "1.964", "1.962"))
    with pytest.raises(ConfigError, match=r"seeds=\[0, 1\]: the report reads several seeds"):
        main(["served_recipe", "cells=[recipe/d2_dpace]", "seconds=1", "seeds=[0,1]", f"out={tmp_path / 'never'}"])
    assert not (tmp_path / "never").exists()


def test_the_verdict_calls_a_tie_and_says_when_loop_seconds_trained_unlike(tmp_path):
    """A cell against a copy of itself: Δ 0, a tie, not a win; cells counted from the loop's start whose starts
    differ by more than a tenth of the budget get the line that their training seconds differ, alike ones do not."""
    import tarfile
    with tarfile.open(ROOT / "benchmarks" / "ablations" / "time_cells.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    [row] = main(["served_recipe", "report", f"out={tmp_path / 'time_cells' / 'training'}", "cells=[recipe/d2_dpace]"])
    twin = {**row, "cell": "twin", "tau": row["tau"] - 1e-9}
    lines = verdict([row, twin])
    assert "a tie (the interval holds 0)" in lines[-1] and "+0.000" in lines[-1]
    loop = [{**row, "counts": "loop", "first_step_s": 10.0}, {**twin, "counts": "loop", "first_step_s": 41.0}]
    assert "their training seconds differ" in verdict(loop)[1] and "10.0 to 41.0" in verdict(loop)[1]
    loop[1]["first_step_s"] = 20.0  # 10 s apart: within a tenth of 160
    assert not any("differ" in x for x in verdict(loop))
    assert "from the loop's start" in verdict(loop)[0]
    assert "counted unlike" in verdict([row, loop[1]])[0]


def test_the_report_puts_the_campaigns_cells_at_equal_tokens_beside_and_names_both_winners(tmp_path, capsys):
    """tokens_out= reads the same cell ids from the campaign's committed run folders (8 M tokens each, the same
    pinned ground truth, so paired prompt for prompt) and says which cell wins at each basis; a folder without them
    is refused by name."""
    import tarfile
    with tarfile.open(ROOT / "benchmarks" / "ablations" / "time_cells.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    listed = tuple(f"campaign_out/served_recipe/runs/s0-recipe-{x}-seed0/" for x in ("d2_dpace_l8", "d2_dpace", "d1_dpace"))
    with tarfile.open(ROOT / "benchmarks" / "ablations" / "campaign_out.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data", members=[m for m in tar if m.name.startswith(listed)])
    cells = "cells=[recipe/d2_dpace_l8,recipe/d2_dpace,recipe/d1_dpace]"
    main(["served_recipe", "report", f"out={tmp_path / 'time_cells' / 'training'}", cells,
          f"tokens_out={tmp_path / 'campaign_out'}"])
    text = capsys.readouterr().out
    assert "At equal tokens (7,987,200 consumed tokens each): **s0-recipe-d2_dpace_l8-seed0** has the highest τ, " \
           "1.822." in text
    assert "- against s0-recipe-d1_dpace-seed0: +0.265 [" in text  # 1.822 against DFlash 1's 1.557 at 8 M
    assert text.rstrip().endswith("Winner at equal GPU time: s0-recipe-d2_dpace_l8-seed0; at equal tokens: "
                                  "s0-recipe-d2_dpace_l8-seed0.")
    with pytest.raises(ConfigError, match=r"tokens_out=.*nowhere.*<out>/<campaign>/runs/<cell id>"):
        main(["served_recipe", "report", f"out={tmp_path / 'time_cells' / 'training'}", cells,
              f"tokens_out={tmp_path / 'nowhere'}"])
    # a cell the campaign's folder lacks (only the three listed were unpacked) is named, and when cells would run,
    # before the first one starts
    with pytest.raises(ConfigError, match=r"runs/s0-recipe-d2_dpace_bs8-seed0"):
        main(["served_recipe", "cells=[recipe/d2_dpace_bs8]", "seconds=1", f"out={tmp_path / 'never'}",
              f"tokens_out={tmp_path / 'campaign_out'}"])
    assert not (tmp_path / "never").exists()


def test_the_learning_curve_pairs_each_evaluation_with_the_tokens_and_training_seconds_before_it(tmp_path):
    """metrics.jsonl as a time cell with trainer.eval_at_tokens writes it: interval rows, an in-training evaluation,
    the final one; the report's curve reads each τ at the consumed tokens and train/budget_s logged before it."""
    from sweeps.time_cells import curve_points, report
    rows = [{"step": 10, "data/consumed_tokens": 1000.0, "train/budget_s": 4.0},
            {"step": 20, "data/consumed_tokens": 2000.0, "train/budget_s": 8.5},
            {"step": 20, "eval/subset/tau_served": 1.2, "eval/subset/tau_served_ci_low": 1.1,
             "eval/subset/tau_served_ci_high": 1.3},  # an in-training evaluation's name (evaluator.subset_key)
            {"step": 30, "data/consumed_tokens": 3000.0, "train/budget_s": 12.0},
            {"step": 30, "eval/tau_served": 1.4, "eval/tau_served_ci_low": 1.3, "eval/tau_served_ci_high": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = curve_points(tmp_path)
    assert [(p["tokens"], p["budget_s"], p["tau"]) for p in points] == [(2000.0, 8.5, 1.2), (3000.0, 12.0, 1.4)]
    cell = {"cell": "c", "tau": 1.4, "lo": 1.3, "hi": 1.5, "pl": 1.0, "greedy": None, "copy": None, "tokens": 3000.0,
            "epochs": 1.0, "steps": 30, "loop_s": 13.0, "first_step_s": 1.0, "curve": points}
    text = report([cell])
    assert "| c | 2,000 | 8.5 | 1.200 [1.100, 1.300] |" in text and "| c | 3,000 | 12.0 | 1.400 [1.300, 1.500] |" in text
    assert "Learning curve" not in report([{**cell, "curve": points[1:]}])  # the final evaluation alone: no curve
