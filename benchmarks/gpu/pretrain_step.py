"""The reference target's pretraining step, variants side by side in one process (benchmarks/reference_target.md):
`python benchmarks/gpu/pretrain_step.py [--variants off:32,default:32,...] [--seconds 20] [--profile]`.

Each variant builds the same `h384_l8` model (seed 0), trains on random tokens of `--seq-len` (speed does not
depend on the data) with the recipe's optimizer, and reports tokens/s after its warm-up (compilation
excluded, reported apart), peak memory, and its first-step loss against the others on the same batch. A
variant is `mode:batch`, mode a `pretrain.compile` value: `off` (eager), `default`, `reduce-overhead` (CUDA
graphs) or `max-autotune-no-cudagraphs` (torch.compile of the forward + loss, as the recipe does it).
`--profile` prints the eager step's top CUDA kernels and how busy the GPU is.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from dflash.pretrain.config import PretrainConfig
from dflash.pretrain.evaluate import lm_loss
from dflash.pretrain.loop import build_optimizer, train_step, training_loss_fn
from dflash.pretrain.model import GdnKernels, build_hf_config, build_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def run_variant(cfg: PretrainConfig, mode: str, batch: int, seconds: float, warmup: int, ref_ids) -> dict:
    torch.cuda.reset_peak_memory_stats() if DEV == "cuda" else None
    model = build_model(build_hf_config(cfg, cfg.vocab_size, 1, 0), cfg.seed).to(DEV).train()
    opt = build_optimizer(cfg, model, torch.device(DEV))
    loss_fn = training_loss_fn(replace(cfg, compile=mode), model, torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(1)
    batches = [torch.randint(3, cfg.vocab_size, (batch, cfg.seq_len), device=DEV, generator=g) for _ in range(8)]

    def step(ids):
        return train_step(model, opt, loss_fn, ids, cfg.grad_clip)

    first_loss = float(loss_fn(ref_ids[:batch]).detach())  # before any update: comparable across variants
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(batches[i % 8])
    sync()
    warm_s, n, t1 = time.perf_counter() - t0, 0, time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        for _ in range(10):
            step(batches[n % 8])
            n += 1
        sync()
    dt = time.perf_counter() - t1
    out = {"mode": mode, "batch": batch, "tok_s": n * batch * cfg.seq_len / dt, "ms_per_step": 1e3 * dt / n,
           "steps": n, "warmup_s": warm_s, "peak_gib": (torch.cuda.max_memory_allocated() if DEV == "cuda" else 0) / 2 ** 30,
           "first_loss": first_loss}
    del model, opt, loss_fn
    torch.cuda.empty_cache() if DEV == "cuda" else None
    return out


def profile_eager(cfg: PretrainConfig, batch: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    model = build_model(build_hf_config(cfg, cfg.vocab_size, 1, 0), cfg.seed).to(DEV).train()
    opt = build_optimizer(cfg, model, torch.device(DEV))
    ids = torch.randint(3, cfg.vocab_size, (batch, cfg.seq_len), device=DEV)

    def step():  # no gradient clipping: the step a 2026-12-01 profile (5,733 kernels) was taken on
        lm_loss(model, ids, torch.bfloat16).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(5):
            step()
        sync()
        wall = time.perf_counter() - t
    ev = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA")
    n_kernels = sum(e.count for e in ev if e.device_type.name == "CUDA")
    print(f"eager profile, batch {batch}: {1e3 * wall / 5:.1f} ms/step wall, GPU kernels {gpu_us / 5e3:.1f} ms/step "
          f"({100 * gpu_us / 1e6 / wall:.0f}% busy), {n_kernels / 5:.0f} kernels/step")
    print(ev.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="off:32,off:64,off:128,default:32,default:128,reduce-overhead:32")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cfg = PretrainConfig(seq_len=a.seq_len)  # the h384_l8 defaults, vocab 4096
    GdnKernels("qwen3_5").use_torch()  # the recipe trains on transformers' torch GDN (docs/DESIGN.md)
    if a.profile:
        profile_eager(cfg, 32)
    variants = [(m, int(b)) for m, b in (v.split(":") for v in a.variants.split(","))]
    ref_ids = torch.randint(3, cfg.vocab_size, (max(b for _, b in variants), cfg.seq_len), device=DEV,
                            generator=torch.Generator(device=DEV).manual_seed(0))
    rows = []
    for mode, batch in variants:
        try:
            rows.append(run_variant(cfg, mode, batch, a.seconds, a.warmup, ref_ids))
        except Exception as e:  # one failing variant must not lose the others' figures
            rows.append({"mode": mode, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            torch.cuda.empty_cache() if DEV == "cuda" else None
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["tok_s"] for r in rows if r.get("mode") == "off" and "tok_s" in r), None)
    print(f"\n{'variant':<20}{'tok/s':>10}{'x off':>7}{'ms/step':>9}{'warmup s':>9}{'GiB':>6}{'loss0':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']}:{r['batch']:<8} error {r['error'][:90]}")
            continue
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        print(f"{r['mode'] + ':' + str(r['batch']):<20}{r['tok_s']:>10,.0f}{ratio:>7}{r['ms_per_step']:>9.1f}"
              f"{r['warmup_s']:>9.1f}{r['peak_gib']:>6.1f}{r['first_loss']:>8.4f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"seq_len": a.seq_len, "rows": rows, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()
