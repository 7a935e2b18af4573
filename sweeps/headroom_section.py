"""Headroom beside a stage's τ in the campaign report (docs/evaluation.md, "Headroom: the oracle, reach and the
target's entropy"): how deep into the block each option's rounds get, how predictable the target's text is, and,
where the campaign measured it, the oracle's τ and the share of the prompt-lookup-to-oracle gap each option closes.

The figures are the objective table's own (`stats` of `eval/served/tasks.json`, written by
`dflash.evaluation.headroom`): `eval/reach_posNN`, `eval/target_entropy_*`, `eval/tau_oracle`,
`eval/oracle_gap_closed`; a campaign evaluated before they were recorded gets no section. Where the cells did not
measure the oracle (`eval.oracle.samples=0`), the section reads it from `<out>/<campaign>/headroom.json`
(`python -m sweeps.campaign_headroom`, measured after the fact on the pinned ground truth of the suite's first
prompts): the oracle τ per proposal policy, and each option's gap closed on exactly those prompt samples, its τ and
prompt lookup's pooled over its seeds' rows of them, against the oracle of the policy its cells were scored under.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from dflash.evaluation.headroom import gap_closed

HEADROOM_FILE = "headroom.json"
BOUND = ("What the oracle bounds: the τ of a drafter that drafts the whole block in one pass from the prefix alone, "
         "as DFlash 1 does (position k never sees the drafts before it), up to its estimate's noise; a drafter that "
         "conditions on its own earlier drafts (DFlash 2's selector walk, trees) can beat it.")


def read_headroom(folder: Path | None) -> dict | None:
    """`<folder>/headroom.json` (a campaign's folder), or None where there is none."""
    f = Path(folder) / HEADROOM_FILE if folder is not None else None
    return json.loads(f.read_text()) if f is not None and f.is_file() else None

REACH_POSITIONS = (2, 3, 4, 6, 8, 12)


def _mean_stat(tables: dict[int, dict], key: str) -> float:
    vals = [float(t["stats"][key]) for t in tables.values() if key in (t.get("stats") or {})]
    return sum(vals) / len(vals) if vals else math.nan


def reach_shares(tables: dict[int, dict], positions: tuple[int, ...] = REACH_POSITIONS) -> dict[int, float]:
    """The share of rounds reaching each block position k, the mean over an option's seeds (nan where its tables
    carry no `eval/reach_posNN`)."""
    return {k: _mean_stat(tables, f"eval/reach_pos{k:02d}") for k in positions}


def nats(x: float) -> str:
    """An entropy in nats to 2 decimals; a value a float's rounding put below 0 (a one-hot marginal) reads 0.00."""
    return f"{x if x > 0 else 0.0:.2f}"  # max(-0.0, 0.0) is -0.0


def pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{100 * x:.1f}%"


def _oracle_of(hr: dict, policy: str, block_size: int) -> dict | None:
    return next((o for o in hr.get("oracles", []) if o["policy"] == policy and int(o["block_size"]) == block_size),
                None)


def on_oracle_prompts(seeds: dict[int, dict], hr: dict) -> tuple[float, float, dict] | None:
    """(the option's τ, prompt lookup's τ, the oracle entry of its policy), both τ pooled over its seeds' rows of
    exactly the prompt samples that oracle ran on; None where a table is of another ground truth, lacks one of those
    rows or no oracle of its policy and block size was measured."""
    sums = [0.0, 0.0, 0.0, 0.0]  # τ sum, rounds, prompt lookup's τ sum, its rounds
    oracle = None
    for t in seeds.values():
        info = t.get("info") or {}
        o = _oracle_of(hr, str(info.get("policy")), int(info.get("block_size") or 0))
        if o is None or (oracle is not None and o is not oracle) \
                or info.get("ground_truth_key") != hr["ground_truth_key"]:
            return None
        oracle = o
        names = {x["task"] for x in o["tasks"]}
        rows = [r for r in t.get("tasks") or [] if r.get("task") in names]
        if len(rows) != len(names) or any("tau_sum_prompt_lookup" not in r for r in rows):
            return None
        for i, col in enumerate(("tau_sum_vanilla", "rounds", "tau_sum_prompt_lookup", "rounds_prompt_lookup")):
            sums[i] += sum(float(r[col]) for r in rows)
    if oracle is None or not sums[1] or not sums[3]:
        return None
    return sums[0] / sums[1], sums[2] / sums[3], oracle


def _measured_on(hr: dict, o: dict) -> tuple:
    """(prompts, samples a round, device, date, command) of one oracle entry, the file's own where the entry (one
    written before entries said it) does not say it."""
    return tuple(o.get(k, hr.get(k, "")) for k in ("prompts", "samples", "device", "date", "command"))


def measured_after(hr: dict) -> list[str]:
    """The lines that say what `headroom.json` measured: the oracle τ per policy with its interval, prompts and
    samples (each policy's own where they were measured on different prompts: `campaign_headroom policy=`), the
    command, what the oracle bounds, the target's entropy on those prompts (the most prompts any oracle ran on)."""
    oracles = hr["oracles"]
    level = oracles[0].get("ci_level", 0.95) if oracles else 0.95
    on = {_measured_on(hr, o) for o in oracles}

    def where(m: tuple) -> str:
        prompts, samples, device = m[:3]
        return (f"the first {prompts} of {hr['prompts_in_suite']} prompts × {hr['samples_per_prompt']} samples, "
                f"{samples} target samples a round, {device or '?'}")

    def tau(o: dict) -> str:
        return f"under {o['policy']} drafts **{o['tau']:.3f}** [{o['ci_low']:.3f}, {o['ci_high']:.3f}]"
    if len(on) <= 1:
        m = on.pop() if on else (hr.get("prompts"), hr.get("samples"), hr.get("device"), hr.get("date", ""),
                                 hr.get("command", ""))
        out = [f"Oracle τ (the target's own marginals as the drafter, same rule and ground truth), measured after the "
               f"campaign on its pinned ground truth ({HEADROOM_FILE}, {m[3]}: `{m[4]}`): "
               f"{', '.join(tau(o) for o in oracles)} ({100 * level:g}% interval over prompts; {where(m)})."]
    else:
        out = [f"Oracle τ (the target's own marginals as the drafter, same rule and ground truth), measured after the "
               f"campaign on its pinned ground truth ({HEADROOM_FILE}; {100 * level:g}% intervals over prompts), each "
               f"policy on its own prompts:", ""]
        out += [f"- {tau(o)} ({where(m)}; {m[3]}: `{m[4]}`)" for o in oracles for m in [_measured_on(hr, o)]]
    out += ["", BOUND, ""]
    widest = max(oracles, key=lambda o: int(_measured_on(hr, o)[0] or 0), default={})
    e = widest.get("entropy") or hr.get("entropy") or {}
    if e:
        out += [f"The target's entropy on those prompt samples" + (
                    f" (the first {_measured_on(hr, widest)[0]} prompts')" if len(on) > 1 else "")
                + f": mean {nats(e['mean'])} nats, median {nats(e['median'])}, {pct(e['below_0.1'])} of tokens below "
                  f"0.1 nats.", ""]
    return out


def headroom_section(by_opt: dict[str, dict[int, dict]], headroom: dict | None = None) -> list[str]:
    """Markdown: the target's entropy along the ground truth, the oracle τ where measured, and per option the share
    of rounds reaching block positions 2 … 12 and the gap it closes. Empty where no table records reach.
    `headroom`: the campaign's headroom.json (`read_headroom`), read where the cells did not measure the oracle."""
    tables = [t for seeds in by_opt.values() for t in seeds.values()]
    if not any(str(k).startswith("eval/reach_pos") for t in tables for k in (t.get("stats") or {})):
        return []
    every = {i: t for i, t in enumerate(tables)}
    ent = {k: _mean_stat(every, f"eval/target_entropy_{k}") for k in ("mean", "median", "below_0.1")}
    oracle = _mean_stat(every, "eval/tau_oracle")
    hr = headroom if math.isnan(oracle) and headroom and headroom.get("oracles") else None
    other_truth = hr is not None and not any((t.get("info") or {}).get("ground_truth_key") == hr["ground_truth_key"]
                                             for t in tables)
    lines = ["Headroom (the objective table's, mean over each option's seeds): share of rounds reaching block "
             "position k" + (", and the share of the prompt-lookup-to-oracle gap closed" if not math.isnan(oracle)
                             else "") + ".", ""]
    if not math.isnan(ent["mean"]):
        lines += [f"The target's entropy along the ground truth: mean {nats(ent['mean'])} nats, median "
                  f"{nats(ent['median'])}, {pct(ent['below_0.1'])} of tokens below 0.1 nats.", ""]
    if not math.isnan(oracle):
        lines += [f"Oracle τ (the target's own marginals as the drafter, same rule and ground truth): {oracle:.3f}.",
                  ""]
    elif hr is not None and not other_truth:
        lines += measured_after(hr)
    else:
        lines += ["Oracle τ: not measured in this campaign (`eval.oracle.samples=0`)" + (
            f"; its {HEADROOM_FILE} was measured on another ground truth (key {hr['ground_truth_key'][:16]}…) than "
            f"these cells', so it is not read here" if other_truth else "") + ".", ""]
    after = hr is not None and not other_truth
    head = ["option", *(f"k={k}" for k in REACH_POSITIONS)]
    head += ["gap closed"] if not math.isnan(oracle) else (
        ["τ on the oracle's prompts", "prompt lookup's τ there", "gap closed (vs the oracle of its policy)"]
        if after else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for opt, seeds in by_opt.items():
        row = [opt, *(pct(v) for v in reach_shares(seeds).values())]
        if not math.isnan(oracle):
            row.append(pct(_mean_stat(seeds, "eval/oracle_gap_closed")))
        elif after:
            got = on_oracle_prompts(seeds, hr)
            if got is None:
                row += ["—", "—", "— (other prompts or ground truth)"]
            else:
                tau, pl, o = got
                row += [f"{tau:.3f}", f"{pl:.3f}", f"{pct(gap_closed(tau, pl, o['tau']))} ({o['policy']})"]
        lines.append("| " + " | ".join(row) + " |")
    if after:
        lines += ["", "Gap closed = (τ − τ prompt lookup) / (τ oracle − τ prompt lookup), every τ on the same "
                  "prompt samples (the option's pooled over its seeds), against the oracle of the policy its cells were "
                  "scored under."]
    return lines + [""]
