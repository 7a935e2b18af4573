"""Which reference-target shape learns most in a fixed time: `python benchmarks/gpu/pretrain_shapes.py`.

Loads the corpus once (`--scope`, default installed), trains its tokenizer and writes it to `--tokenizer-out`
(so the pretraining that follows reuses it and hits the token cache), then trains each candidate shape for
`--seconds` of wall clock on the same windows and measures tokens/s and the val loss it reached. Prints a
table, writes `--out` (JSON) and prints the overrides of the shape with the lowest val loss as the last
line (`CHOSEN: key=value ...`), with `max_steps` sized to `--train-seconds` at its measured rate.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash.data.corpus import CorpusConfig
from dflash.devices import resolve_device
from dflash.pretrain.config import PretrainConfig
from dflash.pretrain.data import WindowSampler, prepare_data
from dflash.pretrain.evaluate import eval_windows, evaluate_nll
from dflash.pretrain.loop import build_optimizer, lr_at, train_step, training_loss_fn
from dflash.pretrain.model import bf16_bytes, build_hf_config, build_model, count_params, select_gdn_kernels

SHAPES = {  # name → PretrainConfig overrides (all qwen3_5, every 4th layer full attention)
    "h256_l8": dict(hidden_size=256, num_layers=8, intermediate_size=768, num_heads=4, num_kv_heads=2,
                    linear_num_key_heads=4, linear_num_value_heads=4),
    "h384_l8": dict(hidden_size=384, num_layers=8, intermediate_size=1024, num_heads=6, num_kv_heads=2,
                    linear_num_key_heads=4, linear_num_value_heads=8),
    "h320_l12": dict(hidden_size=320, num_layers=12, intermediate_size=896, num_heads=4, num_kv_heads=2,
                     linear_num_key_heads=4, linear_num_value_heads=4),
}


def measure(cfg: PretrainConfig, data, device, seconds: float, val_tokens: int) -> dict:
    model = build_model(build_hf_config(cfg, data.tok.get_vocab_size(), data.eos_id, data.pad_id), cfg.seed)
    model.to(device).train()
    choice, _, kernels = select_gdn_kernels(model, device, cfg, torch.bfloat16, "qwen3_5")
    sampler = WindowSampler(data.train.to(device), cfg.seq_len, cfg.batch_size, cfg.seed)
    opt = build_optimizer(cfg, model, device)
    loss_fn = training_loss_fn(cfg, model, torch.bfloat16 if device.type == "cuda" else None)
    steps, t0, warm_t, warm_steps = 0, time.perf_counter(), None, 0
    while time.perf_counter() - t0 < seconds:
        for gr in opt.param_groups:  # the schedule as a run of `seconds` would have it
            gr["lr"] = lr_at(cfg, steps, (time.perf_counter() - t0) / seconds)
        train_step(model, opt, loss_fn, sampler.next(), cfg.grad_clip)
        steps += 1
        if steps == 5:
            torch.cuda.synchronize() if device.type == "cuda" else None
            warm_t, warm_steps = time.perf_counter(), steps
    torch.cuda.synchronize() if device.type == "cuda" else None
    dt = time.perf_counter() - (warm_t or t0)
    tok_s = (steps - warm_steps) * cfg.batch_size * cfg.seq_len / max(dt, 1e-9)
    s, n = evaluate_nll(model, eval_windows(data.val, cfg.seq_len, val_tokens), cfg.batch_size, torch.bfloat16, device)
    kernels.restore()
    return {"params": count_params(model), "bf16_mb": bf16_bytes(model) / 1e6, "steps": steps, "tok_s": tok_s,
            "val_loss": s / n, "val_ppl": math.exp(s / n), "kernels": choice}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scope", default="installed")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--train-seconds", type=float, default=330.0)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--split-newlines", action="store_true", help="tokenizer_split_newlines=true")
    ap.add_argument("--token-cache", default="/tmp/dflash_tokens")
    ap.add_argument("--tokenizer-out", default="/tmp/dflash_tokenizer")
    ap.add_argument("--val-tokens", type=int, default=262144)
    ap.add_argument("--out", default="pretrain_shapes.json")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    base = PretrainConfig(corpus=CorpusConfig(scope=a.scope), token_cache_dir=a.token_cache, gdn_kernels="torch",
                          batch_size=a.batch_size, seq_len=a.seq_len, warmup_steps=50,
                          tokenizer_split_newlines=a.split_newlines)
    device = resolve_device("auto")
    t0 = time.perf_counter()
    data = prepare_data(base)
    Path(a.tokenizer_out).mkdir(parents=True, exist_ok=True)  # the raw tokenizer: same fingerprint, cache hit
    (Path(a.tokenizer_out) / "tokenizer.json").write_text(data.tok.to_str(), encoding="utf-8")
    report = {"corpus": data.corpus_stats, "setup": data.setup, "setup_s": time.perf_counter() - t0, "shapes": {}}
    print(f"corpus: {json.dumps({k: v for k, v in data.corpus_stats.items() if k != 'fingerprint'})}")
    for name in a.shapes.split(","):
        cfg = replace(base, **SHAPES[name], max_steps=10 ** 9)
        report["shapes"][name] = r = measure(cfg, data, device, a.seconds, a.val_tokens)
        print(f"{name}: {r['params']:,} params ({r['bf16_mb']:.1f} MB bf16), {r['tok_s']:,.0f} tok/s, "
              f"{r['steps']} steps in {a.seconds:.0f} s, val loss {r['val_loss']:.3f} (ppl {r['val_ppl']:.2f})",
              flush=True)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    best = min(report["shapes"], key=lambda k: report["shapes"][k]["val_loss"])
    steps = int(report["shapes"][best]["tok_s"] * a.train_seconds / (a.batch_size * a.seq_len))
    report["chosen"] = {"shape": best, "max_steps": steps}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("CHOSEN: " + " ".join(f"{k}={v}" for k, v in {**SHAPES[best], "max_steps": steps}.items()))


if __name__ == "__main__":
    main()
