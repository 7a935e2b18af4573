"""A campaign's answer on one screen: which option won each stage, by how much, how sure, and what the recipe
(the chain of winners) reaches against prompt lookup and against the campaign's first cell.

    python -m sweeps.results_summary benchmarks/ABLATIONS.md out=campaign_out [campaign.KEY=VALUE] reference_64m …
        [sweeps_out=sweeps_out sweep=recipe_reference …]

rewrites the generated blocks of each named campaign in the markdown file from the store under `out`: its summary
(between `<!-- results-summary:NAME -->` and `<!-- /results-summary:NAME -->`, added at the top when absent) and,
where the file has one, its report without the summary (`<!-- report:NAME -->` … `<!-- /report:NAME -->`). Each
`sweep=NAME` gets its block `results-summary:sweep:NAME` from the sweep store under `sweeps_out` (its study and
trial folders): the best trial's settings and τ [CI], prompt lookup's with the paired Δ, the trials tied with it,
how the trials ended (`sweeps.sweep_report.summary_lines`). The
campaign report (`python -m sweeps.campaign NAME report`) opens with the same lines, writes them to
`<out>/<NAME>/SUMMARY.md` and logs them on the campaign's summary run in its MLflow experiment (`log_summary`).

Every figure is the report's own: τ of the objective pooled over the seeds every option of the stage has, its 95%
seed × prompt × sample bootstrap interval, and Δs paired seed for seed and prompt for prompt (`campaign_report`).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from dflash.atomic import atomic_write_text
from dflash.evaluation.pairing import metric_columns
from dflash.tracking.ui_view import display_tags, group_view_by
from sweeps.cost import cell_cost
from sweeps.campaign_report import (BELOW_PL, CI_LEVEL, _by_option, _delta, _fmt, _objective_suite, paired_ci,
                                    below_prompt_lookup, data_sets, pooled, shared_seeds, stage_call)

PL_COLUMNS = ("tau_sum_prompt_lookup", "rounds_prompt_lookup")
SUMMARY_RUN_TAG = "dflash.campaign_summary"  # the tag naming the campaign whose summary run this is


def _sd(iv) -> str:
    """A signed Δ with its interval: +0.090 [-0.016, +0.193]."""
    return f"{iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"


def _signed(text: str) -> str:
    """The report's Δ text with its non-negative figures signed: "0.090 [-0.016, 0.193]" → "+0.090 [-0.016, +0.193]";
    "not paired: why" where it does not pair."""
    return re.sub(r"(?<![\d+\-.])(\d+\.\d{3})", r"+\1", text)


def _verdict_word(verdict: str) -> str:
    return verdict.split(" (within")[0] if verdict in ("better", "worse") or verdict.startswith("tie") else ""


def _seeds(xs) -> str:
    return ("seed " if len(xs) == 1 else "seeds ") + ", ".join(map(str, xs))


def stage_answer(c, summary: dict, i: int) -> dict[str, Any]:
    """One stage's answer on its objective: the winner (the campaign's call where the stage is complete, else the
    highest mean over the seeds every option has), the options tied with it, its pooled τ, its paired Δ over the
    runner-up, the seeds it rests on; `missing` names options with no run at all (then nothing is called)."""
    from sweeps.campaign_spec import at_best_lr
    stage = c.stages[i]
    cells = at_best_lr([x for x in summary["cells"] if x["stage"] == i and not x.get("failed")])
    suite = _objective_suite(cells, c.objective) if cells else None
    cols = metric_columns(c.objective)
    by_opt = _by_option(cells, suite) if suite else {}
    missing = [o for o in stage.options if o not in by_opt]
    shared = shared_seeds(by_opt)
    finished = {(x["option"], int(x["seed"])) for x in cells}
    failed_cells = sorted({(x["option"], int(x["seed"])) for x in summary["cells"]
                           if x["stage"] == i and x.get("failed")} - finished)  # not trained again since
    out: dict[str, Any] = {"index": i, "factor": stage.factor, "missing": missing, "seeds": shared, "runs": len(cells),
                           "suite": suite, "failed": sorted({o for o, _ in failed_cells} & set(missing)),
                           "failed_cells": failed_cells}
    if missing or not shared or cols is None:
        return out
    use = [x for x in cells if int(x["seed"]) in shared]
    out["mixed_data"] = len(data_sets(use)) > 1  # cells that read different online text (the report names them)
    out["complete"] = all((o, s) in finished for o in stage.options for s in c.seeds)
    from sweeps.campaign_spec import best_option
    # the campaign's call where it made one (later stages were built on it; an open stage's call is of the seeds
    # it had then), else the highest mean over the shared seeds; ties against it over the shared seeds
    winner = (summary.get("winners") or {}).get(stage.factor) or best_option(use)
    call = (summary.get("calls") or {}).get(stage.factor) if out["complete"] else None
    if not call or "order" not in call:  # a call recorded before orders were
        call = stage_call(use, c.objective, winner)
    tied = call.get("tied") or []
    out["order"] = call.get("order")
    value = lambda x: float(x["value"]) if x.get("value") is not None else float("-inf")  # noqa: E731
    means = {o: sum(value(x) for x in use if x["option"] == o) / len(shared) for o in stage.options}
    won = {s: by_opt[winner][s] for s in shared}
    out["winner_cells"] = [x for x in use if x["option"] == winner]
    out.update(winner=winner, tied=tied, tau=pooled(list(won.values()), cols.sum_col, cols.count_col),
               below_pl=below_prompt_lookup(list(won.values())), tables=won)
    from sweeps.least_degenerate import order_check
    out["least_degenerate"] = order_check(use, suite, stage.options[0])
    others = [o for o in stage.options if o != winner]
    if others:
        runner = max(others, key=lambda o: means[o])
        out["runner_up"] = runner
        out["delta"] = _delta(won, {s: by_opt[runner][s] for s in shared}, cols.sum_col, cols.count_col)
    else:  # one option ranks nothing: weighed against the winners of the stages before it instead
        out["vs_winners"] = _against_earlier_winners(c, summary, i, suite, won)
    return out


def _against_earlier_winners(c, summary: dict, i: int, suite: str, tables: dict[int, dict]) -> list[tuple]:
    """(stage factor, its winner, (Δ text, verdict)) of a one-option stage's option against each earlier stage's
    winner, paired seed for seed and prompt for prompt (`_delta`): the served campaign's recipe stage (1.636) ties
    the drafter stage's DFlash 2 + Muon (1.637), which its own stage, having no second option, cannot say."""
    cols = metric_columns(c.objective)
    out = []
    for j, stage in enumerate(c.stages[:i]):
        winner = (summary.get("winners") or {}).get(stage.factor)
        cells = [x for x in summary["cells"] if x["stage"] == j and x["option"] == winner and not x.get("failed")]
        ref = _by_option(cells, suite).get(winner) if winner else None
        if ref:
            out.append((stage.factor, winner, _delta(tables, ref, cols.sum_col, cols.count_col)))
    return out


def recipe_answer(c, summary: dict, answers: list[dict]) -> dict[str, Any] | None:
    """The campaign's answer: of the called stages no later stage builds on (`on_best`: a chain's last stage, or
    each of independent stages), the winner with the highest pooled τ (its cell: the winners it was built on and
    its option), against prompt lookup on its own prompts and against the campaign's first cell (stage 0's first
    option: the default it started from), paired. Not simply the last stage's: the engine campaign's last stage is
    the old recipe's settings alone, which its drafter stage's winner beats by 0.25."""
    called = [a for a in answers if "winner" in a]
    if not called:
        return None
    built_on = {f for st in c.stages for f in st.on_best}
    leaves = [a for a in called if a["factor"] not in built_on] or called
    last = max(leaves, key=lambda a: a["tau"].value)
    cols = metric_columns(c.objective)
    tables = list(last["tables"].values())
    out = {"stage": last["factor"], "winner": last["winner"], "tau": last["tau"], "seeds": last["seeds"],
           "below_pl": last["below_pl"],
           "chain": [*((f, (summary.get("winners") or {}).get(f)) for f in c.stages[last["index"]].on_best),
                     (last["factor"], last["winner"])],
           "open": not last["complete"], "lr": (summary.get("winner_lrs") or {}).get(last["factor"])}
    if PL_COLUMNS[0] in (tables[0].get("tasks") or [{}])[0]:
        out["vs_pl"] = paired_ci(tables, tables, (cols.sum_col, cols.count_col), PL_COLUMNS)
        out["pl"] = pooled(tables, *PL_COLUMNS)
    first = c.stages[0].options[0]
    stage0 = [x for x in summary["cells"] if x["stage"] == 0 and x["option"] == first and not x.get("failed")]
    base = _by_option(stage0, answers[0]["suite"]).get(first, {}) if answers[0].get("suite") else {}
    out["first"] = first
    out["first_tokens"] = max((x.get("consumed_tokens") or 0 for x in stage0), default=0)
    if base and not (last["factor"] == c.stages[0].factor and last["winner"] == first):
        out["vs_first"] = _delta(last["tables"], base, cols.sum_col, cols.count_col)
    winner_cells = [x for x in summary["cells"] if x["stage"] == last["index"] and x["option"] == last["winner"]]
    out["tokens"] = max((x.get("consumed_tokens") or 0 for x in winner_cells), default=0)
    return out


def _stage_line(i: int, a: dict, c) -> str:
    head = f"- Stage {i} **{a['factor']}**"
    if a["missing"] or not a["seeds"]:
        what = ", ".join(a["missing"]) or "a seed every option shares"
        failed = f"; {', '.join(a['failed'])} ran and failed" if a.get("failed") else ""
        return (f"{head}: not called, no finished run of {what}{failed} (`python -m sweeps.campaign {c.name} "
                f"only=[{a['factor']}]`).")
    left = sorted(set(c.seeds) - set(a["seeds"]))
    failed = ", ".join(f"{o} (seed {s})" for o, s in a.get("failed_cells") or [])
    open_ = "" if a["complete"] else (f"; **open**: {_seeds(left)} not run for every option"
                                      + (f" ({failed} ran and failed)" if failed else ""))
    tau = _fmt(a["tau"]) + (f" {BELOW_PL}" if a["below_pl"] else "")
    mixed = "; **not one data set** (the report names the cells)" if a.get("mixed_data") else ""
    if "vs_winners" in a:  # one option: no winner of its own stage, weighed against the earlier stages' winners
        against = "".join(f"; vs {f}'s winner {w} {_delta_words(d)}" for f, w, d in a["vs_winners"])
        return (f"{head} ({_seeds(a['seeds'])}, {a['runs']} runs{open_}): one option, so no winner: "
                f"**{a['winner']}** τ {tau}{against}{mixed}.")
    tie = f"; tied with {', '.join(a['tied'])}" if a["tied"] else "; no tie"
    delta = f"; vs {a['runner_up']} (runner-up) {_delta_words(a['delta'])}" if "delta" in a else ""
    order = f"; order {a['order']}" if a.get("order") and " " in a["order"] else ""
    return (f"{head} ({_seeds(a['seeds'])}, {a['runs']} runs{open_}): **{a['winner']}** τ {tau}{tie}{delta}"
            f"{order}{_lr_clause(c.stages[i])}{_cost_clause(a)}{_least_degenerate_clause(a.get('least_degenerate'))}"
            f"{mixed}.")


def _lr_clause(stage) -> str:
    """Where the stage's options carry an lr grid: that each is compared at its best of it."""
    if not stage.lr_grid:
        return ""
    grid = ", ".join(f"{x:g}" for x in sorted({lr for lrs in stage.lr_grid.values() for lr in lrs}))
    return f"; {', '.join(stage.lr_grid)} each at its best of lr ∈ {{{grid}}} (the report's stage names it)"


def _cost_clause(a: dict) -> str:
    """The winner's cost, mean over its cells (`sweeps.cost.cell_cost`); empty where no cell records it."""
    cost = [got for x in a.get("winner_cells") or [] if (got := cell_cost(x)) is not None]
    if not cost:
        return ""
    mean = {k: sum(g[k] for g in cost) / len(cost) for k in cost[0]}
    return (f"; {a['winner']} cost {mean['gpu_s']:,.0f} GPU-s a cell at {mean['tok_s']:,.0f} consumed tok/s, τ "
            f"{mean['tau_per_gpu_h']:.2f} per GPU-hour")


def _delta_words(delta: tuple[str, str]) -> str:
    """A `_delta` result as the summary says it: "+0.078 [+0.069, +0.086] better", "not paired (why)"."""
    d, verdict = delta
    return f"not paired ({verdict})" if d == "not paired" else f"{_signed(d)} {_verdict_word(verdict)}".rstrip()


def _least_degenerate_clause(check: dict | None) -> str:
    """Whether the stage's order holds on its least-degenerate prompt samples (`sweeps.least_degenerate`)."""
    if check is None:
        return ""
    words = check["words"].replace("The ", "the ", 1)
    return (f"; on the {check['kept']} of {check['total']} least-degenerate prompt samples {words} (Kendall τ-b "
            f"{check['kendall_tau_b']:+.2f})")


def _recipe_line(r: dict) -> str:
    tau = _fmt(r["tau"]) + (f" {BELOW_PL}" if r["below_pl"] else "")
    chain = ", ".join(f"{f}={w}" for f, w in r["chain"])
    chain += f" at lr {r['lr']:g}" if r.get("lr") is not None else ""
    parts = [f"- **Recipe** ({chain}{'; the last stage still open' if r['open'] else ''}; {r['tokens']:,.0f} "
             f"consumed tokens): τ **{tau}**"]
    if "vs_pl" in r:
        parts.append(f"prompt lookup {_fmt(r['pl'])}, paired Δ {_sd(r['vs_pl'])}")
    if "vs_first" in r:
        parts.append(f"vs the campaign's first cell `{r['first']}` ({r['first_tokens']:,.0f} tokens) "
                     f"{_delta_words(r['vs_first'])}")
    return "; ".join(parts) + f"; {_seeds(r['seeds'])}."


def render_summary(c, summary: dict, level: int = 2) -> list[str]:
    """The summary's markdown lines: a heading, what the numbers are, the recipe, one line per stage."""
    answers = [stage_answer(c, summary, i) for i in range(len(c.stages))]
    suite = next((a["suite"] for a in answers if a.get("suite")), None)
    setting = next((((t.get("info") or {}).get("sampling")) for a in answers for t in a.get("tables", {}).values()
                    if (t.get("info") or {}).get("sampling")), None)  # the objective's setting, in words
    setting = f" ({setting}: the served setting)" if setting and c.objective.startswith("eval/tau_served") else (
        " (greedy, T=0: the old protocol)" if c.objective == "eval/tau_vanilla" else "")
    lines = [f"{'#' * level} Results summary: `{c.name}`", "",
             f"Objective `{c.objective}`{setting} on suite `{suite}`; τ pooled over the seeds every option of a stage "
             f"has ({CI_LEVEL:.0%} seed × prompt × sample bootstrap interval); Δ paired seed for seed, prompt for "
             f"prompt; a tie is a "
             f"Δ interval containing 0 or a Δ one seed reverses; {BELOW_PL}: below prompt lookup.", ""]
    recipe = recipe_answer(c, summary, answers)
    if recipe is not None:
        lines.append(_recipe_line(recipe))
    lines += [_stage_line(i, a, c) for i, a in enumerate(answers)]
    return [*lines, ""]


def label_cell_runs(client, experiment_id: str, c, stage_tags: dict[str, dict[str, str]] | None = None) -> int:
    """Tag every cell run of the campaign's experiment (named by its cell id) with `campaign`, `stage` ("1 noise":
    sorts and groups by stage), `option`, `seed` and the key-metrics view's figures of the campaign's objective
    (`dflash.tracking.ui_view.display_tags`), and log them as params `campaign.name`, `campaign.stage`,
    `campaign.option` (parallel coordinates plot params): so the runs table groups by stage and option, where its
    run names alone (`s1-noise-uniform-seed0`) cannot. A param a run already has with another value is left as it
    is (MLflow's params are write-once); `stage_tags` {run name: tags}: its option's paired Δ against the winner of
    each stage it is a run of (`sweeps.campaign_mlflow.log_stage_runs`). Returns how many runs were labelled."""
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException

    from dflash.tracking.ui_view import STAGE_DELTA_TAG
    from sweeps.campaign_mlflow import CELL_NAME, NOT_IN_STAGE
    n = 0
    for run in client.search_runs([experiment_id], max_results=10000):
        m = CELL_NAME.match(run.info.run_name or "")
        if m is None:
            continue
        stage, factor, option, seed = int(m[1]), m[2], m[3], m[4]
        tags = {"campaign": c.name, "stage": f"{stage} {factor}", "option": option, "seed": seed,
                **display_tags(run.data.metrics, c.objective)}  # the key-metrics view's rounded τ [CI] columns
        tags.update((stage_tags or {}).get(run.info.run_name, {}))  # its option's paired Δ against stage winners
        if tags.get(STAGE_DELTA_TAG) == NOT_IN_STAGE:  # no cell of the grid now: a group of its own, not the stage's
            tags["stage"] += " (not in the result)"
        tags["mlflow.note.content"] = cell_note(c, run, tags)  # Description: its place, its result, how it ran
        params = {"campaign.name": c.name, "campaign.stage": f"{stage} {factor}", "campaign.option": option}
        if all(run.data.tags.get(k) == v for k, v in tags.items()) and all(
                run.data.params.get(k) == v for k, v in params.items()):
            continue
        client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        new = [Param(k, v) for k, v in params.items() if k not in run.data.params]
        if new:
            try:
                client.log_batch(run.info.run_id, params=new)
            except MlflowException:
                pass
        n += 1
    return n


def cell_note(c, run, tags: dict[str, str]) -> str:
    """A campaign cell run's Description (`dflash.tracking.ui_view.with_result`): which campaign, stage, option and
    seed it is, what it says in each stage it is a run of (its option's paired Δ against the winner), its result on
    the campaign's objective, then the command line it was made with."""
    from dflash.tracking.run_info import NOTE
    from dflash.tracking.ui_view import CAMPAIGN_HEAD, STAGE_DELTA_TAG, result_note, with_result
    from sweeps.campaign_mlflow import ANSWERS
    stages = "; ".join(f"{k}: {v.split(': ', 1)[-1]}" for k, v in tags.items() if re.match(r"^stage \d+ ", k)) \
        or tags.get(STAGE_DELTA_TAG, "")
    head = (f"{CAMPAIGN_HEAD} `{c.name}`, stage {tags['stage']}, option `{tags['option']}`, seed {tags['seed']}"
            + (f" ({stages})" if stages else "") + f". Each stage's answer pooled over its seeds: the runs of stage "
            f"`{ANSWERS}`.")
    return with_result(run.data.tags.get(NOTE, ""), head, result_note(run.data.metrics, c.objective))


def experiment_note(c) -> str:
    """The campaign experiment's Description: what it measured, and under which protocol: a campaign scored on the
    legacy objective is marked as the old one, so its experiment never reads as a current answer."""
    from dflash.evaluation.protocol import LEGACY_OBJECTIVE
    old = (f"**Old protocol** (`{LEGACY_OBJECTIVE}`: greedy, fixed-length ground truth that loops; not a current "
           f"answer, see the served campaign). " if c.objective in (LEGACY_OBJECTIVE, "eval/tau_tree_64") else "")
    return f"Campaign `{c.name}`: {old}{c.description}"


def log_summary(c, out: Path, text: str, summary: dict) -> str | None:
    """Log `text` as `results_summary.md` and the Description of the campaign's summary run (tagged
    `dflash.campaign_summary`, `dflash.kind=campaign`: not a training run) in the campaign's experiment of
    `<out>/mlflow.db`, log a summary run per called stage of `summary` (`sweeps.campaign_mlflow.log_stage_runs`),
    label its cell runs (`label_cell_runs`), group the experiment's key-metrics view by stage, and give the
    experiment the campaign's description where it has none. Returns the run id; None where the store or the
    experiment is not there."""
    db = Path(out) / "mlflow.db"
    if not db.is_file():
        return None
    from dflash.tracking.run_info import get_or_create_experiment
    from dflash.tracking.store import open_client
    uri = f"sqlite:///{db.resolve()}"
    client = open_client(uri)  # the bounded client of every command (a sqlite store made whole first)
    if client.get_experiment_by_name(c.experiment) is None:
        return None
    eid = get_or_create_experiment(client, c.experiment, uri)
    note = client.get_experiment(eid).tags.get("mlflow.note.content")
    if not note or note.startswith(f"Campaign `{c.name}`"):  # none yet, or one a report wrote: the current text
        client.set_experiment_tag(eid, "mlflow.note.content", experiment_note(c))
    found = client.search_runs([eid], f"tags.`{SUMMARY_RUN_TAG}` = '{c.name}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
    else:
        run_id = client.create_run(eid, run_name=f"campaign {c.name}: summary",
                                   tags={SUMMARY_RUN_TAG: c.name, "dflash.kind": "campaign"}).info.run_id
    from sweeps.campaign_mlflow import log_stage_runs
    label_cell_runs(client, eid, c, log_stage_runs(client, eid, c, summary))  # a summary run per called stage
    group_view_by(client, eid, "stage", c.objective)  # the key-metrics view: a group per stage, best τ first
    client.set_tag(run_id, "mlflow.note.content", text)
    client.log_text(run_id, text, "results_summary.md")
    client.set_terminated(run_id)
    return run_id


def report_block(c, summary: dict, out: Path | None = None) -> str:
    """The campaign report without its summary, every heading one level down: a section of a longer page; `out`:
    the store, where the campaigns it compares with are read (without it, their rank agreement is "not in this
    store", as the committed block once said beside a table quoting it)."""
    from sweeps.campaign_report import render_report
    text = render_report(c, summary, with_summary=False, out=out)
    return re.sub(r"(?m)^(#+) ", lambda m: "#" + m[1] + " ", text)


def update_block(body: str, key: str, text: str, add: bool) -> str:
    """`body` with its generated block `key` (between `<!-- key -->` and `<!-- /key -->`) replaced by `text`; where
    absent, added after the title line when `add`, else left out."""
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(body):
        return pattern.sub(lambda _: block, body)
    if not add:
        return body
    title, _, rest = body.partition("\n")
    return f"{title}\n\n{block}\n{rest}"


def sweep_summary(name: str, sweeps_out: Path) -> str:
    """The summary block of sweep `name` (conf/sweep/<name>.yaml) from its study in `<sweeps_out>/<name>.journal`
    and its trials' folders (`sweeps.sweep_report.summary_lines`)."""
    import optuna

    from sweeps.space import SweepError, load_sweep
    from sweeps.storage import make_storage
    from sweeps.sweep_report import summary_lines
    sweep = load_sweep(name)
    journal = sweeps_out / f"{name}.journal"
    if not journal.is_file():
        raise SweepError(f"sweep={name}: no study storage {journal} (sweeps_out={sweeps_out}; the recipe sweep's "
                         f"store: python -m dflash.tracking.packed_store unpack benchmarks/sweeps/sweeps_out.tar.xz)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=make_storage(str(journal)))
    return "\n".join(summary_lines(study, sweep, sweeps_out.resolve(), level=3))


def main(argv: list[str] | None = None) -> dict[str, str]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return {}
    md = Path(argv[0])
    if not md.is_file():
        print(f"{md}: no such markdown file (the file whose summary blocks to rewrite)", file=sys.stderr)
        raise SystemExit(2)

    def value(key: str, default: str) -> str:
        return next((a.partition("=")[2] for a in argv[1:] if a.startswith(f"{key}=")), default)
    out, sweeps_out = Path(value("out", "campaign_out")), Path(value("sweeps_out", "sweeps_out"))
    edits = [a for a in argv[1:] if a.startswith("campaign.")]  # e.g. a legacy store's campaign.objective
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import load_summary
    from sweeps.space import SweepError
    body = md.read_text()
    texts = {}
    try:
        for name in [a.partition("=")[2] for a in argv[1:] if a.startswith("sweep=")]:
            texts[f"sweep:{name}"] = sweep_summary(name, sweeps_out)
            body = update_block(body, f"results-summary:sweep:{name}", texts[f"sweep:{name}"], add=True)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    for name in [a for a in argv[1:] if not a.startswith(("out=", "campaign.", "sweep=", "sweeps_out="))]:
        c = load_campaign(name, edits)
        summary = load_summary(c, out)
        texts[name] = "\n".join(render_summary(c, summary, level=3))
        body = update_block(body, f"results-summary:{name}", texts[name], add=True)
        body = update_block(body, f"report:{name}", report_block(c, summary, out), add=False)
    atomic_write_text(md, body)  # every campaign and sweep read before the file is touched
    return texts


if __name__ == "__main__":
    main()
