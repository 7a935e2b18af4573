"""How MLflow 3's UI opens a dflash experiment: its training view, and a saved runs-table view of the key figures.

MLflow 3's UI opens an experiment in its GenAI view unless the URL asks for the training one
(`workflowType=machine_learning`, mlflow/server/js in MLflow 3.17) or the experiment's kind says so (tag
`mlflow.experimentKind` = `custom_model_development`). Its runs table shows Source / Models / Dataset until
columns are picked by hand; a saved view picks them: experiment tag `mlflow.sharedViewState.<key>`, opened by
`?viewStateShareKey=<key>`, whose value is the envelope `{name, createdAt, updatedAt, state}` with `state` the
runs table's state as JSON (`selectedColumns`, `columnOrder`, `columnWidths`, `orderByKey`, ...). The UI applies a
width only to a column named in `columnOrder`.

Two things the open-source runs table cannot do: it heads a metric column with the metric's key in a 100 px
column (`eval/tau_served`, `eval/tau_served_ci_low` and `eval/tau_served_ci_high` all read `eval/tau_se…`) and it
prints a metric's float in full (`2.4132180213928223`). So the view shows the answer as run tags written beside
the metrics (`display_tags`): one column per figure, its interval in the same cell, three decimals. The metrics
stay as they are, for charts, sorting and the API.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping

ML_WORKFLOW = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG, ML_EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
KEY_METRICS_VIEW = "dflash-key-metrics"
VIEW_NAME = "dflash: key metrics"

# The display tags (run tags, read by people; the metrics they come from are the record). MLflow's tag keys allow
# letters (τ, Δ), digits, spaces and `_-.:/`, no brackets.
TAU_TAG = "τ"  # the objective (eval/tau_served; a legacy store's eval/tau_vanilla) with its CI: "2.413 [2.361, 2.466]"
PL_TAG = "τ prompt lookup"  # prompt lookup's τ on the same prompts and ground truth, with its CI
DELTA_PL_TAG = "Δτ vs prompt lookup"  # paired over prompts: "+0.313 [+0.251, +0.371]"
GREEDY_TAG = "τ greedy"  # T = 0 beside a sampled served setting, with its CI
TREE_TAG = "τ DDTree greedy"  # DDTree (T = 0 only) at its largest node budget, with its CI: "4.123 [4.001, 4.250] at 64"
# a campaign's paired Δ of the objective within a stage (sweeps.campaign_mlflow.log_stage_runs): on the stage's
# summary run the winner's over the runner-up, on each cell run its option's against the stage's winner
STAGE_DELTA_TAG = "Δτ in stage"
DISPLAY_TAGS = (TAU_TAG, STAGE_DELTA_TAG, DELTA_PL_TAG, PL_TAG, GREEDY_TAG, TREE_TAG)
DIGITS = 3

# a campaign's report labels its cell runs with stage and option (sweeps.results_summary.label_cell_runs); a
# sweep trial carries its Optuna state (COMPLETE / PRUNED / FAIL)
# the answer first: a campaign stage's τ and its Δ over the runner-up fit a 1600 px screen beside the run's name (which
# names its option), the other figures and the option after them
KEY_TAG_COLUMNS = ("stage", TAU_TAG, STAGE_DELTA_TAG, "option", "optuna.state",
                   *(t for t in DISPLAY_TAGS if t not in (TAU_TAG, STAGE_DELTA_TAG)), "loss", "noise", "buffer")
KEY_METRIC_COLUMNS = ("data/consumed_tokens",)  # whole numbers: they print as they are


def _num(metrics: Mapping[str, float], key: str) -> float | None:
    v = metrics.get(key)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _with_ci(metrics: Mapping[str, float], key: str, signed: bool = False) -> str | None:
    """`key`'s value with its interval (`<key>_ci_low` / `_ci_high`) where it has one, rounded for reading."""
    v = _num(metrics, key)
    if v is None:
        return None
    fmt = f"{{:+.{DIGITS}f}}" if signed else f"{{:.{DIGITS}f}}"
    lo, hi = _num(metrics, f"{key}_ci_low"), _num(metrics, f"{key}_ci_high")
    return fmt.format(v) + (f" [{fmt.format(lo)}, {fmt.format(hi)}]" if lo is not None and hi is not None else "")


def display_tags(metrics: Mapping[str, float], objective: str = "eval/tau_served") -> dict[str, str]:
    """The key-metrics view's run tags (module doc) from a run's metrics: the objective's τ [CI], prompt lookup's,
    the paired Δ against it, greedy τ beside a sampled served setting, DDTree's at its largest budget. Empty
    without the objective."""
    tau = _with_ci(metrics, objective)
    if tau is None:
        return {}
    out = {TAU_TAG: tau}
    if objective == "eval/tau_served":  # its setting's own keys: eval/<label>/... (dflash.evaluation.protocol)
        from dflash.evaluation.protocol import served_label
        label = served_label(metrics)
        pre = f"eval/{label}/"
        greedy = _with_ci(metrics, "eval/t0/tau_vanilla") if label != "t0" else None
    else:  # a legacy objective (eval/tau_vanilla, eval/tau_tree_64): the unlabelled keys of its one setting
        pre, greedy = "eval/", None
    for tag, key, signed in ((PL_TAG, "tau_prompt_lookup", False), (DELTA_PL_TAG, "delta_prompt_lookup", True)):
        text = _with_ci(metrics, pre + key, signed)
        if text is not None:
            out[tag] = text
    if greedy is not None:
        out[GREEDY_TAG] = greedy
    tree = "eval/t0/" if objective == "eval/tau_served" else "eval/"  # trees run greedy only
    budgets = [int(k[len(tree) + 9:]) for k in metrics
               if k.startswith(tree + "tau_tree_") and k[len(tree) + 9:].isdigit()]
    if budgets:
        out[TREE_TAG] = f"{_with_ci(metrics, f'{tree}tau_tree_{max(budgets)}')} at {max(budgets)}"
    return out


def setting_words(label: str) -> str:
    """A setting label in words: `t1` → "T=1", `t0.7_p0.95` → "T=0.7, top_p 0.95"."""
    parts = label[1:].split("_")
    words = {"p": "top_p ", "k": "top_k "}
    return ", ".join([f"T={parts[0]}", *(words.get(p[0], p[0]) + p[1:] for p in parts[1:])])


RESULT_HEAD, CAMPAIGN_HEAD, HOW_HEAD = "**Result**", "**Campaign**", "**How it ran**"


def result_note(metrics: Mapping[str, float], objective: str = "eval/tau_served") -> str:
    """A run's result as the first paragraph of its Description: the objective's τ [CI], named with its setting
    (T=1 and the drafts' proposal policy, or the old greedy protocol), prompt lookup's τ and the paired Δ against
    it, greedy τ beside a sampled setting, labelled; '' without the objective."""
    tags = display_tags(metrics, objective)
    if not tags:
        return ""
    if objective == "eval/tau_served":
        from dflash.evaluation.protocol import served_label, served_policy
        t = served_label(metrics).split("/")[0]
        setting = "T=0, greedy" if t == "t0" else setting_words(t)
        policy = served_policy(metrics)
        setting += f", the served setting, {policy} drafts" if policy != "greedy" else ", the served setting"
    else:
        setting = "the old protocol: greedy, fixed-length ground truth that loops"
    parts = [f"τ {tags[TAU_TAG]}"]
    if PL_TAG in tags:
        parts.append(f"prompt lookup {tags[PL_TAG]}" + (f", paired Δ {tags[DELTA_PL_TAG]}" if DELTA_PL_TAG in tags
                                                         else ""))
    if GREEDY_TAG in tags:
        parts.append(f"greedy (T=0) τ {tags[GREEDY_TAG]}")
    if TREE_TAG in tags:
        parts.append(f"DDTree greedy (T=0) τ {tags[TREE_TAG]}")
    return f"{RESULT_HEAD} (`{objective}`, {setting}; 95% intervals): " + "; ".join(parts) + "."


def with_result(note: str, *heads: str) -> str:
    """A run's Description opening with `heads` (its result, `result_note`; a campaign cell's place in its campaign),
    then how it ran (the command line, run folder and commit the run was made with): a Description written so
    before has its opening paragraphs replaced, the rest kept."""
    paragraphs = [p for p in (note or "").split("\n\n")]
    while paragraphs and paragraphs[0].startswith((RESULT_HEAD, CAMPAIGN_HEAD, HOW_HEAD)):
        paragraphs.pop(0)
    rest = "\n\n".join(paragraphs).strip()
    shown = [h for h in heads if h]
    if not shown:
        return rest
    return "\n\n".join([*shown, *([f"{HOW_HEAD} (on the machine that ran it):", rest] if rest else [])])


def _column(kind: str, name: str) -> str:
    return f"{kind}.`{name}`"  # the runs table's column id (its canonical sort key)


# the widest value each display column shows ("+0.313 [+0.251, +0.371]"); other columns fit their header
_VALUE_CHARS = {TAU_TAG: 20, STAGE_DELTA_TAG: 44, PL_TAG: 20, DELTA_PL_TAG: 23, GREEDY_TAG: 20, TREE_TAG: 27,
                "stage": 10, "option": 26, "data/consumed_tokens": 11}


# MLflow's Run Name column opens 190 px wide, which cut a campaign cell's name before its seed
# (`s1-drafter-dflash2_muon-lr0.0018-seed1`); given in `columnOrder` with a width, the UI applies it
RUN_NAME_COLUMN, RUN_NAME_WIDTH = "attributes.`Run Name`", 24 + 8 * 36


def view_state(group_by: str | None = None, objective: str = "eval/tau_served") -> dict:
    """The runs table's state the saved view opens with: stage, option, the display tags, seed, consumed tokens;
    every column wide enough for its header and its values; best `objective` first; grouped by run tag `group_by` (a
    campaign's `stage`: its groups open, best first within each)."""
    names = [("tags", t) for t in KEY_TAG_COLUMNS] + [("params", "seed")] + \
        [("metrics", m) for m in KEY_METRIC_COLUMNS]
    cols = [_column("attributes", "Source")] + [_column(k, n) for k, n in names]
    widths = {_column(k, n): 24 + 8 * max(len(n), _VALUE_CHARS.get(n, 0)) for k, n in names}
    widths[RUN_NAME_COLUMN] = RUN_NAME_WIDTH
    state = {"selectedColumns": cols, "columnOrder": [RUN_NAME_COLUMN, *cols[1:]], "columnWidths": widths,
             "orderByKey": _column("metrics", objective), "orderByAsc": False,
             "searchFilter": "attributes.status != 'FAILED'",  # a cell that failed and ran again: its result only
             **chart_state(objective)}
    if group_by:
        state["groupBy"] = {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": group_by}]}
    return state


def stage_metric(objective: str, what: str) -> str:
    """A campaign stage's summary-run metric about `objective` (`sweeps.campaign_mlflow.stage_figures`):
    `stage/tau_served_delta_runner_up`, `stage/tau_served/<option>`: named after the objective, so the chart view's
    filter on its name (`chart_state`) shows them."""
    return f"stage/{objective.removeprefix('eval/')}{what if what[:1] in ('/', '_') else '_' + what}"


def chart_state(objective: str = "eval/tau_served") -> dict:
    """The chart view's state in the saved view: one section, the objective's bar chart (`eval/tau_served`, one bar
    per run) and its interval's ends beside it, then a campaign stage's paired Δ of its winner over the runner-up
    (`stage_metric`, on the stage's summary run) with its interval's ends, and only charts of the objective's name
    shown
    (`chartsSearchFilter`, MLflow 3.17's runs-chart state keys): it opened on constant `buffer/depth_*` charts and
    one-dot τ line charts."""
    section = "dflash-objective"
    name = objective.removeprefix("eval/")
    titles = {objective: f"{name} (the objective)",
              stage_metric(objective, "delta_runner_up"): "a campaign stage's winner: paired Δ over the runner-up"}
    charts = [{"uuid": f"dflash-{key}{end}", "type": "BAR", "runsCountToCompare": 100, "metricSectionId": section,
               "deleted": False, "isGenerated": False, "metricKey": key + end, "displayName": f"{title}{end}"}
              for key, title in titles.items() for end in ("", "_ci_low", "_ci_high")]
    return {"compareRunCharts": charts, "isAccordionReordered": True, "hideEmptyCharts": True,
            "chartsSearchFilter": name,
            "compareRunSections": [{"uuid": section, "name": f"{name}: the objective and its 95% CI", "display": True,
                                    "isReordered": True, "deleted": False, "isGenerated": False}]}


def stage_view_key(index: int) -> str:
    return f"dflash-stage-{index}"


def stage_view(client, experiment_id: str, index: int, column: str, objective: str = "eval/tau_served") -> None:
    """A saved view of one campaign stage, its compare view (`?viewStateShareKey=dflash-stage-<index>`): the runs
    that carry the stage's run tag `column` ("stage 1 drafter": each run's option and its paired Δ against the
    stage's winner, the stage's summary run its answer; a run an earlier stage trained, reused here, too), best
    `objective` first, ungrouped, with the key-metrics view's τ columns and charts (`chart_state`). Written unless
    someone changed it in the UI."""
    key = SAVED_VIEW_PREFIX + stage_view_key(index)
    names = [("tags", column), *(("tags", t) for t in (TAU_TAG, DELTA_PL_TAG, PL_TAG, GREEDY_TAG, TREE_TAG)),
             ("params", "seed")]
    cols = [_column("attributes", "Source")] + [_column(k, n) for k, n in names]
    widths = {_column(k, n): 24 + 8 * max(len(n), _VALUE_CHARS.get(n, 0)) for k, n in names}
    widths[_column("tags", column)] = 24 + 8 * 74  # "dflash2_muon (winner): vs dflash1_muon (runner-up) +0.078 …"
    widths[RUN_NAME_COLUMN] = RUN_NAME_WIDTH
    state = {"selectedColumns": cols, "columnOrder": [RUN_NAME_COLUMN, *cols[1:]], "columnWidths": widths,
             "orderByKey": _column("metrics", objective), "orderByAsc": False,
             "searchFilter": f"tags.`{column}` LIKE '%' AND attributes.status != 'FAILED'", **chart_state(objective)}
    now = int(time.time() * 1000)
    value = json.dumps({"name": f"dflash: {column}", "createdAt": now, "updatedAt": now, "state": json.dumps(state)})
    old, ours = _envelope(client.get_experiment(experiment_id).tags.get(key))
    if ours and old != state:
        client.set_experiment_tag(experiment_id, key, value)


def experiment_view_tags(now_ms: int | None = None, group_by: str | None = None,
                         objective: str = "eval/tau_served") -> dict[str, str]:
    """The experiment tags that open it in MLflow 3's training view with the key-metrics runs table."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    view = {"name": VIEW_NAME, "createdAt": now, "updatedAt": now, "state": json.dumps(view_state(group_by, objective))}
    return {EXPERIMENT_KIND_TAG: ML_EXPERIMENT_KIND, SAVED_VIEW_PREFIX + KEY_METRICS_VIEW: json.dumps(view)}


def _envelope(value: str | None) -> tuple[dict | None, bool]:
    """(the view's state, whether the view is as dflash wrote it): the UI's "Override saved view" keeps the key,
    may compress the state and moves `updatedAt` past `createdAt`, which dflash writes equal."""
    try:
        env = json.loads(value or "")
        created = env["createdAt"]
    except (ValueError, KeyError, TypeError):
        return None, True  # no view (or not one the UI could open): ours to write
    ours = env.get("updatedAt", created) == created
    try:
        return json.loads(env["state"]), ours
    except (ValueError, KeyError, TypeError):
        return None, ours


def stale_view(value: str | None) -> bool:
    """Whether an experiment's key-metrics view tag is missing or an older dflash state, ours to replace; a view
    someone changed in the UI is theirs. Its grouping and order are the campaign's (`group_view_by`): kept."""
    state, ours = _envelope(value)
    own = ("groupBy", "orderByKey", *chart_state())  # the campaign's grouping, its objective's order and charts
    return ours and (state is None or {k: v for k, v in state.items() if k not in own}
                     != {k: v for k, v in view_state().items() if k not in own})


def group_view_by(client, experiment_id: str, tag: str, objective: str = "eval/tau_served") -> None:
    """Make the experiment's key-metrics view group its runs by run tag `tag` (a campaign's `stage`), best
    `objective` first (a legacy store's `eval/tau_vanilla`), unless someone changed that view in the UI."""
    key = SAVED_VIEW_PREFIX + KEY_METRICS_VIEW
    state, ours = _envelope(client.get_experiment(experiment_id).tags.get(key))
    if ours and state != view_state(tag, objective):
        client.set_experiment_tag(experiment_id, key, experiment_view_tags(group_by=tag, objective=objective)[key])


def ui_run_url(base: str, experiment_id: str, run_id: str) -> str:
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{ML_WORKFLOW}"


def ui_runs_table_url(base: str, experiment_id: str) -> str:
    return f"{base}/#/experiments/{experiment_id}/runs?viewStateShareKey={KEY_METRICS_VIEW}&{ML_WORKFLOW}"
