"""One trial: sampled overrides → composed run config → `train()` with a pruning evaluator → objective.

The trial's training run is the MLflow child of the study's parent run: it is created (tagged
`mlflow.parentRunId`, `optuna.study_name`, `optuna.trial_number`, `optuna.state=RUNNING`) before training
starts and the trainer logs into it (`dflash.app.run.train(..., run_id=…)`). When the trial ends, the
Optuna callback `TrialEnd` writes `optuna.state` (COMPLETE / PRUNED / FAIL), `optuna.pruned_step`,
`optuna.value`, sets the run status (FINISHED, a pruned trial too: its tag and Description say pruned; FAILED)
and refreshes the parent (best value, params, run, checkpoint; trial counts).

Names: a trial's run folder is `<out>/<study>/trial_00012-<loss>-<noise>-<buffer>-s<seed>` and its MLflow run
has the same name; its Description holds the `python -m experiments.run …` line that trains it again. The
parent's Description shows the current best trial with a link to its run; its `best.*` tags are the current
best trial's params only (a previous best's keys are removed).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.config import ConfigError, RunConfig
from dflash.run_dir import RunDir
from dflash.tracking.ui_view import ML_WORKFLOW
from sweeps.support import TAG_PRUNED_STEP, TAG_VALUE, EvalPruned, PruningEvaluator, SweepTracker
from sweeps.space import SweepDef, SweepError, merge_overrides, suggest

ATTR_RUN_ID, ATTR_RUN_DIR, ATTR_CKPT, ATTR_ERROR = "mlflow.run_id", "sweep.run_dir", "sweep.checkpoint", "sweep.error"
# A trial cut by a signal / job limit is continued by a new trial that resumes its run dir (`continue_interrupted`).
# Optuna cannot add attrs to a finished trial, so the link lives on the continuation (`sweep.continues`).
ATTR_INTERRUPTED = "sweep.interrupted"  # the trial stopped on SIGTERM / SIGINT / KeyboardInterrupt
ATTR_RESUME_DIR = "sweep.resume_dir"  # a continuation: the run dir it resumes
ATTR_CONTINUES = "sweep.continues"  # a continuation: the trial number it continues
ATTR_RESUME_STEP = "sweep.resume_step"  # a continuation: the checkpoint step it started from
# A trial trained again from scratch with another trial's params (`rerun=N`): the number it repeats. What the gate
# reads when the best trial's own drafter went with the machine that trained it (the recipe sweep's trial 30)
ATTR_RERUN_OF = "sweep.rerun_of"
STUDY_CONTINUED = "sweep.continued_as"  # the study's {old trial: continuing trial} map, for the dashboard
# every launch's start, naive local time as Optuna's trial starts (ISO): the sweep report measures from it what a job
# spends before its first trial starts (shared inputs, worker spawn)
STUDY_LAUNCH_STARTS = "sweep.launch_starts"


@dataclass
class TrialContext:
    sweep: SweepDef
    base_overrides: list[str]  # the sweep's fixed overrides merged with the command line's
    out_dir: str  # trial run dirs: <out_dir>/trial_00012
    study_name: str
    parent_run_id: str | None = None
    lease_attrs: dict[str, Any] = field(default_factory=dict)
    worker: int = 0


# --------------------------------------------------------------------------- config + evaluator


def compose_trial_config(overrides: list[str]) -> tuple[RunConfig, Any]:
    """-> (RunConfig, its EvalConfig). `eval.*` overrides compose like any other key."""
    from experiments.config import compose_config

    cfg = compose_config(overrides)
    return cfg, getattr(cfg, "eval", None)


def validate_eval(ecfg) -> None:
    if ecfg is None:
        return
    from dflash.evaluation import validate_eval_config
    try:
        validate_eval_config(ecfg)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def base_evaluator(ecfg, out_dir=None):
    """The evaluator the trainer would build itself (`dflash.evaluation.make_evaluator(cfg.eval,
    out_dir=<run dir>/eval)`), or None when eval is disabled."""
    if ecfg is None or not getattr(ecfg, "enabled", True):
        return None
    from dflash.evaluation import make_evaluator
    return make_evaluator(ecfg, out_dir=out_dir)


# --------------------------------------------------------------------------- the trial


def trial_description(ctx: TrialContext, number: int, overrides: list[str]) -> str:
    """The trial run's Description: the command that trains it again (without the pruner)."""
    cmd = shlex.join(["python", "-m", "experiments.run", *overrides])
    return (f"Trial {number} of sweep study `{ctx.study_name}` ({ctx.sweep.name}). Train it again:\n\n"
            f"```\n{cmd}\n```")


def _child_run(trial, ctx: TrialContext, tracker: SweepTracker | None, cfg: RunConfig, run_dir: Path,
               sampled: list[str], values: dict[str, Any], overrides: list[str]) -> str | None:
    """The trial's MLflow child run: a continuation reopens the run it continues (the trainer's resume reopens
    the same id), so the training curve stays one run; a new trial gets a new child."""
    if tracker is None or not ctx.parent_run_id or not cfg.tracking.enabled:
        return None
    continues = trial.user_attrs.get(ATTR_CONTINUES)
    run_id = trial.user_attrs.get(ATTR_RUN_ID) if continues is not None else None
    if run_id:
        tracker.retag_child(run_id, trial.number, {ATTR_CONTINUES: continues})
        return run_id
    from dflash.tracking.run_info import NOTE, SOURCE_NAME, SOURCE_TYPE
    tags = {"sweep.name": ctx.sweep.name, "sweep.overrides": " ".join(sampled),
            "optuna.params": json.dumps(values, default=str), SOURCE_NAME: "sweeps.launch",
            SOURCE_TYPE: "LOCAL", NOTE: trial_description(ctx, trial.number, overrides)}
    if continues is not None:
        tags[ATTR_CONTINUES] = continues
    if ATTR_RERUN_OF in trial.user_attrs:
        tags[ATTR_RERUN_OF] = trial.user_attrs[ATTR_RERUN_OF]
    run_id = tracker.create_child(ctx.parent_run_id, ctx.study_name, trial.number, run_name=run_dir.name, tags=tags)
    if run_id:
        trial.set_user_attr(ATTR_RUN_ID, run_id)
    return run_id


def run_trial(trial, ctx: TrialContext, tracker: SweepTracker | None) -> float:
    from dflash.app.run import run_label  # imported late: the launcher process never trains

    sampled, values = suggest(trial, ctx.sweep)  # a continuation's params are enqueued: the same as before
    overrides = merge_overrides(ctx.base_overrides, sampled)
    for k, v in {**ctx.lease_attrs, "sweep.worker": ctx.worker,
                 "sweep.gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                 "sweep.overrides": json.dumps(sampled)}.items():
        trial.set_user_attr(k, v)
    try:
        cfg, ecfg = compose_trial_config(overrides)
        resume_dir = trial.user_attrs.get(ATTR_RESUME_DIR)
        if resume_dir:  # same overrides, same folder: the trainer continues from its newest checkpoint
            run_dir = Path(resume_dir)
            cfg = dataclasses.replace(cfg, run_dir=str(run_dir), resume=str(run_dir))
        else:
            run_dir = Path(ctx.out_dir).resolve() / f"trial_{trial.number:05d}-{run_label(cfg)}"
            cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
        trial.set_user_attr(ATTR_RUN_DIR, str(run_dir))
        run_id = _child_run(trial, ctx, tracker, cfg, run_dir, sampled, values, overrides)
        evaluator = PruningEvaluator(trial, ctx.sweep.objective.metric, run_dir,
                                     base=base_evaluator(ecfg, out_dir=RunDir(run_dir).eval_dir))
        from dflash.app.run import train  # imported late: the launcher process never trains
        result = train(cfg, evaluator, run_id=run_id)
        if result.checkpoint is not None:
            trial.set_user_attr(ATTR_CKPT, str(Path(result.checkpoint).resolve()))
        metric = ctx.sweep.objective.metric
        if metric not in result.metrics:
            shown = ", ".join(sorted(k for k in result.metrics if "/task/" not in k)[:40])
            raise ConfigError(f"objective metric {metric!r} is not among the run's final metrics ({shown}); "
                              f"set the sweep's objective.metric (eval/* needs the evaluator enabled)")
        value = float(result.metrics[metric])
        if not math.isfinite(value):
            raise FloatingPointError(f"objective {metric}={value}")
        return value
    except EvalPruned:
        raise
    except BaseException as e:
        try:
            trial.set_user_attr(ATTR_ERROR, f"{type(e).__name__}: {e}"[:2000])
            if isinstance(e, KeyboardInterrupt):  # the trainer's RunInterrupted (SIGTERM / SIGINT) is one
                trial.set_user_attr(ATTR_INTERRUPTED, True)
        except Exception:  # noqa: BLE001
            pass
        raise


# --------------------------------------------------------------------------- continuations


def checkpoint_step(run_dir: str | None) -> int | None:
    """The newest checkpoint's step in `<run_dir>/checkpoints` (`step_NNNNNNNN.pt`); None when there is none."""
    return RunDir(run_dir).newest_checkpoint_step() if run_dir else None


def continued_map(trials) -> dict[int, int]:
    """{old trial number: the trial continuing it}, from the continuations' `sweep.continues`."""
    return {int(t.user_attrs[ATTR_CONTINUES]): t.number for t in trials if ATTR_CONTINUES in t.user_attrs}


def chains(trials) -> list[list]:
    """Each trial with the trials continuing it, in order: [[2, 6], [8, 10, 13], [5]] (by trial number)."""
    nxt = continued_map(trials)
    by_number = {t.number: t for t in trials}
    followers = set(nxt.values())
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        if t.number in followers:
            continue
        chain = [t]
        while chain[-1].number in nxt:
            chain.append(by_number[nxt[chain[-1].number]])
        out.append(chain)
    return out


def _was_cut(t, reaped) -> bool:
    """A FAIL trial stopped from outside rather than by its own error: reaped now (its worker is gone), marked
    interrupted by run_trial, or FAIL without an error attr (run_trial records every error it sees, so that
    one was reaped earlier: its worker died)."""
    ua = t.user_attrs
    return t.number in reaped or bool(ua.get(ATTR_INTERRUPTED)) or ATTR_ERROR not in ua


def continue_interrupted(study, reaped=()) -> dict[int, int]:
    """Enqueue a continuation of every cut FAIL trial whose run dir holds a checkpoint and that no trial continues
    yet: the same params, resuming that run dir (the samplers take enqueued trials first). A continuation that
    itself was cut is continued again only when its checkpoint moved on (a trial that cannot progress stops).
    Returns {old: new} for the trials enqueued now."""
    from optuna.trial import TrialState
    trials = study.get_trials(deepcopy=False)
    done = continued_map(trials)
    wanted: list[int] = []
    for t in trials:
        run_dir = t.user_attrs.get(ATTR_RUN_DIR)
        step = checkpoint_step(run_dir)
        if t.state != TrialState.FAIL or t.number in done or step is None or not _was_cut(t, reaped):
            continue
        if step <= int(t.user_attrs.get(ATTR_RESUME_STEP, -1)):
            continue
        attrs = {ATTR_RESUME_DIR: run_dir, ATTR_CONTINUES: t.number, ATTR_RESUME_STEP: step}
        if t.user_attrs.get(ATTR_RUN_ID):
            attrs[ATTR_RUN_ID] = t.user_attrs[ATTR_RUN_ID]
        study.enqueue_trial(dict(t.params), user_attrs=attrs, skip_if_exists=False)
        wanted.append(t.number)
    if not wanted:
        return {}
    now = continued_map(study.get_trials(deepcopy=False))
    made = {old: now[old] for old in wanted}
    shown = dict(study.user_attrs.get(STUDY_CONTINUED) or {})
    shown.update({str(old): new for old, new in made.items()})
    study.set_user_attr(STUDY_CONTINUED, shown)
    return made


def rerun_params(study, numbers: list[int]) -> dict[int, dict[str, Any]]:
    """{N: trial N's params} for `rerun=[N, ...]`, checked before the launch does anything: a number the study
    lacks, or one without params, is an error naming the ones that can be trained again."""
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    known = sorted(n for n, t in trials.items() if t.params)
    bad = [n for n in numbers if n not in known]
    if bad:
        raise SweepError(f"rerun: trial(s) {bad} of study {study.study_name!r} have no params to train again "
                         f"(trials with params: {known})")
    return {n: dict(trials[n].params) for n in numbers}


def enqueue_reruns(study, params: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Enqueue each trial of `params` (`rerun_params`) again with its params, from scratch (a new run dir and MLflow
    child; the samplers take enqueued trials first, so they count against the launch's `n_trials`). For a trial
    whose drafter is not on this machine: a fresh machine gets the committed store without weights, and only a
    checkpointed cut trial can continue. Returns {old: new}."""
    made: dict[int, int] = {}
    for n, values in params.items():
        study.enqueue_trial(values, user_attrs={ATTR_RERUN_OF: n}, skip_if_exists=False)
        made[n] = max(t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get(ATTR_RERUN_OF) == n)
    return made


def gate_trial(study) -> dict[str, Any] | None:
    """The complete trial whose drafter the promotion gate reads on this machine: the best trial when its `final/`
    is here, else the best complete rerun of it (`rerun=N`, or a continuation of one) whose `final/` is: the best
    settings trained again, its own value beside the best's. None when neither is here (the caller says so)."""
    from optuna.trial import TrialState
    trials = study.get_trials(deepcopy=False)
    if not any(t.state == TrialState.COMPLETE for t in trials):
        return None
    best = study.best_trial

    def has_drafter(t) -> bool:
        run_dir = t.user_attrs.get(ATTR_RUN_DIR)
        return bool(run_dir) and RunDir(run_dir).has_final()

    reruns = [c[-1] for c in chains(trials) if c[0].user_attrs.get(ATTR_RERUN_OF) == best.number
              and c[-1].state == TrialState.COMPLETE and has_drafter(c[-1])]
    sign = 1 if study.direction.name == "MAXIMIZE" else -1
    pick = best if has_drafter(best) else max(reruns, key=lambda t: sign * t.value, default=None)
    if pick is None:
        return None
    return {"number": pick.number, "value": pick.value, "params": dict(pick.params),
            "run_dir": pick.user_attrs.get(ATTR_RUN_DIR), "best": best.number, "best_value": best.value}


# --------------------------------------------------------------------------- bookkeeping


def study_summary(study) -> dict[str, Any]:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    continued = continued_map(trials)  # a cut trial and its continuation are one trial: counted once, not a failure
    counts = {s.name: 0 for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)}
    for t in trials:
        if t.number not in continued:
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
    out: dict[str, Any] = {"n_trials": len(trials) - len(continued), "n_continued": len(continued),
                           "states": counts, "best": None}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        b = study.best_trial
        out["best"] = {"number": b.number, "value": b.value, "params": dict(b.params),
                       "run_id": b.user_attrs.get(ATTR_RUN_ID), "run_dir": b.user_attrs.get(ATTR_RUN_DIR),
                       "checkpoint": b.user_attrs.get(ATTR_CKPT), "host": b.user_attrs.get("sweep.host")}
    return out


TIE_LEVEL = 0.95  # the paired interval that calls two trials a tie


def trial_table(run_dir: str | None, metric: str) -> dict | None:
    """A trial's per-prompt task table for `metric` from its run folder (`eval/served/tasks.json` for the objective
    `eval/tau_served`, `eval/<suite>/served/tasks.json` for a suite's; legacy runs' `eval/tasks.json` for
    `eval/tau_vanilla`: `pairing.table_file`); None when absent."""
    from dflash.evaluation.pairing import metric_columns, table_file
    cols = metric_columns(metric)
    if cols is None or not run_dir:
        return None
    f = RunDir(run_dir).eval_dir / table_file(cols.artifact)
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None


def best_and_ties(study, best: dict[str, Any], metric: str, level: float = TIE_LEVEL) -> dict[str, Any]:
    """The best trial's pooled CI and the complete trials tied with it: their paired Δ interval against the best,
    prompt for prompt on the same ground truth, contains 0. `checked`: False when the best trial has no task
    table (ties then unknown); trials without a comparable table are listed in `unpaired`."""
    from optuna.trial import TrialState

    from dflash.evaluation.pairing import NotPaired, metric_columns, paired_delta, task_rows
    from dflash.evaluation.stats import hierarchical_ci
    out: dict[str, Any] = {"checked": False, "ci": None, "tied": [], "unpaired": []}
    table = trial_table(best.get("run_dir"), metric)
    cols = metric_columns(metric)
    if table is None or cols is None:
        return out
    try:
        rows = task_rows(table, cols.sum_col, cols.count_col)
    except NotPaired:
        return out
    iv = hierarchical_ci(rows, None, level)
    out.update(checked=True, ci=[iv.low, iv.high])
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.number == best["number"]:
            continue
        other = trial_table(t.user_attrs.get(ATTR_RUN_DIR), metric)
        try:
            if other is None:
                raise NotPaired("no task table")
            d = paired_delta(table, other, (cols.sum_col, cols.count_col), (cols.sum_col, cols.count_col), level)
        except NotPaired:
            out["unpaired"].append(t.number)
            continue
        if d.low <= 0.0 <= d.high:
            out["tied"].append({"number": t.number, "value": t.value, "delta": [d.value, d.low, d.high]})
    return out


def _best_line(b: dict[str, Any], metric: str, link: str) -> list[str]:
    """The Description's verdict: the best trial with its CI, and the trials tied with it."""
    ties = b.get("ties") or {}
    ci = ties.get("ci")
    value = f"{metric} = {b['value']:.4f}" + (f" [{100 * TIE_LEVEL:g}% CI {ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")
    tied = ties.get("tied") or []
    if tied:
        names = ", ".join(f"{t['number']} ({t['value']:.4f}, Δ {t['delta'][0]:+.4f} [{t['delta'][1]:+.4f}, "
                          f"{t['delta'][2]:+.4f}])" for t in tied)
        head = (f"**Best: trial {b['number']}, tied with trial(s) {names}** (paired Δ interval contains 0: no "
                f"trial is ahead of these), {value}, run {link}")
    else:
        head = f"**Best: trial {b['number']}**, {value}, run {link}"
        head += " (no other complete trial is tied with it)" if ties.get("checked") else \
            " (ties not checked: the trial has no per-prompt task table)"
    if ties.get("unpaired"):
        head += f"; not comparable prompt for prompt: trial(s) {', '.join(map(str, ties['unpaired']))}"
    return [head]


def parent_description(study_name: str, summary: dict[str, Any], metric: str, experiment_id: str | None,
                       storage: str = "") -> str:
    """The parent run's Description (markdown): the current best trial, a link to its run, the counts."""
    c, b = summary["states"], summary["best"]
    lines = [f"Sweep study `{study_name}`: {summary['n_trials']} trials, {c['COMPLETE']} complete, "
             f"{c['PRUNED']} pruned, {c['FAIL']} failed, {c['RUNNING']} running"
             + (f", {summary['n_continued']} cut and continued." if summary.get("n_continued") else ".")]
    if b is None:
        lines.append("No complete trial yet.")
    else:
        run = Path(b["run_dir"]).name if b["run_dir"] else (b["run_id"] or "")
        link = f"[{run}](#/experiments/{experiment_id}/runs/{b['run_id']}?{ML_WORKFLOW})" \
            if b["run_id"] and experiment_id else f"`{run}`"
        params = ", ".join(f"{k}={v}" for k, v in b["params"].items())
        lines += [*_best_line(b, metric, link), f"params: {params}"]
        if b["run_dir"]:
            lines.append(f"promote: `python -m experiments.promote {b['run_dir']}`")
    if storage and "://" not in storage:
        lines.append(f"study: `optuna-dashboard {storage}`")
    return "\n\n".join(lines)


def update_parent(study, tracker: SweepTracker | None, parent_id: str | None,
                  finished=None) -> dict[str, Any]:
    """Refresh the parent run from the study (best trial, counts, Description); `finished`: a trial that just
    ended. The parent shows the current best trial only: `best.*` tags of an earlier best are deleted."""
    summary = study_summary(study)
    if tracker is None or not parent_id:
        return summary
    from dflash.tracking.run_info import NOTE
    current = tracker.tags_of(parent_id)
    metric = current.get("sweep.objective") or study.user_attrs.get("sweep.objective", "")
    if summary["best"] is not None and metric:
        summary["best"]["ties"] = best_and_ties(study, summary["best"], metric)
    c = summary["states"]
    n_done = c["COMPLETE"] + c["PRUNED"] + c["FAIL"]
    tags: dict[str, Any] = {"sweep.n_trials": summary["n_trials"], "sweep.n_complete": c["COMPLETE"],
                            "sweep.n_pruned": c["PRUNED"], "sweep.n_failed": c["FAIL"],
                            "sweep.n_running": c["RUNNING"], "sweep.n_continued": summary["n_continued"]}
    metrics: dict[str, float] = {"sweep/n_complete": c["COMPLETE"], "sweep/n_pruned": c["PRUNED"],
                                 "sweep/n_failed": c["FAIL"]}
    b = summary["best"]
    if b is not None:
        tags.update({"sweep.best_trial": b["number"], "sweep.best_value": b["value"],
                     "sweep.best_params": json.dumps(b["params"], default=str),
                     "sweep.best_run_id": b["run_id"] or "", "sweep.best_run_dir": b["run_dir"] or "",
                     "sweep.best_checkpoint": b["checkpoint"] or "", "sweep.best_host": b["host"] or ""})
        tags.update({f"best.{k}": v for k, v in b["params"].items()})
        tags["sweep.best_run_name"] = Path(b["run_dir"]).name if b["run_dir"] else ""
        ties = b.get("ties") or {}
        tags["sweep.tied_with_best"] = ",".join(str(t["number"]) for t in ties.get("tied", [])) \
            if ties.get("checked") else "not checked"
        if ties.get("ci"):
            tags["sweep.best_ci"] = json.dumps([round(x, 6) for x in ties["ci"]])
        metrics["sweep/best_value"] = b["value"]
    tags[NOTE] = parent_description(study.study_name, summary, metric or "objective",
                                    tracker.experiment_id, current.get("optuna.storage", ""))
    tracker.delete_tags(parent_id, [k for k in current if k.startswith("best.") and k not in tags])
    tracker.update_parent(parent_id, tags, metrics, step=n_done)
    if finished is not None and finished.state.name == "COMPLETE":
        tracker.update_parent(parent_id, {}, {"sweep/trial_value": finished.value}, step=finished.number)
    return summary


def reconcile_children(study, tracker: SweepTracker | None, parent_id: str | None) -> int:
    """Make every child run's `optuna.state` (and status) agree with its finished trial; returns fixes."""
    if tracker is None or not parent_id:
        return 0
    from sweeps.support import TAG_STATE
    runs = {r.info.run_id: r for r in tracker.children(parent_id)}
    trials = study.get_trials(deepcopy=False)
    continued = continued_map(trials)  # their child run is their continuation's: its state is the one shown
    fixed = 0
    for t in trials:
        rid = t.user_attrs.get(ATTR_RUN_ID)
        if not rid or rid not in runs or not t.state.is_finished() or t.number in continued:
            continue
        r = runs[rid]
        want_status = child_status(t)
        if r.data.tags.get(TAG_STATE) != t.state.name or r.info.status != want_status:
            tracker.finish_child(rid, t.state.name, _outcome_tags(t), t.user_attrs.get(ATTR_RUN_DIR), want_status)
            fixed += 1
    return fixed


def child_status(t) -> str:
    """The MLflow status of a finished trial's child run: KILLED for a trial a signal cut (Optuna can only call
    it FAIL; the trainer closed its run KILLED and a later launch continues it), else `RUN_STATUS`'s."""
    from sweeps.support import RUN_STATUS
    if t.state.name == "FAIL" and t.user_attrs.get(ATTR_INTERRUPTED):
        return "KILLED"
    return RUN_STATUS[t.state.name]


def _outcome_tags(t) -> dict[str, Any]:
    tags: dict[str, Any] = {}
    if t.state.name == "PRUNED" and t.last_step is not None:
        tags[TAG_PRUNED_STEP] = t.last_step
    if t.state.name == "COMPLETE" and t.value is not None:
        tags[TAG_VALUE] = t.value
    if t.state.name == "FAIL":
        tags["optuna.fail_reason"] = t.user_attrs.get(ATTR_ERROR, "")[:1000]
    return tags


class TrialEnd:
    """Optuna callback run in the worker after each trial is told."""

    def __init__(self, tracker: SweepTracker | None, parent_id: str | None, worker: int, console=None):
        self.tracker, self.parent_id, self.worker = tracker, parent_id, worker
        self.console = console or sys.stderr
        self.consecutive_failures = 0
        self.last = None  # the trial this worker told last

    def __call__(self, study, t) -> None:
        self.last = t
        self.consecutive_failures = self.consecutive_failures + 1 if t.state.name == "FAIL" else 0
        try:
            self._report(study, t)
        except Exception as e:  # noqa: BLE001 - bookkeeping must not kill the worker
            print(f"[sweep {study.study_name} w{self.worker}] trial {t.number} {t.state.name}; bookkeeping "
                  f"failed: {type(e).__name__}: {e}", file=self.console, flush=True)

    def _report(self, study, t) -> None:
        rid = t.user_attrs.get(ATTR_RUN_ID)
        if self.tracker is not None and rid:
            self.tracker.finish_child(rid, t.state.name, _outcome_tags(t), t.user_attrs.get(ATTR_RUN_DIR),
                                      child_status(t))
        summary = update_parent(study, self.tracker, self.parent_id, finished=t)
        if t.state.name == "COMPLETE" and t.value is not None:
            what = f"value={t.value:.6g}"
        elif t.state.name == "PRUNED":
            what = f"pruned at step {t.last_step}"
        else:
            what = str(t.user_attrs.get(ATTR_ERROR, "failed"))[:300]
        best = summary["best"]
        tail = f" | best #{best['number']} {best['value']:.6g}" if best else ""
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"pid {os.getpid()} @{socket.gethostname()}" + (f" gpu {gpu}" if gpu else "")
        print(f"[sweep {study.study_name} w{self.worker} {where}] trial "
              f"{t.number} {t.state.name} {what} {json.dumps(t.params, default=str)}{tail}",
              file=self.console, flush=True)
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
