"""The pipeline's headline: tokens the drafter trained on per second, in the real trainer.

The trainer runs on synthetic sequences of exactly `seq_len` tokens for `pipeline_warmup` steps (compiles,
autotuning, the buffer's first fill), then `pipeline_repeats` windows of equal length; its metrics are read
once per window (`perf/consumed_tok_s`, `perf/pipeline_tok_s`, …). The headline is the bench's own clock over
all the windows together: the tokens of the steps it saw, over the wall time from the device idle before the
first window to the device idle after the last. It must agree with the trainer's `perf/consumed_tok_s` of the
same windows (within 2%, tested). `perf/pipeline_tok_s` credits the stock the producer left in the buffer
(tokens put, not trained on): it is reported as `stock_credited_tok_s`, never as the headline (a
20-step window's stock swing once read 6,085 where 5,071 trained).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from contextlib import contextmanager

import torch

from dflash.bench.config import BenchConfig
from dflash.bench.profiling import StepProfiler
from dflash.config import RunConfig
from dflash.target.model import Target
from dflash.tracking.loggers import read_jsonl_metrics


@dataclasses.dataclass
class Schedule:
    """Steps of the pipeline measurement: warm-up, then `repeats` windows of `window` steps, then the
    profiled steps."""
    warmup: int
    window: int
    repeats: int
    profiled: int

    @classmethod
    def of(cls, b: BenchConfig, producer_batch: int = 1) -> "Schedule":
        """Windows of pipeline_steps / repeats steps, rounded up to whole producer periods: a producer claiming
        `producer_batch` sequences forwards once per producer_batch / gcd(producer_batch, drafter_batch) steps,
        so a window that cuts that period holds a varying number of target forwards. At 27B, windows of 10 steps
        with producer_batch 4 read 5,110 / 6,535 / 5,119 / 6,541 (spread 24.6%); windows of 12 read
        5,673 / 5,671 (0.05%; H200, 2026-12-01, benchmarks/RESULTS.md)."""
        period = max(producer_batch, 1) // math.gcd(max(producer_batch, 1), max(b.drafter_batch, 1))
        window = -(-max(1, b.pipeline_steps // b.pipeline_repeats) // period) * period
        warmup = -(-max(b.pipeline_warmup, 1) // window) * window  # whole windows: metrics read at their ends
        return cls(warmup, window, b.pipeline_repeats, b.profile_steps)

    @property
    def measured_end(self) -> int:
        return self.warmup + self.window * self.repeats

    @property
    def total(self) -> int:
        return self.measured_end + self.profiled


class StepClock:
    """Tokens trained on and wall time between two step counts, on the bench's own clock: the device is
    synchronised at both ends (twice per run: the trainer reads its metrics there anyway)."""

    def __init__(self, device: torch.device, start: int, end: int):
        self.device, self.start, self.end = device, start, end
        self.tokens, self.t0, self.t1 = 0, None, None

    def after_step(self, done: int, tokens: int) -> None:
        if self.start < done <= self.end:
            self.tokens += tokens
        if done in (self.start, self.end):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.t0, self.t1 = (now, self.t1) if done == self.start else (self.t0, now)

    @property
    def tok_s(self) -> float:
        return self.tokens / (self.t1 - self.t0) if self.t0 is not None and self.t1 is not None else 0.0


def bench_config(cfg: RunConfig, b: BenchConfig, s: Schedule) -> RunConfig:
    """The run config of the measurement: synthetic sequences of exactly `seq_len`, metrics once per window,
    no checkpoints, evaluation or tracking server."""
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, source="synthetic", min_len=b.seq_len, max_len=b.seq_len,
                                 num_sequences=max(64, 4 * s.total)),
        trainer=dataclasses.replace(cfg.trainer, max_steps=s.total, num_anchors=b.anchors,
                                    sequences_per_step=b.drafter_batch, checkpoint_every=10**9,
                                    eval_every=0, warmup_steps=1, online_data=False),
        tracking=dataclasses.replace(cfg.tracking, enabled=False, console=False, log_every=s.window))


def bench_pipeline(cfg: RunConfig, target: Target, b: BenchConfig) -> dict:
    """The real trainer; `cfg.run_dir` must be this measurement's own (its metrics.jsonl is read back)."""
    from dflash.app.run import TrainingRun
    s = Schedule.of(b, cfg.trainer.producer_batch)
    run = TrainingRun(bench_config(cfg, b, s), target=target)
    trainer = run.trainer
    clock = StepClock(trainer.device, s.warmup, s.measured_end)
    syncs: dict = {}
    profiler = StepProfiler(trainer.device, s.measured_end, b.profile_steps, syncs, bool(b.sync_stacks))

    tokens_per_step = b.drafter_batch * b.seq_len  # synthetic sequences of exactly seq_len tokens

    @contextmanager
    def around_step(step: int):
        profiler.enter(step)
        yield
        clock.after_step(step + 1, tokens_per_step)
        profiler.leave(step)
    run.run(final=False, around_step=around_step)  # a benchmark writes no final drafter
    windows = window_records(run.run_dir, s)
    out = summarise(clock, windows, trainer.dist.world)
    out.update(sync_summary(syncs))
    out.update({"producer_batch": cfg.trainer.producer_batch,
                "producer_mode": "inline" if trainer.producers_inline else "thread",
                "producer_stream": cfg.trainer.producer_stream,
                "window_steps": s.window, "repeats": s.repeats, "warmup_steps": s.warmup,
                "measured_steps": s.window * s.repeats})
    return out


def window_records(run_dir, s: Schedule) -> list[dict]:
    """The trainer's metric records at the ends of the measured windows; the last record of each step, since a
    folder reused by an earlier measurement holds that one's records before ours."""
    by_step = {r["step"]: r for r in read_jsonl_metrics(run_dir) if "step" in r}
    return [by_step[k] for k in range(s.warmup + s.window, s.measured_end + 1, s.window) if k in by_step]


def summarise(clock: StepClock, windows: list[dict], world: int = 1) -> dict:
    """The headline (the bench's clock), the trainer's consumed rate over the same windows (their total
    tokens over their total time: the harmonic mean of equal-token windows), its spread over the windows,
    and the stock-credited figure, labelled. Under torchrun every rank trains the same tokens per step
    (sequences of exactly seq_len) in lockstep, so all ranks together are `world` times this rank's clock;
    the trainer's own figures are summed over ranks already."""
    consumed = [w["perf/consumed_tok_s"] for w in windows]
    stocked = [w["perf/pipeline_tok_s"] for w in windows]
    out = {"consumed_tok_s": clock.tok_s * world, "tokens_trained": clock.tokens * world,
           "seconds": (clock.t1 or 0.0) - (clock.t0 or 0.0),
           "perf/consumed_tok_s": statistics.harmonic_mean(consumed) if consumed else 0.0,
           "consumed_tok_s_per_window": consumed,
           "spread": (max(consumed) - min(consumed)) / statistics.mean(consumed) if consumed else 0.0,
           "stock_credited_tok_s": statistics.harmonic_mean(stocked) if stocked and min(stocked) > 0 else 0.0}
    out["perf/pipeline_tok_s"] = out["stock_credited_tok_s"]  # the trainer's name for it
    last = windows[-1] if windows else {}
    out.update({k: v for k, v in last.items()
                if k in ("perf/drafter_tok_s", "perf/target_tok_s", "perf/consumer_wait_frac", "buffer/total")})
    return out


def sync_summary(syncs: dict) -> dict:
    if not syncs:
        return {}
    steps = max(syncs["steps"], 1)
    return {"host_syncs_per_step": syncs["syncs"] / steps, "host_reads_per_step": syncs["host_reads"] / steps,
            "sync_calls": {k: v for k, v in syncs.items() if k not in ("steps", "syncs", "sites", "host_reads")},
            "sync_sites": syncs["sites"]}
