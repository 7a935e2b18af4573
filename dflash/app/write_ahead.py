"""What many runs of one campaign or sweep share, made once before they start (docs/sweeps.md, docs/data.md).

Runs that share a GPU and start together would otherwise all make the same inputs at the same time: every one
parses the corpus into its prompt pool, every one writes the same first online batches (the engine's shards
are keyed by the data settings, not by the run, so the second writer's work is thrown away), and every one
generates the evaluation's ground truth at its end. `write_ahead(cfg, items)` makes them once, in this process:

- the prompt pool (cached under `data.pool.cache_dir`);
- online data (`data.source=online` / `trainer.online_data`): the written batches that hold items
  0 … items−1, saved as shards under `data.online.shard_dir`, which every later run with the same data
  settings reads instead of writing;
- the ground truth of every evaluation suite (`eval.suite` and `eval.extra_suites`, and with online data the
  training prompts of `eval/tau_train`; cached under `eval.cache_dir`, its tokens pinned under `eval.truth_dir`
  when set), when `eval.enabled`.

It returns what it did and how fast (`data/write_ahead_batches`, `perf/write_tok_s`, seconds per part), so a
campaign's summary records the engine's generation speed beside the runs that used it.
"""
from __future__ import annotations

import gc
import logging
import math
import time

import torch

log = logging.getLogger(__name__)


def items_needed(cfg, data) -> int:
    """Items a run of `cfg` can claim: what it consumes (`planned_items`) plus what can be ahead of the
    consumer (a full buffer, and one producer batch in flight per producer)."""
    from dflash.training.datastream import planned_items
    t = cfg.trainer
    return planned_items(cfg, data, 1) + cfg.buffer.max_depth + t.producer_batch * max(1, t.producers)


def write_ahead(cfg, items: int | None = None, more_cfgs=()) -> dict[str, float | str | None]:
    """Make the shared inputs of runs like `cfg` (module doc). `items`: online items to have written
    (default: the most that `cfg` or any of `more_cfgs`, e.g. other buffer settings, can claim)."""
    out = _make(cfg, items, more_cfgs)
    # The runs that follow get the GPU memory back, once the target, the evaluator and the data are out of scope:
    # emptied before (inside `_make`), the cache kept 6.1 GiB of an H100 in a campaign's process beside its cells
    # (2026-12-05, nvidia-smi at a cell's out-of-memory error).
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        log.info("after the shared inputs this process holds %.2f GiB of GPU memory",
                 torch.cuda.memory_reserved() / 2**30)
    return out


def _make(cfg, items: int | None, more_cfgs) -> dict[str, float | str | None]:
    from dflash.app.auto import resolve_auto
    from dflash.devices import resolve_device
    from dflash.evaluation.evaluator import SuiteEvaluator
    from dflash.serving.export import facts_of_target
    from dflash.target.model import Target
    from dflash.app.chat_data import build_run_data
    from dflash.training.datastream import uses_online
    from dflash.training.distributed import DistInfo
    out: dict[str, float | str | None] = {}
    t0 = time.perf_counter()
    target = Target(cfg.target)
    out["sys/write_ahead_target_load_s"] = time.perf_counter() - t0
    if uses_online(cfg):
        t1 = time.perf_counter()
        # the online settings as the runs will resolve them (write_batch, reuse: dflash/app/auto.py)
        cfg, _ = resolve_auto(cfg, target, resolve_device(cfg.trainer.device), facts_of_target(target).rope_theta)
        data = build_run_data(cfg, target, DistInfo())
        out["sys/write_ahead_pool_s"] = time.perf_counter() - t1
        n = max(items_needed(x, data) for x in (cfg, *more_cfgs)) if items is None else int(items)
        w = data.writer
        online = cfg.data.online
        per_batch = online.write_batch * online.reuse  # items a written batch serves
        batches = math.ceil(n / per_batch)
        t2 = time.perf_counter()
        for b in range(batches):
            w.sequence(b * per_batch)
        w.close()  # the batch the writer started ahead finishes its shard (the runs read it) before this returns
        out.update(w.stats())
        # which text the runs read (a string among the figures: JSON records only, never an MLflow metric)
        out["data/digest"] = w.digest(batches)
        out.update({"data/write_ahead_items": batches * per_batch, "data/write_ahead_batches": batches,
                    "sys/write_ahead_data_s": time.perf_counter() - t2, "data/pool_prompts": len(w.pool)})
        log.info("write-ahead: %d online batches of %d (%d read from shards, %d written, %.0f written tok/s)",
                 batches, online.write_batch, w.shard_reads, w.written_batches, out["perf/write_tok_s"])
    if cfg.eval.enabled:
        t3 = time.perf_counter()
        ev = SuiteEvaluator(cfg.eval)
        if cfg.data.source == "conversations":  # the data's own suites (chat_heldout), objective or extra
            if not uses_online(cfg):
                data = build_run_data(cfg, target, DistInfo())
            ev.add_suites(data.eval_suites, data.eval_note)
        suites = list(ev.suites)
        if uses_online(cfg) and cfg.eval.train_tasks > 0:
            # eval/tau_train's prompts (cut from the pool, as every run's evaluator cuts them): without this, the
            # cells of a campaign each built the same ground truth at their first eval, at once (two cells on one
            # H200, 2026-12-02: 55-75 s each, the GPU shared)
            ev.use_train_sequences(data.examples())
            suites += [s for s in [ev.train_suite(target.tokenizer)] if s is not None]
        from dflash.evaluation.protocol import truth_specs
        specs = truth_specs(cfg.eval, target)
        for suite in suites:  # at every setting the runs evaluate at (the train prompts: the served one only)
            for spec in specs[:1] if suite.name == "train" else specs:
                ev.memo.get(target, suite, spec)
        out["sys/write_ahead_ground_truth_s"] = time.perf_counter() - t3
        out["eval/write_ahead_suites"] = len(suites)
    out["sys/write_ahead_s"] = time.perf_counter() - t0
    return out
