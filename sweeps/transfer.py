"""Do a campaign's answers hold on another target? Two campaigns that ran the same stages on two targets, side by
side (docs/sweeps.md, "Two targets").

    python -m sweeps.transfer engine math_engine [out=campaign_out] [out_b=DIR] [write=benchmarks/ABLATIONS.md]

For every stage (factor) both campaigns ran, over the options both have:
- each option's τ of its campaign's objective on each target, pooled over that campaign's seeds with its seed ×
  prompt × sample interval (`campaign_report.pooled`), and its rank there;
- Kendall's τ-b between the two targets' orders, with a 95% interval over seeds: each target's seeds are resampled
  (independently: the targets share no seed-level randomness) and an option's τ at the drawn seeds is the mean of
  its per-seed τ. With three seeds a target has ten distinct draws, so the interval is coarse; it says how far
  the agreement can move with the seeds, not a sampling distribution of many;
- every pair of options as each target's tie rule calls it (`campaign_report._delta`: a paired Δ interval that
  excludes 0 and no seed reversing it), and what that makes of the conclusion: it **holds on both**, it
  **reverses**, it is separated on one target only, or it is a tie on both;
- the share of rounds that reach block positions 2, 3, 4, 6, 8 and 12 on each target (`eval/reach_posNN` of the
  objective table): where a target's text lets deep positions work and where it does not, so a loss that weights
  them can only differ on one of the two.

`write=FILE` replaces the block `<!-- transfer:A:B -->` … `<!-- /transfer:A:B -->` in FILE (added after its title
when absent); both campaigns are read before the file is touched.
"""
from __future__ import annotations

import random
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

from dflash.atomic import atomic_write_text
from dflash.evaluation.pairing import metric_columns
from sweeps.campaign_report import _by_option, _delta, _objective_suite, load_summary, pooled, shared_seeds
from sweeps.campaign_spec import at_best_lr, load_campaign
from sweeps.headroom_section import REACH_POSITIONS, pct, reach_shares
from sweeps.learning_curves import kendall_tau_b

N_BOOT = 2000


def stage_tables(c, summary: dict) -> dict[str, dict[str, Any]]:
    """{factor: {"suite", "cols", "by_opt": {option: {seed: objective table}}}} of every stage with finished cells,
    each option at its best learning rate where the stage had a grid."""
    cols = metric_columns(c.objective)
    if cols is None:
        raise ValueError(f"campaign {c.name}: objective {c.objective!r} has no per-prompt table to compare")
    out = {}
    for i, stage in enumerate(c.stages):
        cells = at_best_lr([x for x in summary["cells"] if x.get("stage") == i and not x.get("failed")
                            and x.get("run_dir")])
        suite = _objective_suite(cells, c.objective) if cells else None
        by_opt = _by_option(cells, suite) if suite else {}
        if by_opt:
            out[stage.factor] = {"suite": suite, "cols": (cols.sum_col, cols.count_col), "by_opt": by_opt}
    return out


def seed_tau(table: dict, cols: tuple[str, str]) -> float:
    """One run's τ on its table: Σ τ-sums / Σ rounds over its prompt samples."""
    rows = table.get("tasks") or []
    rounds = sum(float(r[cols[1]]) for r in rows)
    return sum(float(r[cols[0]]) for r in rows) / rounds if rounds else float("nan")


def kendall_over_seeds(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]], options: list[str],
                       n_boot: int = N_BOOT, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Kendall's τ-b of the options' mean τ on target A against target B, and its percentile interval over seeds
    resampled with replacement in each target (`a`, `b`: option -> seed -> τ, every option with the same seeds)."""
    seeds_a, seeds_b = sorted(next(iter(a.values()))), sorted(next(iter(b.values())))

    def tau_b(draw_a: list[int], draw_b: list[int]) -> float:
        return kendall_tau_b([sum(a[o][s] for s in draw_a) / len(draw_a) for o in options],
                             [sum(b[o][s] for s in draw_b) / len(draw_b) for o in options])
    point = tau_b(seeds_a, seeds_b)
    rng = random.Random(seed)
    reps = sorted(tau_b(rng.choices(seeds_a, k=len(seeds_a)), rng.choices(seeds_b, k=len(seeds_b)))
                  for _ in range(n_boot))
    reps = [r for r in reps if r == r]  # a draw with every option equal on one side has no order (nan)
    if not reps:
        return point, float("nan"), float("nan")
    lo = reps[int((1 - level) / 2 * (len(reps) - 1))]
    hi = reps[int((1 + level) / 2 * (len(reps) - 1))]
    return point, lo, hi


def pair_conclusion(call_a: str, call_b: str) -> str:
    """What two targets' calls of one pair (each `better`, `worse` or a tie/unpaired text) make of it."""
    sep_a, sep_b = call_a in ("better", "worse"), call_b in ("better", "worse")
    if sep_a and sep_b:
        return "**holds on both**" if call_a == call_b else "**reverses**"
    if sep_a or sep_b:
        return f"on {'A' if sep_a else 'B'} only (a tie on {'B' if sep_a else 'A'})"
    return "a tie on both"


def stage_section(factor: str, sa: dict, sb: dict, names: tuple[str, str]) -> list[str]:
    """The markdown of one shared stage: τ and ranks on both targets, the rank agreement, the pair calls, reach."""
    options = [o for o in sa["by_opt"] if o in sb["by_opt"]]
    lines = [f"### Stage `{factor}` in both campaigns", ""]
    if len(options) < 2:
        return lines + [f"Fewer than two options on both targets ({', '.join(options) or 'none'}): no order to "
                        "compare.", ""]
    sides = {"a": sa, "b": sb}
    seeds = {side: shared_seeds({o: st["by_opt"][o] for o in options}) for side, st in sides.items()}
    # each option's tables at the seeds every option of its side has
    shared = {side: {o: {s: t for s, t in st["by_opt"][o].items() if s in seeds[side]} for o in options}
              for side, st in sides.items()}
    per_seed = {side: {o: {s: seed_tau(t, st["cols"]) for s, t in shared[side][o].items()} for o in options}
                for side, st in sides.items()}
    iv = {side: {o: pooled(list(shared[side][o].values()), *st["cols"]) for o in options}
          for side, st in sides.items()}
    rank = {side: {o: 1 + sorted(options, key=lambda x: -iv[side][x].value).index(o) for o in options}
            for side in ("a", "b")}
    a, b = names
    lines += [f"A: `{a}` (suite `{sa['suite']}`, seeds {', '.join(map(str, seeds['a']))}); "
              f"B: `{b}` (suite `{sb['suite']}`, seeds {', '.join(map(str, seeds['b']))}).", "",
              "| option | τ on A [95% CI] | rank on A | τ on B [95% CI] | rank on B |", "| --- | --- | --- | --- | --- |"]
    for o in sorted(options, key=lambda x: rank["a"][x]):
        lines.append(f"| {o} | {iv['a'][o].value:.3f} [{iv['a'][o].low:.3f}, {iv['a'][o].high:.3f}] | {rank['a'][o]} | "
                     f"{iv['b'][o].value:.3f} [{iv['b'][o].low:.3f}, {iv['b'][o].high:.3f}] | {rank['b'][o]} |")
    k, lo, hi = kendall_over_seeds(per_seed["a"], per_seed["b"], options)
    lines += ["", f"Rank agreement: Kendall's τ-b **{k:+.2f}** [{lo:+.2f}, {hi:+.2f}] over {len(options)} options "
              "(95% interval over seeds, resampled in each target).", "",
              "| pair | on A | on B | conclusion |", "| --- | --- | --- | --- |"]
    held = []
    for x, y in combinations(sorted(options, key=lambda o: rank["a"][o]), 2):
        calls = []
        for side, st in sides.items():
            text, verdict = _delta(shared[side][x], shared[side][y], *st["cols"])
            calls.append((text, verdict))
        conclusion = pair_conclusion(calls[0][1], calls[1][1])
        if conclusion == "**holds on both**":
            held.append(f"{x} {'>' if calls[0][1] == 'better' else '<'} {y}")
        lines.append(f"| {x} − {y} | {calls[0][0]} {calls[0][1]} | {calls[1][0]} {calls[1][1]} | {conclusion} |")
    lines += ["", "Holds on both targets: " + ("; ".join(held) if held else "none of the pairs") + ".", "",
              "Share of rounds reaching block position k (mean over seeds):", "",
              "| option | target | " + " | ".join(f"k={k}" for k in REACH_POSITIONS) + " |",
              "| --- | --- | " + " | ".join("---" for _ in REACH_POSITIONS) + " |"]
    for o in sorted(options, key=lambda x: rank["a"][x]):
        for label, side in (("A", "a"), ("B", "b")):
            r = reach_shares(shared[side][o])
            lines.append(f"| {o} | {label} | " + " | ".join(pct(r[k]) for k in REACH_POSITIONS) + " |")
    return lines + [""]


def transfer_report(a: str, b: str, out_a: Path, out_b: Path, edits: list[str] = ()) -> str:
    """The markdown comparing campaign `a` (its store under `out_a`) with campaign `b` (under `out_b`)."""
    ca, cb = load_campaign(a, list(edits)), load_campaign(b, list(edits))
    ta, tb = stage_tables(ca, load_summary(ca, out_a)), stage_tables(cb, load_summary(cb, out_b))
    shared = [f for f in ta if f in tb]
    lines = [f"## Do the answers transfer? `{a}` (A) against `{b}` (B)", "",
             f"Objectives: A `{ca.objective}`, B `{cb.objective}`. Stages both ran: "
             + (", ".join(f"`{f}`" for f in shared) or "none") + ". Command: `python -m sweeps.transfer "
             f"{a} {b}`.", ""]
    for f in shared:
        lines += stage_section(f, ta[f], tb[f], (a, b))
    missing = sorted((set(ta) | set(tb)) - set(shared))
    if missing:
        lines += ["Stages only one campaign has finished: " + ", ".join(f"`{f}`" for f in missing) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = [x for x in argv if "=" not in x]
    if len(names) != 2 or any(x in ("-h", "--help") for x in argv):
        print(__doc__)
        raise SystemExit(0 if any(x in ("-h", "--help") for x in argv) else 2)

    def value(key: str, default: str) -> str:
        return next((x.partition("=")[2] for x in argv if x.startswith(f"{key}=")), default)
    out_a = Path(value("out", "campaign_out"))
    out_b = Path(value("out_b", str(out_a)))
    dest = value("write", "")
    if dest and not Path(dest).is_file():
        print(f"write={dest}: no such markdown file", file=sys.stderr)
        raise SystemExit(2)
    text = transfer_report(*names, out_a, out_b, [x for x in argv if x.startswith("campaign.")])
    if dest:
        from sweeps.results_summary import update_block
        body = Path(dest).read_text()
        atomic_write_text(Path(dest), update_block(body, f"transfer:{names[0]}:{names[1]}", text, add=True))
    print(text)
    return text


if __name__ == "__main__":
    main()
