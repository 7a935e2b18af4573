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


def _option_curves(cells: list[dict], objective: str) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """option -> seed -> its (GPU-seconds, objective) curve; resumed cells left out (their wall clock has a gap)."""
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for x in cells:
        if x.get("value") is None or x.get("resumed") or x.get("reused_from"):
            continue
        cost = cell_cost(x)
        if cost is None:
            continue
        pts = gpu_curve(read_metrics(Path(x["run_dir"])), objective, cost["gpu_s"], int(x.get("gpus") or 1))
        if len(pts) > 1:
            curves.setdefault(x["option"], {})[int(x.get("seed") or 0)] = pts
    return curves


def _at_budget(curve: list[tuple[float, float]], budget: float) -> tuple[float, float] | None:
    """The curve's last evaluation within `budget` GPU-seconds (a measured point, never interpolated)."""
    within = [p for p in curve if p[0] <= budget * 1.001]
    return within[-1] if within else None


def _leader_verdict(at: dict[str, dict[int, tuple[float, float]]]) -> str:
    """Which option leads at one budget (highest mean over its seeds), and whether it leads on every seed the
    options share (seed for seed; the in-training evaluations keep no per-prompt results, so no paired interval)."""
    means = {o: _mean([v for _, v in by_seed.values()]) for o, by_seed in at.items()}
    lead = max(means, key=means.get)
    behind = [o for o in at if o != lead]
    if not behind:
        return f"{lead} alone"
    beaten = [o for o in behind if (shared := set(at[lead]) & set(at[o]))
              and all(at[lead][s][1] > at[o][s][1] for s in shared)]
    if len(beaten) == len(behind):
        return f"**{lead}**, ahead on every seed"
    return f"{lead} (tied, seed for seed, with {', '.join(o for o in behind if o not in beaten)})"


def equal_gpu_time_lines(cells: list[dict], objective: str) -> list[str]:
    """The options at equal GPU time: at the GPU-seconds of each option's full run (its slowest seed's), every
    option's last evaluation within it (mean over its seeds; "—" where a seed has none) and which option leads
    there (`_leader_verdict`): a learning curve in GPU-seconds, read at the budgets the options' own runs define.
    The cheapest option's full run is the first budget: the one at which every option can be compared, if any."""
    curves = _option_curves(cells, objective)
    if len(curves) < 2:
        return []
    budgets = sorted({max(c[-1][0] for c in by_seed.values()) for by_seed in curves.values()})
    options = list(curves)
    rows = [f"At equal GPU time (`{objective}` at each option's last evaluation within the GPU-seconds of a full run, "
            "mean over its seeds, at its mean GPU-seconds there; budgets: each option's full run, its slowest "
            "seed's; the leader is ahead on every seed or tied):", "",
            "| GPU-s | " + " | ".join(options) + " | leads |", "|---" * (len(options) + 2) + "|"]
    for budget in budgets:
        at: dict[str, dict[int, tuple[float, float]]] = {}
        cols = []
        for opt in options:
            pts = {seed: _at_budget(c, budget) for seed, c in curves[opt].items()}
            if any(p is None for p in pts.values()):
                cols.append("—")
                continue
            at[opt] = pts
            cols.append(f"{_mean([v for _, v in pts.values()]):.3f} ({_mean([g for g, _ in pts.values()]):,.0f} s)")
        rows.append(f"| {budget:,.0f} | " + " | ".join(cols) + f" | {_leader_verdict(at) if at else '—'} |")
    return [*rows, ""]
