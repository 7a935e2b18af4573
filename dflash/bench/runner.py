"""Throughput benchmark at production shapes (issue: production-shape throughput).

Measured side by side in one process, on one device:
- `peak`: a bf16 matmul (n×n×n) — the MFU denominator, measured on the spot;
- `target`: the frozen target's forward with hidden states and LM-head labels (what a producer does);
- `drafter`: full training steps (forward, chunked LM-head loss, backward, fused AdamW) on synthetic
  features of the same shape, with a per-phase time breakdown;
- `pipeline`: the real trainer (producer thread → buffer → drafter steps) on synthetic sequences.

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
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash.config import RunConfig, validate, with_overrides
from dflash.training.distributed import init_distributed
from dflash.training.losses import IGNORE_INDEX, build_loss, compute_position_stats
from dflash.bench.profiling import profile_kernels, traced_steps
from dflash.target.model import Target
from dflash.target.kernels import torch_gdn_path
from dflash.tracking.loggers import default_run_name, read_jsonl_metrics

log = logging.getLogger(__name__)
_STARTED = default_run_name()  # one benchmark folder per process


@dataclass
class BenchConfig:
    seq_len: int = 2048
    target_batch: int = 4  # sequences per target forward
    anchors: int = 256  # blocks per sequence in the drafter step
    drafter_batch: int = 1  # sequences per drafter step
    warmup: int = 3
    iters: int = 10
    peak_n: int = 8192
    pipeline_steps: int = 20  # 0 skips the pipeline measurement
    profile_steps: int = 5  # pipeline steps traced by the profiler to count host syncs (0: no trace)
    sync_stacks: int = 0  # 1: record Python stacks in that trace to name each sync's call site (slow to process)
    # target_torch: the torch GDN fallback beside the fast path
    sections: str = "peak,target,target_torch,drafter,pipeline"
    # Before/after, side by side: the drafter step and the pipeline again under each variant, a variant being
    # config overrides joined by '&', variants separated by ';' (e.g. "drafter.attn_group=0;trainer.compile=true")
    drafter_variants: str = ""
    pipeline_variants: str = ""
    kernel_profile: int = 1  # 1: break each drafter step's GPU time down by kernel family (profiler, 2 steps)


def parse_variants(spec: str) -> list[tuple[str, list[str]]]:
    """'a=1&b=2;c=3' → [('a=1&b=2', ['a=1', 'b=2']), ('c=3', ['c=3'])]."""
    return [(v.strip(), [o for o in v.strip().split("&") if o]) for v in spec.split(";") if v.strip()]


def variant_configs(cfg: RunConfig, spec: str, key: str) -> dict[str, RunConfig]:
    """Each variant's config, checked before any work starts (a bad key names `bench.<key>`)."""
    out = {}
    for label, overrides in parse_variants(spec):
        out[label] = with_overrides(cfg, overrides, f"bench.{key}")
        validate(out[label])
    return out


def _timed(fn, iters: int, device: torch.device) -> float:
    """Mean seconds per call (CUDA-synchronised around the loop, not inside it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def _attention_flops(q, k, v, mask, is_causal: bool) -> int:
    """Useful forward FLOPs of one SDPA call: both matmuls over the key positions each query may see.
    Grouped-query attention (fewer K/V heads) is fine; a boolean mask or causal flag scales the count to
    the visible fraction (the drafter's block mask leaves most of the keys hidden)."""
    b, h, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    visible = 1.0
    if mask is not None:
        vis = mask if mask.dtype == torch.bool else torch.isfinite(mask) & (mask > -1e30)
        visible = vis.expand(b, h, s_q, s_k).float().mean().item()
    elif is_causal:
        visible = min(1.0, (s_q + 1) / (2 * s_k))
    return int(2 * b * h * s_q * s_k * (d + d_v) * visible)


def _sdpa_formula(op, backward: bool):
    """A raw-argument flop formula for one fused-attention op, its arguments bound by the op's schema."""
    names = [arg.name for arg in op._schema.arguments]

    def formula(*args, out_val=None, **kwargs) -> int:
        bound = {**dict(zip(names, args)), **kwargs}
        fwd = _attention_flops(bound["query"], bound["key"], bound["value"], bound.get("attn_bias"),
                               bool(bound.get("is_causal", False)))
        return 2 * fwd if backward else fwd  # backward: four matmuls of the forward's size
    formula._get_raw = True  # FlopCounterMode passes tensors, not shapes
    return formula


def _sdpa_flop_mapping() -> dict:
    aten = torch.ops.aten
    out = {}
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention"):
        for suffix, backward in (("", False), ("_backward", True)):
            if hasattr(aten, name + suffix):
                packet = getattr(aten, name + suffix)  # the counter looks ops up by overload packet
                out[packet] = _sdpa_formula(packet.default, backward)
    return out


def _flops(fn) -> int:
    """FLOPs of one call: torch's counter for matmuls, our own formula for fused attention (torch 2.11's
    asserts equal Q and K/V head counts and ignores masks)."""
    with FlopCounterMode(display=False, custom_mapping=_sdpa_flop_mapping()) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(n: int, device: torch.device, iters: int = 10) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    return 2 * n**3 / _timed(lambda: a @ b, iters, device)


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
    for _ in range(b.warmup):  # also warms FLA's autotuning for this shape before timing
        run()
    flops = _flops(run) / ids.numel()
    sec = _timed(run, b.iters, target.device)
    return {"tok_s": ids.numel() / sec, "flops_per_tok": flops, "sec_per_call": sec}


class DrafterStepBench:
    """One trainer-shaped drafter step on synthetic features, with a CUDA-event phase breakdown."""

    def __init__(self, cfg: RunConfig, target: Target, b: BenchConfig):
        from dflash.drafter.model import build_drafter
        from dflash.training.trainer import compile_drafter
        self.cfg, self.b, self.device = cfg, b, target.device
        t = target
        self.drafter = build_drafter(cfg.drafter, t.hidden_size, t.info.num_layers, t.mask_token_id,
                                     t.layer_ids).to(t.device)
        self.drafter.attach_target_head(t.embed_weight(), t.lm_head_weight())
        self.model = compile_drafter(self.drafter) if cfg.trainer.compile else self.drafter
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=1e-4, fused=t.device.type == "cuda")
        self.loss_fn = build_loss(cfg.loss)
        bs, T, B = cfg.drafter.block_size, b.seq_len, b.drafter_batch
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.features = torch.randn(B, T, len(t.layer_ids), t.hidden_size, dtype=t.dtype, device=t.device)
        n = min(b.anchors, T - bs + 1)
        self.anchors = torch.stack([torch.randperm(T - bs + 1, generator=gen)[:n].sort().values + 1
                                    for _ in range(B)]).to(t.device)
        self.anchor_tokens = torch.randint(0, t.vocab_size - 1, (B, n), device=t.device)
        self.labels = torch.randint(0, t.vocab_size - 1, (B * n, bs - 1), device=t.device)
        self.phases: dict[str, float] = {}

    def useful_flops(self) -> int:
        """FLOPs of one step counted on its eager SDPA twin, before anything is compiled: the attention kernel
        and compilation change how the work runs, not how much of it is useful (masked-out keys are not counted
        either way), and a counting dispatch mode must not meet compiled code (it breaks FlexAttention's trace
        and sends dynamo back to eager)."""
        from dflash.drafter.attention import attention_kernel
        saved = self.model, self.drafter.attn_kernel
        self.model, self.drafter.attn_kernel = self.drafter, attention_kernel("sdpa")
        try:
            return _flops(self.step)
        finally:
            self.model, self.drafter.attn_kernel = saved

    def step(self, timed: bool = False) -> None:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if timed else None
        mark = (lambda i: ev[i].record()) if timed else (lambda i: None)  # noqa: E731
        mark(0)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            hidden = self.model(self.features, self.anchors, self.anchor_tokens)
        mark(1)
        B, N, K, H = hidden.shape
        stats = compute_position_stats(hidden.reshape(B * N, K, H), self.drafter.lm_head_VH, self.labels,
                                       chunk_size=self.cfg.loss.chunk_size, lm_head_grad=self.cfg.loss.lm_head_grad)
        loss = self.loss_fn.reduce(stats, self.labels != IGNORE_INDEX)
        mark(2)
        loss.backward()
        mark(3)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mark(4)
        if timed:
            torch.cuda.synchronize()
            names = ["drafter_forward", "lm_head_loss", "backward", "optimizer"]
            for i, name in enumerate(names):
                self.phases[name] = self.phases.get(name, 0.0) + ev[i].elapsed_time(ev[i + 1]) / 1e3

    def run(self) -> dict:
        flops = self.useful_flops()
        for _ in range(self.b.warmup):
            self.step()
        sec = _timed(self.step, self.b.iters, self.device)
        if self.device.type == "cuda":
            self.phases = {}
            for _ in range(3):
                self.step(timed=True)
            self.phases = {k: v / 3 for k, v in self.phases.items()}
        data_tokens = self.b.drafter_batch * self.b.seq_len
        out = {"tok_s": data_tokens / sec, "flops_per_tok": flops / data_tokens, "sec_per_step": sec,
               "phases": self.phases}
        if self.device.type == "cuda" and self.b.kernel_profile:
            out["kernels"] = profile_kernels(self.step)
        return out


def bench_pipeline(cfg: RunConfig, target: Target, b: BenchConfig) -> dict:
    """The real trainer on synthetic sequences of exactly `seq_len` tokens; throughput after warm-up,
    then `profile_steps` steps traced to count host syncs inside the step. `cfg.run_dir` must be this
    measurement's own: its metrics.jsonl is read back."""
    from dflash.training.trainer import Trainer
    steps = b.pipeline_steps + b.profile_steps
    run_cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, source="synthetic", min_len=b.seq_len, max_len=b.seq_len,
                                 num_sequences=max(64, 4 * steps)),
        trainer=dataclasses.replace(cfg.trainer, max_steps=steps, num_anchors=b.anchors,
                                    sequences_per_step=b.drafter_batch, checkpoint_every=10**9,
                                    eval_every=0, warmup_steps=1, online_data=False),
        tracking=dataclasses.replace(cfg.tracking, enabled=False, console=False,
                                     log_every=max(1, b.pipeline_steps // 2)))
    trainer = Trainer(run_cfg, target=target)
    trainer._finish = lambda loggers, metrics: None  # a benchmark writes no final drafter
    syncs: dict = {}
    if b.profile_steps:
        trainer._step = traced_steps(trainer, b.pipeline_steps, b.profile_steps, syncs, bool(b.sync_stacks))
    trainer.run()
    # the interval that ends at pipeline_steps (warm-up before it, the profiled steps after it)
    metrics = next((r for r in read_jsonl_metrics(trainer.run_dir) if r.get("step") == b.pipeline_steps), {})
    out = {k: v for k, v in metrics.items() if k.startswith(("perf/", "buffer/total"))}
    if syncs:
        out["host_syncs_per_step"] = syncs["syncs"] / max(syncs["steps"], 1)
        out["host_reads_per_step"] = syncs["host_reads"] / max(syncs["steps"], 1)
        out["sync_calls"] = {k: v for k, v in syncs.items() if k not in ("steps", "syncs", "sites", "host_reads")}
        out["sync_sites"] = syncs["sites"]
    out["producer_batch"] = cfg.trainer.producer_batch
    out["producer_mode"] = "inline" if trainer.producers_inline else "thread"
    return out


def run_bench(cfg: RunConfig, b: BenchConfig) -> dict:
    sections = set(b.sections.split(","))
    drafter_variants = variant_configs(cfg, b.drafter_variants, "drafter_variants")
    pipeline_variants = variant_configs(cfg, b.pipeline_variants, "pipeline_variants")
    info = init_distributed()  # under torchrun: before the target, so "cuda" is this rank's GPU
    target = Target(cfg.target)
    dev = target.device
    split = cfg.trainer.device not in ("auto", str(dev)) and "cuda" in cfg.trainer.device
    out: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "kernels": target.kernels, "world_size": info.world,
                 # GPUs the pipeline uses: one per rank, two per rank when target and drafter are split
                 "gpus": info.world * (2 if split else 1), "attn_group": cfg.drafter.attn_group}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    if "peak" in sections:
        out["peak_flops"] = matmul_peak(b.peak_n if dev.type == "cuda" else 512, dev)
        log.info("bench peak: %.0f TFLOP/s", out["peak_flops"] / 1e12)
    if "target" in sections:
        out["target"] = _measure("target", lambda: bench_target(target, b))
    if "target_torch" in sections and any(v != "torch" for v in target.kernels.values()):
        # skipped where the fast path is absent anyway
        out["target_torch"] = _measure("target_torch", lambda: bench_target_torch(target, b))
    if "drafter" in sections:
        out["drafter"] = _measure("drafter", lambda: DrafterStepBench(cfg, target, b).run())
    for label, vcfg in drafter_variants.items():
        out.setdefault("drafter_variants", {})[label] = _measure(
            f"drafter [{label}]", lambda vcfg=vcfg: DrafterStepBench(vcfg, target, b).run(), keep_going=True)
    if "pipeline" in sections and b.pipeline_steps:
        out["pipeline"] = _measure("pipeline", lambda: bench_pipeline(in_dir(cfg, "pipeline"), target, b))
    for i, (label, vcfg) in enumerate(pipeline_variants.items()):
        out.setdefault("pipeline_variants", {})[label] = _measure(
            f"pipeline [{label}]", lambda vcfg=vcfg, i=i: bench_pipeline(in_dir(vcfg, f"pipeline_variant{i}"), target, b),
            keep_going=True)
    if dev.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return derive(out)


def in_dir(cfg: RunConfig, name: str) -> RunConfig:
    """`cfg` with its own run folder under the benchmark's (`run_dir`, else runs/bench-<time>): every pipeline
    measurement writes and reads back its own metrics.jsonl."""
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
    """MFU of each side and of the pipeline (target + drafter FLOPs per data token)."""
    peak = out.get("peak_flops")
    t, d, p = out.get("target"), out.get("drafter"), out.get("pipeline")
    if peak and t:
        t["mfu"] = t["tok_s"] * t["flops_per_tok"] / peak
    if peak and d:
        d["mfu"] = d["tok_s"] * d["flops_per_tok"] / peak
    if t and d:
        serial = 1 / (1 / t["tok_s"] + 1 / d["tok_s"])
        out["back_to_back_tok_s"] = serial
        if peak:
            out["back_to_back_mfu"] = serial * (t["flops_per_tok"] + d["flops_per_tok"]) / peak
    for p in ([p] if p else []) + list(out.get("pipeline_variants", {}).values()):
        tok, gpus = p.get("perf/pipeline_tok_s", 0.0), out.get("gpus", 1)
        p["tok_s_per_gpu"] = tok / gpus
        if t and d and peak:
            p["mfu"] = tok * (t["flops_per_tok"] + d["flops_per_tok"]) / (peak * gpus)
    for v in out.get("drafter_variants", {}).values():
        if peak and "tok_s" in v:
            v["mfu"] = v["tok_s"] * v["flops_per_tok"] / peak
    return out


def format_table(out: dict) -> str:
    rows = [("device", out["device"], ""), ("kernels", str(out["kernels"]), "")]
    if "peak_flops" in out:
        rows.append(("matmul peak", f"{out['peak_flops'] / 1e12:.0f} TFLOP/s", "measured"))
    for side in ("target", "drafter"):
        if side in out:
            s = out[side]
            rows.append((f"{side} tok/s", f"{s['tok_s']:,.0f}",
                         f"{s['flops_per_tok'] / 1e9:.1f} GFLOP/tok, MFU {s.get('mfu', 0):.0%}"))
    if "target_torch" in out:
        s, fast = out["target_torch"], out.get("target", {}).get("tok_s", 0.0)
        rows.append(("target tok/s, torch GDN", f"{s['tok_s']:,.0f}",
                     f"fast path is {fast / s['tok_s']:.2f}x" if s["tok_s"] else ""))
    base = out.get("drafter", {}).get("tok_s", 0.0)
    for label, s in out.get("drafter_variants", {}).items():
        if "error" in s:
            rows.append((f"drafter tok/s [{label}]", "failed", s["error"]))
            continue
        ratio = f"{s['tok_s'] / base:.2f}x the default, " if base else ""
        rows.append((f"drafter tok/s [{label}]", f"{s['tok_s']:,.0f}",
                     f"{ratio}{s['sec_per_step'] * 1e3:.1f} ms/step, MFU {s.get('mfu', 0):.0%}"))
    if "back_to_back_tok_s" in out:
        rows.append(("back-to-back tok/s", f"{out['back_to_back_tok_s']:,.0f}",
                     f"MFU {out.get('back_to_back_mfu', 0):.0%} (serial sum of the two sides)"))
    if "pipeline" in out:
        rows.append(_pipeline_row("pipeline tok/s", out["pipeline"], out))
        p = out["pipeline"]
        if "host_syncs_per_step" in p:
            rows.append(("host syncs in step", (f"{p['host_syncs_per_step']:.2f}/step, "
                                                f"{p.get('host_reads_per_step', 0):.2f} host reads/step"),
                         f"profiler trace; {p.get('sync_calls') or 'none'}; at {p.get('sync_sites') or '-'}"))
    for label, p in out.get("pipeline_variants", {}).items():
        rows.append(_pipeline_row(f"pipeline tok/s [{label}]", p, out))
    if "drafter" in out and out["drafter"].get("phases"):
        ph = out["drafter"]["phases"]
        total = sum(ph.values()) or 1
        rows.append(("drafter step", " | ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ph.items()),
                     " | ".join(f"{v / total:.0%}" for v in ph.values())))
    for label, d in [("default", out.get("drafter", {}))] + list(out.get("drafter_variants", {}).items()):
        if d.get("kernels"):
            fams = d["kernels"]["ms_per_step"]
            rows.append((f"drafter kernels [{label}]", " | ".join(f"{k} {v:.1f}" for k, v in fams.items()),
                         "ms/step of GPU time by kernel family"))
    if "peak_mem_gb" in out:
        rows.append(("peak GPU memory", f"{out['peak_mem_gb']:.1f} GiB", ""))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}  {c}" for a, b, c in rows)


def _pipeline_row(name: str, p: dict, out: dict) -> tuple[str, str, str]:
    if "error" in p:
        return name, "failed", p["error"]
    return (name, f"{p.get('perf/pipeline_tok_s', 0):,.0f}",
            (f"{out.get('gpus', 1)} device(s), {p.get('tok_s_per_gpu', 0):,.0f} each, "
             f"MFU {'n/a' if 'mfu' not in p else format(p['mfu'], '.0%')}; "
             f"consumer waits {p.get('perf/consumer_wait_frac', 0):.0%}; "
             f"producer batch {p.get('producer_batch', 1)}, {p.get('producer_mode', '?')}"))
