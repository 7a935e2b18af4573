"""The ablation campaign: cells at an equal token budget, one MLflow experiment, winners carried to later
stages, and a cut-off campaign continuing where it stopped."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from dflash.config import ConfigError
import sweeps.cells as sweep_cells
from sweeps.campaign import main, stage_groups
from sweeps.campaign_spec import Cell, Stage, best_option, check_only, load_campaign, stage_cells
from sweeps.cells import cell_env

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_campaigns_parse_and_every_cell_composes():
    for name in ("reference", "cpu_smoke"):
        assert main([name, "--check"]) == {}


def test_bad_campaigns_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    good = (ROOT / "conf" / "campaign" / "cpu_smoke.yaml").read_text()
    bad.write_text(good + "budgte: 3\n")
    with pytest.raises(ConfigError, match="budgte"):
        load_campaign(str(bad))
    bad.write_text(good.replace("on_best: [loss]", "on_best: [noise]"))
    with pytest.raises(ConfigError, match="on_best"):
        load_campaign(str(bad))
    with pytest.raises(ConfigError, match="budget_tokens"):
        load_campaign("cpu_smoke", ["campaign.budget_tokens=0"])
    with pytest.raises(ConfigError, match="unknown key 'lsos'|lsos"):  # a run override is composed up front
        main(["cpu_smoke", "--check", "lsos.gamma=3"])


def test_cells_share_the_budget_and_build_on_the_winner():
    c = load_campaign("cpu_smoke")
    first = stage_cells(c, 0, {})
    assert [x.option for x in first] == ["hard_ce", "hard_ce", "soft_kl", "soft_kl"]
    assert all(f"trainer.token_budget={c.budget_tokens}" in x.overrides for x in first)
    second = stage_cells(c, 1, {"loss": "soft_kl"})
    assert all("+loss=soft_kl" in x.overrides and f"+noise={x.option}" in x.overrides for x in second)
    assert best_option([{"option": "a", "value": 1.0}, {"option": "a", "value": 3.0},
                        {"option": "b", "value": 1.9}, {"option": "b", "value": 2.0}]) == "a"


def test_a_stage_of_named_override_sets(tmp_path):
    """`options:` as a mapping varies what no single config group holds (the 64 M campaign's views against
    distinct sequences); the empty set is the base run itself, and a later stage builds on the winning set."""
    raw = (ROOT / "conf" / "campaign" / "cpu_smoke.yaml").read_text() + (
        "  - factor: data\n    on_best: [loss]\n    options:\n      views1: []\n"
        "      views4: [data.online.reuse=4, data.max_epochs=4]\n"
        "  - factor: buffer\n    on_best: [data]\n    options: [r10_20, fifo]\n")
    f = tmp_path / "sets.yaml"
    f.write_text(raw)
    c = load_campaign(str(f), ["campaign.seeds=[0]"])
    data = stage_cells(c, 2, {"loss": "soft_kl"})
    assert [x.option for x in data] == ["views1", "views4"]
    assert data[1].overrides[-2:] == ["data.online.reuse=4", "data.max_epochs=4"]  # the option last
    assert data[1].overrides[-7] == "+loss=soft_kl"  # the winner it builds on, before the seed and the budget
    assert not any(o.startswith("+data=") for x in data for o in x.overrides)
    assert sorted(data[0].overrides) == sorted(stage_cells(c, 0, {})[1].overrides)  # views1 = the soft_kl cell
    buf = stage_cells(c, 3, {"loss": "soft_kl", "data": "views4"})
    assert all("data.online.reuse=4" in x.overrides and f"+buffer={x.option}" in x.overrides for x in buf)
    assert stage_groups(c) == [[0], [1, 2], [3]]
    for bad, msg in (("views4: data.online.reuse=4", "views4: expected a list of key=value"),
                     ("views4: [reuse]", "views4: expected a list of key=value")):
        f.write_text(raw.replace("views4: [data.online.reuse=4, data.max_epochs=4]", bad))
        with pytest.raises(ConfigError, match=msg):
            load_campaign(str(f))
    f.write_text(raw.replace("views1: []", "views1: [data.online.reuse=x]"))
    with pytest.raises(ConfigError, match="reuse"):  # composed before any work, named
        main([str(f), "--check", "campaign.seeds=[0]"])


def test_a_resumed_cell_counts_only_the_tokens_of_its_own_launch(tmp_path):
    from sweeps.cells import tokens_at_resume
    run = tmp_path / "cell"
    assert tokens_at_resume(run) == 0.0  # a new cell trains its whole budget in this launch
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data/consumed_tokens": s * 100}) + "\n"
                                               for s in (10, 20, 30, 40)))
    for name in ("step_00000020.pt", "step_00000020.pt.sha256", "step_00000030.pt"):
        (run / "checkpoints" / name).write_bytes(b"")
    assert tokens_at_resume(run) == 3000.0  # the newest checkpoint (step 30), not the last logged step (40)


def test_stages_that_build_on_decided_factors_share_one_pool():
    assert stage_groups(load_campaign("reference")) == [[0], [1, 2]]  # noise and buffer both on the loss
    assert stage_groups(load_campaign("cpu_smoke")) == [[0], [1]]
    c = load_campaign("cpu_smoke")
    c.stages = [*c.stages, dataclasses.replace(c.stages[1], factor="buffer", on_best=["noise"])]
    assert stage_groups(c) == [[0], [1], [2]]  # builds on the noise winner: waits for it


def test_one_pool_runs_each_distinct_config_once(monkeypatch, tmp_path):
    import sweeps.campaign as campaign
    c = load_campaign("cpu_smoke", ["campaign.workers=4"])
    ran = []

    def fake_run(c_, cell, out, gpu=None, share=0, oom_restarts=0):
        ran.append(cell.id)
        return {**cell.labels(), "value": float(len(ran)), "consumed_tokens": 1}
    monkeypatch.setattr(sweep_cells, "run_cell", fake_run)
    monkeypatch.setattr(campaign, "config_key", lambda ov: "same" if "+noise=none" in ov or "+buffer=fifo" in ov
                        else " ".join(ov))
    noise = stage_cells(c, 1, {"loss": "hard_ce"})[:1]
    buffer = [Cell(2, "buffer", "fifo", 0, ["+buffer=fifo"])]
    other = [Cell(2, "buffer", "r10_20", 0, ["+buffer=r10_20"])]
    results = campaign._run_stage(c, [*noise, *buffer, *other], tmp_path, {}, None)
    # the fifo cell is the noise cell's run: trained once (the two runs go in parallel, in either order)
    assert sorted(ran) == sorted([noise[0].id, other[0].id])
    assert results[1]["reused_from"] == noise[0].id and results[1]["cell"] == buffer[0].id
    assert results[1]["value"] == results[0]["value"]


def test_a_shared_pool_starts_the_start_first_factors_first(monkeypatch, tmp_path):
    import sweeps.campaign as campaign
    c = load_campaign("served", ["campaign.workers=1"])  # one worker: the start order is the run order
    assert c.start_first == ["recipe", "drafter"] and stage_groups(c) == [[0, 1, 2]]
    cells = [x for i in range(len(c.stages)) for x in stage_cells(c, i, {})]
    ran = []

    def fake_run(c_, cell, out, gpu=None, share=0, oom_restarts=0):
        ran.append((cell.seed, cell.factor))
        return {**cell.labels(), "value": 1.0, "consumed_tokens": 1}
    monkeypatch.setattr(sweep_cells, "run_cell", fake_run)
    monkeypatch.setattr(campaign, "prepare_store", lambda *a: None)
    campaign._run_stage(c, cells, tmp_path, {}, None)
    # seed by seed, the slow factors first within each: 1 recipe cell, 4 drafter cells less dflash1_adamw's
    # (the loss stage's hard_ce run: same config), 6 loss cells
    one_seed = ["recipe"] + ["drafter"] * 3 + ["loss"] * 6
    assert ran == [(s, f) for s in c.seeds for f in one_seed] and c.seeds == [0, 1, 2]  # three seeds by default
    with pytest.raises(ConfigError, match="start_first"):
        load_campaign("served", ["campaign.start_first=[noise]"])



def test_cells_start_where_the_memory_their_options_held_before_fits(monkeypatch, tmp_path):
    """Seed 1 of the served campaign after seed 0 recorded each option's peak (the H100's figures, 2026-12-05) on a
    GPU of 26 GiB, three workers: the two DFlash 2 cells (18.1 GiB each) and the 8-layer recipe (15.0) never run
    beside each other, and the small cells still share the GPU."""
    import json
    import threading
    import time

    import sweeps.campaign as campaign
    from sweeps.cells import CONTEXT_GIB
    from sweeps.launcher import LauncherConfig, LocalLauncher
    c = load_campaign("served", ["campaign.workers=3", "campaign.seeds=[1]"])
    peaks = {(0, "hard_ce"): 5.4, (0, "dpace"): 5.4, (0, "lk"): 7.1, (0, "soft_kl"): 8.1, (0, "soft_kl_streak"): 8.1,
             (1, "dflash1_muon"): 5.4, (1, "dflash2_adamw"): 18.1, (1, "dflash2_muon"): 18.1,
             (2, "layers8_streak"): 15.0}
    for (stage, option), peak in peaks.items():
        d = tmp_path / c.name / "runs" / f"s{stage}-x-{option}-seed0"
        d.mkdir(parents=True)
        (d / "cell.json").write_text(json.dumps({"stage": stage, "option": option, "gpu_reserved_peak_gb": peak}))
    running, together, lock = {}, [], threading.Lock()

    def fake_run(c_, cell, out, gpu=None, share=0, oom_restarts=0):
        need = peaks.get((cell.stage, cell.option), 8.1) + CONTEXT_GIB  # streak: the loss stage's largest
        with lock:
            running[cell.id] = need
            together.append(dict(running))
        time.sleep(0.05)
        with lock:
            running.pop(cell.id)
        return {**cell.labels(), "value": 1.0, "consumed_tokens": 1}
    monkeypatch.setattr(sweep_cells, "run_cell", fake_run)
    monkeypatch.setattr(campaign, "prepare_store", lambda *a: None)
    cells = [x for i in range(len(c.stages)) for x in stage_cells(c, i, {})]
    launcher = LocalLauncher(LauncherConfig(gpus=["0"], gpu_memory_gib=26))
    results = campaign._run_stage(c, cells, tmp_path, {}, None, launcher=launcher)
    assert all(r is not None and r["value"] == 1.0 for r in results)
    assert all(sum(t.values()) <= 26 for t in together if len(t) > 1), together
    assert max(len(t) for t in together) >= 2  # still packed
    big = {f"s{s}-{f}-{o}-seed1" for (s, o), f in zip([(1, "dflash2_adamw"), (1, "dflash2_muon"), (2, "layers8_streak")],
                                                       ["drafter", "drafter", "recipe"])}
    assert not any(len(big & set(t)) > 1 for t in together)


def _fake_cells_that_keep_their_records(monkeypatch, campaign, earlier: dict) -> list:
    """run_cell records value 3.0 with the cell's overrides into `earlier`, where a later launch's cell_result finds
    it by run folder name; returns the list of cell ids run."""
    ran = []

    def fake_run(c_, cell, out, gpu=None, share=0, oom_restarts=0):
        ran.append(cell.id)
        earlier[cell.id] = {**cell.labels(), "value": 3.0, "overrides": cell.overrides}
        return earlier[cell.id]
    monkeypatch.setattr(sweep_cells, "run_cell", fake_run)
    monkeypatch.setattr(campaign, "cell_result", lambda run_dir: earlier.get(Path(run_dir).name))
    return ran


def test_a_stage_with_pinned_cells_trains_its_reference_again_under_the_pin(monkeypatch, tmp_path):
    """The loss stage's winner ran before ground truth was pinned: a later stage's new cells evaluate on the pin,
    so their reference (the same config) trains once more under it instead of being reused, and later launches
    reuse that pinned run; a stage with no pinned cell (all finished earlier) keeps its unpinned reference."""
    import sweeps.campaign as campaign
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]", "campaign.workers=1"])
    pin = ["eval.truth_dir=/pins"]
    cells = {o: Cell(1, "noise", o, 0, [f"+noise={o}", *pin]) for o in ("none", "uniform")}
    buffers = {o: Cell(2, "buffer", o, 0, [f"+buffer={o}", *pin]) for o in ("r10_20", "fifo")}
    monkeypatch.setattr(campaign, "config_key", lambda ov: "ref" if {"+noise=none", "+buffer=r10_20"} & set(ov)
                        else " ".join(ov))
    old_ref = {"cell": "s0-loss-hard_ce-seed0", "value": 1.0, "overrides": ["+loss=hard_ce"]}  # no pin
    earlier = {cells["uniform"].id: {**cells["uniform"].labels(), "value": 2.0, "overrides": ["+noise=uniform"]}}
    ran = _fake_cells_that_keep_their_records(monkeypatch, campaign, earlier)
    group = [cells["none"], cells["uniform"], buffers["r10_20"], buffers["fifo"]]
    for launch in range(2):
        results = campaign._run_stage(c, group, tmp_path, {"ref": old_ref}, None)
        by = {r["cell"]: r for r in results}
        assert by[cells["none"].id]["reused_from"] == old_ref["cell"]  # noise: nothing pinned, as it was
        assert by[buffers["r10_20"].id]["value"] == 3.0  # the buffer stage's reference: the pinned run
        assert "reused_from" not in by[buffers["r10_20"].id]  # its own run (launch 1: its own record)
        assert sorted(ran) == sorted([buffers["r10_20"].id, buffers["fifo"].id])  # trained in launch 0 only
    assert sweep_cells.pinned({"overrides": ["+eval.truth_dir=/p"]}) and not sweep_cells.pinned(old_ref)


def test_the_pin_is_decided_per_seed_so_an_unpinned_seed_keeps_its_unpinned_reference(monkeypatch, tmp_path):
    """Seed 0's noise cells all ran before the pin, seed 1's are new (on the pin): seed 0's `none` stays the loss
    stage's unpinned run, the one its options pair with, and seed 1's is the pinned run of seed 1. Deciding by
    stage alone had put seed 0's `none` on a pinned run, and seed 0's Δs became "not paired"."""
    import sweeps.campaign as campaign
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0,1]", "campaign.workers=1"])
    pin = ["eval.truth_dir=/pins"]
    cells = [Cell(1, "noise", o, s, [f"+noise={o}", f"seed={s}", *pin])
             for s in (0, 1) for o in ("none", "uniform")]
    monkeypatch.setattr(campaign, "config_key", lambda ov: (f"ref{ov[1]}" if "+noise=none" in ov else " ".join(ov)))
    old_ref0 = {"cell": "s0-loss-streak-seed0", "value": 1.0, "overrides": ["+loss=streak"]}  # before the pin
    pinned_twin0 = {"cell": "s2-data-views4-seed0", "value": 1.5, "overrides": ["+data=views4", *pin]}
    ref1 = {"cell": "s0-loss-streak-seed1", "value": 2.5, "overrides": ["+loss=streak", *pin]}
    earlier = {cells[1].id: {**cells[1].labels(), "value": 2.0, "overrides": ["+noise=uniform", "seed=0"]}}  # unpinned
    ran = _fake_cells_that_keep_their_records(monkeypatch, campaign, earlier)
    done = {"ref" + "seed=0": old_ref0, "ref" + "seed=1": ref1}
    # the pinned twin of seed 0's reference is a record of this group (a later stage's own cell, the same config)
    twin = Cell(2, "data", "views4", 0, ["+noise=none", "seed=0", *pin])
    earlier[twin.id] = {**twin.labels(), **pinned_twin0}
    results = campaign._run_stage(c, [*cells, twin], tmp_path, done, None)
    by = {r["cell"]: r for r in results}
    assert by[cells[0].id]["reused_from"] == "s0-loss-streak-seed0"  # seed 0: nothing new, nothing pinned
    assert by[cells[2].id]["reused_from"] == "s0-loss-streak-seed1"  # seed 1: new cells, a pinned reference
    assert ran == [cells[3].id]


def test_only_starts_a_listed_cells_reference_too_where_it_has_no_run_on_the_pin(monkeypatch, tmp_path):
    """only=[buffer/fifo] on the pin: the stage's reference (r10_20, the same run as the loss stage's unpinned
    winner) trains with it, so fifo's Δ has a pinned run to pair with; the other new cell does not start. Once the
    reference has its pinned run, only=[buffer/proportional] starts that cell alone."""
    import sweeps.campaign as campaign
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]", "campaign.workers=1"])
    pin = ["eval.truth_dir=/pins"]
    cells = [Cell(2, "buffer", o, 0, [f"+buffer={o}", *pin]) for o in ("r10_20", "fifo", "proportional")]
    monkeypatch.setattr(campaign, "config_key", lambda ov: "ref" if "+buffer=r10_20" in ov else " ".join(ov))
    old_ref = {"cell": "s0-loss-hard_ce-seed0", "value": 1.0, "overrides": ["+loss=hard_ce"]}  # no pin
    ran = _fake_cells_that_keep_their_records(monkeypatch, campaign, {})
    results = campaign._run_stage(c, cells, tmp_path, {"ref": old_ref}, None, ["buffer/fifo"])
    assert sorted(ran) == ["s2-buffer-fifo-seed0", "s2-buffer-r10_20-seed0"] and results[2] is None
    assert results[0]["value"] == 3.0 and "reused_from" not in results[0]  # the pinned reference run
    ran.clear()
    campaign._run_stage(c, cells, tmp_path, {"ref": old_ref}, None, ["buffer/proportional"])
    assert ran == ["s2-buffer-proportional-seed0"]


def test_only_starts_the_listed_cells_and_a_shared_run_if_one_of_its_cells_is_listed(monkeypatch, tmp_path):
    import sweeps.campaign as campaign
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]"])
    ran = []
    monkeypatch.setattr(sweep_cells, "run_cell", lambda c_, cell, out, gpu=None, share=0, oom_restarts=0: ran.append(cell.id) or
                        {**cell.labels(), "value": 1.0, "overrides": cell.overrides})
    monkeypatch.setattr(campaign, "config_key", lambda ov: "ref" if {"+noise=none", "+buffer=r10_20"} & set(ov)
                        else " ".join(ov))
    cells = [Cell(stage, factor, o, 0, [f"+{factor}={o}"])
             for stage, factor, o in ((1, "noise", "none"), (1, "noise", "uniform"), (2, "buffer", "r10_20"),
                                      (2, "buffer", "fifo"))]
    results = campaign._run_stage(c, cells, tmp_path, {}, None, ["buffer"])
    assert sorted(ran) == ["s1-noise-none-seed0", "s2-buffer-fifo-seed0"]  # r10_20's run is noise/none's
    assert results[1] is None and results[2]["reused_from"] == "s1-noise-none-seed0"
    with pytest.raises(ConfigError, match="buffr"):
        check_only(c, ["buffr"])
    check_only(c, ["noise", "loss/soft_kl"])


def test_every_cell_and_the_shared_inputs_pin_the_ground_truth_under_the_campaign(monkeypatch, tmp_path):
    """eval.truth_dir=<out>/<campaign>/truth for the shared-inputs step (which writes the pins first) and every cell,
    so launches on other machines evaluate on the same tokens; being the same for all cells, it leaves
    config_key's reuse of identical cells as it was."""
    import dflash.app.write_ahead as write_ahead
    import sweeps.campaign as campaign
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]"])
    out = tmp_path / "out"
    pinned = f"eval.truth_dir={out / 'cpu_smoke' / 'truth'}"
    made, ran = [], []
    monkeypatch.setattr(write_ahead, "write_ahead",
                        lambda cfg, more_cfgs=(): made.append(cfg) or {"sys/write_ahead_s": 0.0})

    def fake_run(c_, cell, out_, gpu=None, share=0, oom_restarts=0):
        assert len(made) == 1  # the shared inputs, once, before the first cell that starts
        ran.append(cell)
        return {**cell.labels(), "value": float(cell.option == "soft_kl"), "consumed_tokens": 1,
                "run_dir": str(tmp_path / cell.id), "overrides": cell.overrides}  # as run_cell records them
    monkeypatch.setattr(sweep_cells, "run_cell", fake_run)
    summary = campaign.run_campaign(c, out, ["tracking.enabled=false"])
    assert made[0].eval.truth_dir == str(out / "cpu_smoke" / "truth") and len(made) == 1
    assert len(ran) == 3 and all(cell.overrides.count(pinned) == 1 for cell in ran)
    assert [x["option"] for x in summary["cells"] if x.get("reused_from")] == ["none"]  # +noise=none: that run
    assert campaign.with_truth_dir(c, out, ["+eval.truth_dir=/pins"]) == ["+eval.truth_dir=/pins"]  # the user's
    # a stage added to the finished campaign's file: the shared inputs are made again (its cells may read other
    # data) and only the new stage's cells train
    monkeypatch.setattr(campaign, "cell_result", lambda run_dir: next(
        ({**r, "earlier_launch": True} for r in summary["cells"] if r["cell"] == Path(run_dir).name), None))
    c.stages.append(Stage("buffer", ["r10_20", "fifo"], ["loss"]))
    made.clear(), ran.clear()
    again = campaign.run_campaign(c, out, ["tracking.enabled=false"])
    assert len(made) == 1 and again["complete"] and [cell.option for cell in ran] == ["fifo"]
    assert made[0].buffer.name == "fifo"  # the inputs of the cell to train, not the first stage's again
    # each launch that trained a cell is in the history (a launch's stages and shared inputs are its own alone)
    assert [x["cells_run"] for x in again["launches"]] == [3, 1] and again["launches"][0] == summary["launches"][0]
    from sweeps.campaign_report import _speed_lines
    said = "\n".join(_speed_lines(again))
    assert "Launches (2; the lines below are the last one's): 1. " in said and ": 1 cells, " in said
    assert "Launches" not in "\n".join(_speed_lines(summary))  # one launch: its own lines say it
    monkeypatch.setattr(campaign, "cell_result", lambda run_dir: next(
        ({**r, "earlier_launch": True} for r in again["cells"] if r["cell"] == Path(run_dir).name), None))
    (out / "cpu_smoke" / "summary.json").write_text(json.dumps({**again, "complete": False}))
    ran.clear()
    assert campaign.run_campaign(c, out, ["tracking.enabled=false"])["launches"] == again["launches"]  # none ran
    assert ran == []


def test_cells_get_their_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cell_env(6)["OMP_NUM_THREADS"] == "2" and cell_env(32)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cell_env(6)["OMP_NUM_THREADS"] == "3"  # the caller's setting stands


@pytest.mark.slow
def test_campaign_runs_then_resumes_where_it_was_cut(tmp_path):
    import mlflow
    db = tmp_path / "mlflow.db"
    args = ["cpu_smoke", f"out={tmp_path / 'out'}", "campaign.seeds=[0]", f"tracking.tracking_uri=sqlite:///{db}"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        summary = main(args)
        runs = tmp_path / "out" / "cpu_smoke" / "runs"
        cells = sorted(p.name for p in runs.iterdir() if p.is_dir())
        # 4 cells, 3 runs: +noise=none on the winning loss is that loss's own run (the default noise)
        assert len(cells) == 3 and len(summary["cells"]) == 4 and summary["complete"]
        reused = [x for x in summary["cells"] if x.get("reused_from")]
        assert [x["option"] for x in reused] == ["none"]
        assert reused[0]["reused_from"] == f"s0-loss-{summary['winners']['loss']}-seed0"
        assert summary["winners"]["loss"] in ("hard_ce", "soft_kl")
        for cell in summary["cells"]:
            assert cell["consumed_tokens"] >= 2000  # every cell trained on its whole budget
        # Cut one cell: its record is gone but its checkpoints stay -> the next launch resumes only that one.
        cut = runs / cells[0]
        (cut / "cell.json").unlink()
        mtimes = {c: (runs / c / "cell.json").stat().st_mtime for c in cells[1:]}
        again = main(args)
        assert (cut / "cell.json").is_file() and len(again["cells"]) == 4 and again["complete"]
        assert {c: (runs / c / "cell.json").stat().st_mtime for c in cells[1:]} == mtimes
        rec = json.loads((cut / "cell.json").read_text())
        assert rec["resumed"]  # from its checkpoint, not from scratch
        assert 0 <= rec["leg_tokens"] < rec["consumed_tokens"]  # this launch trained only what the checkpoint lacked
    finally:
        os.chdir(cwd)
    client = mlflow.tracking.MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("dflash-campaign-smoke")
    assert exp is not None and len(client.search_runs([exp.experiment_id])) == 3  # one per run, none twice
    assert json.loads((tmp_path / "out" / "cpu_smoke" / "summary.json").read_text())["winners"]
    _check_report_from_mlflow(tmp_path, again)


def _check_report_from_mlflow(tmp_path, summary):
    """The ablation notebook's tables (rebuilt from the MLflow store alone, artifacts found beside the sqlite
    file after the run folders are gone) are the campaign report's."""
    import shutil

    from sweeps.campaign_mlflow import summary_from_mlflow
    from sweeps.campaign_report import render_report
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]"])
    from_folders = render_report(c, summary)
    assert "| hard_ce | 1 |" in from_folders and "Δτ vanilla vs hard_ce" in from_folders  # stage 1 vs baseline
    moved = tmp_path / "copied"
    moved.mkdir()
    shutil.copy(tmp_path / "mlflow.db", moved / "mlflow.db")
    shutil.copytree(tmp_path / "mlartifacts", moved / "mlartifacts")
    shutil.rmtree(tmp_path / "out")
    shutil.rmtree(tmp_path / "mlartifacts")
    rebuilt = summary_from_mlflow(c, f"sqlite:///{moved / 'mlflow.db'}", tmp_path / "nb")
    assert rebuilt["complete"] and rebuilt["winners"] == summary["winners"]
    # tables, not speed lines; not the cost tables either: those read the cells' records (`cell.json`), gone with
    # the run folders (sweeps/campaign_mlflow.py)
    def strip(text: str) -> list[str]:
        first, *costs = text.split("\nCost (")
        kept = [first, *(c.split("\n\n", 2)[2] if c.count("\n\n") >= 2 else "" for c in costs)]
        return [line for part in kept for line in part.splitlines() if line.startswith("| ")]
    # the stage tables (10 lines), the objective suite's headroom tables (reach per block position, 6) and its
    # least-degenerate tables (6), the same from the store
    assert "On the least-degenerate rows of" in from_folders and "| option | cells | GPU-s |" in from_folders
    assert "| option | k=2 | k=3 |" in from_folders
    assert len(strip(from_folders)) == 22 and strip(render_report(c, rebuilt)) == strip(from_folders)
    # the ablation notebook renders those tables from the copied store
    from tests.test_notebooks import _execute, _outputs
    nb = _execute("ablation.ipynb", {"TRACKING_URI": f"sqlite:///{moved / 'mlflow.db'}",
                                     "EXPERIMENT": "dflash-campaign-smoke", "STUDY": "",
                                     "CAMPAIGN": "cpu_smoke", "CAMPAIGN_EDITS": ["campaign.seeds=[0]"]})
    md = "\n".join(o["data"]["text/markdown"] for o in _outputs(nb) if "text/markdown" in o.get("data", {}))
    assert strip(md) == strip(from_folders)
    figures = next(cell for cell in nb.cells if "stage_figures(campaign" in cell.source)  # one per stage
    assert sum("image/png" in o.get("data", {}) for o in figures.outputs) == len(c.stages)


def test_a_deadline_starts_no_cell_after_it_and_leaves_an_incomplete_summary(tmp_path):
    """A launch that starts no cell makes no shared inputs either (they are made before the first cell that
    starts): it only writes the summary from what is on disk."""
    out = tmp_path / "out"
    summary = main(["cpu_smoke", f"out={out}", "campaign.seeds=[0]", "deadline_s=0.000001",
                    f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    assert summary["complete"] is False and summary["cells"] == [] and summary["winners"] == {}
    assert not (out / "cpu_smoke" / "runs").exists() or not any((out / "cpu_smoke" / "runs").iterdir())
    assert json.loads((out / "cpu_smoke" / "summary.json").read_text())["complete"] is False
    assert not (out / "cpu_smoke" / "write_ahead.json").exists()  # nothing to make them for


def test_a_campaign_of_another_target_is_refused_before_any_work(tmp_path):
    out = tmp_path / "out"
    cell = out / "cpu_smoke" / "runs" / "s0-loss-hard_ce-seed0"
    cell.mkdir(parents=True)
    (cell / "tags.json").write_text(json.dumps({"dflash.target_fingerprint": "0123456789abcdef"}))
    with pytest.raises(ConfigError, match="0123456789abcdef.*s0-loss-hard_ce-seed0.*target is now"):
        main(["cpu_smoke", f"out={out}", "campaign.seeds=[0]", f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    assert not (out / "cpu_smoke" / "write_ahead.json").exists() and not (tmp_path / "m.db").exists()


def _table(key: str, sums: list[float], rounds: list[float], pl: list[float]) -> dict:
    return {"info": {"ground_truth_key": key, "suite_label": "heldout"},
            "tasks": [{"task": f"t{i}", "tau_sum_vanilla": s, "rounds": n, "tau_sum_tree_16": s + n,
                       "rounds_tree_16": n, "tau_sum_prompt_lookup": p, "rounds_prompt_lookup": n}
                      for i, (s, n, p) in enumerate(zip(sums, rounds, pl))]}


def test_report_pairs_each_option_with_the_reference_seed_for_seed(tmp_path):
    from sweeps.campaign_report import stage_table
    cells = []
    tables = {("hard_ce", 0): _table("gt", [20, 30, 25, 40], [10] * 4, [15] * 4),
              ("hard_ce", 1): _table("gt", [22, 28, 26, 38], [10] * 4, [15] * 4),
              ("soft_kl", 0): _table("gt", [30, 40, 35, 50], [10] * 4, [15] * 4),  # +1.0 τ on every prompt
              ("soft_kl", 1): _table("gt", [32, 38, 36, 48], [10] * 4, [15] * 4),
              ("lk", 0): _table("other", [20, 30, 25, 40], [10] * 4, [15] * 4),  # another ground truth
              ("lk", 1): _table("other", [20, 30, 25, 40], [10] * 4, [15] * 4),
              ("lk_alone", 0): _table("gt", [20, 30, 25, 40], [10] * 4, [30] * 4),  # below prompt lookup
              ("lk_alone", 1): _table("gt", [20, 30, 25, 40], [10] * 4, [30] * 4),
              ("seed2", 0): _table("gt", [20, 30, 25, 40], [10] * 4, [15] * 4),  # one more seed than the others
              ("seed2", 1): _table("gt", [20, 30, 25, 40], [10] * 4, [15] * 4),
              ("seed2", 2): _table("gt", [90, 90, 90, 90], [10] * 4, [15] * 4),
              # seed 0 before the pin, seed 1 on it (as views2 ran): seed 1 pairs, and the Δ says so
              ("streak", 0): _table("other", [30, 40, 35, 50], [10] * 4, [15] * 4),
              ("streak", 1): _table("gt", [27, 33, 31, 43], [10] * 4, [15] * 4)}  # +0.5 τ on every prompt
    for (opt, seed), t in tables.items():
        d = tmp_path / f"{opt}{seed}" / "eval"
        d.mkdir(parents=True)
        (d / "tasks.json").write_text(json.dumps(t))
        cells.append({"option": opt, "seed": seed, "run_dir": str(d.parent)})
    rows = stage_table(cells, "heldout", "hard_ce")
    by = {r.split("|")[1].strip(): r for r in rows[2:] if r.startswith("| ")}
    assert by["hard_ce"].endswith("| — | reference |") and "0.000 [0.000, 0.000]" not in by["hard_ce"]
    # pooled over the seeds every option has: seed2's seed 2 (τ 9) is said, not pooled
    assert "| seed2 | 2 | 2.875 [" in by["seed2"] and "also run, not pooled: seed2 seed 2." in rows[-1 - 2]
    # two seeds: the seed level widens the interval by t_1 / z · sqrt(2) = 9.17 (docs/evaluation.md)
    assert "| lk_alone | 2 | 2.875 [-1.136, 7.459] ↓PL |" in by["lk_alone"]
    assert "↓PL" not in by["hard_ce"] and "↓PL:" in rows[-1]
    assert "better" in by["soft_kl"] and "1.000 [1.000, 1.000]" in by["soft_kl"]
    assert "not paired" in by["lk"]
    assert "0.500 [0.500, 0.500] (seed 1 alone; seed 0: other ground truth) | better" in by["streak"]
    assert "τ prompt-lookup" in rows[0] and "τ tree 16 nodes" in rows[0]
    from sweeps.campaign_report import delta_table
    table = delta_table(cells, "heldout", "hard_ce")
    deltas = {r.split("|")[1].strip(): r for r in table[2:]}
    assert set(deltas) == {"soft_kl", "lk", "streak", "lk_alone", "seed2"} and "Δτ tree 16 nodes vs hard_ce" in table[0]
    assert deltas["soft_kl"].count("**better**") == 2 and "not paired" in deltas["lk"]  # vanilla and tree 16
    assert deltas["streak"].count("(seed 1 alone; seed 0: other ground truth) **better**") == 2


def test_a_difference_one_seed_reverses_is_a_tie(tmp_path):
    """At 64 M: streak led dpace by +0.336 at seed 0 and trailed it by −0.126 at seed 1. Over ten seeds, nine at
    +0.5 and one at −0.1 on every prompt, the seed × prompt interval of the pooled Δ can still exclude 0; it is a
    tie when a seed's own Δ has the other sign, and a win when every seed agrees. With two such seeds the interval
    itself holds 0."""
    from sweeps.campaign_report import delta_table, stage_call, stage_table
    ref = [20, 30, 25, 40, 22, 31, 27, 36]
    seeds = range(10)
    tables = {**{("dpace", s): ref for s in seeds},
              **{("streak", s): [x + (5 if s < 9 else -1) for x in ref] for s in seeds},  # +0.5, at seed 9 −0.1 τ
              **{("hard_ce", s): [x + (3 if s % 2 else 1) for x in ref] for s in seeds}}  # +0.3, +0.1 τ
    cells = []
    for (opt, seed), sums in tables.items():
        d = tmp_path / f"{opt}{seed}" / "eval"
        d.mkdir(parents=True)
        (d / "tasks.json").write_text(json.dumps(_table("gt", sums, [10] * 8, [15] * 8)))
        cells.append({"option": opt, "seed": seed, "run_dir": str(d.parent), "stage": 0, "value": sum(sums) / 80})
    by = {r.split("|")[1].strip(): r for r in stage_table(cells, "heldout", "dpace")[2:]}
    assert "0.440 [0.294, 0.513]" in by["streak"]  # the pooled interval alone would call it better
    assert "tie (the seeds disagree: seed 0 +0.500" in by["streak"] and "seed 9 -0.100)" in by["streak"]
    assert "0.200 [0.127, 0.273] | better |" in by["hard_ce"]
    deltas = {r.split("|")[1].strip(): r for r in delta_table(cells, "heldout", "dpace")[2:]}
    assert "tie, the seeds disagree" in deltas["streak"] and "**better**" in deltas["hard_ce"]
    call = stage_call(cells, "eval/tau_vanilla", "streak")  # the highest mean: seed 9 reverses it against both
    assert call["tied"] == ["dpace", "hard_ce"], call
    assert call["order"] == "streak ≈ hard_ce > dpace"  # each adjacent pair by the same rule
    two = [x for x in cells if x["seed"] < 2]
    by = {r.split("|")[1].strip(): r for r in stage_table(two, "heldout", "dpace")[2:]}
    assert "tie (within" in by["hard_ce"]  # +0.1 and +0.3: two seeds cannot separate it


def test_the_best_recipe_is_the_campaigns_best_cell():
    """`+recipe=best_reference` trains exactly what the reference_recipe campaign's winning cell (t262: 8 layers with
    the recipe sweep's best LR and streak settings at 262 M tokens, header cuts in a 224,000-prompt pool) trained
    (benchmarks/ABLATIONS.md, "The recipe")."""
    from sweeps.cells import config_key
    c = load_campaign("reference_recipe")
    winners = {"depth": "layers8_sweep30", "prompts": "headers"}
    cell = next(x for x in stage_cells(c, 2, winners) if x.option == "t262" and x.seed == 0)
    drop = ("tracking.experiment=",)
    assert config_key(["+recipe=best_reference", "seed=0"]) == config_key(
        [o for o in cell.overrides if not o.startswith(drop)])


def test_the_engine_recipe_is_the_engine_campaigns_best_cell():
    """`+recipe=engine_reference` trains exactly what the engine campaign's drafter-stage winner (DFlash 2 + Muon at
    its best lr, 0.0054) trained (benchmarks/ABLATIONS.md, first screen; conf/recipe/engine_reference.yaml)."""
    from sweeps.cells import config_key
    c = load_campaign("engine")
    cell = next(x for x in stage_cells(c, 1, {}) if x.option == "dflash2_muon" and x.lr == 0.0054 and x.seed == 0)
    assert config_key(["+recipe=engine_reference", "seed=0"]) == config_key(
        [o for o in cell.overrides if not o.startswith("tracking.experiment=")])


def test_the_served_recipe_is_the_served_recipe_campaigns_best_cell():
    """`+recipe=served_reference` trains exactly the `served_recipe` campaign's best cell (DFlash 2 + Muon + dpace at
    8 layers; benchmarks/ABLATIONS.md, first screen; conf/recipe/served_reference.yaml)."""
    from sweeps.cells import config_key
    c = load_campaign("served_recipe")
    cell = next(x for x in stage_cells(c, 0, {}) if x.option == "d2_dpace_l8" and x.seed == 1)
    assert config_key(["+recipe=served_reference", "seed=1"]) == config_key(
        [o for o in cell.overrides if not o.startswith("tracking.experiment=")])


def test_an_option_may_train_at_its_own_budget():
    """reference_recipe's `budget` stage: t131 is the 131 M winner itself (the same composed config: reused, not
    trained again), t262 sets its own budget, which wins over the campaign's (the option's overrides come last)."""
    from sweeps.cells import config_key
    from experiments.config import compose_config
    c = load_campaign("reference_recipe")
    winners = {"depth": "layers8_sweep30", "prompts": "headers"}
    t131, t262 = (x for x in stage_cells(c, 2, winners) if x.seed == 0)
    best = next(x for x in stage_cells(c, 0, {}) if x.option == "layers8_sweep30" and x.seed == 0)
    assert config_key(t131.overrides) == config_key(best.overrides)
    cfg = compose_config(t262.overrides)
    assert (cfg.trainer.token_budget, cfg.trainer.max_steps) == (262_144_000, 12_800)
    assert cfg.trainer.token_budget == 2 * c.budget_tokens and cfg.drafter.num_layers == 8
    assert cfg.trainer.eval_at_tokens == [16_000_000, 64_000_000, 131_072_000]
    # 4 views of as many distinct sequences as the budget reads: inside data.max_epochs, within the pool
    reads = cfg.trainer.token_budget // cfg.data.max_len
    assert reads / cfg.data.online.reuse <= cfg.data.pool.size and cfg.data.online.reuse <= cfg.data.max_epochs


def test_a_cell_run_on_another_winner_is_named(tmp_path, caplog):
    """A cell's folder is named by stage, option and seed only. When an earlier stage's winner changes (seed 1 put
    dpace ahead of seed 0's streak at 64 M), a noise cell trained on streak is not one on dpace: the campaign names
    the folder and the overrides it lacks, and the report does not take that record for the cell."""
    from sweeps.cells import record_matches, stale_records
    c = load_campaign("reference_64m")
    on_streak = stage_cells(c, 1, {"loss": "streak"})[0]
    on_dpace = stage_cells(c, 1, {"loss": "dpace"})[0]
    assert on_streak.id == on_dpace.id  # the same folder
    folder = tmp_path / "reference_64m" / "runs" / on_streak.id
    folder.mkdir(parents=True)
    record = {**on_streak.labels(), "overrides": [*on_streak.overrides, "eval.truth_dir=/x"], "value": 4.2}
    (folder / "cell.json").write_text(json.dumps(record))
    assert record_matches(record, on_streak) and not record_matches(record, on_dpace)
    assert stale_records(c, tmp_path, [on_streak]) == []  # the winner it was trained on: its own record
    assert stale_records(c, tmp_path, [on_dpace]) == [f"{folder} (needs +loss=dpace)"]
    assert f"{folder} (needs +loss=dpace)" in caplog.text and "Move them away" in caplog.text
    from sweeps.campaign_report import with_recorded_cells
    summary = {"cells": [], "winners": {"loss": "dpace"}}
    assert with_recorded_cells(c, tmp_path, summary)["cells"] == []
    summary["winners"]["loss"] = "streak"
    assert [x["cell"] for x in with_recorded_cells(c, tmp_path, summary)["cells"]] == [on_streak.id]


SERVED_TINY = ["campaign.seeds=[0]", "campaign.budget_tokens=1280", "campaign.max_steps=2", "trainer.sequences_per_step=2",
               "trainer.num_anchors=8", "trainer.producer_batch=2", "trainer.compile=false", "trainer.warmup_steps=1",
               "trainer.tau_probe.every=0", "data.pool.size=64", "data.online.write_batch=8",
               "eval.heldout.num_prompts=4", "eval.subset=4", "eval.heldout.max_new_tokens=24", "eval.max_new_tokens=16",
               "eval.samples=1", "eval.bootstrap=200", "eval.tree_budgets=[16]"]


@pytest.mark.slow
def test_the_served_campaigns_drafter_stage_runs_end_to_end_and_reports_both_settings(tmp_path):
    """The served campaign as the GPU job runs it (`benchmarks/leased_gpu/campaign.sh served`), its drafter stage
    at tiny shapes on the CPU: DFlash 1 and 2 cells with AdamW and Muon train on data written at T = 1, evaluate
    at T = 1 and T = 0 on ground truth that ends, and the report prints both tables with their ground truth's
    degeneracy and the rank agreement of T = 0 with T = 1. dflash1_adamw is the loss stage's hard_ce run."""
    out = tmp_path / "out"
    args = ["served", f"out={out}", "only=[drafter]", "workers=2", f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
            *SERVED_TINY]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        summary = main(args)
        report = Path(main(["served", "report", f"out={out}", "campaign.seeds=[0]"])["report"]).read_text()
    finally:
        os.chdir(cwd)
    drafter = {x["option"]: x for x in summary["cells"] if x["factor"] == "drafter"}
    assert set(drafter) == {"dflash1_adamw", "dflash1_muon", "dflash2_adamw", "dflash2_muon"}
    assert all(x["value"] is not None and x["consumed_tokens"] >= 1280 for x in drafter.values())
    assert drafter["dflash1_adamw"]["reused_from"] == "s0-loss-hard_ce-seed0"
    stage = report[report.index("## Stage 1: drafter"):report.index("## Stage 2")]
    served = stage[stage.index("### suite `heldout`, sampled at T=1"):stage.index("### suite `heldout`, greedy (T=0)")]
    greedy = stage[stage.index("### suite `heldout`, greedy (T=0)"):]
    for table in (served, greedy):
        assert "Ground truth" in table and "tokens in repeated 16-grams" in table
        assert all(f"| {o} | 1 |" in table for o in drafter)
    assert "τ tree" not in served  # trees at T = 0 only, and for DFlash 1 drafters only: said where left out
    assert ("Left out, since not every option has it: τ tree 16 nodes (only dflash1_adamw, dflash1_muon; DDTree runs "
            "for DFlash 1 drafters only" in greedy)
    assert "| greedy (T=0), the same runs | 4 |" in stage


def test_a_cell_records_the_data_it_read_and_the_report_says_when_a_stage_mixes_two(monkeypatch, tmp_path):
    """A cell's record carries the digest of the online data its launch wrote or read (`write_ahead.json`); a stage
    whose cells read different data (sampled data written again on another machine, or recorded before digests)
    says so before its tables; one data set says nothing."""
    import json

    from sweeps.campaign_report import _data_lines
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]"])
    cell = stage_cells(c, 0, {})[0]
    (tmp_path / c.name).mkdir()
    (tmp_path / c.name / "write_ahead.json").write_text(json.dumps({"data/digest": "abc123"}))
    monkeypatch.setattr(sweep_cells, "call", lambda *a, **k: 0)  # the training process "ran"
    monkeypatch.setattr(sweep_cells, "last_logged", lambda run_dir, key: 1.0)
    rec = sweep_cells.run_cell(c, cell, tmp_path)
    assert rec["data_digest"] == "abc123"
    assert json.loads((sweep_cells.cell_dir(tmp_path, c, cell) / "cell.json").read_text())["data_digest"] == "abc123"
    same = [{"cell": f"c{i}", "value": 1.0, "data_digest": "abc123"} for i in range(3)]
    assert _data_lines(same) == []
    mixed = [*same, {"cell": "late", "value": 1.0, "data_digest": "fff000"}, {"cell": "old", "value": 1.0},
             {"cell": "failed", "value": None, "data_digest": "999"}, {"cell": "reused", "value": 1.0,
                                                                        "data_digest": "999", "reused_from": "c0"}]
    line = _data_lines(mixed)[0]
    assert line.startswith("**Not one data set**") and "data `abc123`: c0, c1, c2" in line
    assert "data `fff000`: late" in line and "data `not recorded`: old" in line and "999" not in line


def test_a_failed_cell_is_named_with_its_cause():
    """A cell's failure as the stage line names it: out of memory (beside how many), an exit status, or a lost job's
    reason (not "exit status <reason>")."""
    from sweeps.campaign_report import _failure_cause
    assert _failure_cause({"failed": 1, "oom": True, "at_once": 6}) == "out of GPU memory beside 5 other cells"
    assert _failure_cause({"failed": 1, "oom": True}) == "out of GPU memory"
    assert _failure_cause({"failed": 2}) == "exit status 2"
    lost = _failure_cause({"failed": "job 7 (/x/submitit): UncompletedJobError: " + "x" * 500})
    assert lost.startswith("job lost: job 7 (/x/submitit): UncompletedJobError") and len(lost) <= 210


def test_the_served_compiled_campaign_trains_dflash2_compiled_at_the_served_settings():
    """conf/campaign/served_compiled.yaml: served's base, budget and seeds (its cells stand beside served's at the
    same budget), and DFlash 2 cells whose composed config compiles the drafter, where served's stay eager."""
    from experiments.config import compose_config
    compiled, served = load_campaign("served_compiled"), load_campaign("served")
    assert (compiled.base, compiled.budget_tokens, compiled.max_steps, compiled.seeds, compiled.objective) == (
        served.base, served.budget_tokens, served.max_steps, served.seeds, served.objective)
    cells = {cell.option: cell for cell in stage_cells(compiled, 0, {}) if cell.seed == 0}
    assert set(cells) == {"dflash1_muon", "dflash2_adamw", "dflash2_muon"}
    for option, cell in cells.items():
        cfg = compose_config(cell.overrides)
        assert cfg.trainer.compile, option
        assert cfg.drafter.architecture == ("dflash2" if option.startswith("dflash2") else "dflash")
    eager = {cell.option: compose_config(cell.overrides) for cell in stage_cells(served, 1, {}) if cell.seed == 0}
    assert not eager["dflash2_muon"].trainer.compile and eager["dflash2_muon"].trainer.optimizer == "muon"
    assert compose_config(cells["dflash2_muon"].overrides).trainer.optimizer == "muon"
