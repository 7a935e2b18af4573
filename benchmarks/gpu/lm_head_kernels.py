"""The LM-head work at the 27B shapes, before and after, side by side in one process (docs/benchmarks.md):
`python benchmarks/gpu/lm_head_kernels.py [--positions 4096] [--target-positions 8192] [--iters 10]`.

A random bf16 head of Qwen3.6-27B's shape (V = 248,320, D = 5,120), then:
- the drafter's LM-head loss, forward and backward, at `loss.lm_head_kernel` = torch and = triton, on the same
  hidden states and labels (the published drafter's 256 anchors × 16 positions = 4,096 per sequence): ms per
  call, and how far the two paths' CE and hidden-state gradients lie apart;
- the target's labels (`Target.labels_from_hidden`'s argmax over the head), upcast to float32 first (as before
  2026-12-01) and on the bf16 logits (now): ms per producer batch of 4 × 2,048 positions, and whether they agree.
Prints one JSON line per figure and a table last. Runs on the CPU too (a smoke run at tiny sizes).
"""
from __future__ import annotations

import argparse
import json

import torch

from dflash.bench.flops import timed
from dflash.training.lm_head_loss import fused_position_stats, resolve_chunk

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def timed_ms(fn, iters: int) -> float:
    """Mean ms a call after one warm-up call (`dflash.bench.flops.timed`)."""
    return timed(fn, iters, DEV, warmup=1) * 1e3


def loss_pass(hidden, head, labels, kernel: str):
    h = hidden.detach().requires_grad_()
    ce = fused_position_stats(h, head, labels, None, None, temperature=1.0, chunk_size=resolve_chunk(0, head.shape[0]),
                              kernel=kernel)[0]
    ce.sum().backward()
    return ce.detach(), h.grad


def labels_upcast(last, head, chunk):
    return torch.cat([(last[s:s + chunk] @ head.T).float().argmax(-1) for s in range(0, last.shape[0], chunk)])


def labels_native(last, head, chunk):
    return torch.cat([(last[s:s + chunk] @ head.T).argmax(-1) for s in range(0, last.shape[0], chunk)])


def main() -> None:
    ap = argparse.ArgumentParser()
    cpu = DEV.type == "cpu"
    ap.add_argument("--vocab", type=int, default=4096 if cpu else 248_320)
    ap.add_argument("--hidden", type=int, default=64 if cpu else 5120)
    ap.add_argument("--positions", type=int, default=256 if cpu else 4096)
    ap.add_argument("--target-positions", type=int, default=512 if cpu else 8192)
    ap.add_argument("--iters", type=int, default=2 if cpu else 10)
    a = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    head = (torch.randn(a.vocab, a.hidden, device=DEV, generator=g) * 0.02).bfloat16()
    hidden = torch.randn(a.positions, a.hidden, device=DEV, generator=g).bfloat16()
    labels = torch.randint(0, a.vocab, (a.positions,), device=DEV, generator=g)
    rows = []
    kernels = ["torch", "triton"] if DEV.type == "cuda" else ["torch"]
    ref = None
    for kernel in kernels:
        ms = timed_ms(lambda k=kernel: loss_pass(hidden, head, labels, k), a.iters)
        ce, grad = loss_pass(hidden, head, labels, kernel)
        diff = {} if ref is None else {"ce_max_abs_diff": (ce - ref[0]).abs().max().item(),
                                       "grad_max_rel_diff": ((grad.float() - ref[1].float()).abs().max()
                                                             / ref[1].float().abs().max()).item()}
        ref = ref or (ce, grad)
        rows.append({"what": f"drafter LM-head loss fwd+bwd, lm_head_kernel={kernel}", "ms": ms,
                     "positions": a.positions, **diff})
        print(json.dumps(rows[-1]), flush=True)
    last = torch.randn(a.target_positions, a.hidden, device=DEV, generator=g).bfloat16()
    chunk = resolve_chunk(0, a.vocab)
    agree = torch.equal(labels_upcast(last, head, chunk), labels_native(last, head, chunk))
    for name, fn in (("float32 upcast, then argmax (before)", labels_upcast), ("argmax of bf16 (now)", labels_native)):
        rows.append({"what": f"target labels: {name}", "ms": timed_ms(lambda f=fn: f(last, head, chunk), a.iters),
                     "positions": a.target_positions, "labels_identical": agree})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'what':<58} {'ms':>8}  positions")
    for r in rows:
        print(f"{r['what']:<58} {r['ms']:8.2f}  {r['positions']}")


if __name__ == "__main__":
    main()
