"""One training run, composed: `train(cfg)` is what `experiments/run.py`, sweeps, tests and notebooks call.

`TrainingRun(cfg)` checks the whole config before any work (bad input: ConfigError, nothing written), reads a
resume's checkpoint before anything in its folder changes, makes the run folder, loads the target, resolves
every "auto" setting once (dflash/app/auto.py), builds the components and hands them to the loop
(dflash/training/trainer.py `Trainer`). `run()` opens the loggers (the MLflow run) only then, after every check
that can fail, trains through the loop's hooks (metrics to the loggers, the periodic and the final evaluation,
the export to `final/`), closes the run FINISHED / FAILED / KILLED and asks the promotion gate.

Faults: anything that fails, or a SIGTERM / SIGINT, before the first step of a new run leaves no run folder
behind (and an MLflow run already open closes FAILED / KILLED); during setup and the final evaluation one signal
stops the run where it is (exit 128 + signal, KILLED); in the loop it stops at the next step boundary with a
checkpoint (dflash/training/interrupts.py).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dflash.app.auto import params_with_requested, resolve_auto
from dflash.config import ConfigError, RunConfig, from_dict, to_dict, validate
from dflash.data.sources import inactive_data_keys
from dflash.devices import resolve_device
from dflash.drafter.model import DFlashDrafter, build_drafter
from dflash.evaluation import make_evaluator
from dflash.run_dir import (ResumeState, RunDir, SkipLogged, missing_folders, probe_folder, read_resume_state,
                            remove_empty_folders)
from dflash.serving.export import facts_of_target, save_drafter
from dflash.serving.promotion import auto_promote
from dflash.target.model import Target
from dflash.tracking.background import in_background
from dflash.tracking.loggers import MultiLogger, build_loggers
from dflash.tracking.run_info import absolute_sqlite_uri, git_sha, run_params
from dflash.tracking.backfill import backfill_mlflow
from dflash.tracking.store import StoreError, check_tracking_uri, signals_deferred
from dflash.tracking.sysmetrics import system_metrics
from dflash.app.chat_data import build_run_data, check_chat_records
from dflash.training.datastream import DataMeter, epoch_guard
from dflash.training.distributed import DistInfo, broadcast_object, init_distributed
from dflash.training.distributed import shutdown as shutdown_distributed
from dflash.training.hooks import LoopHooks, TrainParts
from dflash.training.interrupts import StopOnSignal
from dflash.training.losses import build_loss
from dflash.training.selector_loss import with_selector
from dflash.training.noise import build_noise
from dflash.training.trainer import Trainer

log = logging.getLogger(__name__)

# An evaluator takes (drafter, target, step, final, logger) and returns `eval/…` metrics; by default
# `dflash.evaluation.make_evaluator(cfg.eval)` (cheap subset every trainer.eval_every steps, full suite at the end).
Evaluator = Callable[[DFlashDrafter, Target, int, bool, object], dict]


@dataclass
class TrainResult:
    run_dir: Path
    run_id: str | None
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None


# ------------------------------------------------------------------------------ the config, checked
def resolve_run(cfg: RunConfig) -> RunConfig:
    """For `resume=<dir>`: the saved resolved config of that run (its run_dir and resume filled in).
    A config whose run_dir already is the resumed dir was resolved by the caller (e.g. `experiments.run`
    applying key=value overrides on top of the saved config) and is used as given."""
    if not cfg.resume or Path(cfg.run_dir or ".").resolve() == Path(cfg.resume).resolve():
        return cfg
    try:
        resumed = from_dict(RunDir(cfg.resume).read_config())
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume={cfg.resume!r}: {e}") from e
    return dataclasses.replace(resumed, run_dir=str(cfg.resume), resume=str(cfg.resume))


def check_run(cfg: RunConfig) -> None:
    """`validate` plus the checks across groups that need no weights (ConfigError naming the key)."""
    validate(cfg)
    if cfg.drafter.is_dflash2 and cfg.drafter.final_logit_softcapping > 0:
        raise ConfigError(f"drafter.final_logit_softcapping={cfg.drafter.final_logit_softcapping}: training needs 0 "
                          f"(the block losses' fused LM-head path computes uncapped logits); a cap is served "
                          f"and evaluated, not trained")
    if build_loss(cfg.loss).needs_soft and cfg.target.soft_top_k <= 0:
        raise ConfigError(f"loss.name={cfg.loss.name} needs soft labels: target.soft_top_k must be > 0, "
                          f"got {cfg.target.soft_top_k}")


def check_run_folder(cfg: RunConfig) -> None:
    """ConfigError naming run_dir when the run folder cannot be made there (probed, nothing left behind)."""
    folder = RunDir.for_config(cfg.run_dir, run_label(cfg)).root
    try:
        probe_folder(folder)
    except OSError as e:
        raise ConfigError(f"run_dir={cfg.run_dir or folder}: the run folder cannot be made "
                          f"({type(e).__name__}: {e.strerror or e})") from e


def check_tracking(cfg: RunConfig) -> None:
    """A store MLflow can track, made whole now (a fresh sqlite file is built here, before any work) unless
    tracking is off: ConfigError naming tracking.tracking_uri and how to repair a damaged store."""
    if cfg.tracking.enabled:
        try:
            check_tracking_uri(cfg.tracking.tracking_uri)
        except StoreError as e:
            raise ConfigError(f"tracking.tracking_uri={cfg.tracking.tracking_uri}: {e} "
                              f"(or tracking.enabled=false to train untracked)") from e


def read_resume(cfg: RunConfig) -> ResumeState | None:
    """For `resume=`: the newest intact checkpoint (falling back past torn or corrupt ones, with a warning) and
    what the run already logged, read before anything in the folder changes. ConfigError when none is usable."""
    if not cfg.resume:
        return None
    try:
        return read_resume_state(RunDir(cfg.resume))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def run_label(cfg: RunConfig) -> str:
    """What the run is, in the order a reader compares runs: `hard_ce-cosine-r30_90-s0`; a DFlash 2 drafter
    says so before the seed (`hard_ce-none-r10_20-dflash2-s0`), so its folder and MLflow run are not taken for a
    DFlash 1 run's."""
    drafter = "" if cfg.drafter.architecture == "dflash" else f"-{cfg.drafter.architecture}"
    return f"{cfg.loss.name}-{cfg.noise.name}-{cfg.buffer.name}{drafter}-s{cfg.seed}"


def tracked_params(cfg: RunConfig, loss_fn, noise) -> dict[str, str]:
    """The config as MLflow params, without knobs the run never reads: other losses' and noise schedules'
    keys (each variant lists its own `config_keys`), the random-target spec of a checkpoint target, the data
    settings its source never reads (`inactive_data_keys`), and the settings of a switched-off evaluation or
    promotion (only their `enabled` stays)."""
    active = {"loss": loss_fn.config_keys, "noise": type(noise).config_keys}
    active.update({group: ("enabled",) for group in ("eval", "promote") if not getattr(cfg, group).enabled})
    drop = (["target.random"] if cfg.target.path else []) + inactive_data_keys(cfg.data, cfg.trainer.online_data)
    return run_params(to_dict(cfg), active, drop=drop)


def run_tags(cfg: RunConfig) -> dict[str, str]:
    return {"loss": cfg.loss.name, "noise": cfg.noise.name, "buffer": cfg.buffer.name,
            "buffer_policy": cfg.buffer.policy, "target": cfg.target.name, "git_sha": git_sha(),
            "dflash.kind": "train"}


# ------------------------------------------------------------------------------ the components
def build_parts(cfg: RunConfig, target: Target, device: torch.device, dist: DistInfo) -> tuple[TrainParts, dict]:
    """The loop's components for the resolved `cfg`, in the order the seeded RNG has always drawn them, and
    the data's tags (the memorization guard warns here, before any work, when planned past data.max_epochs)."""
    loss_fn = build_loss(cfg.loss)
    drafter = build_drafter(cfg.drafter, target.hidden_size, target.info.num_layers, target.mask_token_id,
                            target.layer_ids, target.info.vocab_size)
    drafter = drafter.to(device=device, dtype=getattr(torch, cfg.trainer.dtype))
    drafter.attach_target_head(target.embed_weight(), target.lm_head_weight())
    loss_fn = with_selector(loss_fn, drafter, cfg.loss.selector_alpha)  # DFlash 2: + α × the selector's CE
    data = build_run_data(cfg, target, dist)  # stored sequences, the online stream or a chat dataset
    tags = epoch_guard(cfg, data, dist.world)
    meter = DataMeter(data, cfg.trainer.token_budget, dist)
    noise = build_noise(cfg.noise, cfg.trainer.max_steps)
    return TrainParts(target, drafter, loss_fn, noise, data, meter), tags


class TrainingRun:
    """A run composed and ready to train (module doc); `trainer` is its loop, `run()` trains it."""

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None, target: Target | None = None,
                 run_id: str | None = None):
        t_setup = time.perf_counter()
        self.dist = init_distributed()  # torchrun: one rank per GPU; a plain process is rank 0 of 1
        self.stop = StopOnSignal()
        self.run_id = run_id  # log into an existing MLflow run (a sweep trial's child run)
        self.run_dir: Path | None = None
        self._made: list[Path] = []  # the folders this process made (the run's, then its new parents), deepest first
        with self.stop.at_once(where=" during setup"):  # no step boundary to wait for: stop where it is
            cfg = resolve_run(cfg)
            cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(
                cfg.tracking, tracking_uri=absolute_sqlite_uri(cfg.tracking.tracking_uri)))
            check_run(cfg)  # bad input fails here, before the target loads or anything is written
            if self.dist.is_main:
                check_chat_records(cfg)  # a chat file's records, read before anything is written
                check_run_folder(cfg)  # before the store is made: an unusable run_dir leaves no mlflow.db
                check_tracking(cfg)
            self.cfg = cfg  # as requested: config.yaml and the checkpoints record it
            self.resume_state = read_resume(cfg) if self.dist.is_main else None  # read only, validated here
            try:
                self._setup(cfg, evaluator, target)
            except BaseException:
                self._discard_folder()
                raise
        self.trainer.phase_s["sys/setup_s"] = time.perf_counter() - t_setup

    def _setup(self, cfg: RunConfig, evaluator, target) -> None:
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        main = self.dist.is_main
        self.run_dir = Path(broadcast_object(str(self._make_folder(cfg)) if main else None, self.dist))
        self.evaluator = None if not main else (
            evaluator if evaluator is not None else make_evaluator(cfg.eval, out_dir=RunDir(self.run_dir).eval_dir))
        self.target = target or Target(cfg.target)  # benchmarks reuse one (54 GB) target
        device = resolve_device(cfg.trainer.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the drafter may sit on another GPU than the target
        self.target_facts = facts_of_target(self.target)  # the drafter's RoPE base for 0; the serving folder's facts
        self.ran, self.requested = resolve_auto(cfg, self.target, device, self.target_facts.rope_theta)
        parts, self.data_tags = build_parts(self.ran, self.target, device, self.dist)
        self.data_report = parts.data.report
        if hasattr(self.evaluator, "use_train_sequences"):  # eval/tau_train: the generalization gap
            self.evaluator.use_train_sequences(parts.data.examples())
        if hasattr(self.evaluator, "add_suites"):  # the data's own distribution (a chat dataset's held-out split)
            self.evaluator.add_suites(parts.data.eval_suites, parts.data.eval_note)
        rs = self.resume_state
        from_zero = broadcast_object(rs is not None and rs.checkpoint is None if main else None, self.dist)
        trained = dataclasses.replace(self.ran, resume="") if from_zero else self.ran  # no checkpoint yet: step 0
        self.trainer = Trainer(trained, parts, RunDir(self.run_dir).checkpoints, resume=None if from_zero else rs,
                               dist=self.dist, stop=self.stop, saved_config=to_dict(cfg))
        if main:  # only now, with the resume state applied, does the run folder change
            RunDir(self.run_dir).write_config(to_dict(cfg))
            RunDir(self.run_dir).remove_torn_writes()

    def _make_folder(self, cfg: RunConfig) -> Path:
        """`runs/<label>-<time>` (or run_dir); the folder's name is also the MLflow run's name."""
        rd = RunDir.for_config(cfg.run_dir, run_label(cfg))
        self._made = missing_folders(rd.root)
        try:
            return rd.create().root
        except OSError as e:
            self._discard_folder()
            raise ConfigError(f"run_dir={cfg.run_dir or rd.root}: the run folder cannot be made "
                              f"({type(e).__name__}: {e.strerror or e})") from e

    def _discard_folder(self) -> None:
        """A new run that failed or was stopped before its first step leaves no half-made folder, nor the parents
        it made for it (a first run's `runs/`)."""
        if self._made and self.dist.is_main:
            shutil.rmtree(self._made[0], ignore_errors=True)
            remove_empty_folders(self._made[1:])  # only while empty: another run may have started in one
            self._made = []

    def _loggers(self):
        """Rank 0's loggers: MLflow off the training thread; on resume the saved MLflow run reopened (taken
        over when it was left RUNNING) and steps already logged not logged again."""
        c, rs, t = self.ran, self.resume_state, self.trainer
        params = params_with_requested(tracked_params(c, t.loss_fn, t.noise), self.requested)
        loggers = build_loggers(c.tracking, self.run_dir, params, run_tags(c), c.trainer.max_steps,
                                run_id=self.run_id or (rs.run_id if rs else None))
        if rs is not None and loggers.mlflow is not None:  # what a kill -9 caught in flight: MLflow gets it now
            backfill_mlflow(loggers.mlflow, self.run_dir)
        loggers = in_background(loggers)
        return SkipLogged(loggers, rs.logged) if rs is not None and rs.logged else loggers

    def run(self, final: bool = True,
            around_step: Callable[[int], AbstractContextManager] | None = None) -> TrainResult:
        """Train to trainer.max_steps (or the time budget), checkpointing and logging; then, with `final`, export
        the drafter to `final/` and run the full evaluation (a benchmark passes final=False). `around_step`:
        `Trainer.run`'s."""
        c, t, main = self.ran, self.trainer, self.dist.is_main
        loggers, status = MultiLogger([]), "FAILED"
        result = TrainResult(self.run_dir, None)
        try:
            with self.stop:
                # no step boundary before the loop: a signal stops the run here, and it leaves no folder
                with self.stop.at_once(where=" before the first step"):
                    if main:
                        with signals_deferred():  # the MLflow run opens whole, so that it can close KILLED
                            loggers = self._loggers()  # after every check that can fail
                    result.run_id = loggers.run_id
                    loggers.set_tags({**{f"kernel.{k}": v for k, v in self.target.kernels.items()},
                                      "dflash.target_fingerprint": self.target.fingerprint})
                    loggers.set_tags(self.data_tags)
                    loggers.log_artifact(str(RunDir(self.run_dir).config_file))
                    if self.data_report:  # what the data trains on, for a person to read (experiments.data inspect)
                        loggers.log_text(self.data_report, "data/conversations.md")
                    hooks = RunHooks(self, loggers, final)
                result.metrics = t.run(hooks, around_step)
            result.checkpoint = hooks.final_dir
            status = "FINISHED"
        except BaseException as e:  # a signal carries run_status="KILLED", a pruned sweep trial "FINISHED"
            status = getattr(e, "run_status", "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            _close_quietly(loggers, status)
            if status != "FINISHED" and t.final_step == t.start_step:  # not one step trained: nothing to keep
                self._discard_folder()
            shutdown_distributed(self.dist)
        # The gate reads the closed (FINISHED) run's evaluated metrics: only after close.
        if main:
            auto_promote(result.run_id, c.promote, c.tracking.tracking_uri)
        return result


class RunHooks(LoopHooks):
    """The run's side of the loop: metrics to the loggers, the evaluations, the final export."""

    def __init__(self, run: TrainingRun, loggers, final: bool):
        self.run, self.loggers, self.final = run, loggers, final
        self.final_dir: Path | None = None

    def on_log(self, trainer, metrics, step) -> None:
        tc = self.run.ran.tracking
        if tc.system_metrics and not tc.enabled:  # else MLflow's own monitor logs them (`system/…`)
            metrics.update(system_metrics())
        self.loggers.log(metrics, step)

    def on_eval(self, trainer, step) -> None:
        if self.run.evaluator:
            self.loggers.log(self.run.evaluator(trainer.drafter, trainer.target, step, False, self.loggers), step)

    def on_loop_end(self, trainer, metrics) -> None:
        if not self.final or not self.run.dist.is_main:
            return
        run, loggers, step = self.run, self.loggers, trainer.final_step
        final = RunDir(run.run_dir).final
        t0 = time.perf_counter()
        save_drafter(trainer.drafter, final, extra={"target": run.cfg.target.name, "loss": run.cfg.loss.name,
                                                   "target_fingerprint": trainer.target.fingerprint},
                     target=run.target_facts)
        loggers.log_artifact(str(final), "checkpoint")
        trainer.phase_s["sys/save_s"] = time.perf_counter() - t0
        if run.evaluator:
            t0 = time.perf_counter()
            # no step boundary in an evaluation: one signal stops it (the checkpoint of the last step is saved)
            with run.stop.at_once(step, trainer.latest_checkpoint(), " during the final evaluation"):
                ev = run.evaluator(trainer.drafter, trainer.target, step, True, loggers)
            loggers.log(ev, step)
            metrics.update(ev)
            trainer.phase_s["sys/final_eval_s"] = time.perf_counter() - t0
        loggers.log(trainer.phase_s, step)
        metrics.update(trainer.phase_s)
        self.final_dir = final


def _close_quietly(loggers, status: str) -> None:
    """Closing the loggers must never mask the run's own exception."""
    try:
        loggers.close(status)
    except Exception as e:  # noqa: BLE001
        if status == "FINISHED":
            raise
        log.warning("closing the loggers failed too: %s", e)


def train(cfg: RunConfig, evaluator: Evaluator | None = None, *, run_id: str | None = None) -> TrainResult:
    return TrainingRun(cfg, evaluator, run_id=run_id).run()
