"""The committed campaign store (`benchmarks/ablations/campaign_out.tar.xz`) read as a researcher reads it: unpacked
anywhere (`python -m dflash.tracking.packed_store unpack`), its artifacts show; the ablation table's interval is the
campaign report's pooled one."""
import json
import sqlite3
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "benchmarks" / "ablations" / "campaign_out.tar.xz"
SERVED_SEEDS = "campaign.seeds=[0,1]"  # the seeds the store's served cells ran (the campaign file asks for three now)
LEGACY = "campaign.objective=eval/tau_vanilla"  # the store's runs predate eval/tau_served (dflash.evaluation.protocol)


@pytest.fixture(scope="module")
def campaign_store(tmp_path_factory):
    from dflash.tracking.packed_store import unpack
    d = tmp_path_factory.mktemp("extracted_somewhere")
    unpack(STORE, d)
    return d / "campaign_out"


def test_artifact_locations_are_relative_to_the_store(campaign_store, monkeypatch):
    from mlflow.tracking import MlflowClient
    con = sqlite3.connect(campaign_store / "mlflow.db")
    uris = [u for (u,) in con.execute("SELECT artifact_uri FROM runs")]
    locs = [loc for (loc,) in con.execute("SELECT artifact_location FROM experiments WHERE name='dflash-ablation'")]
    con.close()
    assert uris and all(u.startswith("mlartifacts/") for u in uris), uris[:3]
    assert locs == ["mlartifacts"]
    # `mlflow ui` started beside mlflow.db (docs/tracking.md) lists every run's artifacts
    monkeypatch.chdir(campaign_store)
    c = MlflowClient("sqlite:///mlflow.db")
    runs = c.search_runs([c.get_experiment_by_name("dflash-ablation").experiment_id], max_results=100)
    trained = [r for r in runs if r.data.tags.get("dflash.kind") != "campaign"]  # less the report's answer runs
    assert len(runs) == 31 and len(trained) == 27
    assert all({a.path for a in c.list_artifacts(r.info.run_id)} >= {"eval"} for r in trained)


def test_relocate_artifacts_absolute_for_any_working_folder(tmp_path):
    from mlflow.tracking import MlflowClient

    from dflash.tracking.packed_store import unpack
    from dflash.tracking.run_info import relocate_artifacts
    unpack(STORE, tmp_path)
    db = tmp_path / "campaign_out" / "mlflow.db"
    # 155 runs (three loss cells of seed 1 copied in: dflash.tracking.copy_runs; the served campaign's twenty cells,
    # the two attempts that ran out of GPU memory and its summary run; the engine campaign's 18 cells, its three
    # stage runs and its summary run, then its drafter stage's 15 lr-grid cells and the five attempts that ran out of
    # GPU memory beside eight others, then the grid's 0.0054 point, 9 cells and two attempts that ran out of memory
    # beside the oracle job; the math_engine campaign's 18 cells, its two stage runs and its summary run; then each
    # older campaign's answer runs, its summary and one per stage: 4 for reference, 5 for reference_64m, 4 for
    # reference_recipe, 3 for served), six experiments' locations, 8 registered model versions (the gate's: the
    # 8-layer champion v3 among them, a refused buffer cell, the refused cuts8 cell, the refused soft_kl_streak cell
    # of seed 1, t262, and the engine campaign's DFlash 2 + Muon drafter at lr 0.0018, seed 1, the champion now);
    # then the served_recipe campaign's 12 cells, its stage run and its summary run, and its experiment's location
    assert relocate_artifacts(db, relative=False) == 200
    c = MlflowClient(f"sqlite:///{db}")
    r = next(r for r in c.search_runs([c.get_experiment_by_name("dflash-ablation").experiment_id])
             if r.data.tags.get("dflash.kind") != "campaign")  # a training run, not a report's answer run
    assert r.info.artifact_uri == (db.parent / "mlartifacts").as_uri() + f"/{r.info.run_id}/artifacts"
    assert {a.path for a in c.list_artifacts(r.info.run_id)} >= {"eval"}
    champion = c.get_model_version_by_alias("dflash-drafter-bead276919cb7b82", "champion")  # the run's checkpoint in this copy
    assert champion.source == (db.parent / "mlartifacts").as_uri() + f"/{champion.run_id}/artifacts/checkpoint"


def test_ablation_table_shows_the_pooled_interval(campaign_store):
    """One CI for one result: the row's interval is τ pooled over its seeds with the seed × prompt × sample
    bootstrap, exactly the campaign report's (benchmarks/ABLATIONS.md: dpace 1.817 [0.919, 2.875] over its two
    seeds), not the mean of the two seeds' bounds."""
    from dflash.tracking import analysis as A
    runs = A.load_runs(f"sqlite:///{campaign_store / 'mlflow.db'}", "dflash-ablation")
    assert runs["artifact_dir"].notna().all()
    table = A.ablation_table(runs, by=["loss", "noise", "buffer"], metrics=["eval/tau_vanilla"])
    cells = A.format_table(table)["eval/tau_vanilla"]
    row = cells.xs(("dpace", "none", "r10_20"), level=["loss", "noise", "buffer"]).iloc[0]
    assert row.startswith("1.817 [0.919, 2.875]") and "(n=2" in row, row
    report = (ROOT / "benchmarks" / "ABLATIONS.md").read_text()
    assert "the seed × prompt bootstrap widens τ's to [0.919, 2.875]" in report  # the reference campaign's report


def test_report_names_the_cells_not_run_yet(campaign_store):
    """reference_64m runs seeds [0, 1]; every stage has run seed 0 and the loss stage seed 1 too: read with both
    seeds, the loss stage is called on both and every later stage is incomplete and names its seed-1 cells and the
    command, instead of calling a winner on half its cells."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import write_report
    c = load_campaign("reference_64m", [LEGACY])
    assert c.seeds == [0, 1]
    write_report(c, campaign_store)
    text = (campaign_store / "reference_64m" / "ABLATIONS.md").read_text()
    stages = {s.split("\n", 1)[0].split(" (")[0]: s for s in text.split("\n## Stage ")[1:]}
    loss = stages["0: loss"]
    # seed 1 of dpace, hard_ce and streak were copied in from the store they ran in
    assert "Stage incomplete" not in loss and "; 12 runs" in loss
    assert "Highest mean objective: **streak** (a winner only where its Δ interval below excludes 0). **Tied with " \
           "it: dpace, hard_ce, lk, soft_kl, soft_kl_streak**" in loss  # two seeds: +0.090 [−2.625, +2.949] over dpace
    noise = stages["1: noise"]
    assert "**Stage incomplete**: 5 of 8 cells" in noise  # seed 1's none is the loss stage's streak run of seed 1
    assert "Not run yet: uniform (seed 1), gaussian (seed 1), cosine (seed 1)" in noise
    assert "`python -m sweeps.campaign reference_64m only=[noise]`" in noise
    assert "**Stage incomplete**: 6 of 10 cells" in stages["3: buffer"]
    assert "**The campaign is not complete**" in text
    # read with the seed it ran, the same store calls every stage: nothing left
    write_report(load_campaign("reference_64m", [LEGACY, "campaign.seeds=[0]"]), campaign_store)
    text = (campaign_store / "reference_64m" / "ABLATIONS.md").read_text()
    assert "incomplete" not in text and "not complete" not in text


def test_a_summary_of_one_seed_does_not_hide_the_other(campaign_store):
    """A launch with `campaign.seeds=[1]` writes a summary of seed 1's cells only: the report of seed 0 still finds
    seed 0's cells by their own records (cell.json) and calls the loss stage's winner again from them."""
    import json

    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import write_report
    f = campaign_store / "reference_64m" / "summary.json"
    kept = f.read_text()  # the store is the module's: put back for the tests after this one
    summary = json.loads(kept)
    summary["cells"] = [x for x in summary["cells"] if x["stage"] != 0]  # as if seed 0's loss cells were not in it
    summary["winners"].pop("loss")
    summary["calls"].pop("loss")
    f.write_text(json.dumps(summary))
    try:
        write_report(load_campaign("reference_64m", [LEGACY, "campaign.seeds=[0]"]), campaign_store)
    finally:
        f.write_text(kept)
    loss = (campaign_store / "reference_64m" / "ABLATIONS.md").read_text().split("\n## Stage 0: loss", 1)[1]
    loss = loss.split("\n## Stage ", 1)[0]
    assert "Stage incomplete" not in loss and "Highest mean objective: **streak**" in loss


def test_a_reused_reference_is_in_its_stages_learning_curve(campaign_store):
    """reference_64m's buffer stage reuses the data stage's views4 run as its r10_20 reference (the same
    composed config) and the noise stage the loss stage's streak run as `none`: both are rows of their stage's
    learning curve, so the rank agreement ranks every option, and the report says whose run they are."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import write_report
    write_report(load_campaign("reference_64m", [LEGACY, "campaign.seeds=[0]"]), campaign_store)
    text = (campaign_store / "reference_64m" / "ABLATIONS.md").read_text()
    assert "**Not run yet**" not in text and "Stage incomplete" not in text
    stages = {s.split("\n", 1)[0].split(" (")[0]: s for s in text.split("\n## Stage ")[1:]}
    for stage, reference, run in [("1: noise", "none", "s0-loss-streak-seed0"),
                                  ("3: buffer", "r10_20", "s2-data-views4-seed0")]:
        curve = stages[stage].split("#### Learning curve", 1)[1].split("Rank agreement", 1)[0]
        assert f"\n| {reference} | 1 | " in curve, curve
        assert f"`{reference}` (seed 0) is `{run}`'s run" in stages[stage]
    assert "| r10_20 | 1 | 4.227 [3.882, 4.629] ↓PL |" in stages["3: buffer"]  # the pinned reference, held-out


def test_a_relocated_store_keeps_new_runs_artifacts_beside_it(tmp_path, monkeypatch):
    """A committed store (relative artifact locations) extracted and written to from another working folder: a new
    run's artifacts land in the store's mlartifacts/, not in the working folder (where the recipe sweep's first trials
    left their eval tables and checkpoints, outside the packed store)."""
    from mlflow.tracking import MlflowClient

    from dflash.tracking.run_info import get_or_create_experiment, relocate_artifacts
    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    c = MlflowClient(uri)
    eid = get_or_create_experiment(c, "dflash", uri)
    c.set_terminated(c.create_run(eid).info.run_id)
    assert relocate_artifacts(store / "mlflow.db") == 2  # packed: the experiment and its run
    assert c.get_experiment(eid).artifact_location == "mlartifacts"
    elsewhere = tmp_path / "repo_root"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert get_or_create_experiment(c, "dflash", uri) == eid
    assert c.get_experiment(eid).artifact_location == (store / "mlartifacts").as_uri()
    run_id = c.create_run(eid).info.run_id
    (tmp_path / "tasks.json").write_text("{}")
    c.log_artifact(run_id, str(tmp_path / "tasks.json"), "eval")
    assert (store / "mlartifacts" / run_id / "artifacts" / "eval" / "tasks.json").is_file()
    assert not (elsewhere / "mlartifacts").exists()


def test_the_recipe_quotes_the_stores_figures(campaign_store):
    """The figures `+recipe=best_reference` and ABLATIONS.md quote are the committed store's: its winning cell's
    held-out τ with its interval, and the gate's decision on that cell's run (@champion)."""
    import json

    from mlflow.tracking import MlflowClient
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import write_report
    summary = json.loads((campaign_store / "reference_recipe" / "summary.json").read_text())
    cell = next(c for c in summary["cells"] if c["cell"] == "s2-budget-t262-seed0")
    write_report(load_campaign("reference_recipe", [LEGACY]), campaign_store)
    report = (campaign_store / "reference_recipe" / "ABLATIONS.md").read_text()
    budget = report.split("## Stage 2: budget", 1)[1]
    row = next(r for r in budget.split("### suite `heldout`", 1)[1].splitlines() if r.startswith("| t262 |"))
    tau = row.split(" | ")[2]  # "8.543 [8.005, 9.099]"
    assert tau.startswith(f"{cell['value']:.3f} [")
    recipe = (ROOT / "conf" / "recipe" / "best_reference.yaml").read_text()
    ablations = (ROOT / "benchmarks" / "ABLATIONS.md").read_text()
    assert f"Held-out greedy τ {tau}" in recipe and f"held-out τ **{tau}**" in ablations
    v7 = MlflowClient(f"sqlite:///{campaign_store / 'mlflow.db'}").get_model_version("dflash-drafter-bead276919cb7b82", "7")
    assert v7.run_id == json.loads((campaign_store.parent / cell["run_dir"] / "mlflow_run.json").read_text())["run_id"]
    # promoted then, behind the engine campaign's served-protocol drafter now
    assert v7.tags["dflash.promotion.decision"] == "promoted" and v7.tags["dflash.promotion.superseded_by"] == "8"


def test_the_committed_registry_is_one_model_per_target_with_a_served_champion(campaign_store):
    """One registered model per target fingerprint (dflash.serving.registry_split moved the old layout's versions,
    numbers kept), every version saying its protocol; the reference target's @champion is a served-protocol drafter
    (the engine campaign's DFlash 2 + Muon at lr 0.0018, seed 1), its figures rounded."""
    from mlflow.tracking import MlflowClient

    from dflash.serving.promotion import PROTOCOL_TAG, TARGET_FP
    c = MlflowClient(f"sqlite:///{campaign_store / 'mlflow.db'}")
    models = {m.name: m for m in c.search_registered_models()}
    assert set(models) == {"dflash-drafter-bead276919cb7b82", "dflash-drafter-fe9adcea8a8d70e3"}
    for name, m in models.items():
        assert m.tags[TARGET_FP] == name.rsplit("-", 1)[1]
        for v in c.search_model_versions(f"name='{name}'"):
            assert v.tags[TARGET_FP] == m.tags[TARGET_FP] and v.tags[PROTOCOL_TAG], (name, v.version)
    assert sorted(int(v.version) for v in c.search_model_versions("name='dflash-drafter-bead276919cb7b82'")) == list(range(3, 9))
    champion = c.get_model_version_by_alias("dflash-drafter-bead276919cb7b82", "champion")
    assert str(champion.version) == "8" and champion.tags[PROTOCOL_TAG].startswith("served")
    assert c.get_run(champion.run_id).info.run_name == "s1-drafter-dflash2_muon-lr0.0018-seed1"
    assert champion.tags["eval/tau_served"] == "1.584" and champion.tags["dflash.promotion.decision"] == "promoted"
    old = c.get_model_version("dflash-drafter-bead276919cb7b82", "7")
    assert old.tags[PROTOCOL_TAG].startswith("old protocol") and old.tags["eval/tau_vanilla"] == "8.543"
    assert models["dflash-drafter-fe9adcea8a8d70e3"].aliases == {}  # both of its versions were refused


def test_every_campaign_experiment_says_its_protocol(campaign_store):
    """Each campaign's experiment has a Description, the old-protocol ones saying so first (`eval/tau_vanilla`:
    greedy, fixed-length ground truth that loops), and its cell runs' Descriptions open with their place in the
    campaign and their result, not with a command line."""
    from mlflow.tracking import MlflowClient
    c = MlflowClient(f"sqlite:///{campaign_store / 'mlflow.db'}")
    notes = {e.name: e.tags.get("mlflow.note.content", "") for e in c.search_experiments() if e.name != "Default"}
    for name in ("dflash-ablation", "dflash-campaign-64m", "dflash-campaign-recipe"):
        assert "**Old protocol** (`eval/tau_vanilla`" in notes[name], name
    assert all(note.startswith("Campaign `") for note in notes.values()), notes
    for e in c.search_experiments():
        for r in c.search_runs([e.experiment_id], "attributes.status = 'FINISHED'", max_results=1000):
            if r.data.tags.get("dflash.kind") != "campaign" and "campaign" in r.data.tags:
                assert r.data.tags["mlflow.note.content"].startswith("**Campaign** `"), (e.name, r.info.run_name)


@pytest.mark.parametrize("archive,dump", [(STORE, "campaign_out/mlflow.sql"),
                                          (ROOT / "benchmarks" / "sweeps" / "sweeps_out.tar.xz", "sweeps_out/mlflow.sql")])
def test_the_committed_stores_hold_their_database_as_sql(archive, dump):
    """Every GPU call carries both stores inside its 64 MiB: as SQL dumps they pack to less than half their vacuumed
    databases (the campaign store of 2026-12-03: 3.0 MB against 7.3 MB), room for the seeds still to run."""
    with tarfile.open(archive) as t:
        names = t.getnames()
    assert dump in names and dump.replace(".sql", ".db") not in names


def test_ablations_first_screen_is_the_stores_summary(campaign_store):
    """benchmarks/ABLATIONS.md opens with the served_recipe campaign's results summary, then the engine campaign's
    (T=1 under the engines' proposal policy), the `served` campaign's section (drafts sampled from q) with its own, and the old protocol's section
    with each old campaign's; it holds each campaign's report; all as the committed store renders them now
    (`python -m sweeps.results_summary`): not a copy that can go stale. Each summary fits its section's first
    screen and says for every stage which option won, by how much, how sure, or what is left to run."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import load_summary
    from sweeps.results_summary import render_summary, report_block
    text = (ROOT / "benchmarks" / "ABLATIONS.md").read_text()
    old = text.split("\n## The old protocol: measured on looping greedy ground truth\n", 1)[1]
    served = text.split("\n## Drafts sampled from q: the `served` campaign", 1)[1]
    engine = text.split("\n## Under the engines' proposal policy: the engine campaign's stages\n", 1)[1]
    screens = {"served_recipe": "\n".join(text.splitlines()[:40]), "engine": "\n".join(engine.splitlines()[:40]),
               "served": "\n".join(served.splitlines()[:40]), "old": "\n".join(old.splitlines()[:45])}
    for name, overrides, screen in [("served_recipe", [], "served_recipe"), ("engine", [], "engine"),
                                    ("served", [SERVED_SEEDS], "served"),
                                    ("reference_recipe", [LEGACY], "old"), ("reference_64m", [LEGACY], "old")]:
        first_screen = screens[screen]
        c = load_campaign(name, overrides)
        summary = load_summary(c, campaign_store)
        lines = render_summary(c, summary, level=3)
        block = text.split(f"<!-- results-summary:{name} -->\n", 1)[1].split(f"\n<!-- /results-summary:{name} -->")[0]
        assert block == "\n".join(lines).rstrip() and block in first_screen
        assert sum(line.startswith("- Stage ") for line in lines) == len(c.stages)
        report = text.split(f"<!-- report:{name} -->\n", 1)[1].split(f"\n<!-- /report:{name} -->")[0]
        assert report == report_block(c, summary, campaign_store).rstrip()
        assert "not in this store" not in report  # the campaigns it compares with are in the committed store
    first_screen = screens["old"]
    # two seeds: the interval is widened by t_1 / z · sqrt(2) = 9.17 (docs/evaluation.md), so every option ties
    assert "- Stage 0 **loss** (seeds 0, 1, 12 runs): **streak** τ 3.938 [0.630, 7.973] ↓PL; tied with dpace, " \
           "hard_ce, lk, soft_kl, soft_kl_streak; vs dpace (runner-up) +0.090 [-2.625, +2.949] tie; order streak ≈ " \
           "dpace ≈ soft_kl_streak ≈ hard_ce ≈ soft_kl ≈ lk; streak cost 626 GPU-s a cell at 102,243 consumed tok/s, " \
           "τ 21.33 per GPU-hour; on the 64 of 256 least-degenerate " \
           "prompt samples **the winner changes**, to soft_kl_streak (Kendall τ-b +0.60)." in first_screen
    assert "τ **8.543 [8.005, 9.099]**; prompt lookup 6.160 [5.768, 6.547], paired Δ +2.384 [+2.043, +2.740]" \
           in first_screen


def test_the_report_the_notebook_and_mlflow_give_the_same_numbers(campaign_store, tmp_path):
    """For the same runs, the campaign report (run folders and summary.json), the ablation notebook's summary
    (`summary_from_mlflow`: the MLflow store alone) and MLflow's own metrics say the same: the same cells, the same
    summary lines, each one-seed winner's pooled τ its run's `eval/tau_vanilla`, and the summary the report logs
    on the campaign's summary run is its SUMMARY.md."""
    from mlflow.tracking import MlflowClient

    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_mlflow import summary_from_mlflow
    from sweeps.campaign_report import load_summary, write_report
    from dflash.tracking.ui_view import KEY_METRICS_VIEW, SAVED_VIEW_PREFIX, TAU_TAG
    from sweeps.results_summary import SUMMARY_RUN_TAG, render_summary, stage_answer
    uri = f"sqlite:///{campaign_store / 'mlflow.db'}"
    client = MlflowClient(uri)
    for name in ["reference_64m", "reference_recipe"]:
        c = load_campaign(name, [LEGACY])
        report, notebook = load_summary(c, campaign_store), summary_from_mlflow(c, uri, tmp_path / name)
        cells = lambda s: sorted((x["cell"], x.get("reused_from", "")) for x in s["cells"])  # noqa: E731
        assert cells(report) == cells(notebook)
        assert render_summary(c, report) == render_summary(c, notebook)
        for i in range(len(c.stages)):
            a = stage_answer(c, notebook, i)
            if "winner" not in a or len(a["seeds"]) != 1:
                continue
            cell = next(x for x in notebook["cells"] if x["stage"] == i and x["option"] == a["winner"])
            logged = client.get_run(cell["run_id"]).data.metrics["eval/tau_vanilla"]
            assert abs(logged - a["tau"].value) < 5e-4, (name, i, logged, a["tau"].value)
        got = write_report(c, campaign_store)
        run = client.get_run(got["summary_run"])
        assert run.data.tags[SUMMARY_RUN_TAG] == name and run.data.tags["dflash.kind"] == "campaign"
        logged = client.download_artifacts(run.info.run_id, "results_summary.md", str(tmp_path))
        assert Path(logged).read_text() == (campaign_store / name / "SUMMARY.md").read_text()
        note = client.get_experiment_by_name(c.experiment).tags["mlflow.note.content"]
        assert note.startswith(f"Campaign `{name}`: **Old protocol**")  # never read as a current answer
        assert write_report(c, campaign_store)["summary_run"] == run.info.run_id  # one summary run, updated
        # every cell run labelled for the runs table's grouping: campaign, stage, option and seed
        for x in notebook["cells"]:
            if not x.get("reused_from"):
                r = client.get_run(x["run_id"])
                assert (r.data.tags["campaign"], r.data.tags["stage"], r.data.tags["option"], r.data.tags["seed"]) \
                    == (name, f"{x['stage']} {x['factor']}", x["option"], str(x["seed"])), x["cell"]
                assert r.data.params["campaign.option"] == x["option"]
                # the key-metrics view's τ column: the objective with its interval, rounded
                assert r.data.tags[TAU_TAG].startswith(f"{r.data.metrics['eval/tau_vanilla']:.3f} ["), x["cell"]
        view = client.get_experiment_by_name(c.experiment).tags[f"{SAVED_VIEW_PREFIX}{KEY_METRICS_VIEW}"]
        state = json.loads(json.loads(view)["state"])
        assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "stage"}]
        assert state["orderByKey"] == "metrics.`eval/tau_vanilla`"  # the store's objective, best first


def test_the_notebooks_summary_pairs_the_buffer_stage_on_the_pin(campaign_store, tmp_path):
    """The ablation notebook's summary from the MLflow store alone (`summary_from_mlflow`) takes a reused reference as
    the campaign did: the buffer stage's seed-0 cells ran on the pin, so their `r10_20` is the data stage's pinned
    `views4` run, not the loss stage's run from before the pin (which left every buffer Δ "not paired"); the noise
    stage's seed-0 cells ran before the pin and keep the loss stage's run."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_mlflow import summary_from_mlflow
    from sweeps.campaign_report import render_report
    c = load_campaign("reference_64m", [LEGACY, "campaign.seeds=[0]"])
    summary = summary_from_mlflow(c, f"sqlite:///{campaign_store / 'mlflow.db'}", tmp_path / "nb")
    reused = {x["cell"]: x["reused_from"] for x in summary["cells"] if x.get("reused_from")}
    assert reused == {"s1-noise-none-seed0": "s0-loss-streak-seed0", "s3-buffer-r10_20-seed0": "s2-data-views4-seed0"}
    buffer = render_report(c, summary).split("## Stage 3: buffer", 1)[1]
    assert "| fifo | -0.021 [-0.054, 0.010] tie |" in buffer  # ABLATIONS.md's fifo − r10_20, held-out


def test_each_stage_figure_shows_the_reports_numbers(campaign_store, tmp_path):
    """The loss stage's figure, from the report's summary and from the notebook's alike: one curve per run ending at
    its final τ, prompt lookup's band, and each option's paired Δ against the winner with the report's tie call."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_mlflow import summary_from_mlflow
    from sweeps.campaign_report import load_summary
    from sweeps.stage_figures import stage_figure_data
    c = load_campaign("reference_64m", [LEGACY])
    d = stage_figure_data(c, load_summary(c, campaign_store), 0)
    assert d.winner == "streak" and len(d.curves) == 12
    assert all(pts[-1][0] == 64_000_000 and len(pts) == 3 for pts in d.curves.values())  # 4 M, 16 M, final
    deltas = {opt: (round(v, 3), tie) for opt, v, _, _, tie in d.deltas}
    # two seeds: every Δ against the winner is a tie (the seed level widens it 9.17×: docs/evaluation.md)
    assert deltas["dpace"] == (-0.09, True) and all(tie for _, tie in deltas.values())
    assert round(d.prompt_lookup[0], 3) == 6.16
    nb = stage_figure_data(c, summary_from_mlflow(c, f"sqlite:///{campaign_store / 'mlflow.db'}", tmp_path), 0)
    assert nb.deltas == d.deltas and nb.prompt_lookup == d.prompt_lookup


def test_a_cell_that_failed_is_named_failed_not_finished(campaign_store):
    """The served campaign's streak cell of seed 0 ran out of GPU memory beside five other cells on an 80 GiB card
    (2026-12-05) before a later launch trained it: read with that record (`sweeps.cells.run_cell`'s), its stage
    counts it neither as finished nor as not run, names it with its cause, is not called, and the target line counts
    only the runs that trained a drafter. As the store holds it now (every cell finished), the stage is called."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import load_summary, render_report
    from sweeps.results_summary import render_summary
    c = load_campaign("served", [SERVED_SEEDS])
    summary = load_summary(c, campaign_store)
    lines = "\n".join(render_summary(c, summary))
    assert "- Stage 0 **loss** (seeds 0, 1, 12 runs): **soft_kl_streak**" in lines and "failed" not in lines
    for i, x in enumerate(summary["cells"]):
        if x["cell"] == "s0-loss-streak-seed0":
            summary["cells"][i] = {**{k: x[k] for k in ("cell", "stage", "factor", "option", "seed", "overrides",
                                                        "run_dir", "objective")},
                                   "value": None, "consumed_tokens": None, "failed": 1, "oom": True, "at_once": 6}
    loss = render_report(c, summary, out=campaign_store).split("\n## Stage 0: loss", 1)[1].split("\n## Stage ", 1)[0]
    assert "**Stage incomplete**: 11 of 12 cells finished" in loss
    assert "Failed (run again to retry): streak (seed 0): out of GPU memory beside 5 other cells." in loss
    assert "Not run yet" not in loss
    text = render_report(c, summary, out=campaign_store)
    assert "`bead276919cb7b82` (19 runs)." in text
    summary["winners"].pop("loss")  # as that launch recorded it: the stage was not called
    lines = "\n".join(render_summary(c, summary))  # seed 1 has every option: the line is of seed 1 alone
    assert ("- Stage 0 **loss** (seed 1, 11 runs; **open**: seed 0 not run for every option (streak (seed 0) ran "
            "and failed)): **soft_kl_streak** τ 1.501") in lines
    summary["cells"] = [x for x in summary["cells"] if not (x["cell"] == "s0-loss-streak-seed1")]
    lines = "\n".join(render_summary(c, summary))  # streak has no finished run left
    assert "- Stage 0 **loss**: not called, no finished run of streak; streak ran and failed" in lines


def test_the_summary_says_when_a_stage_read_two_data_sets(campaign_store):
    """The served drafter stage read by the summary as if DFlash 2 + Muon's cell had read other online text than
    the others (as a later launch's would: `data_digest`): its line says so; read as it is, it does not."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import load_summary
    from sweeps.results_summary import render_summary
    c = load_campaign("served", [SERVED_SEEDS])
    summary = load_summary(c, campaign_store)
    line = lambda s: next(x for x in render_summary(c, s) if x.startswith("- Stage 1 **drafter**"))  # noqa: E731
    # as it is: seed 0's cells read text an earlier launch wrote (no digest recorded), seed 1's the one it wrote again
    assert line(summary).endswith("; **not one data set** (the report names the cells).")
    for x in summary["cells"]:
        x.setdefault("data_digest", "39cc885e6affe21b")
    assert "not one data set" not in line(summary)


@pytest.mark.slow
def test_the_served_campaigns_runs_table_answers_each_stage(campaign_store):
    """The campaign's MLflow face answers which option won each stage, by how much, how sure: one summary run per
    stage (the pooled τ with its CI, the paired Δ over the runner-up, every option's Δ against the winner, as
    metrics and as the key-metrics view's columns) and each cell run's Δ against its stage's winner. The recipe
    stage has one option: no winner of its own, its Δ against the earlier stages' winners instead (it ties the
    drafter stage's DFlash 2 + Muon, which the page had said in prose alone)."""
    from mlflow.tracking import MlflowClient

    from dflash.tracking.ui_view import STAGE_DELTA_TAG, TAU_TAG
    from sweeps.campaign_mlflow import ANSWERS, STAGE_RUN_TAG
    from sweeps.campaign_report import load_summary
    from sweeps.campaign_spec import load_campaign
    from sweeps.results_summary import log_summary, render_summary
    c = load_campaign("served", [SERVED_SEEDS])
    summary = load_summary(c, campaign_store)
    lines = render_summary(c, summary)
    recipe = next(line for line in lines if line.startswith("- Stage 2 **recipe**"))
    # two seeds: the seed x prompt x sample interval is widened 9.17x (docs/evaluation.md), so every Δ ties
    assert "one option, so no winner: **layers8_streak** τ 1.636 [1.465, 1.799]" in recipe
    assert "vs drafter's winner dflash2_muon -0.001 [-0.088, +0.085] tie" in recipe and "no tie" not in recipe
    first = log_summary(c, campaign_store, "\n".join(lines), summary)
    client = MlflowClient(f"sqlite:///{campaign_store / 'mlflow.db'}")
    eid = client.get_experiment_by_name(c.experiment).experiment_id
    runs = {r.data.tags[STAGE_RUN_TAG]: r for r in client.search_runs([eid], f"tags.`{STAGE_RUN_TAG}` LIKE 'served/%'")}
    assert set(runs) == {"served/0", "served/1", "served/2"}
    drafter = runs["served/1"]
    assert drafter.info.run_name == "stage 1 drafter: dflash2_muon (winner)" and drafter.data.tags["stage"] == ANSWERS
    assert drafter.data.tags[TAU_TAG] == "1.637 [1.464, 1.813]"
    assert drafter.data.tags[STAGE_DELTA_TAG] == ("vs dflash1_muon (runner-up) +0.078 [-0.065, +0.219] tie; tied: "
                                                  "dflash1_adamw, dflash1_muon")
    m = drafter.data.metrics
    assert f"{m['eval/tau_served']:.3f}" == "1.637" and f"{m['eval/tau_served_ci_low']:.3f}" == "1.464"
    assert f"{m['stage/tau_served_delta_runner_up']:.3f} {m['stage/tau_served_delta_runner_up_ci_low']:.3f}" \
        == "0.078 -0.065"
    assert f"{m['stage/tau_served_delta/dflash1_muon']:.3f}" == "-0.078" and "stage/tau_served/dflash1_adamw" in m
    assert runs["served/2"].info.run_name == "stage 2 recipe: layers8_streak (one option)"
    assert runs["served/2"].data.tags[STAGE_DELTA_TAG].startswith("vs dflash2_muon (drafter) -0.001 [-0.088, +0.085] tie")
    cell = client.search_runs([eid], "attributes.run_name = 's1-drafter-dflash1_muon-seed0'")[0]
    assert cell.data.tags[STAGE_DELTA_TAG] == "vs dflash2_muon -0.078 [-0.219, +0.065] tie"
    assert log_summary(c, campaign_store, "\n".join(lines), summary) == first  # the same runs, updated
    assert len(client.search_runs([eid], f"tags.`{STAGE_RUN_TAG}` LIKE 'served/%'")) == 3


def test_the_engine_campaigns_drafter_stage_compares_each_option_at_its_best_lr(campaign_store):
    """The drafter stage's compare view and the runs table say which runs the answer rests on: an option's runs at
    its best lr carry its Δ against the winner, its other lr's runs say they are not compared, and the cells of the
    stage's first launch (before its lr grid renamed them) leave the view; a cell run's Description opens with its
    place in the campaign and its result at T=1, the command line it was made with below."""
    from mlflow.tracking import MlflowClient

    from dflash.tracking.ui_view import (CAMPAIGN_HEAD, HOW_HEAD, RESULT_HEAD, RUN_NAME_COLUMN, SAVED_VIEW_PREFIX,
                                         STAGE_DELTA_TAG, stage_view_key)
    from sweeps.campaign_mlflow import NOT_IN_STAGE
    from sweeps.campaign_report import load_summary
    from sweeps.campaign_spec import load_campaign
    from sweeps.results_summary import log_summary, render_summary
    c = load_campaign("engine")
    summary = load_summary(c, campaign_store)
    for _ in range(2):  # a report again labels alike
        log_summary(c, campaign_store, "\n".join(render_summary(c, summary)), summary)
    client = MlflowClient(f"sqlite:///{campaign_store / 'mlflow.db'}")
    eid = client.get_experiment_by_name(c.experiment).experiment_id
    tags = {r.info.run_name: r.data.tags for r in client.search_runs([eid], "attributes.status = 'FINISHED'",
                                                                     max_results=1000)}
    column = "stage 1 drafter"
    assert tags["s1-drafter-dflash2_muon-lr0.0054-seed1"][column] == "dflash2_muon: the stage's winner"
    assert tags["s1-drafter-dflash1_muon-lr0.0054-seed0"][STAGE_DELTA_TAG] == \
        "vs dflash2_muon -0.208 [-0.252, -0.168] worse"
    off = "not compared (the stage takes its best lr, 0.0054)"
    assert tags["s1-drafter-dflash2_muon-lr0.0006-seed0"][column] == f"dflash2_muon: lr 0.0006: {off}"
    assert tags["s1-drafter-dflash2_muon-lr0.0018-seed1"][column] == f"dflash2_muon: lr 0.0018: {off}"
    assert tags["s0-loss-hard_ce-seed0"][column] == f"dflash1_adamw: lr 0.0006: {off}"  # the loss stage's, reused
    first_launch = tags["s1-drafter-dflash2_muon-seed0"]
    assert column not in first_launch and first_launch[STAGE_DELTA_TAG] == NOT_IN_STAGE
    assert first_launch["stage"] == "1 drafter (not in the result)"  # a group of its own in the key-metrics view
    assert sum(t.get("stage") == "1 drafter" for t in tags.values()) == 24  # 27 cells, three of them stage 0's
    in_view = [n for n, t in tags.items() if column in t]
    assert len(in_view) == 27 + 1  # 3 options x 3 lrs x 3 seeds (three of them the loss stage's), the stage's run
    note = tags["s1-drafter-dflash2_muon-lr0.0054-seed1"]["mlflow.note.content"]
    assert note.startswith(f"{CAMPAIGN_HEAD} `engine`, stage 1 drafter, option `dflash2_muon-lr0.0054`, seed 1 "
                           f"(stage 1 drafter: the stage's winner)")
    result = note.split("\n\n")[1]
    assert result.startswith(f"{RESULT_HEAD} (`eval/tau_served`, T=1, the served setting, sampled drafts")
    assert "τ 1.605 [1.582, 1.627]" in result and "greedy (T=0) τ 2.219 [2.079, 2.366]" in result
    assert f"{HOW_HEAD} (on the machine that ran it):" in note and "python -m experiments.run" in note
    view = json.loads(json.loads(client.get_experiment(eid).tags[SAVED_VIEW_PREFIX + stage_view_key(1)])["state"])
    assert view["columnOrder"][0] == RUN_NAME_COLUMN and view["columnWidths"][RUN_NAME_COLUMN] >= 7 * 38
