"""The training loop: target producers → buffer → drafter steps, checkpointed at step boundaries, resumable.

`Trainer` is handed its components (`TrainParts`: target, drafter, loss, noise, data) and trains them: the step
API (`make_batch`, `step`), the loop (`run`), its checkpoints and its resume. Everything around a run (the run
folder, resume state, loggers, evaluation, export, promotion) is composed one layer up, in dflash/app/run.py,
and reaches the loop only through `LoopHooks` (dflash/training/hooks.py). The step loop never syncs the host:
metrics accumulate on the device and are read every `tracking.log_every` steps (docs/DESIGN.md, "The buffer": a per-step
`.item()` cost the original pipeline 1.3 s a step).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from dflash.errors import ConfigError
from dflash.training.batching import DrafterBatch, make_batch, masked_tokens
from dflash.training.buffer import BucketedBuffer
from dflash.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dflash.training.compiling import compile_drafter
from dflash.training.distributed import (DistInfo, broadcast_object, gather_objects, init_distributed, mean_, sum_,
                                         wrap_ddp)
from dflash.training.health import check_alive
from dflash.training.hooks import LoopHooks, TrainParts
from dflash.training.interrupts import RunInterrupted, StopOnSignal
from dflash.training.optim import build_optimizer
from dflash.training.pipeline import PRODUCER_MODES, Item, ProducerPool
from dflash.training.tau_probe import probe_due, probe_tau

if TYPE_CHECKING:  # annotations only
    from dflash.config import RunConfig

log = logging.getLogger(__name__)
# a signal while a step waits for its data: the seconds the data still has before the run stops there (below the
# kill delay of `timeout -k` in the GPU job scripts, 10-15 s, so the stop is still a clean one)
WAIT_GRACE_S = 5.0


@dataclass
class StepOutput:
    """What `Trainer.step` returns: device tensors, read by the host only every tracking.log_every steps."""
    loss: torch.Tensor  # scalar, detached
    grad_norm: torch.Tensor  # before clipping
    metrics: dict[str, torch.Tensor]  # the loss's: acc, acc_per_pos [K], streak


def warmup_cosine(step: int, warmup: int, max_steps: int, min_ratio: float, progress_floor: float = 0.0) -> float:
    """LR factor: linear warmup over `warmup` steps, then cosine from 1 to `min_ratio` at `max_steps`
    (progress is at least `progress_floor`, e.g. the wall-clock fraction of a time budget). The floor caps the
    warmup too: a time budget that runs out while the warmup's steps are still counting (slow steps, a short
    budget) ends with the LR at the cosine's floor, not at the ramp's peak."""
    frac = min(max((step - warmup) / max(max_steps - warmup, 1), progress_floor), 1.0)
    cosine = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return min((step + 1) / warmup, cosine) if step < warmup else cosine


def lr_lambda(cfg: RunConfig, time_progress: Callable[[], float] = lambda: 0.0) -> Callable[[int], float]:
    """The LR factor at a step; `time_progress()` (trainer.schedule_by_time: `TimeProgress.value`) pushes the
    cosine on."""
    t = cfg.trainer
    return lambda step: warmup_cosine(step, t.warmup_steps, t.max_steps, t.min_lr_ratio, time_progress())


class TimeProgress:
    """The time budget's clock (`budget_seconds`: what trainer.time_budget_counts counts) and, with
    trainer.schedule_by_time, the fraction of this job's time budget spent, as the cosine's progress floor, so
    a run its time budget stops ends with its LR decayed (an equal-GPU-time comparison of drafters whose steps
    differ in cost: each one's schedule spans the same seconds, not a max_steps only the fastest would reach).

    The job's clock starts once its first step has run, so compiling does not eat the schedule: the cosine spans
    what is left of the budget after it (all of it with trainer.time_budget_counts=training, where the budget
    starts there too). The fraction moves only at log intervals, from rank 0's clock (every rank
    must step with the same LR), and a checkpoint keeps it: a resumed job goes on from there over its own budget
    (progress p0 + (1 - p0) x its own fraction). Off, `value` stays at what a checkpoint held (0 for a new run), so
    the step count alone drives the cosine."""

    def __init__(self, budget_s: float, enabled: bool, start: float = 0.0, from_first_step: bool = False):
        self.budget_s, self.enabled, self.from_first_step = budget_s, enabled and budget_s > 0, from_first_step
        self.start = self.value = min(max(start, 0.0), 1.0)
        self.t_first: float | None = None
        self.t_budget = 0.0  # where the budget's seconds start: the loop's start, or the first step (training)
        self.paused_s = 0.0  # seconds the budget does not count: in-training evaluations, where it counts training
        self.span_s = budget_s

    def first_step_done(self, t_loop: float, now: float) -> None:
        """The clock starts: the budget left after the loop's first step (compiling) is what the cosine spans, or
        all of it where the budget itself starts there (trainer.time_budget_counts=training)."""
        before = 0.0 if self.from_first_step else now - t_loop
        self.t_first, self.span_s = now, max(self.budget_s - before, 1e-6)
        self.t_budget = now if self.from_first_step else t_loop

    def pause(self, seconds: float) -> None:
        """An in-training evaluation took `seconds`: a budget that counts training leaves them out."""
        if self.from_first_step:
            self.paused_s += seconds

    def budget_seconds(self, now: float) -> float:
        """The seconds the time budget has counted (train/budget_s; checked against trainer.time_budget_s)."""
        return now - self.paused_s - self.t_budget

    def fraction(self, now: float) -> float:
        """This job's share of the schedule so far (rank 0's reading is the one `update` takes)."""
        if not self.enabled or self.t_first is None:
            return self.value
        spent = now - self.paused_s - self.t_first
        return self.start + (1.0 - self.start) * min(max(spent / self.span_s, 0.0), 1.0)

    def update(self, value: float) -> None:
        self.value = max(self.value, value)


class MetricAccumulator:
    """Sums on the device; `read()` is the only host sync, done every `log_every` steps. Scalar metrics a loss
    adds beyond the block ones (the DFlash 2 selector's) are summed too and logged as train/<name>."""

    _BLOCK_METRICS = ("acc", "acc_per_pos", "streak", "ce")

    def __init__(self, K: int, device: torch.device, dist_info: DistInfo = DistInfo()):
        self.K, self.device, self.dist = K, device, dist_info
        self.reset()

    def reset(self) -> None:
        z = lambda *s: torch.zeros(*s, device=self.device)  # noqa: E731
        self.loss, self.acc, self.streak, self.grad_norm, self.nonfinite = z(()), z(()), z(()), z(()), z(())
        self.ce = z(())
        self.acc_pos = z(self.K)
        self.extra: dict[str, torch.Tensor] = {}  # a loss's own scalar metrics (DFlash 2: the selector's)
        self.steps = 0

    def add(self, loss, metrics: dict, grad_norm) -> None:
        self.loss += loss.detach()
        self.nonfinite += (~torch.isfinite(loss.detach())).float()
        self.acc += metrics["acc"]
        self.acc_pos += metrics["acc_per_pos"]
        self.streak += metrics["streak"]
        self.ce += metrics["ce"]
        for key, value in metrics.items():
            if key not in self._BLOCK_METRICS:
                self.extra[key] = self.extra[key] + value.detach() if key in self.extra else value.detach().float()
        self.grad_norm += grad_norm
        self.steps += 1

    def read(self) -> dict[str, float]:
        n = max(self.steps, 1)
        extra = sorted(self.extra)
        vec = torch.cat([torch.stack([self.loss, self.acc, self.streak, self.grad_norm, self.nonfinite,
                                      self.ce]), self.acc_pos, torch.stack([self.extra[k] for k in extra])
                         if extra else self.acc_pos.new_zeros(0)])
        vals = mean_(vec, self.dist).cpu().tolist()  # ranks averaged: one collective per interval
        # train/ce: plain CE against the target's argmax, whatever the loss: comparable across losses
        out = {"train/loss": vals[0] / n, "train/acc": vals[1] / n, "train/anchor_streak": vals[2] / n,
               "train/grad_norm": vals[3] / n, "train/nonfinite_steps": vals[4], "train/ce": vals[5] / n}
        out.update({f"train/acc_pos{k + 1:02d}": v / n for k, v in enumerate(vals[6:6 + self.K])})
        out.update({f"train/{k}": v / n for k, v in zip(extra, vals[6 + self.K:])})
        return out


class Trainer:
    def __init__(self, cfg: "RunConfig", parts: TrainParts, checkpoint_dir: str | Path, *, resume=None,
                 dist: DistInfo | None = None, stop: StopOnSignal | None = None, saved_config: dict | None = None):
        """`cfg`: the run's config with its "auto" values resolved (what runs); `saved_config`: what each
        checkpoint records as the run's config (default: `cfg`). `resume` (rank 0's): the checkpoint to continue
        from and its loaded `state` (dflash/run_dir.py `ResumeState`), read and verified before this."""
        self.dist = dist or init_distributed()  # torchrun: one rank per GPU; a plain process is rank 0 of 1
        self.cfg = cfg
        self.checkpoint_dir = Path(checkpoint_dir)
        self.resume_state = resume
        self.stop = stop or StopOnSignal()  # SIGTERM/SIGINT: checkpoint at the next step boundary
        self.newest_checkpoint: Path | None = None  # where a stop while waiting for data resumes from
        self.saved_config = saved_config if saved_config is not None else dataclasses.asdict(cfg)
        self.target, self.drafter, self.loss_fn, self.noise = parts.target, parts.drafter, parts.loss_fn, parts.noise
        self.data, self.data_meter = parts.data, parts.data_meter
        self.device = next(self.drafter.parameters()).device
        self.train_model = wrap_ddp(self.drafter, self.dist, self.device)  # the drafter itself on one process
        if cfg.trainer.compile:
            self.train_model = compile_drafter(self.train_model, cfg.trainer.compile_mode)
        self.producers_inline = self._inline_producer()
        t = cfg.trainer  # adamw, or muon for the 2-D weights + AdamW for the rest (dflash/training/optim.py)
        self.opt = build_optimizer(t.optimizer, self.drafter, t.lr, t.weight_decay, t.muon_lr_scale, self.device)
        self.time_progress = self._time_progress()  # a resumed run's: _restore
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg, lambda: self.time_progress.value))
        self.buffer = BucketedBuffer(cfg.buffer, seed=cfg.seed)
        self.start_step, next_item, replay = self._restore()
        self.final_step = self.start_step
        self.source = self.data.source(next_item, replay, self.dist.rank, self.dist.world)
        # where a run's wall time goes besides training (a campaign's 4 M-token cells spent ~155 of 250 s
        # elsewhere): the composing layer logs sys/setup_s, sys/loop_s (of it sys/first_data_s and sys/first_step_s,
        # the seconds before the first step's data came and before it was launched, and sys/train_eval_s, the
        # in-training evaluations'), sys/save_s, sys/final_eval_s
        self.phase_s: dict[str, float] = {}

    def _time_progress(self, start: float = 0.0) -> TimeProgress:
        t = self.cfg.trainer
        return TimeProgress(t.time_budget_s, t.schedule_by_time, start, t.time_budget_counts == "training")

    def _restore(self) -> tuple[int, int, list[int]]:
        if not self.cfg.resume:
            return 0, 0, []
        # Rank 0 picked and verified the checkpoint (loaded on the CPU: RNG states must stay there; the optimizer
        # and model copy their tensors to the parameters' device when loading); the other ranks load that file.
        ckpt = Path(broadcast_object(str(self.resume_state.checkpoint) if self.dist.is_main else None, self.dist))
        state = self.resume_state.state if self.dist.is_main else load_checkpoint(ckpt, map_location="cpu")
        recorded = state.get("target_fingerprint")
        if recorded and recorded != self.target.fingerprint:
            raise ConfigError(f"resume={self.cfg.resume!r}: {ckpt} was trained for target fingerprint {recorded}, "
                              f"but target {self.cfg.target.name!r} is now {self.target.fingerprint}; start a new run")
        try:
            self.drafter.load_state_dict(state["drafter"])
            self.opt.load_state_dict(state["optimizer"])
            self.time_progress = self._time_progress(state.get("time_progress", 0.0))  # before the scheduler
            self.sched.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as e:  # e.g. a key=value override changed the drafter's shape
            raise ConfigError(f"resume={self.cfg.resume!r}: {ckpt} does not fit this config "
                              f"({type(e).__name__}: {str(e)[:400]})") from e
        if len(state["ranks"]) != self.dist.world:
            raise ConfigError(f"resume={self.cfg.resume!r}: checkpoint written by {len(state['ranks'])} ranks, "
                              f"this run has {self.dist.world} (data order and buffers are per rank)")
        mine = state["ranks"][self.dist.rank]
        self.buffer.load_state_dict(mine["buffer"])
        torch.set_rng_state(mine["rng"]["torch"])
        random.setstate(mine["rng"]["python"])
        self.data_meter.load_state_dict(mine.get("data", {}))
        log.info("resumed from %s at step %d", ckpt, state["step"])
        if self.resume_state is not None:
            self.resume_state.state = {}  # applied: do not hold a second copy of the weights and optimizer
        return state["step"], mine["items_put"], [key for _, key in mine["pending_keys"]]

    def _checkpoint(self, step: int) -> Path | None:
        """Every rank's buffer, data position and RNG go into rank 0's one file (a collective: all ranks call)."""
        buf_state, pending = self.buffer.snapshot()
        ranks = gather_objects({"buffer": buf_state, "pending_keys": pending, "items_put": sum(buf_state["puts"]),
                                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                                "data": self.data_meter.state_dict()}, self.dist)
        if not self.dist.is_main:
            return None
        state = {"step": step, "drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "ranks": ranks, "config": self.saved_config,
                 "target_fingerprint": self.target.fingerprint, "time_progress": self.time_progress.value}
        path = save_checkpoint(self.checkpoint_dir, step, state, self.cfg.trainer.keep_checkpoints)
        self.newest_checkpoint = path
        return path

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir.is_dir() else None

    # -- the step API (the loop and the bench call these) -----------------------------------------------
    def make_batch(self, items: list[Item]) -> DrafterBatch:
        """The drafter batch of buffered `items`: anchors, feature noise at the schedule's current σ, padding."""
        c = self.cfg
        return make_batch(items, block_size=c.drafter.block_size, num_anchors=c.trainer.num_anchors,
                          seed=c.seed, noise=self.noise, sigma=self.noise.sigma(), device=self.device,
                          pad_multiple=c.trainer.pad_multiple, fixed_anchors=c.trainer.compile)

    def step(self, batch: DrafterBatch) -> StepOutput:
        """One optimizer step on `batch`: drafter forward (bf16 autocast per trainer.autocast), the loss with
        its own LM-head statistics, backward, gradient clipping, the optimizer (trainer.optimizer) and the LR schedule. Returns device
        tensors only (no host sync). The phases are profiler ranges (`dflash.drafter_forward`, `dflash.loss`,
        `dflash.backward`, `dflash.optimizer`: the bench's sync trace names sites by them), free unless a
        profiler runs."""
        record = torch.profiler.record_function
        with record("dflash.drafter_forward"), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                                               enabled=self._autocast()):
            hidden = self.train_model(batch.features_BTLH, batch.anchors_BN, batch.anchor_tokens_BN)
        with record("dflash.loss"):
            loss, metrics = self.loss_fn(hidden, self.drafter.lm_head_VH, batch)
        with record("dflash.backward"):
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.trainer.grad_clip)
        with record("dflash.optimizer"):
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        return StepOutput(loss.detach(), grad_norm, metrics)

    def _step(self, items, acc: MetricAccumulator) -> int:
        """The loop's step: batch, optimizer step, metrics summed on the device; the tokens consumed."""
        batch = self.make_batch(items)
        out = self.step(batch)
        acc.add(out.loss, out.metrics, out.grad_norm)
        return batch.num_tokens

    def _autocast(self) -> bool:
        mode = self.cfg.trainer.autocast
        return self.device.type == "cuda" if mode == "auto" else mode == "bf16"

    def _producers(self) -> ProducerPool:
        n = 1 if self.cfg.buffer.deterministic else self.cfg.trainer.producers
        top_k = self.cfg.target.soft_top_k if self.loss_fn.needs_soft else 0  # > 0 there: checked at composition
        return ProducerPool(self.target, self.buffer, self.source, n, top_k, self.cfg.trainer.producer_batch,
                            inline=self.producers_inline, stream=self.cfg.trainer.producer_stream).start()

    def _inline_producer(self) -> bool:
        return PRODUCER_MODES[self.cfg.trainer.producer_mode](self.device, self.target.device)

    def run(self, hooks: LoopHooks | None = None,
            around_step: Callable[[int], AbstractContextManager] | None = None) -> dict[str, float]:
        """Train to trainer.max_steps (or the time / token budget), checkpointing, with the producers running;
        `hooks` (dflash/training/hooks.py) take the metrics, the periodic evaluation and, after the last
        checkpoint, the end of the run. `around_step(step)` is entered around each loop step (items →
        `make_batch` → `step` → metrics), outside its `dflash.train_step` profiler range: the bench starts and
        stops a profiler there. Returns the last interval's metrics. Signals: while `self.stop` is active (the
        composing layer enters it), one SIGTERM/SIGINT checkpoints at the next step boundary and raises
        RunInterrupted."""
        hooks = hooks or LoopHooks()
        producers = self._producers()
        try:
            t_loop = time.perf_counter()
            metrics = self._loop(producers, hooks, around_step or (lambda step: nullcontext()))
            self.phase_s["sys/loop_s"] = time.perf_counter() - t_loop
            hooks.on_loop_end(self, metrics)
            return metrics
        finally:
            producers.shutdown()
            if self.data.writer is not None:  # batches being written ahead finish their shards, unless the run
                self.data.writer.close(wait=not self.stop.requested)  # stops on a signal: then they are dropped

    def _stop_now(self, done: int, at_log: bool, saved: bool) -> None:
        """A SIGTERM/SIGINT seen at a step boundary: checkpoint this step and stop (every rank at the same step:
        under several ranks the request is shared at log intervals, one collective there)."""
        requested = self.stop.requested
        if self.dist.enabled:
            if not at_log:
                return
            signum = broadcast_object(self.stop.signum, self.dist)
            requested, self.stop.signum = signum is not None, signum
        if requested:
            path = None if saved else self._checkpoint(done)
            raise RunInterrupted(self.stop.signum, done, path or self.latest_checkpoint())

    def _loop(self, producers: ProducerPool, hooks: LoopHooks, around_step) -> dict[str, float]:
        c, K = self.cfg, self.cfg.drafter.block_size - 1
        acc = MetricAccumulator(K, self.device, self.dist)
        metrics: dict[str, float] = {}
        window = _Window(producers, self.buffer, self.dist)
        t_start, done = time.perf_counter(), self.start_step
        last_probed = self.start_step
        self.newest_checkpoint = self.latest_checkpoint()  # then kept by _checkpoint (no file read a step)
        # milestones a resumed run already passed (this rank's restored count, times the ranks) are not re-run
        passed = self.data_meter.tokens * self.dist.world
        self.milestones_done = {m for m in c.trainer.eval_at_tokens if m <= passed}
        for step in range(self.start_step, c.trainer.max_steps):
            self.noise.advance(step)
            with torch.profiler.record_function("dflash.next_items"), self._waiting(done):  # profiled: the
                items = [producers.next_item() for _ in range(c.trainer.sequences_per_step)]  # inline producer
            if step == self.start_step:  # the first interval's log line can be minutes away (compilation)
                self.phase_s["sys/first_data_s"] = time.perf_counter() - t_start
                log.info("first step %d: its data came %.1f s after the loop began", step + 1,
                         self.phase_s["sys/first_data_s"])
            with around_step(step), torch.profiler.record_function("dflash.train_step"):  # free unless profiled
                tokens = self._step(items, acc)
            if step == self.start_step:  # what a time budget pays before training: first data, compiling
                t_first = time.perf_counter()
                self.phase_s["sys/first_step_s"] = t_first - t_start
                log.info("first step %d: launched %.1f s after the loop began (compiling included)", step + 1,
                         self.phase_s["sys/first_step_s"])
                self.time_progress.first_step_done(t_start, t_first)
            window.add(tokens, len(items))
            self.data_meter.add(tokens, len(items), masked_tokens(items))
            done = self.final_step = step + 1  # steps trained so far (the composing layer reads it on a fault)
            last = done == c.trainer.max_steps
            if done % c.tracking.log_every == 0 or last:
                metrics = self._read_metrics(acc, window, done)
                now = time.perf_counter()  # one reading for the schedule and the budget: a stop ends it decayed
                spent_s = self.time_progress.budget_seconds(now)  # what trainer.time_budget_s counts so far
                if self.time_progress.enabled:  # rank 0's clock for every rank (one collective an interval)
                    self.time_progress.update(broadcast_object(self.time_progress.fraction(now), self.dist))
                    metrics["train/time_progress"] = self.time_progress.value
                if c.trainer.time_budget_s > 0:  # the budget's seconds so far: a learning curve's x in time
                    metrics["train/budget_s"] = spent_s
                if probe_due(c.trainer.tau_probe, done, last_probed, last):  # off most intervals: its cost is on
                    metrics.update(probe_tau(self.drafter, items, c.trainer.tau_probe, self._autocast()))
                    last_probed = done  # the critical path (tau_probe.py)
                hooks.on_log(self, metrics, done)
                check_alive(metrics, int(self.drafter.lm_head_VH.shape[0]), done)
                last = last or self._out_of_time(spent_s) or self.data_meter.over_budget()
            if not last and self._eval_due(done):
                t_eval = time.perf_counter()
                hooks.on_eval(self, done)
                t_eval = time.perf_counter() - t_eval
                self.time_progress.pause(t_eval)  # a learning curve's points cost no training (budget: training)
                self.phase_s["sys/train_eval_s"] = self.phase_s.get("sys/train_eval_s", 0.0) + t_eval
            saved = done % c.trainer.checkpoint_every == 0 or last
            if saved:
                self._checkpoint(done)
            if not last:
                self._stop_now(done, done % c.tracking.log_every == 0, saved)
            if last:
                break
        return metrics

    def _waiting(self, done: int):
        """While the step waits for its data, a signal stops the run there unless the data comes within
        WAIT_GRACE_S (then the step runs and the stop checkpoints exactly at its end): a writer in the loop can keep
        the next batch minutes away (a 27B target writes 64 rows in 87 s). Nothing is half-trained then, and the
        newest checkpoint is where it resumes. Under several ranks the stop stays at a log interval, where every
        rank takes it together."""
        if self.dist.enabled:
            return nullcontext()
        return self.stop.patient(WAIT_GRACE_S, done, self.newest_checkpoint,
                                 f" while waiting for data after step {done}")

    def _eval_due(self, done: int) -> bool:
        """Every trainer.eval_every steps, and at the first log interval at or past each trainer.eval_at_tokens
        milestone (consumed tokens, all ranks: the meter's count as of the last log interval)."""
        c = self.cfg.trainer
        if c.eval_every and done % c.eval_every == 0:
            return True
        if done % self.cfg.tracking.log_every or not c.eval_at_tokens:
            return False
        consumed = self.data_meter.total_tokens
        due = [m for m in c.eval_at_tokens if m <= consumed and m not in self.milestones_done]
        self.milestones_done.update(due)
        return bool(due)

    def _out_of_time(self, elapsed_s: float) -> bool:
        """Rank 0's clock decides for every rank (checked only at log intervals: no extra sync)."""
        budget = self.cfg.trainer.time_budget_s
        if budget <= 0:
            return False
        return bool(broadcast_object(elapsed_s >= budget, self.dist))

    def _read_metrics(self, acc: MetricAccumulator, window: "_Window", step: int) -> dict[str, float]:
        m = acc.read()  # the one host sync of the interval
        if m["train/nonfinite_steps"] > 0:
            raise FloatingPointError(f"loss became non-finite before step {step} "
                                     f"({int(m['train/nonfinite_steps'])} steps); run marked FAILED")
        acc.reset()
        m["train/lr"] = self.sched.get_last_lr()[0]
        m["train/noise_sigma"] = self.noise.sigma()
        m.update(window.read(self.cfg.buffer.max_depth))
        m.update(self.data_meter.read())  # data/epochs, data/consumed_tokens (drives trainer.token_budget)
        return m


class _Window:
    """Throughput over the interval between two metric reads (host-side counters only).

    `perf/pipeline_tok_s` is the steady-state rate: tokens consumed, less what the consumer drew from (or
    put back into) the buffer's stock over the window, so a pre-filled buffer draining does not inflate it.
    """

    def __init__(self, producers: ProducerPool, buffer: BucketedBuffer, dist_info: DistInfo = DistInfo()):
        self.producers, self.buffer, self.dist = producers, buffer, dist_info
        self.tokens, self.items = 0, 0
        self.t0 = time.perf_counter()
        self.prod0 = producers.perf()
        stats = buffer.stats()
        self.wait0, self.depth0 = self._waited(stats), stats["buffer/total"]

    def _waited(self, stats: dict) -> float:
        """Consumer seconds not spent on drafter steps: waiting on the buffer, or producing inline."""
        return stats["buffer/get_wait_s"] + self.producers.inline_s

    def add(self, tokens: int, items: int) -> None:
        self.tokens += tokens
        self.items += items

    def read(self, max_depth: int) -> dict[str, float]:
        now = time.perf_counter()
        stats = self.buffer.stats()
        prod_tokens, prod_busy = self.producers.perf()
        wall = max(now - self.t0, 1e-9)
        waited = self._waited(stats) - self.wait0
        drained = (self.depth0 - stats["buffer/total"]) * self.tokens / max(self.items, 1)
        out = {"perf/pipeline_tok_s": max(self.tokens - drained, 0.0) / wall,
               "perf/consumed_tok_s": self.tokens / wall,
               "perf/drafter_tok_s": self.tokens / max(wall - waited, 1e-9),
               "perf/target_tok_s": (prod_tokens - self.prod0[0]) / max(prod_busy - self.prod0[1], 1e-9),
               "perf/consumer_wait_frac": waited / wall, "buffer/max_depth": max_depth}
        if torch.cuda.is_initialized():  # what this process holds of its GPU so far (the allocator's count: no sync);
            # a campaign's cells share one GPU, and this sizes how many fit (sweeps/cells.py records it per cell)
            out["perf/gpu_reserved_peak_gb"] = torch.cuda.max_memory_reserved() / 2**30
        if self.dist.enabled:  # throughput (and tokens) of all ranks together
            keys = [k for k in out if k.endswith("_tok_s")]
            total = sum_(torch.tensor([out[k] for k in keys], dtype=torch.float64), self.dist).tolist()
            out.update(dict(zip(keys, total)), **{"perf/world_size": self.dist.world})
        out.update({k: v for k, v in stats.items() if k.startswith("buffer/depth") or k == "buffer/total"})
        self.tokens, self.items, self.t0, self.prod0 = 0, 0, now, (prod_tokens, prod_busy)
        self.wait0, self.depth0 = self._waited(stats), stats["buffer/total"]
        return out

