"""What a campaign cell cost beside what it reached: its GPU-seconds, the tokens it trained on per second, τ per
GPU-hour, and the options compared at equal GPU time along their learning curves (docs/sweeps.md, "Cost").

A cell's GPU-seconds are the wall seconds of its training loop (`sys/loop_s`, which holds its in-training
evaluations too) times the GPUs its training ran on (`perf/world_size`, logged by a distributed run; 1 otherwise).
A resumed cell's record holds its last leg's loop alone, so its GPU-seconds are its consumed tokens at that leg's
rate. Cells that ran beside others on one GPU (a campaign's `workers`) each count their own wall time: their cost
is what they took with the GPU shared as it was, not what they would take alone.

The equal-GPU-time view reads each cell's learning curve (the objective at every in-training evaluation and at
its end, `sweeps.learning_curves.eval_curve`) with the GPU-seconds at each point (`gpu_curve`: from the wall-clock
stamps of `metrics.jsonl`, counted back from the loop's end), and compares the options at the GPU time of the cheapest option's full run (its slowest seed's): each at its last
evaluation within it (a measured point, never interpolated).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sweeps.learning_curves import eval_curve, read_metrics


def cell_cost(cell: dict) -> dict[str, float] | None:
    """{"gpu_s", "tok_s", "tau_per_gpu_h"} of a finished cell's record; None where it lacks its loop time."""
    loop_s = (cell.get("phases_s") or {}).get("loop_s")
    total = cell.get("consumed_tokens")
    # a resumed cell's loop time is its last leg's: without that leg's tokens its rate cannot be had
    leg = cell.get("leg_tokens") or (None if cell.get("resumed") else total)
    if not loop_s or not leg or not total or cell.get("value") is None:
        return None
    tok_s = leg / loop_s  # the whole leg's rate (perf/consumed_tok_s is the last log interval's)
    gpu_s = total / tok_s * int(cell.get("gpus") or 1)
    return {"gpu_s": gpu_s, "tok_s": tok_s, "tau_per_gpu_h": float(cell["value"]) / (gpu_s / 3600)}


def gpu_curve(rows: Sequence[dict], objective: str, total_gpu_s: float, gpus: int = 1) -> list[tuple[float, float]]:
    """(GPU-seconds, objective) at every evaluation of one uninterrupted run whose loop took `total_gpu_s`: a
    point's GPU-seconds are the total less the wall seconds from its step's metrics row to the loop's last row
    (the run's own clock stamps), times `gpus`; the final evaluation sits at the total."""
    step_of: dict[float, int] = {}
    time_of: dict[int, float] = {}
    for r in rows:
        if "data/consumed_tokens" in r and "time" in r:
            step_of.setdefault(r["data/consumed_tokens"], r["step"])
            time_of.setdefault(r["step"], r["time"])
    if not time_of:
        return []
    end = time_of[max(time_of)]
    return [(max(total_gpu_s - (end - time_of[step_of[tok]]) * gpus, 0.0), value)
            for tok, value in eval_curve(rows, objective) if tok in step_of]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def cost_lines(cells: list[dict]) -> list[str]:
    """A markdown table: per option, the mean over its finished cells of GPU-seconds, consumed tokens per second
    and τ per GPU-hour (`cell_cost`)."""
    by_opt: dict[str, list[dict]] = {}
    for x in cells:
        got = cell_cost(x)
        if got is not None:
            by_opt.setdefault(x["option"], []).append(got)
    if not by_opt:
        return []
    rows = ["Cost (mean over the option's cells; wall time of the training loop × its GPUs, cells sharing a GPU each "
            "counting their own wall time: sweeps/cost.py):", "",
            "| option | cells | GPU-s | consumed tok/s | τ per GPU-hour |", "|---|---|---|---|---|"]
    for opt, got in by_opt.items():
        rows.append(f"| {opt} | {len(got)} | {_mean([g['gpu_s'] for g in got]):,.0f} | "
                    f"{_mean([g['tok_s'] for g in got]):,.0f} | {_mean([g['tau_per_gpu_h'] for g in got]):.2f} |")
    return [*rows, ""]


def equal_gpu_time_lines(cells: list[dict], objective: str) -> list[str]:
    """The options at equal GPU time: each option's objective, mean over its seeds, at its last evaluation within
    the GPU-seconds of the cheapest option's full run (resumed cells left out: their wall clock has a gap)."""
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for x in cells:
        if x.get("value") is None or x.get("resumed") or x.get("reused_from"):
            continue
        cost = cell_cost(x)
        if cost is None:
            continue
        pts = gpu_curve(read_metrics(Path(x["run_dir"])), objective, cost["gpu_s"], int(x.get("gpus") or 1))
        if len(pts) > 1:
            curves.setdefault(x["option"], []).append(pts)
    if len(curves) < 2:
        return []
    budget = min(max(c[-1][0] for c in cs) for cs in curves.values())  # every seed of the cheapest option: its end
    said = []
    for opt, cs in curves.items():
        within = [[p for p in c if p[0] <= budget * 1.001] for c in cs]
        if any(not w for w in within):
            said.append(f"{opt}: no evaluation within it")
            continue
        said.append(f"{opt} {_mean([w[-1][1] for w in within]):.3f} (at {_mean([w[-1][0] for w in within]):,.0f} "
                    f"GPU-s)")
    return [f"At equal GPU time ({budget:,.0f} GPU-s, the cheapest option's full run; each option's last "
            f"evaluation within it, mean over its seeds): " + "; ".join(said) + ".", ""]
