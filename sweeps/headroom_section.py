"""Headroom beside a stage's τ in the campaign report (docs/evaluation.md, "Headroom: the oracle, reach and the
target's entropy"): how deep into the block each option's rounds get, how predictable the target's text is, and,
where the campaign measured it, the oracle's τ and the share of the prompt-lookup-to-oracle gap each option closes.

The figures are the objective table's own (`stats` of `eval/served/tasks.json`, written by
`dflash.evaluation.headroom`): `eval/reach_posNN`, `eval/target_entropy_*`, `eval/tau_oracle`,
`eval/oracle_gap_closed`; a campaign evaluated before they were recorded gets no section.
"""
from __future__ import annotations

import math

REACH_POSITIONS = (2, 3, 4, 6, 8, 12)


def _mean_stat(tables: dict[int, dict], key: str) -> float:
    vals = [float(t["stats"][key]) for t in tables.values() if key in (t.get("stats") or {})]
    return sum(vals) / len(vals) if vals else math.nan


def reach_shares(tables: dict[int, dict], positions: tuple[int, ...] = REACH_POSITIONS) -> dict[int, float]:
    """The share of rounds reaching each block position k, the mean over an option's seeds (nan where its tables
    carry no `eval/reach_posNN`)."""
    return {k: _mean_stat(tables, f"eval/reach_pos{k:02d}") for k in positions}


def pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{100 * x:.1f}%"


def headroom_section(by_opt: dict[str, dict[int, dict]]) -> list[str]:
    """Markdown: the target's entropy along the ground truth, the oracle τ where measured, and per option the share
    of rounds reaching block positions 2 … 12 and the gap it closes. Empty where no table records reach."""
    tables = [t for seeds in by_opt.values() for t in seeds.values()]
    if not any(str(k).startswith("eval/reach_pos") for t in tables for k in (t.get("stats") or {})):
        return []
    every = {i: t for i, t in enumerate(tables)}
    ent = {k: _mean_stat(every, f"eval/target_entropy_{k}") for k in ("mean", "median", "below_0.1")}
    oracle = _mean_stat(every, "eval/tau_oracle")
    lines = ["Headroom (the objective table's, mean over each option's seeds): share of rounds reaching block "
             "position k" + (", and the share of the prompt-lookup-to-oracle gap closed" if not math.isnan(oracle)
                             else "") + ".", ""]
    if not math.isnan(ent["mean"]):
        lines += [f"The target's entropy along the ground truth: mean {ent['mean']:.2f} nats, median "
                  f"{ent['median']:.2f}, {pct(ent['below_0.1'])} of tokens below 0.1 nats.", ""]
    lines += [f"Oracle τ (the target's own marginals as the drafter, same rule and ground truth): {oracle:.3f}."
              if not math.isnan(oracle) else "Oracle τ: not measured in this campaign (`eval.oracle.samples=0`).", ""]
    head = ["option", *(f"k={k}" for k in REACH_POSITIONS)] + (["gap closed"] if not math.isnan(oracle) else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for opt, seeds in by_opt.items():
        row = [opt, *(pct(v) for v in reach_shares(seeds).values())]
        if not math.isnan(oracle):
            row.append(pct(_mean_stat(seeds, "eval/oracle_gap_closed")))
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]
