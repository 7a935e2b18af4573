"""A campaign's cells at equal GPU time, each alone on the GPU: the comparison a campaign's token budget cannot make.

    python -m sweeps.time_cells <campaign> cells=[factor/option, ...] seconds=S [seed=N] [out=time_cells_out]
                                [max_tokens=T] [counts=training|loop] [campaign.KEY=VALUE ...] [any run override ...]
    python -m sweeps.time_cells <campaign> report [out=...] [cells=[...]] [seeds=[N, ...]]
                                [tokens_out=<the campaign's out folder>]

A campaign compares options at equal consumed tokens, several cells sharing one GPU (fair in tokens, not in time:
sweeps/campaign.py). Which option wins when each gets the same GPU-seconds is another question, the one a user
with a fixed GPU budget asks (DFlash 2 trains at 0.64x DFlash 1's tokens a second at the reference shapes). Here
each listed cell runs by itself, one after another, as its campaign composes it (`stage_cells`: the base, the seed,
the option), with:

- `trainer.time_budget_s=S` and `trainer.schedule_by_time=true`: every cell trains S seconds and its LR's cosine
  spans them from its first step on, so each ends decayed whatever its step costs (a max_steps schedule would be
  decayed only for the fastest option);
- `trainer.time_budget_counts=training` (`counts`, default training): the S seconds are training alone, from each
  cell's first step on (first data and compiling left out: on a fresh GPU machine they took 88-115 s of a 160-s
  cell, on a warm one 10-41 s) with in-training evaluations' seconds left out; `counts=loop` counts all from the
  loop's start (how the cells of 2026-12-07 ran);
- `trainer.token_budget=T` (`max_tokens`, default 500 M) and a max_steps in the campaign's tokens-per-step ratio to
  it: caps that bound the data plan, not meant to be reached;
- no in-training evaluation (`trainer.eval_at_tokens=[]`, `trainer.eval_every=0`) unless asked: pass
  `trainer.eval_at_tokens=[...]` for a learning curve in consumed tokens and training seconds (the budget's clock
  stops while they run, so they cost wall time, not training); the final evaluation runs after the budget, as in
  the campaign, on the ground truth `eval.truth_dir` pins (pass the campaign's, `<campaign out>/<campaign>/truth`,
  to pair with its cells and its prompt lookup).

Every cell reads the same data: the same online stream from the same seed, of which a faster cell reads more. A
finished cell (`final/` and its served task table) is kept; one cut off is started again from nothing (a resumed job
would get a second time budget). The report: per cell its τ as served with the interval, prompt lookup's on the same
ground truth, greedy τ, the ground truth's copy rate, the consumed tokens, epochs, steps and the training loop's
seconds with, of them, those before its first step (first data, compiling: a short budget's share that differs
between cells and between a cold machine and a warm one); each cell's paired Δ against the first listed one, on
every row and on the least-degenerate quarter; the verdict: the cell with the highest τ and its paired Δ against
every other (a tie where the interval holds 0), and where `counts=loop` cells spent unlike seconds before their
first step, that their training seconds differ; with in-training evaluations, each cell's learning curve (consumed
tokens, training seconds, τ); with `seeds=[...]` (cells run at several seeds, one `seed=` call each), a row per cell
and seed, and each cell's τ pooled over the seeds it has with the seed × prompt × sample interval (the campaign
report's `pooled`). The report needs no weights: a cell's metrics.jsonl and served task
table are enough (what the GPU job brings back).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError
from dflash.tracking.records import read_metric_records
from dflash.overrides import apply_overrides
from sweeps.campaign_spec import Campaign, Cell, load_campaign, stage_cells

DEFAULT_OUT = "time_cells_out"
SERVED_TABLE = "eval/served/tasks.json"  # under the run folder (dflash.evaluation.protocol.table_places)


@dataclasses.dataclass
class TimeCellsArgs:
    cells: list[str] = dataclasses.field(default_factory=list)  # factor/option of stages without on_best
    seconds: float = 0.0  # each cell's training time (trainer.time_budget_s)
    seed: int = -1  # the campaign's seed to run (-1: its first)
    out: str = DEFAULT_OUT
    max_tokens: int = 500_000_000  # the token cap (trainer.token_budget): bounds the data plan
    counts: str = "training"  # what the seconds count (trainer.time_budget_counts): training, or loop
    tokens_out: str = ""  # report: the campaign's out folder, for the same cells at equal tokens beside
    seeds: list[int] = dataclasses.field(default_factory=list)  # report: the seeds to read (default: seed= alone)


def pick_cells(c: Campaign, names: list[str], seed: int) -> list[Cell]:
    """The listed cells of `c` at `seed`, in the order listed; a name that is not factor/option of a stage without
    `on_best` (whose cells need earlier winners) is an error naming what exists."""
    if not names:
        raise ConfigError("cells=[factor/option, ...] is empty: name the cells to run")
    free = {f"{s.factor}/{o}": i for i, s in enumerate(c.stages) if not s.on_best for o in s.options}
    bad = [n for n in names if n not in free]
    if bad:
        raise ConfigError(f"cells={bad}: not factor/option of a stage of campaign {c.name!r} that builds on no winner; "
                         f"known: {sorted(free)}")
    if seed not in c.seeds:
        raise ConfigError(f"seed={seed}: campaign {c.name!r} has seeds {list(c.seeds)}")
    out = []
    for n in names:
        option = n.split("/", 1)[1]
        out += [x for x in stage_cells(c, free[n], {}) if x.option == option and x.seed == seed and x.lr is None]
    return out


def _seed(c: Campaign, args: TimeCellsArgs) -> int:
    """The campaign's seed the cells run at: `seed=`, else the campaign's first."""
    return args.seed if args.seed >= 0 else c.seeds[0]


def _seeds(c: Campaign, args: TimeCellsArgs) -> list[int]:
    """The seeds the report reads: `seeds=`, else the one the cells run at."""
    return list(args.seeds) or [_seed(c, args)]


def listed_ids(c: Campaign, args: TimeCellsArgs) -> dict[str, list[str]]:
    """Each listed cell's run ids at the report's seeds (`_seeds`), in the listed order."""
    by_seed = [pick_cells(c, args.cells, s) for s in _seeds(c, args)]
    return {name: [cells[i].id for cells in by_seed] for i, name in enumerate(args.cells)}


def seed_pooled(rows: list[dict[str, Any]], groups: dict[str, list[str]]) -> list[str]:
    """Each listed cell with two or more evaluated seeds: its τ pooled over them (Σ τ-sums / Σ rounds) with the
    seed × prompt × sample interval, and its consumed tokens a seed."""
    from sweeps.campaign_report import pooled
    by_id = {r["cell"]: r for r in rows}
    out = []
    for name, ids in groups.items():
        have = [by_id[i] for i in ids if i in by_id]
        if len(have) < 2:
            continue
        p = pooled([r["table"] for r in have], *_served_columns())
        taus = ", ".join(_f(r["tau"]) for r in have)
        tokens = ", ".join(f"{(r['tokens'] or 0) / 1e6:.1f} M" for r in have)
        out.append(f"| {name} | {len(have)} | {_f(p.value)} [{_f(p.low)}, {_f(p.high)}] | {taus} | {tokens} |")
    if not out:
        return []
    return ["", "Pooled over seeds (the seed × prompt × sample interval)\n",
            "| cell | seeds | τ served pooled [95% CI] | τ a seed | consumed tokens a seed |", "| --- " * 5 + "|",
            *out]


def cell_overrides(c: Campaign, cell: Cell, args: TimeCellsArgs, run_dir: Path, extra: list[str]) -> list[str]:
    """The cell as its campaign composes it, then the equal-time settings (module doc), then `extra`."""
    steps = math.ceil(c.max_steps * args.max_tokens / c.budget_tokens)  # the campaign's tokens a step, at the cap
    return [*cell.overrides, f"trainer.time_budget_s={args.seconds:g}", "trainer.schedule_by_time=true",
            f"trainer.time_budget_counts={args.counts}",
            f"trainer.token_budget={args.max_tokens}", f"trainer.max_steps={steps}", "trainer.eval_at_tokens=[]",
            "trainer.eval_every=0", f"run_dir={run_dir}", *extra]


def finished(run_dir: Path) -> bool:
    """Trained and evaluated here: kept by a rerun."""
    return (run_dir / "final").is_dir() and evaluated(run_dir)


def evaluated(run_dir: Path) -> bool:
    """What the report reads is there: its served task table and metrics (the GPU job packs no weights)."""
    return (run_dir / SERVED_TABLE).is_file() and (run_dir / "metrics.jsonl").is_file()


def run_cells(c: Campaign, args: TimeCellsArgs, extra: list[str]) -> list[Path]:
    """Every listed cell, checked first (a bad override fails before any cell trains), then one at a time."""
    from dflash.config import TIME_BUDGET_COUNTS, validate
    from experiments.config import compose_config
    if args.seconds <= 0:
        raise ConfigError(f"seconds={args.seconds:g}: each cell's training time must be > 0")
    if args.counts not in TIME_BUDGET_COUNTS:
        raise ConfigError(f"counts={args.counts}: what each cell's seconds count must be training (from the first "
                          "step on, in-training evaluations out) or loop (all from the loop's start)")
    cells = pick_cells(c, args.cells, _seed(c, args))
    root = Path(args.out) / c.name
    plans = [(cell, root / cell.id) for cell in cells]
    for cell, run_dir in plans:
        validate(compose_config(cell_overrides(c, cell, args, run_dir, extra)))
    for cell, run_dir in plans:
        if finished(run_dir):
            print(f"== {cell.id}: finished, kept", flush=True)
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)  # cut off: a resumed job would get a second time budget
        print(f"== {cell.id}: {args.seconds:g} s alone", flush=True)
        cmd = [sys.executable, "-m", "experiments.run", *cell_overrides(c, cell, args, run_dir, extra)]
        subprocess.run(cmd, check=True)
    return [d for _, d in plans]


# ------------------------------------------------------------------------------------------------ the report
def _final_row(run_dir: Path) -> dict[str, Any]:
    """The run's last value of every metric (the final evaluation's, the data meter's, the phases')."""
    last: dict[str, Any] = {}
    for rec in read_metric_records(run_dir):
        last.update({k: v for k, v in rec.items() if k != "time"})
    return last


def curve_points(run_dir: Path) -> list[dict[str, float]]:
    """Every evaluation of the run in order (trainer.eval_at_tokens' in-training ones, logged under
    `eval/subset/...` on the objective suite's first eval.subset prompts, then the final one), each at the consumed
    tokens and the time budget's seconds (train/budget_s) last logged before it."""
    from dflash.evaluation.evaluator import subset_key
    seen: dict[str, float] = {}
    points = []
    for rec in read_metric_records(run_dir):
        seen.update({k: rec[k] for k in ("data/consumed_tokens", "train/budget_s") if k in rec})
        for name in ("eval/tau_served", subset_key("eval/tau_served")):
            if name in rec:
                points.append({"tokens": seen.get("data/consumed_tokens"), "budget_s": seen.get("train/budget_s"),
                               "tau": rec[name], "lo": rec.get(f"{name}_ci_low"), "hi": rec.get(f"{name}_ci_high")})
    return points


def _served_columns() -> tuple[str, str]:
    """The served task table's τ-sum and rounds columns: what every Δ and pooled τ here reads."""
    from dflash.evaluation.pairing import metric_columns
    cols = metric_columns("eval/tau_served")
    return cols.sum_col, cols.count_col


def _paired(a: dict[str, Any], b: dict[str, Any]):
    """τ(a) − τ(b) of two rows' served tables, paired prompt for prompt: on every row, and on the least-degenerate
    quarter (None where the tables cannot say which it is)."""
    from dflash.evaluation.pairing import least_degenerate_delta, paired_delta
    sc = _served_columns()
    return paired_delta(a["table"], b["table"], sc, sc), least_degenerate_delta(a["table"], b["table"], sc, sc)


def cell_rows(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """One row a finished cell: its figures and its served task table (for the paired Δs)."""
    from dflash.evaluation.protocol import served_label
    rows = []
    for d in run_dirs:
        if not evaluated(d):
            continue
        m = _final_row(d)
        table = json.loads((d / SERVED_TABLE).read_text(encoding="utf-8"))
        params = json.loads((d / "params.json").read_text(encoding="utf-8")) if (d / "params.json").is_file() else {}
        rows.append({"cell": d.name, "tau": m.get("eval/tau_served"), "lo": m.get("eval/tau_served_ci_low"),
                     "hi": m.get("eval/tau_served_ci_high"), "pl": m.get("eval/tau_served_prompt_lookup"),
                     "greedy": m.get("eval/t0/tau_vanilla"), "copy": m.get(f"eval/{served_label(m)}/gt_copy_rate"),
                     "tokens": m.get("data/consumed_tokens"), "epochs": m.get("data/epochs"), "steps": m.get("step"),
                     "loop_s": m.get("sys/loop_s"), "first_step_s": m.get("sys/first_step_s"),
                     "proposal": m.get("eval/served_proposal"), "curve": curve_points(d), "table": table,
                     # runs from before the key counted from the loop's start
                     "counts": params.get("trainer.time_budget_counts", "loop"),
                     "budget_s": float(params.get("trainer.time_budget_s") or 0.0)})
    if rows:
        first = rows[0]
        for r in rows[1:]:
            r["delta"], r["delta_ld"] = _paired(r, first)
    return rows


def _interval(d) -> str:
    return f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: r["tau"])


def _winner_lines(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The cell with the highest τ, and one line for every other cell: the paired Δ (best − it; a tie where the
    interval holds 0) on every row and on the least-degenerate quarter."""
    best = _best(rows)
    out = []
    for r in rows:
        if r is best:
            continue
        d, ld = _paired(best, r)
        word = "better" if d.low > 0 else "a tie (the interval holds 0)"
        holds = ("" if ld is None else f"; least-degenerate quarter {_interval(ld.delta)}, "
                 + ("holds" if ld.delta.low > 0 else "a tie there"))
        out.append(f"- against {r['cell']}: {_interval(d)}, {word}{holds}")
    return best, out


def verdict(rows: list[dict[str, Any]], start_share: float = 0.1) -> list[str]:
    """Which cell wins at equal GPU time (`_winner_lines`). Where seconds counted from the loop's start
    (`counts=loop`) and the cells' seconds before their first step differ by more than `start_share` of the budget
    (or were not logged), a line says that their training seconds differ: equal wall time, not equal training."""
    if len(rows) < 2:
        return []
    budget = max(r["budget_s"] for r in rows)
    counts = sorted({r["counts"] for r in rows})
    what = ("training from each cell's first step" if counts == ["training"] else
            "from the loop's start, first data and compiling inside" if counts == ["loop"] else
            f"counted unlike ({', '.join(counts)})")
    best, lines = _winner_lines(rows)
    out = [f"At equal GPU time ({budget:g} s, {what}): **{best['cell']}** has the highest τ, {_f(best['tau'])}."]
    if "loop" in counts:
        starts = [r["first_step_s"] for r in rows]
        if any(x is None for x in starts):
            out.append("Their seconds before step 1 were not logged (`sys/first_step_s`): whether they trained alike "
                       "is not known.")
        elif max(starts) - min(starts) > start_share * budget:
            out.append(f"Their starts took {min(starts):.1f} to {max(starts):.1f} s of it: their training seconds "
                       "differ (counts=training counts from the first step).")
    return out + lines


def token_verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Which of the campaign's cells wins at equal consumed tokens (`_winner_lines`)."""
    if len(rows) < 2:
        return []
    tokens = sorted({int(r["tokens"] or 0) for r in rows})
    what = (f"{tokens[0]:,} consumed tokens each" if len(tokens) == 1 else
            f"consumed tokens differ: {', '.join(f'{t:,}' for t in tokens)}")
    best, lines = _winner_lines(rows)
    return [f"At equal tokens ({what}): **{best['cell']}** has the highest τ, {_f(best['tau'])}.", *lines]


def _f(x, spec=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report(rows: list[dict[str, Any]], basis: str = "time", groups: dict[str, list[str]] | None = None) -> str:
    """The markdown table of `cell_rows` and its verdict; `basis="tokens"`: the campaign's cells (`tokens_out`);
    `groups` (listed cell → its run ids at the report's seeds): the cells' τ pooled over seeds (`seed_pooled`)."""
    if not rows:
        return "no evaluated cell\n"
    head = "Equal GPU time, each cell alone" if basis == "time" else "Equal tokens, the campaign's cells"
    out = [f"{head}; Δ against {rows[0]['cell']}, paired prompt for prompt "
           "(least-degenerate quarter: the ground truths that repeat the fewest 8-grams)\n",
           "| cell | τ served [95% CI] | prompt lookup | greedy τ | GT copy rate | consumed tokens | epochs | "
           "steps | loop s | of it before step 1 | Δ | Δ least-degenerate |", "| --- " * 12 + "|"]
    for r in rows:
        d, ld = r.get("delta"), r.get("delta_ld")
        ds = _interval(d) if d else "–"
        lds = _interval(ld.delta) if ld else "–"
        out.append(f"| {r['cell']} | {_f(r['tau'])} [{_f(r['lo'])}, {_f(r['hi'])}] | {_f(r['pl'])} | "
                   f"{_f(r['greedy'])} | {_f(r['copy'])} | {_f(r['tokens'], ',.0f')} | {_f(r['epochs'], '.2f')} | "
                   f"{_f(r['steps'], '.0f')} | {_f(r['loop_s'], '.1f')} | {_f(r['first_step_s'], '.1f')} | {ds} | "
                   f"{lds} |")
    if (lines := verdict(rows) if basis == "time" else token_verdict(rows)):
        out += ["", *lines]
    out += seed_pooled(rows, groups or {})
    if any(len(r["curve"]) > 1 for r in rows):  # trainer.eval_at_tokens: each cell's learning curve
        out += ["", "Learning curve (in-training evaluations on the objective suite's first eval.subset prompts, "
                "outside the training seconds where counts=training; the last row a cell's final evaluation)\n", "| cell | consumed tokens | training s | τ served [95% CI] |",
                "| --- " * 4 + "|"]
        out += [f"| {r['cell']} | {_f(p['tokens'], ',.0f')} | {_f(p['budget_s'], '.1f')} | {_f(p['tau'])} "
                f"[{_f(p['lo'])}, {_f(p['hi'])}] |" for r in rows for p in r["curve"]]
    return "\n".join(out) + "\n"


def _token_dirs(tokens_out: str, campaign: str, ids: list[str]) -> list[Path]:
    """The campaign's own run folders of these cells (`<tokens_out>/<campaign>/runs/<cell id>`, as sweeps.campaign
    writes them); refused by name where the folder or an evaluated cell is missing."""
    runs = Path(tokens_out) / campaign / "runs"
    missing = [str(runs / i) for i in ids if not evaluated(runs / i)] if runs.is_dir() else [str(runs)]
    if missing:
        raise ConfigError(f"tokens_out={tokens_out}: no evaluated campaign cell at {', '.join(missing)} (expected the "
                          "campaign's out folder, as sweeps.campaign writes it: <out>/<campaign>/runs/<cell id>)")
    return [runs / i for i in ids]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return []
    ref, rest = argv[0], argv[1:]
    want_report = "report" in rest
    rest = [a for a in rest if a != "report"]
    own = ("cells=", "seconds=", "seed=", "seeds=", "out=", "max_tokens=", "counts=", "tokens_out=")
    args = apply_overrides(TimeCellsArgs(), [a for a in rest if a.startswith(own)], "argument")
    edits = [a for a in rest if a.startswith("campaign.")]
    extra = [a for a in rest if not a.startswith((*own, "campaign."))]
    c = load_campaign(ref, edits)
    root = Path(args.out) / c.name
    if args.seeds and not want_report:
        raise ConfigError(f"seeds={args.seeds}: the report reads several seeds; a run takes one (seed=N a call)")
    groups = listed_ids(c, args) if args.cells else {}
    ids = [i for at_seeds in zip(*groups.values()) for i in at_seeds]  # seed by seed, each in the listed order
    if args.tokens_out:  # before any cell runs: the campaign's folder must hold the listed cells
        _token_dirs(args.tokens_out, c.name, ids)
    if want_report:
        dirs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if ids:  # the listed order: the first is the one the others are compared with
            dirs = [root / i for i in ids]
    else:
        dirs = run_cells(c, args, extra)
    rows = cell_rows(dirs)
    text = report(rows, groups=groups)
    if args.tokens_out and rows:  # the same cells as the campaign ran them, at equal tokens, on the same ground truth
        tok_rows = cell_rows(_token_dirs(args.tokens_out, c.name, [r["cell"] for r in rows]))
        text += "\n" + report(tok_rows, basis="tokens", groups=groups)
        if len(rows) > 1:
            text += f"\nWinner at equal GPU time: {_best(rows)['cell']}; at equal tokens: {_best(tok_rows)['cell']}.\n"
    print(text, flush=True)
    if root.is_dir():
        (root / "report.md").write_text(text, encoding="utf-8")
    return rows


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(main)
