"""A sweep worker: one process (pinned to one GPU when there are GPUs) taking trials until the launch's
shared ticket count runs out. `worker_main` is the `multiprocessing` (spawn) target and also runs
in-process for `workers=1`. Keep this module's imports light: the CUDA device must be chosen (through
CUDA_VISIBLE_DEVICES) before anything initializes CUDA."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

MAX_CONSECUTIVE_FAILURES = 5


class Tickets:
    """How many trials this launch still has to start, shared by its workers."""

    def __init__(self, n: int, mp_context=None):
        if mp_context is not None:
            self._v = mp_context.Value("i", int(n))
            self._lock = None
        else:
            self._v, self._lock = None, threading.Lock()
            self._n = int(n)

    def take(self) -> bool:
        if self._v is not None:
            with self._v.get_lock():
                if self._v.value <= 0:
                    return False
                self._v.value -= 1
                return True
        with self._lock:
            if self._n <= 0:
                return False
            self._n -= 1
            return True

    def give_back(self) -> None:
        """A trial taken but to run again later (`fewer_on_this_gpu`): its ticket back for whoever runs it."""
        if self._v is not None:
            with self._v.get_lock():
                self._v.value += 1
            return
        with self._lock:
            self._n += 1

    @property
    def left(self) -> int:
        return self._v.value if self._v is not None else self._n

    def __getstate__(self):
        return {"_v": self._v, "_n": getattr(self, "_n", 0)}

    def __setstate__(self, st):
        self._v, self._n, self._lock = st["_v"], st["_n"], threading.Lock()


@dataclass
class WorkerSpec:
    index: int
    sweep: Any  # sweeps.space.SweepDef
    base_overrides: list[str]
    storage: str
    study_name: str
    out_dir: str
    lease_dir: str
    parent_run_id: str | None
    tracking_uri: str | None  # None: no MLflow bookkeeping (tracking disabled)
    experiment: str
    seed_offset: int = 0
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES for this worker
    threads: int | None = None  # torch CPU threads
    log_file: str | None = None  # redirect this process's stdout/stderr (spawned workers)
    deadline: float | None = None  # time.time() after which no new trial starts


def _redirect(log_file: str):
    """Send fd 1/2 (trainer progress, warnings, transformers) to the log; return a console stream for the
    one-line trial summaries."""
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


class _NoTracebackForStops(logging.Filter):
    """Optuna logs a trial cut by a signal (the trainer's RunInterrupted, a KeyboardInterrupt) as failed, with its
    traceback; the stop is no fault: its one line stays, the traceback goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_stopped_trials() -> None:
    """Installs `_NoTracebackForStops` on the logger of Optuna's trial loop (once)."""
    trial_log = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, _NoTracebackForStops) for f in trial_log.filters):
        trial_log.addFilter(_NoTracebackForStops())


def worker_main(spec: WorkerSpec, tickets: Tickets, in_process: bool = False) -> int:
    """Returns the number of trials this worker ran."""
    if not in_process and spec.gpu is not None:  # own process: pin it before anything initializes CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.gpu
    console = _redirect(spec.log_file) if (spec.log_file and not in_process) else sys.stderr

    import optuna

    from sweeps.support import SweepTracker
    from sweeps.objective import TrialContext, TrialEnd, run_trial
    from sweeps.space import build_pruner, build_sampler
    from sweeps.storage import Lease, make_storage, reap_stale

    quiet_stopped_trials()
    if not in_process:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if spec.threads:
            import torch
            torch.set_num_threads(spec.threads)
    study = optuna.load_study(study_name=spec.study_name, storage=make_storage(spec.storage),
                              sampler=build_sampler(spec.sweep.sampler, spec.seed_offset),
                              pruner=build_pruner(spec.sweep.pruner))
    tracker = SweepTracker(spec.tracking_uri, spec.experiment) if spec.tracking_uri else None
    lease = Lease(spec.lease_dir, gpu=spec.gpu)
    ctx = TrialContext(sweep=spec.sweep, base_overrides=spec.base_overrides, out_dir=spec.out_dir,
                       study_name=spec.study_name, parent_run_id=spec.parent_run_id,
                       lease_attrs=lease.attrs(), worker=spec.index)
    end = TrialEnd(tracker, spec.parent_run_id, spec.index, console)
    ran = 0
    try:
        while True:
            if spec.deadline is not None and time.time() >= spec.deadline:
                break
            if not tickets.take():
                break
            reap_stale(study, tracker)
            study.optimize(lambda trial: run_trial(trial, ctx, tracker), n_trials=1, catch=(Exception,),
                           callbacks=[end], gc_after_trial=True)
            ran += 1
            if fewer_on_this_gpu(study, end.last, spec, lease, tickets, console):
                break
            if end.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                print(f"[sweep {spec.study_name} w{spec.index}] {end.consecutive_failures} trials failed in a "
                      f"row; this worker stops (see {spec.log_file or 'the log above'})", file=console, flush=True)
                break
    finally:
        lease.release()
    return ran


def fewer_on_this_gpu(study, t, spec: WorkerSpec, lease, tickets: Tickets, console=sys.stderr) -> bool:
    """Whether this worker stops because its trial `t` ran out of GPU memory beside other workers on the GPU: the
    trial's params go back into the study (the same trial, run again by a worker that stays) with its ticket, and
    one worker fewer shares the GPU. Alone there (or the last to stay), the trial stays failed: it does not fit.
    The campaign's cells back off the same way (sweeps.launcher.LocalLauncher)."""
    from sweeps.objective import ATTR_ERROR
    from sweeps.support import is_gpu_oom
    if t is None or t.state.name != "FAIL" or spec.gpu is None or not is_gpu_oom(str(t.user_attrs.get(ATTR_ERROR, ""))):
        return False
    staying = lease.leave_gpu_if_others_stay()
    if staying < 1:
        return False
    study.enqueue_trial(t.params, user_attrs={"sweep.oom_retry_of": t.number}, skip_if_exists=False)
    tickets.give_back()
    print(f"[sweep {spec.study_name} w{spec.index}] trial {t.number} ran out of GPU {spec.gpu}'s memory beside "
          f"{staying} other worker(s) that stay: its params are queued again and this worker stops, so fewer share "
          f"the GPU", file=console, flush=True)
    return True


@dataclass
class WorkerTask:
    """One worker as a launcher task (`sweeps.launcher`): a spawned process on the GPU the launcher placed it on.
    `tickets`: the Tickets this machine's workers share, or (a Slurm job) this job's own count of trials; a job
    first fails the trials of workers that died and enqueues the continuation of cut ones (a requeued job
    continues the trial its preemption cut, from its checkpoint)."""
    spec: WorkerSpec
    tickets: Any  # Tickets | int

    def __call__(self, gpu: str | None) -> int:
        import dataclasses
        import multiprocessing as mp

        from sweeps.launcher import watched
        ctx = mp.get_context("spawn")
        own_job = isinstance(self.tickets, int)
        if own_job:
            self._continue_cut_trials()
            self.tickets = Tickets(self.tickets, ctx)
        spec = dataclasses.replace(self.spec, gpu=self.spec.gpu if self.spec.gpu is not None else gpu)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if spec.gpu is not None:  # the child inherits the environment at spawn
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.gpu
        try:
            p = ctx.Process(target=worker_main, args=(spec, self.tickets), name=f"sweep-w{spec.index}")
            p.start()
        finally:
            if spec.gpu is not None:
                os.environ.pop("CUDA_VISIBLE_DEVICES") if saved is None else os.environ.update(
                    CUDA_VISIBLE_DEVICES=saved)
        self.pid = p.pid
        watched(p, p.join)
        return p.exitcode

    def requeued(self) -> "WorkerTask":
        """What a requeued job runs: the trials this one had left, and one for the continuation of the cut one."""
        return WorkerTask(self.spec, self.tickets.left + 1)

    def _continue_cut_trials(self) -> None:
        import optuna

        from sweeps.objective import continue_interrupted
        from sweeps.storage import make_storage, reap_stale
        study = optuna.load_study(study_name=self.spec.study_name, storage=make_storage(self.spec.storage))
        continue_interrupted(study, reap_stale(study))
