"""The key-metrics runs-table view (dflash/tracking/ui_view.py) on a real sqlite MLflow store: read back as MLflow
3.17's UI reads a saved view (its envelope, the state's keys, widths applied only to `columnOrder`), every column
named apart, the τ figures rounded in the run tags it shows."""
from __future__ import annotations

import json

import pytest

from dflash.evaluation.protocol import OBJECTIVE, served_label
from dflash.tracking.loggers import MLflowLogger, MultiLogger, TrackingConfig
from dflash.tracking.run_info import get_or_create_experiment
from dflash.tracking.ui_view import (DELTA_PL_TAG, GREEDY_TAG, KEY_METRICS_VIEW, PL_TAG, SAVED_VIEW_PREFIX, TAU_TAG,
                                     TREE_TAG, display_tags, group_view_by)

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

VIEW = SAVED_VIEW_PREFIX + KEY_METRICS_VIEW
# the state keys MLflow 3.17's runs page takes from a shared view (mlflow/server/js/build: its search facets and
# its UI state); others are dropped without a word
UI_KEYS = {"searchFilter", "orderByKey", "orderByAsc", "startTime", "lifecycleFilter", "modelVersionFilter",
           "datasetsFilter", "selectedColumns", "columnOrder", "columnWidths", "runsExpanded", "runsPinned",
           "runsHidden", "runsVisibilityMap", "runsHiddenMode", "compareRunCharts", "compareRunSections",
           "viewMaximized", "runListHidden", "isAccordionReordered", "groupBy", "groupsExpanded", "autoRefreshEnabled",
           "useGroupedValuesInCharts", "hideEmptyCharts", "globalLineChartConfig", "chartsSearchFilter"}


def _ui_state(tag_value: str) -> dict:
    """The view as the UI opens it: an envelope with a string name, a number createdAt and a string state."""
    env = json.loads(tag_value)
    assert isinstance(env["name"], str) and isinstance(env["createdAt"], int) and isinstance(env["state"], str)
    state = json.loads(env["state"])
    assert set(state) <= UI_KEYS, set(state) - UI_KEYS
    return state


def test_the_view_names_each_figure_apart_and_rounds_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = "```\npython -m experiments.run\n```"
    lg = MultiLogger([MLflowLogger(TrackingConfig(tracking_uri=uri, experiment="view", console=False,
                                                  system_metrics=False), tags={"mlflow.note.content": command})],
                     note=command)
    served = {"eval/served_temperature": 1.0, "eval/served_top_p": 1.0, "eval/served_top_k": 0.0}
    pre = f"eval/{served_label(served)}/"
    lg.log({"eval/subset/tau_served": 9.87654321, **served}, step=4)  # in training: not the answer
    assert TAU_TAG not in MlflowClient(uri).get_run(lg.run_id).data.tags
    final = {OBJECTIVE: 2.4132180213928223, f"{OBJECTIVE}_ci_low": 2.361234567, f"{OBJECTIVE}_ci_high": 2.46589,
             f"{pre}tau_prompt_lookup": 2.1004999, f"{pre}tau_prompt_lookup_ci_low": 2.05,
             f"{pre}tau_prompt_lookup_ci_high": 2.151, f"{pre}delta_prompt_lookup": 0.31271828,
             f"{pre}delta_prompt_lookup_ci_low": -0.0123, f"{pre}delta_prompt_lookup_ci_high": 0.6,
             "eval/t0/tau_vanilla": 3.0, "eval/t0/tau_vanilla_ci_low": 2.9, "eval/t0/tau_vanilla_ci_high": 3.1,
             "eval/t0/tau_tree_8": 3.2, "eval/t0/tau_tree_64": 4.12345, "eval/t0/tau_tree_64_ci_low": 4.0,
             "eval/t0/tau_tree_64_ci_high": 4.25, "eval/t0/tree_nodes_64": 63.9, **served}
    lg.log(final, step=6)
    lg.close()
    client = MlflowClient(uri)
    run = client.get_run(lg.run_id)
    tags = run.data.tags
    assert tags[TAU_TAG] == "2.413 [2.361, 2.466]"
    assert tags[PL_TAG] == "2.100 [2.050, 2.151]"
    assert tags[DELTA_PL_TAG] == "+0.313 [-0.012, +0.600]"
    assert tags[GREEDY_TAG] == "3.000 [2.900, 3.100]"
    assert tags[TREE_TAG] == "4.123 [4.000, 4.250] at 64"  # the largest budget
    assert run.data.metrics[OBJECTIVE] == final[OBJECTIVE]  # the metric itself keeps every digit
    # the Description opens with the result, at its setting, before how the run was made (it held the command alone)
    note = tags["mlflow.note.content"].split("\n\n")
    assert note[0] == ("**Result** (`eval/tau_served`, T=1, the served setting, sampled drafts; 95% intervals): τ 2.413 "
                       "[2.361, 2.466]; prompt lookup 2.100 [2.050, 2.151], paired Δ +0.313 [-0.012, +0.600]; greedy "
                       "(T=0) τ 3.000 [2.900, 3.100]; DDTree greedy (T=0) τ 4.123 [4.000, 4.250] at 64.")
    assert note[1] == "**How it ran** (on the machine that ran it):" and note[2] == "```\npython -m experiments.run\n```"

    state = _ui_state(client.get_experiment(run.info.experiment_id).tags[VIEW])
    cols = state["selectedColumns"]
    headers = [c.split("`")[1] for c in cols]
    assert len(set(headers)) == len(headers)
    for tag in (TAU_TAG, PL_TAG, DELTA_PL_TAG, GREEDY_TAG, TREE_TAG):
        col = f"tags.`{tag}`"
        assert col in cols and col in state["columnOrder"]  # the UI widens only the columns columnOrder names
        assert state["columnWidths"][col] >= 7 * len(tags[tag])  # the whole "value [low, high]" shows
    assert not [c for c in cols if "_ci_" in c]  # the bounds sit in their value's cell, not in columns of their own
    assert state["orderByKey"] == f"metrics.`{OBJECTIVE}`" and state["orderByAsc"] is False


def test_a_greedy_served_setting_and_a_legacy_objective():
    greedy = {OBJECTIVE: 3.5, "eval/served_temperature": 0.0, "eval/t0/tau_prompt_lookup": 2.0,
              "eval/t0/tau_vanilla": 3.5}
    assert display_tags(greedy) == {TAU_TAG: "3.500", PL_TAG: "2.000"}  # no interval logged: none shown
    legacy = {"eval/tau_vanilla": 8.5431, "eval/tau_vanilla_ci_low": 8.0031, "eval/tau_vanilla_ci_high": 9.0809,
              "eval/delta_prompt_lookup": 2.3839, "eval/delta_prompt_lookup_ci_low": 2.0261,
              "eval/delta_prompt_lookup_ci_high": 2.7559}
    assert display_tags(legacy, "eval/tau_vanilla") == {TAU_TAG: "8.543 [8.003, 9.081]",
                                                        DELTA_PL_TAG: "+2.384 [+2.026, +2.756]"}
    assert display_tags(legacy) == {}  # not evaluated under the served protocol: nothing to show as its τ


def test_an_older_dflash_view_is_replaced_a_users_choices_are_not(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    old_state = {"selectedColumns": ["metrics.`eval/tau_served`", "metrics.`eval/tau_served_ci_low`"],
                 "columnWidths": {"metrics.`eval/tau_served_ci_low`": 200}}
    old = json.dumps({"name": "dflash: key metrics", "createdAt": 1, "updatedAt": 1, "state": json.dumps(old_state)})
    mine = json.dumps({"name": "mine", "createdAt": 1, "updatedAt": 1, "state": "{}"})
    eid = client.create_experiment("old", tags={VIEW: old, SAVED_VIEW_PREFIX + "mine": mine,
                                                "mlflow.experimentKind": "genai_development"})
    assert get_or_create_experiment(client, "old", uri) == eid
    tags = client.get_experiment(eid).tags
    state = _ui_state(tags[VIEW])
    assert f"tags.`{TAU_TAG}`" in state["selectedColumns"] and state != old_state
    assert tags[SAVED_VIEW_PREFIX + "mine"] == mine and tags["mlflow.experimentKind"] == "genai_development"
    get_or_create_experiment(client, "old", uri)  # a current view is left as it is
    assert client.get_experiment(eid).tags[VIEW] == tags[VIEW]
    group_view_by(client, eid, "stage")  # a campaign's: one group per stage, kept by every later training run
    get_or_create_experiment(client, "old", uri)
    grouped = _ui_state(client.get_experiment(eid).tags[VIEW])
    assert grouped["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "stage"}]
    assert {k: v for k, v in grouped.items() if k != "groupBy"} == state
    # someone overrides the view from the UI (same key, updatedAt moved on): theirs from then on
    theirs = json.dumps({"name": "dflash: key metrics", "createdAt": 1, "updatedAt": 2, "state": "H4sI..."})  # gzip
    client.set_experiment_tag(eid, VIEW, theirs)
    get_or_create_experiment(client, "old", uri)
    group_view_by(client, eid, "stage")
    assert client.get_experiment(eid).tags[VIEW] == theirs


def test_chart_views_open_on_the_objective_and_a_stage_has_its_compare_view(tmp_path):
    """The chart view starts from `eval/tau_served` and its interval (then a campaign stage's paired Δ over the
    runner-up), filtered to the objective's charts, and FAILED runs stay out of the table; a campaign stage's own
    saved view lists the runs carrying its tag, best τ first, ungrouped, its tag the first column."""
    from dflash.tracking.ui_view import RUN_NAME_COLUMN, stage_metric, stage_view, stage_view_key, view_state
    state = view_state(objective=OBJECTIVE)
    keys = [c["metricKey"] for c in state["compareRunCharts"]]
    assert keys[:3] == [OBJECTIVE, f"{OBJECTIVE}_ci_low", f"{OBJECTIVE}_ci_high"]
    assert keys[3] == stage_metric(OBJECTIVE, "delta_runner_up") == "stage/tau_served_delta_runner_up"
    assert stage_metric(OBJECTIVE, "/dpace") == "stage/tau_served/dpace"
    assert all("tau_served" in k for k in keys) and state["chartsSearchFilter"] == "tau_served"
    assert {c["metricSectionId"] for c in state["compareRunCharts"]} == {s["uuid"] for s in state["compareRunSections"]}
    assert state["searchFilter"] == "attributes.status != 'FAILED'"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    eid = client.create_experiment("campaign")
    stage_view(client, eid, 1, "stage 1 drafter")
    view = _ui_state(client.get_experiment(eid).tags[SAVED_VIEW_PREFIX + stage_view_key(1)])
    # the run's name whole (MLflow's 190 px cut `s1-drafter-dflash2_muon-lr0.0018-seed1` before its seed), then the tag
    assert view["columnOrder"][:2] == [RUN_NAME_COLUMN, "tags.`stage 1 drafter`"] and "groupBy" not in view
    assert view["columnWidths"][RUN_NAME_COLUMN] >= 7 * len("s1-drafter-dflash2_muon-lr0.0018-seed1")
    assert view["searchFilter"].startswith("tags.`stage 1 drafter` LIKE '%'")
    assert view["orderByKey"] == f"metrics.`{OBJECTIVE}`" and view["compareRunCharts"] == state["compareRunCharts"]
    # found with the filter it sets: a run of the stage, not one of another stage
    a = client.create_run(eid, tags={"stage 1 drafter": "dpace: the stage's winner"}).info.run_id
    client.create_run(eid, tags={"stage 0 loss": "x"})
    assert [r.info.run_id for r in client.search_runs([eid], view["searchFilter"])] == [a]


def test_the_folder_says_the_description_mlflow_shows(tmp_path):
    """A run's folder (tags.json) and its MLflow run carry the same Description: its result once the objective is
    logged, above the command line the run was made with; a second evaluation replaces the first's result."""
    from dflash.tracking.loggers import build_loggers
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    lg = build_loggers(TrackingConfig(tracking_uri=uri, experiment="desc", console=False, system_metrics=False),
                       run_dir, {}, {}, total_steps=2)
    served = {"eval/served_temperature": 1.0, "eval/served_top_p": 1.0, "eval/served_top_k": 0.0,
              "eval/served_proposal": 1.0}
    lg.log({OBJECTIVE: 1.5, **served}, step=1)
    lg.log({OBJECTIVE: 1.25, f"{OBJECTIVE}_ci_low": 1.2, f"{OBJECTIVE}_ci_high": 1.3, **served}, step=2)
    lg.close()
    note = MlflowClient(uri).get_run(lg.run_id).data.tags["mlflow.note.content"]
    assert json.loads((run_dir / "tags.json").read_text())["mlflow.note.content"] == note
    assert note.startswith("**Result** (`eval/tau_served`, T=1, the served setting, argmax drafts; 95% intervals): "
                           "τ 1.250 [1.200, 1.300].\n\n**How it ran**") and note.count("**Result**") == 1
    assert "run folder: " in note
