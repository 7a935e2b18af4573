"""`python -m sweeps.launch <sweep> report [out=sweeps_out] [study=...] [storage=...]`: a sweep's trials as one
markdown table, from what the sweep wrote: the study's storage, the trials' run folders (`<out>/<study>/`) and the
MLflow store (`<out>/mlflow.db` when the one the study recorded is not on this machine). A committed store
(`benchmarks/sweeps/sweeps_out.tar.xz`) reprints on the CPU what the GPU measured.

One row per trial as the study counts it: a trial cut by a job's limit and continued is one row under its last
number (`6 ← 2`); a trial trained again from scratch with another's params (`rerun=N`) says so (`33 (rerun of
30)`). Per row: its state (a cut trial: the step it stopped at, the seconds its remaining steps take
at its last logged rate, and, where its checkpoint is on this machine, what the job continuing it needs in all with
the costs this study measured for starting it and for the final eval: what that job must leave room for; without
its checkpoint here it cannot continue, and the row says so), the searched params,
the steps and consumed tokens it trained, the objective at every in-training eval (its consumed-token milestones,
`eval/subset/...`), the final τ with its 95% CI pooled over the prompts (an objective that is no τ, e.g.
`train/loss`: the study's value, a pruned trial's last report with its step), the paired Δτ against the best trial
(prompt for prompt on the same ground truth; an interval holding 0 is a tie), the same Δ on the least-degenerate
rows alone (`dflash.evaluation.pairing.least_degenerate_tasks`: a ranking should hold where the ground truth does not
repeat itself), DDTree τ at the largest node budget,
prompt lookup's τ on the same ground truth, and the wall seconds of its jobs. Under the table: the parent run, the
ground truth, and every promotion-gate decision (`experiments.promote`) recorded on the study's runs.
"""
from __future__ import annotations

import datetime
import statistics
from pathlib import Path
from typing import Any

from dflash.evaluation.pairing import (NotPaired, ground_truth_of, least_degenerate_delta, metric_columns, paired_delta,
                                      task_rows)
from dflash.evaluation.stats import hierarchical_ci
from dflash.serving.promotion import DECISION_TAG, REASON_TAG, VERSION_TAG
from sweeps.campaign_report import task_methods
from sweeps.learning_curves import eval_curve, read_metrics
from sweeps.objective import (ATTR_CONTINUES, ATTR_ERROR, ATTR_RERUN_OF, ATTR_RUN_DIR, ATTR_RUN_ID,
                              STUDY_LAUNCH_STARTS, TIE_LEVEL, chains, trial_table)

PROMOTION_TAGS = (DECISION_TAG, REASON_TAG, VERSION_TAG)  # dflash/serving/promotion.py's names


def run_folder(trial, out_dir: Path) -> Path | None:
    """The trial's run folder: where it ran, else the folder of that name under `out_dir` (an extracted store)."""
    recorded = trial.user_attrs.get(ATTR_RUN_DIR)
    if not recorded:
        return None
    here = Path(recorded)
    return here if here.is_dir() else out_dir / here.name


def _state(chain) -> str:
    last = chain[-1]
    if last.state.name != "FAIL":
        return last.state.name
    err = str(last.user_attrs.get(ATTR_ERROR, ""))
    if "after step" in err:  # RunInterrupted: "stopped by SIGTERM after step 2940; checkpoint ..."
        return f"cut at step {err.split('after step', 1)[1].split(';')[0].strip()}"
    return "FAIL" + (f" ({err[:60]})" if err else "")


def job_costs(study, out_dir: Path) -> dict[str, float | None]:
    """What a job continuing a cut trial spends besides training, as this study measured it (medians; None where it
    has nothing to measure): `launch`, from the job's start to its continuation's start (shared inputs, spawning
    the workers; launches that recorded their start); `resume`, from a continuation's start to its first logged
    step (the target, the checkpoint, the first steps); `final_eval`, a complete trial's `sys/final_eval_s`. A
    trial's start is Optuna's naive local time on the machine that ran it: it is placed with the UTC offset its launch
    recorded (launches before that record are read in this machine's time zone)."""
    launches = sorted(((s.replace(tzinfo=None), s.tzinfo) for s in map(  # (local wall time, offset), by wall time
        datetime.datetime.fromisoformat, study.user_attrs.get(STUDY_LAUNCH_STARTS, []))), key=lambda w: w[0])
    launch, resume, final = [], [], []
    for t in study.get_trials(deepcopy=False):
        folder = run_folder(t, out_dir)
        rows = read_metrics(folder) if folder else []
        if t.state.name == "COMPLETE":
            final += [r["sys/final_eval_s"] for r in rows if "sys/final_eval_s" in r]
        if ATTR_CONTINUES not in t.user_attrs or t.datetime_start is None:
            continue
        before = [(wall, tz) for wall, tz in launches if wall <= t.datetime_start]
        if before:
            launch.append((t.datetime_start - before[-1][0]).total_seconds())
        start = t.datetime_start.replace(tzinfo=before[-1][1] if before else None).timestamp()
        first = next((r["time"] for r in rows if "train/loss" in r and r.get("time", 0) > start), None)
        if first is not None:
            resume.append(first - start)
    return {k: statistics.median(v) if v else None for k, v in
            (("launch", launch), ("resume", resume), ("final_eval", final))}


def _to_go(folder: Path | None, rows: list[dict], steps: int, tokens: float | None, costs: dict) -> str:
    """A cut trial's steps still to train (from its newest checkpoint) at its last logged rate
    (`perf/consumed_tok_s`, with the GPU shared as it then was), and what the job continuing it needs in all with
    the study's measured `costs` (`job_costs`): what that job must leave room for. Without its checkpoint on this
    machine it cannot continue here, and says so."""
    if folder is None or not tokens or not steps or not (folder / "config.yaml").is_file():
        return ""
    from dflash.run_dir import RunDir
    run = RunDir(folder)
    max_steps = int(run.read_config().get("trainer", {}).get("max_steps", 0))
    rate = next((r["perf/consumed_tok_s"] for r in reversed(rows) if r.get("perf/consumed_tok_s")), None)
    if max_steps <= steps or not rate:
        return ""
    ckpt = run.newest_checkpoint_step()
    train_s = (max_steps - (ckpt or steps)) * tokens / steps / rate
    training = f"~{train_s:.0f} s of training at {rate / 1e3:.0f} K tok/s"
    if ckpt is None:
        return f" of {max_steps:,} ({training}; no checkpoint on this machine: it cannot continue here)"

    def cost(key: str, label: str) -> tuple[float, str]:
        s = costs.get(key)
        return (0.0, f"{label}: not measured") if s is None else (s, f"~{s:.0f} s {label}")
    parts = [cost("launch", "to start it"), cost("resume", "to its first step"), (train_s, training),
             cost("final_eval", "final eval")]
    total = sum(s for s, _ in parts)
    return f" of {max_steps:,} (the next job needs ~{total:.0f} s: {', '.join(said for _, said in parts)})"


def _seconds(chain) -> float | None:
    if any(t.datetime_start is None or t.datetime_complete is None for t in chain):
        return None
    return sum((t.datetime_complete - t.datetime_start).total_seconds() for t in chain)


def _pooled(table: dict, sum_col: str, count_col: str) -> str:
    try:
        rows = task_rows(table, sum_col, count_col)
    except NotPaired:
        return ""
    iv = hierarchical_ci(rows, None, TIE_LEVEL)
    return f"{iv.value:.3f} [{iv.low:.3f}, {iv.high:.3f}]"


def _study_value(trial) -> str:
    """A trial's objective as the study holds it: a complete trial's value; a pruned one's last report to the pruner
    (the figure it was pruned on) with its step."""
    if trial.state.name == "COMPLETE" and trial.value is not None:
        return f"{trial.value:.4g}"
    if trial.state.name == "PRUNED" and trial.intermediate_values:
        step = max(trial.intermediate_values)
        return f"{trial.intermediate_values[step]:.4g} at step {step}"
    return ""


def trial_row(chain, out_dir: Path, objective: str, best_table: dict | None, costs: dict) -> dict[str, Any]:
    """What the table shows of one trial (module doc), as strings and numbers; `best_table`: the best trial's task
    table to pair with (None for the best trial itself); `costs`: `job_costs` for a cut trial's estimate."""
    last = chain[-1]
    folder = run_folder(last, out_dir)
    rows = read_metrics(folder) if folder else []
    curve = eval_curve([r for r in rows if objective not in r], objective)  # the final eval logs `objective`
    steps = max((r["step"] for r in rows if "step" in r), default=0)
    table = trial_table(str(folder) if folder else None, objective)  # the objective suite's task table
    tokens = next((r["data/consumed_tokens"] for r in reversed(rows) if "data/consumed_tokens" in r), None)
    state = _state(chain)
    if state.startswith("cut") or state == "RUNNING":
        state += _to_go(folder, rows, steps, tokens, costs)
    again = chain[0].user_attrs.get(ATTR_RERUN_OF)  # trained again from scratch with that trial's params
    label = " ← ".join(str(t.number) for t in reversed(chain)) + (f" (rerun of {again})" if again is not None else "")
    row: dict[str, Any] = {"trial": label, "state": state,
                           "params": dict(last.params), "steps": steps, "tokens": tokens, "curve": curve,
                           "value": last.value, "seconds": _seconds(chain), "run_id": last.user_attrs.get(ATTR_RUN_ID),
                           "ground_truth": ground_truth_of(table) if table else None}
    cols = metric_columns(objective)
    if cols is None:  # a training metric (cpu_smoke's train/loss): no task table to pool, the study's own figure
        row["ci"] = _study_value(last)
        return row
    if table is None:
        return row
    row["ci"] = _pooled(table, cols.sum_col, cols.count_col)
    methods = task_methods(table)
    trees = [m for m in methods if m[0].startswith("tree ")]
    if trees:
        row["tree"] = (trees[-1][0], _pooled(table, trees[-1][1], trees[-1][2]))
    plookup = [m for m in methods if m[0] == "prompt-lookup"]
    row["prompt_lookup"] = _pooled(table, plookup[0][1], plookup[0][2]) if plookup else ""
    if best_table is not None:
        try:
            d = paired_delta(table, best_table, (cols.sum_col, cols.count_col), (cols.sum_col, cols.count_col),
                             TIE_LEVEL)
            row["delta"] = f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]" + (" tie" if d.low <= 0 <= d.high else "")
        except NotPaired as e:
            row["delta"] = f"not paired ({e})"
            return row
        ld = least_degenerate_delta(table, best_table, (cols.sum_col, cols.count_col), (cols.sum_col, cols.count_col),
                                    TIE_LEVEL)  # paired above: one ground truth, so the same rows of both
        if ld is not None:
            d = ld.delta
            row["least_degenerate"] = {"rows": ld.rows, "delta": d,
                                       "text": f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
                                               + (" tie" if d.low <= 0 <= d.high else "")}
    return row


def _promotions(trials, tracking_uri: str | None) -> list[str]:
    """The gate's decisions on the runs of `trials` (each chain's last: a continued trial's run is its
    continuation's), from their `dflash.promotion.*` tags, one line each."""
    if not tracking_uri:
        return ["promotion: no MLflow store on this machine"]
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri)
    lines = []
    for t in trials:
        rid = t.user_attrs.get(ATTR_RUN_ID)
        if not rid:
            continue
        try:
            tags = client.get_run(rid).data.tags
        except Exception as e:  # noqa: BLE001 - a store without that run (copied in part): said, not fatal
            lines.append(f"- trial {t.number} (run `{rid}`): not in the MLflow store {tracking_uri} "
                         f"({type(e).__name__})")
            continue
        decision, reason, version = (tags.get(k) for k in PROMOTION_TAGS)
        if decision:
            lines.append(f"- trial {t.number} (run `{rid}`): **{decision}** as version {version}: {reason}")
    return lines or ["- no trial went through the promotion gate"]


def _tracking_uri(study, out_root: Path) -> str | None:
    recorded = study.user_attrs.get("mlflow.tracking_uri") or ""
    if recorded.startswith("sqlite:///") and Path(recorded.removeprefix("sqlite:///")).is_file():
        return recorded
    local = out_root / "mlflow.db"
    return f"sqlite:///{local}" if local.is_file() else (recorded or None)


def _tokens(n: float) -> str:
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} K" if n >= 1e3 else f"{n:.0f}"


def _fmt_params(params: dict, keys: list[str]) -> list[str]:
    return [f"{params[k]:.3g}" if isinstance(params.get(k), float) else str(params.get(k, "")) for k in keys]


def _study_rows(study, sweep, out_root: Path) -> dict[str, Any]:
    """What the report and the summary read of `study`: its objective, its trials as the study counts them (chains),
    the best chain (Optuna's best, by the study's own direction) and its task table, and one `trial_row` each."""
    # the objective the study ran under (a store keeps its meaning: studies before sampled evaluation optimized
    # eval/tau_vanilla, the old greedy protocol), else the definition's
    objective = study.user_attrs.get("sweep.objective") or sweep.objective.metric
    out_dir = out_root / study.study_name
    groups = chains(study.get_trials(deepcopy=False))
    complete = [c for c in groups if c[-1].state.name == "COMPLETE"]
    best_number = study.best_trial.number if complete else None
    best = next((c for c in complete if c[-1].number == best_number), None)
    best_folder = run_folder(best[-1], out_dir) if best else None
    best_table = trial_table(str(best_folder) if best_folder else None, objective)
    costs = job_costs(study, out_dir)
    rows = [trial_row(c, out_dir, objective, None if c is best else best_table, costs) for c in groups]
    return {"objective": objective, "groups": groups, "complete": complete, "best": best, "best_table": best_table,
            "rows": rows}


def render(study, sweep, out_root: Path) -> str:
    """The report (module doc) of `study`, run from `sweep`'s definition, its folders under `out_root`."""
    got = _study_rows(study, sweep, out_root)
    objective, groups, complete, best, rows = (got[k] for k in ("objective", "groups", "complete", "best", "rows"))
    keys = [p.key for p in sweep.space]
    head = ["trial", "state", *[k.split(".")[-1] for k in keys], "steps", "consumed tokens", "in-training evals",
            f"{objective} [95% CI]" if metric_columns(objective) else objective, "Δ vs best, paired",
            "Δ vs best, least-degenerate rows", "DDTree", "prompt lookup", "wall s"]
    # the verdict first (the best trial, its ties, how the trials ended), then every trial
    lines = [f"# Sweep `{study.study_name}` ({sweep.name}): {len(groups)} trials, {len(complete)} complete",
             "", *summary_lines(study, sweep, out_root, level=2), "## Every trial", "", f"Objective: {sweep.objective.direction} `{objective}`"
             + (" (the old protocol: greedy, fixed-length ground truth that loops; measured before sampled "
                "evaluation)" if objective == "eval/tau_vanilla" else "")
             + f". Fixed: `{' '.join(sweep.fixed)}`.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c, r in zip(groups, rows):
        curve = ", ".join(f"{_tokens(tok)}: {v:.3f}" for tok, v in r["curve"])
        tree = f"{r['tree'][1]} ({r['tree'][0]})" if r.get("tree") else ""
        delta = "best" if c is best else r.get("delta", "")
        clean = "best" if c is best else (r.get("least_degenerate") or {}).get("text", "")
        cells = [r["trial"], r["state"], *_fmt_params(r["params"], keys), f"{r['steps']:,}",
                 f"{r['tokens']:,.0f}" if r["tokens"] else "", curve, r.get("ci", ""), delta, clean, tree,
                 r.get("prompt_lookup", ""), f"{r['seconds']:.0f}" if r["seconds"] is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    truths = {r["ground_truth"] for r in rows if r["ground_truth"]}
    lines += ["", f"Ground truth: {', '.join(f'`{g}`' for g in sorted(truths)) or 'no task tables'}"
              + (" (differs between trials: the paired Δ is only within one)" if len(truths) > 1 else ""),
              f"MLflow parent run: `{study.user_attrs.get('mlflow.parent_run_id', 'none')}`", "",
              "Promotion gate:", *_promotions([c[-1] for c in groups], _tracking_uri(study, out_root))]
    return "\n".join(lines) + "\n"


def summary_lines(study, sweep, out_root: Path, level: int = 3) -> list[str]:
    """The sweep's answer for a results summary (`python -m sweeps.results_summary … sweep=NAME`): the best trial's
    settings and objective τ [95% CI], prompt lookup's on the same prompts with the paired Δ, the trials tied with it,
    and how the trials ended (a continued trial counted once, as the report counts it)."""
    from dflash.evaluation.pairing import NotPaired
    got = _study_rows(study, sweep, out_root)
    objective, groups, best, table = got["objective"], got["groups"], got["best"], got["best_table"]
    ends: dict[str, int] = {"complete": 0, "pruned": 0}  # said even when none: a sweep that pruned nothing says so
    for r in got["rows"]:
        state = r["state"]
        end = "cut by a job's limit" if state.startswith("cut") else state.split(" ")[0].lower()
        ends[end] = ends.get(end, 0) + 1
    suite = ((table or {}).get("info") or {}).get("suite_label", "?")
    legacy = " (the old protocol: greedy, fixed-length ground truth that loops)" if objective == "eval/tau_vanilla" \
        else ""
    lines = [f"{'#' * level} Results summary: sweep `{study.study_name}`", "",
             f"Objective: {sweep.objective.direction} `{objective}`{legacy} on suite `{suite}`; fixed "
             f"`{' '.join(sweep.fixed)}`; {TIE_LEVEL:.0%} prompt × sample bootstrap interval, Δ paired prompt for "
             f"prompt; a tie is a Δ "
             f"interval containing 0 (`python -m sweeps.launch {sweep.name} report` lists every trial).", ""]
    counts = ", ".join(f"{n} {end}" for end, n in ends.items())
    trials = f"{len(groups)} trials ({counts})"
    if best is None:
        return [*lines, f"- No complete trial: {trials}.", ""]
    row = got["rows"][groups.index(best)]
    keys = [p.key for p in sweep.space]
    params = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in zip(keys, _fmt_params(row["params"], keys)))
    again = best[0].user_attrs.get(ATTR_RERUN_OF)
    head = f"trial {best[-1].number}" + (f" (trained again from scratch with trial {again}'s settings)"
                                         if again is not None else "")
    tokens = f"; {row['tokens']:,.0f} consumed tokens" if row["tokens"] else ""
    parts = [f"- **Best: {head}** ({params}{tokens}): τ **{row.get('ci') or _study_value(best[-1])}**"]
    cols = metric_columns(objective)
    if table is not None and cols is not None and row.get("prompt_lookup"):
        try:
            d = paired_delta(table, table, (cols.sum_col, cols.count_col),
                             ("tau_sum_prompt_lookup", "rounds_prompt_lookup"), TIE_LEVEL)
            parts.append(f"prompt lookup {row['prompt_lookup']}, paired Δ {d.value:+.3f} [{d.low:+.3f}, "
                         f"{d.high:+.3f}]" + (" (below prompt lookup)" if d.high < 0 else ""))
        except NotPaired as e:
            parts.append(f"prompt lookup {row['prompt_lookup']} (not paired: {e})")
    tied = [f"trial {r['trial']} ({r['delta'].removesuffix(' tie')})" for r in got["rows"]
            if str(r.get("delta", "")).endswith(" tie")]
    parts.append("tied with " + ", ".join(tied) if tied else "no trial tied with it")
    parts += _least_degenerate_part(got["rows"], groups, best)
    return [*lines, "; ".join(parts) + ".", f"- {trials}.", ""]


def _least_degenerate_part(rows: list[dict], groups: list, best) -> list[str]:
    """Whether the best trial stays best on the least-degenerate prompt samples (the rows whose ground truth repeats
    the fewest 8-grams, `dflash.evaluation.pairing.least_degenerate_tasks`): the complete trials ahead of it there,
    each with its paired Δ; [] where no trial was paired there."""
    paired = [(r, r["least_degenerate"]) for c, r in zip(groups, rows)
              if c is not best and c[-1].state.name == "COMPLETE" and r.get("least_degenerate")]
    if not paired:
        return []
    where = f"on the {paired[0][1]['rows']} least-degenerate prompt samples"
    ahead = sorted((x for x in paired if x[1]["delta"].value > 0), key=lambda x: -x[1]["delta"].value)
    if not ahead:
        return [f"{where} no trial is ahead of it"]
    return [f"{where} " + ", ".join(f"trial {r['trial']} is ahead, {ld['text'].removesuffix(' tie')}"
                                    + (" (tie)" if ld["text"].endswith(" tie") else " (**better**)")
                                    for r, ld in ahead)]
