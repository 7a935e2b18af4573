"""Where a real training run's loop time goes (benchmarks/RESULTS.md: a run reading shards once consumed 87% of the
tokens per second that the bench's back-to-back measured at the same shapes).

`LoopProfiler` is a `Trainer.run(around_step=...)` hook: the torch profiler runs from the start of loop step
`start` to the end of step `start + steps - 1`. `loop_breakdown` then splits the consumer thread's wall time
into its two profiled ranges — `dflash.next_items` (the items of a step: with the inline producer, shard reads,
the target's forwards and the buffer) and `dflash.train_step` (batch, drafter step, metrics) — and the rest
(logging, checkpoints), gives the GPU's busy fraction (the union of its kernels' intervals over the same wall
time), and names the costliest host ops inside each range.
"""
from __future__ import annotations

from contextlib import contextmanager

from dflash.bench.profiling import on_cpu, device_kernels

RANGES = ("dflash.next_items", "dflash.train_step")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def loop_breakdown(events, top: int = 8) -> dict:
    """Per profiled step, in ms: the consumer's time in each range, the rest, the GPU's busy time and the
    costliest host ops (self time) inside each range."""
    steps = [e for e in events if e.name == "dflash.train_step" and on_cpu(e)]
    if not steps:
        return {"steps": 0}
    thread = steps[0].thread
    mine = [e for e in events if e.thread == thread and on_cpu(e)]
    t0 = min(e.time_range.start for e in mine)
    t1 = max(e.time_range.end for e in mine)
    n, wall = len(steps), t1 - t0
    out: dict = {"steps": n, "wall_ms_per_step": wall / 1e3 / n}
    for name in RANGES:
        spans = [(e.time_range.start, e.time_range.end) for e in mine if e.name == name]
        out[f"{name}_ms_per_step"] = _union_us(spans) / 1e3 / n
        ops: dict[str, float] = {}
        for e in mine:
            if e.name not in RANGES and any(a <= e.time_range.start < b for a, b in spans):
                ops[e.name] = ops.get(e.name, 0.0) + e.self_cpu_time_total
        out[f"{name}_top_ops"] = [{"op": k[:80], "ms_per_step": v / 1e3 / n}
                                  for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]]
    out["other_ms_per_step"] = out["wall_ms_per_step"] - sum(out[f"{r}_ms_per_step"] for r in RANGES)
    kernels = [(e.time_range.start, e.time_range.end) for e in device_kernels(events)]
    clipped = [(max(a, t0), min(b, t1)) for a, b in kernels if b > t0 and a < t1]
    out["gpu_busy_frac"] = _union_us(clipped) / wall if wall > 0 and clipped else 0.0
    return out


class LoopProfiler:
    """`around_step` for `Trainer.run`: profiles loop steps start .. start + steps - 1 into `result`."""

    def __init__(self, device, start: int, steps: int):
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=acts)
        self.start, self.steps, self.result = start, steps, {}

    @contextmanager
    def around_step(self, step: int):
        if step == self.start:
            self.prof.start()
        yield
        if step == self.start + self.steps - 1:
            self.prof.stop()
            self.result = loop_breakdown(self.prof.events())
