"""Throughput benchmark at production shapes (docs/benchmarks.md).

Measured side by side in one process, on one device, each a section of `bench.sections`:
- `peak`: a bf16 matmul (n×n×n) — the MFU denominator, measured on the spot;
- `target` (`target_torch`: on the torch Gated-DeltaNet path): the frozen target's forward with hidden states
  and LM-head labels (what a producer does);
- `drafter`: full training steps on synthetic features of the same shape (dflash/bench/drafter_step.py);
- `pipeline`: the real trainer, headline = tokens trained on per second (dflash/bench/pipeline.py);
- `serving`: what τ buys — decode, verify and draft forwards after long contexts (dflash/bench/serving_speed.py).
Before/after variants of the target forward (in place: `target.fused_ops`), the drafter step and the pipeline run in
the same process (`bench.*_variants`).

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` on one real call of each side (matmuls and
attention; the Gated-DeltaNet recurrences run in Triton kernels that the counter cannot see, so the target's
figure is a slight undercount and its MFU conservative). Throughput does not depend on weight values: the
27B-shaped target is built with random weights directly on the GPU.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dflash.bench.config import BenchConfig, check_bench_config, parse_variants, variant_configs  # noqa: F401
from dflash.bench.drafter_step import DrafterStepBench
from dflash.bench.flops import count_flops, matmul_peak, timed
from dflash.bench.pipeline import bench_pipeline
from dflash.bench.profiling import profile_kernels
from dflash.bench.table import format_table  # noqa: F401 (experiments.bench's import)
from dflash.config import RunConfig
from dflash.target.kernels import torch_gdn_path
from dflash.target.model import Target
from dflash.tracking.run_info import default_run_name
from dflash.training.distributed import init_distributed

log = logging.getLogger(__name__)
_STARTED = default_run_name()  # one benchmark folder per process


def bench_target_torch(target: Target, b: BenchConfig) -> dict:
    """The same forward on transformers' pure-torch Gated-DeltaNet path: what a machine without the fast
    kernels gets, measured beside the fast path in the same process."""
    with torch_gdn_path(target.info.model_type) as kernels:
        out = bench_target(target, dataclasses.replace(b, warmup=1, iters=max(1, b.iters // 2)))
    out["kernels"] = kernels
    return out


def bench_target(target: Target, b: BenchConfig) -> dict:
    ids = torch.randint(0, target.vocab_size - 1, (b.target_batch, b.seq_len), device=target.device)
    run = lambda: target.forward_features(ids)  # noqa: E731
    mode = target.fused.mode  # FLOPs counted on transformers' own modules: a counting mode must not meet compiled
    target.set_fused_ops("off")  # code, and fusing elementwise work changes no matmul
    flops = count_flops(run) / ids.numel()
    target.set_fused_ops(mode)
    # the warm-up also warms FLA's autotuning and compiles the fused pieces for this shape
    sec = timed(run, b.iters, target.device, warmup=b.warmup)
    out = {"tok_s": ids.numel() / sec, "flops_per_tok": flops, "sec_per_call": sec}
    if target.device.type == "cuda" and b.kernel_profile:  # where the forward's time goes, by kernel family
        out["kernels"] = profile_kernels(run, steps=1, top=12)
    return out


@dataclass
class Bench:
    """What every section reads (the run config, the bench keys, the one target, the checked variants) and
    the dict it writes its figures into."""
    cfg: RunConfig
    b: BenchConfig
    target: Target
    drafter_variants: dict[str, RunConfig]
    pipeline_variants: dict[str, RunConfig]
    target_variants: dict[str, RunConfig] = field(default_factory=dict)
    out: dict = field(default_factory=dict)


@contextmanager
def target_as(target: Target, cfg: RunConfig):
    """The bench's one target with a variant's in-place keys (bench.config.IN_PLACE_TARGET_KEYS), then as before."""
    before = target.cfg.fused_ops
    target.set_fused_ops(cfg.target.fused_ops)
    try:
        yield
    finally:
        target.set_fused_ops(before)


def _peak(x: Bench) -> None:
    dev = x.target.device
    x.out["peak_flops"] = matmul_peak(x.b.peak_n if dev.type == "cuda" else 512, dev)
    log.info("bench peak: %.0f TFLOP/s", x.out["peak_flops"] / 1e12)


def _target(x: Bench) -> None:
    x.out["target"] = _measure("target", lambda: bench_target(x.target, x.b))
    x.out["target"]["fused_ops"] = x.target.fused.mode
    for label, vcfg in x.target_variants.items():
        with target_as(x.target, vcfg):
            x.out.setdefault("target_variants", {})[label] = result = _measure(
                f"target [{label}]", lambda: bench_target(x.target, x.b), keep_going=True)
            result["fused_ops"] = x.target.fused.mode


def _target_torch(x: Bench) -> None:
    if any(v != "torch" for v in x.target.kernels.values()):  # skipped where the fast path is absent anyway
        x.out["target_torch"] = _measure("target_torch", lambda: bench_target_torch(x.target, x.b))


def _drafter(x: Bench) -> None:
    x.out["drafter"] = _measure("drafter", lambda: DrafterStepBench(in_dir(x.cfg, "drafter"), x.target, x.b).run())


def _pipeline(x: Bench) -> None:
    if x.b.pipeline_steps:
        x.out["pipeline"] = _measure("pipeline", lambda: bench_pipeline(in_dir(x.cfg, "pipeline"), x.target, x.b))


def _serving(x: Bench) -> None:
    from dflash.bench.serving_speed import bench_serving
    x.out["serving"] = _measure("serving", lambda: bench_serving(x.cfg, x.target, x.b))


# Sections in the order they run; variants run after their own section's default.
SECTIONS: dict[str, Callable[[Bench], None]] = {
    "peak": _peak, "target": _target, "target_torch": _target_torch, "drafter": _drafter,
    "pipeline": _pipeline, "serving": _serving}


TARGET_FORWARD_SECTIONS = {"target", "target_torch", "pipeline", "serving"}  # the sections that run the target


def _variants(x: Bench) -> None:
    for i, (label, vcfg) in enumerate(x.drafter_variants.items()):
        with target_as(x.target, vcfg):
            x.out.setdefault("drafter_variants", {})[label] = _measure(
                f"drafter [{label}]",
                lambda vcfg=vcfg, i=i: DrafterStepBench(in_dir(vcfg, f"drafter_variant{i}"), x.target, x.b).run(),
                keep_going=True)
    if not x.b.pipeline_steps:
        return
    for i, (label, vcfg) in enumerate(x.pipeline_variants.items()):
        with target_as(x.target, vcfg):
            x.out.setdefault("pipeline_variants", {})[label] = _measure(
                f"pipeline [{label}]",
                lambda vcfg=vcfg, i=i: bench_pipeline(in_dir(vcfg, f"pipeline_variant{i}"), x.target, x.b),
                keep_going=True)


def run_bench(cfg: RunConfig, b: BenchConfig) -> dict:
    check_bench_config(b)
    x = Bench(cfg, b, None, variant_configs(cfg, b.drafter_variants, "drafter_variants"),  # type: ignore[arg-type]
              variant_configs(cfg, b.pipeline_variants, "pipeline_variants"),
              variant_configs(cfg, b.target_variants, "target_variants"))
    info = init_distributed()  # under torchrun: before the target, so "cuda" is this rank's GPU
    x.target = Target(cfg.target)
    dev = x.target.device
    x.out.update(describe(cfg, b, x.target, info.world))
    wanted = set(b.sections.split(","))
    if not wanted & TARGET_FORWARD_SECTIONS:  # the drafter's step alone: it reads the embedding and the LM head
        x.out["target_released_gb"] = x.target.release_decoder_layers()
        log.info("bench: no section runs the target, so its decoder layers were released (%.1f GiB); a drafter "
                 "step's peak memory leaves them out", x.out["target_released_gb"])
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for name, section in SECTIONS.items():
        if name in wanted:
            section(x)
        if name == "pipeline":  # the variants after both defaults, so the defaults come first in a short run
            _variants(x)
    if dev.type == "cuda":
        x.out["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return derive(x.out)


def describe(cfg: RunConfig, b: BenchConfig, target: Target, world: int) -> dict:
    """The shapes a figure is found by in the results logs (benchmarks/log/): target, drafter, seq_len, anchors
    and GPUs."""
    dev = target.device
    split = cfg.trainer.device not in ("auto", str(dev)) and "cuda" in cfg.trainer.device
    d = cfg.drafter
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "kernels": target.kernels, "world_size": world,
            # GPUs the pipeline uses: one per rank, two per rank when target and drafter are split
            "gpus": world * (2 if split else 1), "attn_group": d.attn_group,
            "shapes": {"target": cfg.target.name, "target_hidden": target.hidden_size,
                       "target_layers": target.info.num_layers, "vocab": target.vocab_size,
                       "drafter": f"{d.num_layers}x{target.hidden_size} ({d.num_heads}q/{d.num_kv_heads}kv x "
                                  f"{d.head_dim}, ffn {d.intermediate_size}, block {d.block_size})",
                       "seq_len": b.seq_len, "anchors": b.anchors, "drafter_batch": b.drafter_batch,
                       "gpus": world * (2 if split else 1)}}


def in_dir(cfg: RunConfig, name: str) -> RunConfig:
    """`cfg` with its own run folder under the benchmark's (`run_dir`, else runs/bench-<time>): every trainer the
    bench builds writes its config there, and every pipeline measurement reads back its own metrics.jsonl."""
    base = cfg.run_dir or f"runs/bench-{_STARTED}"
    return dataclasses.replace(cfg, run_dir=str(Path(base) / name))


def _measure(name: str, fn, keep_going: bool = False) -> dict:
    """One measurement, logged as soon as it is done (a run cut short by a time limit still leaves its figures
    in the log). A failing variant is recorded and the others still run; compiled graphs and the drafter's
    optimizer state are dropped before the next one (each holds tens of GB at production shapes)."""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - only variants keep going
        if not keep_going:
            raise
        log.exception("bench %s failed", name)
        result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    log.info("bench %s: %s", name, json.dumps(result, default=str))
    return result


def derive(out: dict) -> dict:
    """MFU of each side and of the pipeline (target + drafter FLOPs per data token, counted on the tokens
    trained on; the stock-credited rate gets its own, labelled, MFU)."""
    peak = out.get("peak_flops")
    t, d = out.get("target"), out.get("drafter")
    variants = list(out.get("drafter_variants", {}).values()) + list(out.get("target_variants", {}).values())
    for side in [s for s in (t, d) if s] + variants:
        if peak and "tok_s" in side:
            side["mfu"] = side["tok_s"] * side["flops_per_tok"] / peak
    if t and d:
        serial = 1 / (1 / t["tok_s"] + 1 / d["tok_s"])
        out["back_to_back_tok_s"] = serial
        if peak:
            out["back_to_back_mfu"] = serial * (t["flops_per_tok"] + d["flops_per_tok"]) / peak
    pipes = ([(out["pipeline"], d)] if "pipeline" in out else []) + [
        (p, _own_drafter(out, label, d)) for label, p in out.get("pipeline_variants", {}).items()]
    gpus = out.get("gpus", 1)
    for p, pd in ((p, pd) for p, pd in pipes if "error" not in p):
        p["tok_s_per_gpu"] = p["consumed_tok_s"] / gpus
        if t and pd and peak:
            per_tok = t["flops_per_tok"] + pd["flops_per_tok"]
            p["mfu"] = p["consumed_tok_s"] * per_tok / (peak * gpus)
            p["stock_credited_mfu"] = p["stock_credited_tok_s"] * per_tok / (peak * gpus)
        if t and pd:  # the guard's figure: the pipeline against the serial sum of its own two sides, this process
            p["serial_sum_tok_s"] = 1 / (1 / t["tok_s"] + 1 / pd["tok_s"])
            p["of_serial_sum"] = p["tok_s_per_gpu"] / p["serial_sum_tok_s"]
    return out


def _own_drafter(out: dict, label: str, default: dict | None) -> dict | None:
    """The drafter step a pipeline variant's serial sum is made of: the drafter variant of the same overrides (a
    DFlash 2 pipeline against the DFlash 2 step, not the default drafter's), else the default's."""
    own = out.get("drafter_variants", {}).get(label)
    return own if own and "tok_s" in own else default
