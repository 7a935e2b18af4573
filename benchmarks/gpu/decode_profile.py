"""Where the online writer's decode step goes: wall ms per step at two batch widths, and the ops of
a profiled stretch by host time and by device time.

    PYTHONPATH=$PWD python benchmarks/gpu/decode_profile.py [rows=1024] [steps=24] [device=auto]

If the step costs the same at both widths, it is host-bound: that is the case for CUDA graphs.
"""
from __future__ import annotations

import sys
import time

import torch

from dflash.data.writing import write_continuations
from dflash.target.model import Target
from experiments.config import compose_config


def _sync(target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(target, rows: int, steps: int) -> float:
    prompts = [[5 + (r * 7 + j) % 300 for j in range(8)] for r in range(rows)]
    write_continuations(target, prompts, 8 + 4)  # warm-up: kernels, autotuning
    _sync(target)
    t0 = time.perf_counter()
    write_continuations(target, prompts, 8 + steps)
    _sync(target)
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    rows, steps = int(args.get("rows", 1024)), int(args.get("steps", 24))
    target = Target(compose_config([f"target.device={args.get('device', 'auto')}"]).target)
    for r in (rows // 4, rows):
        print(f"rows {r}: {step_ms(target, r, steps):.1f} ms per decode step", flush=True)
    from torch.profiler import ProfilerActivity, profile
    prompts = [[5 + (r * 7 + j) % 300 for j in range(8)] for r in range(rows)]
    cuda = target.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        write_continuations(target, prompts, 8 + steps)
        _sync(target)
    ev = prof.key_averages()
    print(f"aten ops per step: {sum(e.count for e in ev if e.key.startswith('aten::')) / steps:.0f}")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=12))
    if cuda:
        print(ev.table(sort_by="self_cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main(sys.argv[1:])
