"""Launch (or resume) an Optuna sweep whose trials are short dflash training runs tracked in MLflow.

    python -m sweeps.launch <sweep name | path.yaml> [n_trials=8] [workers=2] [storage=...] [study=...]
                            [out=sweeps_out] [timeout=SECONDS] [gpus=0,1,...] [rerun=[N,...]] [sweep.KEY=VALUE ...]
                            [any Hydra override of the run config ...] [--check]

- `<sweep>`: a file in conf/sweep/ (loss_variants, noise_schedule, buffer_settings, cpu_smoke) or a path.
- `n_trials`: trials this launch adds to the study (default 8). Re-running the same command resumes the
  study (same storage + study name) and runs `n_trials` more.
- `workers`: worker processes on this machine (spawned; one per GPU, round-robin, when GPUs exist).
  `workers=1` runs in this process. With `launcher=slurm` (sweeps/launcher.py: `launcher.timeout_min=`,
  `launcher.partition=`, `launcher.gpus_per_job=`, ...), each worker is a Slurm job with its share of `n_trials`,
  submitted through submitit; a preempted job's trial is continued from its checkpoint when the job is requeued.
  Workers on several machines or jobs share a study through an RDB `storage=` (a journal file only on a
  filesystem they all see).
- `storage`: default the journal file `<out>/<study>.journal`; or an RDB URL (postgresql://…) to share the
  study between machines (each machine runs its own launch against the same URL).
- `study`: default the sweep's `name`.
- `out`: where trial run dirs (`<out>/<study>/trial_00012-<loss>-<noise>-<buffer>-s<seed>`), worker logs and
  the default journal go (look at a study with `optuna-dashboard <out>/<study>.journal`).
- `memory_check`: with trials on the CPU (no GPU), a worker's peak memory is estimated from the run config
  (`sweeps.memory`) before anything starts: `workers` is lowered to what this machine's available memory (or its
  cgroup limit) holds, with one warning, or the launch stops (exit 2) when not one worker fits.
  `memory_check=false` launches anyway.
- `rerun=[N, ...]`: train trials N, ... again from scratch with their params, before anything new is sampled (each
  counts against `n_trials`): for a trial whose drafter is gone (a GPU machine goes back with its run folders) when
  the promotion gate needs one. The rerun is a trial of its own, tagged `sweep.rerun_of` = N; the GPU job gates it
  when the best trial's own drafter is not on the machine (`sweeps.objective.gate_trial`).
- `sweep.KEY=VALUE`: edit the sweep definition for this launch (`sweep.sampler.seed=3`,
  `sweep.pruner.type=none`, `sweep.objective.metric=eval/tau_tree_64`).
- everything else `key=value` / `+group=option`: Hydra overrides of the run config, applied after the
  sweep's `fixed` (an override of the same key replaces the fixed one, e.g. `+target=qwen3_6_27b
  target.path=/models/...`). Searched keys cannot be overridden.
- `--check`: validate the sweep and compose every searched group option, then exit.
- `<sweep> report [out=...] [study=...] [storage=...]`: print the study's trials as one markdown table (state,
  params, budget, in-training evals, final τ with its CI, paired Δ against the best, DDTree, prompt lookup, wall
  time) and the promotion gate's decisions, from the store (`sweeps/sweep_report.py`); trains nothing.

MLflow: one parent run per study (experiment `tracking.experiment` of the composed config) holding the
sweep definition (`sweep.yaml`), sampler / pruner / objective, storage, and — updated as trials finish —
`sweep.best_value`, `sweep.best_params`, `sweep.best_run_id`, `sweep.best_checkpoint` (a drafter folder
for `python -m experiments.promote <sweep.best_run_dir>`). Each trial's training run is its child.

Shared inputs: every trial evaluates on the ground truth pinned in `<out>/<study>/truth` (`eval.truth_dir`, unless
given), so trials of launches on other machines pair; with `workers` > 1 the launch first makes what the trials
would each make at once (prompt pool, online shards, ground truth: `sweeps.shared_inputs`), recorded in
`<out>/<study>/write_ahead.json`.

Cut trials: at each launch, before the workers start, a FAIL trial that was stopped from outside (its worker
gone, or a SIGTERM / SIGINT: a job's time limit) and whose run dir holds a checkpoint is continued: a new trial
with the same params is enqueued (taken before anything is sampled; it counts against `n_trials`) and resumes
that run dir and its MLflow child run. Counts show it once (`n_continued`), not as a failure.

`main(argv)` returns a summary dict; exit status 0, 1 when a worker died (the study stays usable: its
trial is marked FAIL), 2 on invalid input.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing as mp
import os
import re
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from dflash.config import ConfigError
from dflash.overrides import apply_overrides, split_override
from sweeps.launcher import detect_gpus
from sweeps.space import SweepError

DEFAULT_OUT = "sweeps_out"
LAUNCH_KEYS = {"n_trials", "workers", "storage", "study", "out", "timeout", "gpus", "rerun", "memory_check"}

log = logging.getLogger("sweeps.launch")


@dataclasses.dataclass
class LaunchArgs:
    sweep: str
    n_trials: int = 8
    workers: int = 1
    storage: str = ""
    study: str = ""
    out: str = DEFAULT_OUT
    timeout: float | None = None
    gpus: list[str] | None = None
    rerun: list[int] = dataclasses.field(default_factory=list)
    memory_check: bool = True  # CPU trials: fewer workers, or exit 2, when their estimated memory does not fit
    sweep_overrides: list[str] = dataclasses.field(default_factory=list)
    overrides: list[str] = dataclasses.field(default_factory=list)
    check: bool = False
    launcher: Any = None  # sweeps.launcher.LauncherConfig: where the workers run (launcher=slurm: one job each)


def launch_help() -> str:
    """The docstring, the sweep files, the launcher's keys and the run config's groups (what a search space and
    the fixed overrides name)."""
    from experiments.config import CONF_DIR, help_text
    sweeps = sorted(p.stem for p in (CONF_DIR / "sweep").glob("*.yaml"))
    keys = {f.name: f.default if f.default is not dataclasses.MISSING else "[]"
            for f in dataclasses.fields(LaunchArgs) if f.name != "sweep"}
    return help_text(__doc__ + f"\nSweeps (conf/sweep/*.yaml): {', '.join(sweeps)}", run_keys=False,
                     extra={"": keys})


def parse_args(argv: list[str]) -> LaunchArgs:
    if not argv or argv[0] in ("-h", "--help"):
        print(launch_help())
        raise SystemExit(0 if argv else 2)
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    bad_flags = [a for a in argv if a.startswith("--")]
    if bad_flags:
        raise SweepError(f"unknown option(s) {bad_flags}; see python -m sweeps.launch --help")
    from sweeps.launcher import launcher_config
    launcher, rest = launcher_config(argv[1:])
    a = LaunchArgs(sweep=argv[0], check=check, launcher=launcher)
    ours = []
    for arg in rest:
        key, _ = split_override(arg, "argument")
        if key in LAUNCH_KEYS:
            ours.append(arg)
        elif key.startswith("sweep."):
            a.sweep_overrides.append(arg[len("sweep."):])
        else:
            a.overrides.append(arg)
    a = apply_overrides(a, ours, "argument")  # the one override parser (dflash/overrides.py): typed, named
    if a.n_trials < 0:
        raise SweepError(f"n_trials must be >= 0, got {a.n_trials}")
    if a.workers < 1:
        raise SweepError(f"workers must be >= 1, got {a.workers}")
    if len(a.rerun) > a.n_trials:
        raise SweepError(f"rerun={a.rerun}: {len(a.rerun)} trial(s) to train again, more than n_trials={a.n_trials} "
                         f"(a rerun is one of the launch's trials)")
    return a


CPU_STEPS_OK = 200  # the quick start's CPU run (minutes); a sweep's trials beyond this want a GPU
CPU_EVAL_PROMPTS_OK = 16  # prompts of a trial's final evaluation, beyond which it wants a GPU


def eval_suites_size(e) -> list[tuple[str, int, int]]:
    """(suite, prompts, new tokens per prompt) of a trial's final evaluation, read without building it (a
    generated suite's size is its config's; a file that cannot be read counts 0: the run names it later)."""
    from dflash.evaluation.prompts import load_suite
    out = []
    for name in [e.suite, *e.extra_suites]:
        if name == "heldout":
            out.append((name, e.heldout.num_prompts, e.heldout.max_new_tokens))
            continue
        try:
            out.append((name, len(load_suite(name)), e.max_new_tokens))
        except (OSError, ValueError):
            out.append((name, 0, e.max_new_tokens))
    return out


def warn_cpu_budget(args, sweep, cfg) -> bool:
    """Before a sweep whose trials would take hours on this machine's CPU: one warning with its budget and its
    evaluation's size, and the CPU example to run instead. True when it warned."""
    from dflash.devices import resolve_device
    if detect_gpus() or resolve_device(cfg.trainer.device).type != "cpu" or args.n_trials < 1:
        return False
    t, e = cfg.trainer, cfg.eval
    suites = eval_suites_size(e) if e.enabled else []
    if t.max_steps <= CPU_STEPS_OK and sum(n for _, n, _ in suites) <= CPU_EVAL_PROMPTS_OK:
        return False
    budget = f"{t.max_steps:,} steps of {t.sequences_per_step} sequences" + (
        f" (token budget {t.token_budget:,})" if t.token_budget else "")
    evals = ("an evaluation on " + " + ".join(f"{name} ({n} prompts x {k} tokens)" for name, n, k in suites)
             if suites else "no evaluation")
    print(f"[sweep {sweep.name}] WARNING: no GPU here, so {args.n_trials} trial(s) of {budget} each, with {evals}, "
          f"run on the CPU: expect hours per trial. The sweep is meant for a GPU; to check the machinery on a CPU "
          f"in minutes: python -m sweeps.launch cpu_smoke n_trials=2 workers=1", file=sys.stderr, flush=True)
    return True


def check_memory(args, sweep, cfg) -> None:
    """Trials on this machine's CPU: `args.workers` lowered to the workers whose estimated peak fits the available
    memory (one warning), or SweepError (exit 2) when not one fits (`sweeps.memory`)."""
    from dflash.devices import resolve_device
    if not args.memory_check or args.launcher.backend != "local" or args.n_trials < 1:
        return
    if (args.gpus if args.gpus is not None else detect_gpus()) or resolve_device(cfg.trainer.device).type != "cpu":
        return
    from sweeps import memory
    args.workers = memory.fit_workers(args.workers, memory.worker_peak(cfg), memory.available_bytes(), sweep.name)


def validate(sweep, base_overrides: list[str], out_dir: Path):
    """Compose the base config and one config per searched group option; check every searched key."""
    from dflash.config import to_dict
    from dflash.config import validate as validate_run
    from sweeps.objective import compose_trial_config, validate_eval
    from sweeps.space import check_against_config, merge_overrides

    probe = [f"run_dir={out_dir / '_probe'}"]
    cfg, ecfg = compose_trial_config(merge_overrides(base_overrides, probe))
    validate_run(cfg)
    validate_eval(ecfg)
    check_against_config(sweep, to_dict(cfg))
    if sweep.objective.metric.startswith("eval/") and (ecfg is None or not getattr(ecfg, "enabled", True)):
        raise SweepError(f"objective.metric={sweep.objective.metric} needs the evaluator, but eval is disabled or "
                         f"dflash.evaluation is unavailable")
    if sweep.pruner.type != "none" and not cfg.trainer.eval_every:
        log.warning("trainer.eval_every=0: no intermediate reports, so the %s pruner never prunes",
                    sweep.pruner.type)
    for p in sweep.space:
        if p.is_group:
            for opt in p.choices:
                try:
                    c, _ = compose_trial_config(merge_overrides(base_overrides, [p.override(opt)], probe))
                    validate_run(c)
                except ConfigError as e:
                    raise SweepError(f"space.{p.key}: option {opt!r} does not compose with the fixed "
                                     f"overrides: {e}") from e
    return cfg


def _parent_params(sweep, storage_desc: str) -> dict[str, Any]:
    p: dict[str, Any] = {"sweep.name": sweep.name, "objective.metric": sweep.objective.metric,
                         "objective.direction": sweep.objective.direction, "sampler.type": sweep.sampler.type,
                         "pruner.type": sweep.pruner.type, "storage": storage_desc}
    p.update({f"sampler.{k}": v for k, v in sweep.sampler.options.items()})
    p.update({f"pruner.{k}": v for k, v in sweep.pruner.options.items()})
    p.update({f"space.{q.key}": json.dumps(q.to_dict(), default=str) for q in sweep.space})
    return p


def _open_study(sweep, study_name: str, storage: str, storage_desc: str, started: datetime.datetime):
    """The Optuna study (created or resumed), checked against the sweep's direction, with this launch counted and
    its start (naive local time, like Optuna's trial starts) recorded; returns (study, trials before this launch,
    launch number)."""
    import optuna

    from sweeps.objective import STUDY_LAUNCH_STARTS
    from sweeps.storage import make_storage
    study = optuna.create_study(study_name=study_name, storage=make_storage(storage),
                                direction=sweep.objective.direction, load_if_exists=True)
    with warnings.catch_warnings():  # experimental in Optuna 3.2-5; names the axis in optuna-dashboard
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([sweep.objective.metric])  # not "Objective 0"
    if study.direction.name.lower() != sweep.objective.direction:
        raise SweepError(f"study {study_name!r} in {storage_desc} is {study.direction.name.lower()}; the sweep "
                         f"says objective.direction={sweep.objective.direction}")
    ran_for = study.user_attrs.get("sweep.objective")
    if ran_for and ran_for != sweep.objective.metric and study.trials:
        raise SweepError(f"study {study_name!r} in {storage_desc} ran with objective {ran_for}; the sweep now says "
                         f"{sweep.objective.metric}: one study's values cannot mix two metrics (eval/tau_vanilla is "
                         f"the old greedy protocol); start a new study (sweep.name=..., or another storage)")
    old_digest = study.user_attrs.get("sweep.digest")
    if old_digest and old_digest != sweep.digest():
        log.warning("study %s was started with a different sweep definition (%s, now %s); resuming anyway",
                    study_name, old_digest, sweep.digest())
    n_before = len(study.trials)
    launch_no = int(study.user_attrs.get("sweep.launches", 0)) + 1
    study.set_user_attr("sweep.launches", launch_no)
    study.set_user_attr(STUDY_LAUNCH_STARTS, [*study.user_attrs.get(STUDY_LAUNCH_STARTS, []), started.isoformat()])
    study.set_user_attr("sweep.name", sweep.name)
    study.set_user_attr("sweep.digest", sweep.digest())
    study.set_user_attr("sweep.objective", sweep.objective.metric)
    return study, n_before, launch_no


def _code_tags() -> dict[str, str]:
    """The code the sweep ran: MLflow's git commit and Source fields, and the short sha as the trials carry it."""
    from dflash.tracking.run_info import GIT_COMMIT, SOURCE_NAME, SOURCE_TYPE, git_sha
    full = git_sha(full=True)
    return {SOURCE_NAME: "sweeps.launch", SOURCE_TYPE: "LOCAL", "git_sha": git_sha(),
            **({GIT_COMMIT: full} if full != "unknown" else {})}


def _parent_run(tr, study, sweep, study_name: str, storage_desc: str, out_dir: Path, base_overrides: list[str],
                launch: dict[str, Any]):
    """The sweep's MLflow parent run (reused across launches on the same store): (tracker, parent run id), with
    the sweep definition and this launch's arguments logged to it."""
    from dflash.tracking.run_info import absolute_sqlite_uri
    from sweeps.storage import ensure_sqlite_dir
    from sweeps.support import SweepTracker
    tr = dataclasses.replace(tr, tracking_uri=absolute_sqlite_uri(tr.tracking_uri))  # as the trainer does
    ensure_sqlite_dir(tr.tracking_uri)
    tracker = SweepTracker(tr.tracking_uri, tr.experiment)
    prev = study.user_attrs.get("mlflow.parent_run_id")
    if prev and study.user_attrs.get("mlflow.tracking_uri") != tr.tracking_uri:
        prev = None  # another store: a new parent there
    tags = {"optuna.storage": storage_desc, "optuna.direction": sweep.objective.direction,
            "optuna.sampler": sweep.sampler.type, "optuna.pruner": sweep.pruner.type,
            "sweep.name": sweep.name, "sweep.objective": sweep.objective.metric,
            "sweep.definition_path": sweep.path, "sweep.launches": launch["launch"],
            "sweep.out_dir": str(out_dir), "sweep.fixed": " ".join(base_overrides)}
    tags.update(_code_tags())
    parent_id = tracker.ensure_parent(study_name, prev, tags, _parent_params(sweep, storage_desc))
    study.set_user_attr("mlflow.parent_run_id", parent_id)
    study.set_user_attr("mlflow.tracking_uri", tr.tracking_uri)
    study.set_user_attr("mlflow.experiment", tr.experiment)
    tracker.log_text(parent_id, sweep.to_yaml(), "sweep.yaml")
    tracker.log_text(parent_id, json.dumps(launch, indent=1), f"launches/launch_{launch['launch']:03d}.json")
    return tracker, parent_id, tr


def _worker_specs(args, sweep, base_overrides, storage, study_name, out_dir: Path, parent_id, tr, n_before: int,
                  launch_no: int):
    from sweeps.worker import WorkerSpec
    gpus = [] if args.launcher.backend == "slurm" else args.gpus if args.gpus is not None else detect_gpus()
    if gpus and args.workers > len(gpus):
        log.warning("%d workers share %d GPU(s) round-robin", args.workers, len(gpus))
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    deadline = time.time() + args.timeout if args.timeout else None
    specs = [WorkerSpec(index=i, sweep=sweep, base_overrides=base_overrides, storage=storage,
                        study_name=study_name, out_dir=str(out_dir), lease_dir=str(out_dir / "leases"),
                        parent_run_id=parent_id, tracking_uri=tr.tracking_uri if tr.enabled else None,
                        experiment=tr.experiment, seed_offset=1000 * i + 7919 * n_before,
                        gpu=gpus[i % len(gpus)] if gpus else None, threads=threads,
                        log_file=str(out_dir / "logs" / f"{stamp}-launch{launch_no}-w{i}.log"), deadline=deadline)
             for i in range(args.workers)]
    return specs, gpus


def study_location(args: LaunchArgs, sweep) -> tuple[str, Path, str]:
    """(study name, output root, storage) of a launch or report: the sweep's name unless `study=`, `out=` resolved,
    the journal `<out>/<study>.journal` unless `storage=`."""
    name = args.study or sweep.name
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise SweepError(f"study={name!r}: use letters, digits, '_', '-', '.'")
    out_root = Path(args.out).resolve()
    return name, out_root, args.storage or str(out_root / f"{name}.journal")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # the job's start, for the report's cost of a continuing job; with this machine's UTC offset, so a report read
    # in another time zone can place Optuna's naive local trial starts (sweeps/sweep_report.py, job_costs)
    started = datetime.datetime.now().astimezone()
    from sweeps.objective import (continue_interrupted, enqueue_reruns, reconcile_children, rerun_params,
                                  update_parent)
    from sweeps.shared_inputs import make_shared_inputs, with_truth_pin
    from sweeps.space import check_conflicts, load_sweep, merge_overrides
    from sweeps.storage import describe, reap_stale
    from sweeps.worker import Tickets, worker_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[1:2] == ["report"]:
        return report(parse_args(argv[:1] + argv[2:]))
    args = parse_args(argv)
    sweep = load_sweep(args.sweep, args.sweep_overrides)
    check_conflicts(sweep, args.overrides)
    base_overrides = merge_overrides(sweep.fixed, args.overrides)
    study_name, out_root, storage = study_location(args, sweep)
    out_dir = out_root / study_name
    base_overrides = with_truth_pin(base_overrides, out_dir / "truth")  # trials of every launch pair
    storage_desc = describe(storage)
    base_cfg = validate(sweep, base_overrides, out_dir)
    if args.check:
        print(f"sweep {sweep.name}: OK ({len(sweep.space)} parameters; objective "
              f"{sweep.objective.direction} {sweep.objective.metric}; overrides {base_overrides})")
        return {"check": "ok", "sweep": sweep.name}
    check_memory(args, sweep, base_cfg)  # this machine's memory: not a property of the sweep (--check skips it)

    study, n_before, launch_no = _open_study(sweep, study_name, storage, storage_desc, started)
    again = rerun_params(study, args.rerun)  # a bad rerun number stops the launch before its parent run exists
    tracker, parent_id, tr = None, None, base_cfg.tracking
    if tr.enabled:
        launch = {"argv": argv, "host": socket.gethostname(),
                  "launch": launch_no, "n_trials": args.n_trials, "workers": args.workers,
                  "storage": storage_desc, "overrides": base_overrides}
        tracker, parent_id, tr = _parent_run(tr, study, sweep, study_name, storage_desc, out_dir, base_overrides,
                                             launch)
    else:
        log.warning("tracking.enabled=false: no MLflow parent/child runs for this sweep")

    reaped = reap_stale(study, tracker)
    continued = continue_interrupted(study, reaped)  # before any worker: the enqueued ones are taken first
    reruns = enqueue_reruns(study, again)
    reconcile_children(study, tracker, parent_id)
    if reaped:
        print(f"[sweep {study_name}] marked stale trial(s) {reaped} FAIL (their worker is gone)", file=sys.stderr)
    if continued:
        print(f"[sweep {study_name}] continuing cut trial(s) from their checkpoints: "
              + ", ".join(f"#{old} as #{new}" for old, new in continued.items()), file=sys.stderr)
    if reruns:
        print(f"[sweep {study_name}] training again from scratch: "
              + ", ".join(f"#{old} as #{new}" for old, new in reruns.items()), file=sys.stderr)
    warn_cpu_budget(args, sweep, base_cfg)
    if args.workers > 1 and args.n_trials > 0:  # one process makes what the trials starting together would each make
        make_shared_inputs(base_cfg, record=out_dir / "write_ahead.json")
    specs, gpus = _worker_specs(args, sweep, base_overrides, storage, study_name, out_dir, parent_id, tr, n_before,
                                launch_no)
    print(f"[sweep {study_name}] storage {storage_desc} | {n_before} trials so far | +{args.n_trials} with "
          f"{args.workers} worker(s){' on GPUs ' + ','.join(gpus) if gpus else ' on CPU'} | mlflow parent "
          f"{parent_id} ({tr.tracking_uri if tr.enabled else 'off'})", file=sys.stderr, flush=True)

    lost: list[str] = []
    status = "FINISHED"
    try:
        if args.workers == 1 and args.launcher.backend == "local":
            worker_main(specs[0], Tickets(args.n_trials), in_process=True)
        else:
            lost = _run_workers(specs, args.n_trials, study, tracker, args.launcher, out_dir)
    except BaseException as e:  # the parent run never stays RUNNING: KILLED on a stop, FAILED otherwise
        status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
        raise
    finally:
        try:
            reap_stale(study, tracker)
            reconcile_children(study, tracker, parent_id)
            summary = update_parent(study, tracker, parent_id)
            if status == "FINISHED" and len(lost) >= args.workers > 1:  # every worker died: the launch failed
                status = "FAILED"
        except BaseException:
            status = "FAILED" if status == "FINISHED" else status
            raise
        finally:
            if tracker is not None and parent_id:
                tracker.update_parent(parent_id, {"sweep.lost_workers": len(lost)} if lost else {}, {}, 0)
                tracker.end(parent_id, status)
    summary.update(study=study_name, storage=storage_desc, parent_run_id=parent_id, n_before=n_before,
                   n_new=summary["n_trials"] + summary["n_continued"] - n_before, lost_workers=lost,
                   out_dir=str(out_dir), continued_now=continued)
    _print_summary(summary)
    return summary


def report(args: LaunchArgs) -> dict[str, Any]:
    """`<sweep> report`: the study's trials as one markdown table (sweeps/sweep_report.py), printed."""
    import optuna

    from sweeps.space import load_sweep
    from sweeps.storage import make_storage
    from sweeps.sweep_report import render
    sweep = load_sweep(args.sweep, args.sweep_overrides)
    name, out_root, storage = study_location(args, sweep)
    if "://" not in storage and not Path(storage).is_file():
        raise SweepError(f"no study storage {storage} (out={args.out}, study={name}): run the sweep there first, or "
                         f"unpack its store (recipe_reference's: python -m dflash.tracking.packed_store unpack "
                         f"benchmarks/sweeps/sweeps_out.tar.xz)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=make_storage(storage))
    text = render(study, sweep, out_root)
    print(text, end="", flush=True)
    return {"report": text, "study": name}


def _run_workers(specs, n_trials: int, study, tracker, launcher, out_dir: Path) -> list[str]:
    """The workers as launcher tasks (`sweeps.launcher`): on this machine, spawned processes sharing one ticket
    count, one GPU each while there are GPUs enough; with launcher=slurm, one job each with its share of the
    trials. A worker that exits abnormally has its trial(s) marked FAIL, the others go on."""
    from concurrent.futures import ThreadPoolExecutor

    from sweeps.launcher import make_launcher
    from sweeps.storage import reap_stale
    from sweeps.worker import Tickets, WorkerTask

    runner = make_launcher(launcher, out_dir / "submitit")
    shared = Tickets(n_trials, mp.get_context("spawn")) if launcher.backend == "local" else None
    shares = [n_trials // len(specs) + (i < n_trials % len(specs)) for i in range(len(specs))]
    lost: list[str] = []

    def one(i: int) -> None:
        spec = specs[i]
        task = WorkerTask(spec, shared if shared is not None else shares[i])
        rc = runner.run(task, f"{study.study_name}-w{i}")
        if rc != 0:
            lost.append(f"w{spec.index} pid {getattr(task, 'pid', '?')} exit {rc}")
            reaped = reap_stale(study, tracker)
            left = shared.left if shared is not None else "its job's"
            print(f"[sweep {study.study_name}] worker w{spec.index} exited with {rc}; its trial(s) {reaped} marked "
                  f"FAIL; {left} trial(s) left for the other workers (log: {spec.log_file})", file=sys.stderr,
                  flush=True)
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        list(pool.map(one, range(len(specs))))
    return lost


def _print_summary(s: dict[str, Any]) -> None:
    c = s["states"]
    lines = [f"study {s['study']} ({s['storage']}): {s['n_trials']} trials (+{s['n_new']}): "
             f"{c.get('COMPLETE', 0)} complete, {c.get('PRUNED', 0)} pruned, {c.get('FAIL', 0)} failed, "
             f"{c.get('RUNNING', 0)} running"
             + (f", {s['n_continued']} cut and continued (counted once)" if s.get("n_continued") else "")]
    b = s.get("best")
    if b:
        lines.append(f"best trial #{b['number']}: {b['value']:.6g} {json.dumps(b['params'], default=str)}")
        ties = b.get("ties") or {}
        if ties.get("tied"):
            lines.append("tied with it (paired Δ interval contains 0): trial(s) "
                         + ", ".join(f"#{t['number']} {t['value']:.6g}" for t in ties["tied"]))
        lines.append(f"best run: {b['run_id']} dir {b['run_dir']}\n  promote: python -m experiments.promote "
                     f"{b['run_dir']}")
    if s.get("parent_run_id"):
        lines.append(f"mlflow parent run: {s['parent_run_id']}")
    if s.get("storage") and "://" not in s["storage"]:
        lines.append(f"study dashboard: optuna-dashboard {s['storage']}")
    if s.get("lost_workers"):
        lines.append(f"lost workers: {', '.join(s['lost_workers'])}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(lambda: sys.exit(1 if main().get("lost_workers") else 0))
