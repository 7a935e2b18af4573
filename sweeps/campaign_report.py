"""`python -m sweeps.campaign <campaign> report`: the campaign's tables, from the run folders it wrote.

One table per stage (factor) and suite: τ vanilla and DDTree τ per node budget, each the τ pooled over the
stage's seeds with its seed × prompt × sample bootstrap interval (`dflash.evaluation.stats.hierarchical_ci`: the
cells of one option at different seeds are its seed level), prompt-lookup's τ on the same ground truth, and the
paired Δτ against the stage's reference option (its first one: hard_ce for the loss stage, the winner carried in
for later stages) — each option's run paired with the reference's run of the same seed, prompt sample for prompt
sample, resampled together. A comparison is a *win* only when its Δ interval excludes 0 and no seed's own Δ has the
other sign; otherwise it is a tie bounded by that interval. A stage's order is stated only where this rule separates
adjacent options (`stated_order`): "a ≈ b > c". Budget, consumed tokens and epochs of data seen are printed with
every table.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dflash.atomic import atomic_write_text
from dflash.evaluation.pairing import NotPaired, ground_truth_of, task_rows
from dflash.evaluation.stats import Interval, Rows, hierarchical_ci
from sweeps.campaign_spec import at_best_lr, best_option, lr_means, record_winner_lr, stage_cells
from sweeps.cells import cell_dir, cell_result, record_matches, trained_for
from sweeps.cost import cost_lines, equal_gpu_time_lines
from sweeps.headroom_section import headroom_section, read_headroom
from sweeps.learning_curves import curve_section

CI_LEVEL = 0.95


def _tables(run_dir: Path, setting: str = "served") -> dict[str, dict]:
    """{suite label: task table} of a finished run at its served setting (the objective suite in eval/served/,
    the others in eval/<suite>/served/), or with `setting="t0"` greedily (eval/t0/, beside the served ones); a run
    evaluated before sampled evaluation has its tables in eval/ and eval/<suite>/ (the legacy greedy protocol;
    no `info.setting`), read for either setting."""
    out = {}
    ev = run_dir / "eval"
    served = [ev / setting / "tasks.json", *sorted(ev.glob(f"*/{setting}/tasks.json"))]
    legacy = [ev / "tasks.json", *sorted(p for p in ev.glob("*/tasks.json") if p.parent.name not in ("served", "t0"))]
    for f in served if (ev / "served" / "tasks.json").is_file() else legacy:
        if f.is_file():
            t = json.loads(f.read_text())
            name = f.parent.parent.name if f.parent.name == setting else f.parent.name
            out[str((t.get("info") or {}).get("suite_label") or name)] = t
    return out


def task_methods(table: dict) -> list[tuple[str, str, str]]:
    """(label, τ-sum column, round-count column) of every method the table carries."""
    row = (table.get("tasks") or [{}])[0]
    out = [("vanilla", "tau_sum_vanilla", "rounds")]
    budgets = sorted(int(k.removeprefix("tau_sum_tree_")) for k in row if k.startswith("tau_sum_tree_"))
    out += [(f"tree {b} nodes", f"tau_sum_tree_{b}", f"rounds_tree_{b}") for b in budgets]
    if "tau_sum_prompt_lookup" in row:
        out.append(("prompt-lookup", "tau_sum_prompt_lookup", "rounds_prompt_lookup"))
    return out


def common_methods(by_opt: dict[str, dict[int, dict]], seeds: list[int]) -> list[tuple[str, str, str]]:
    """The drafting methods every option's tables of `seeds` carry, in `task_methods` order: a DFlash 2 option has
    no tree columns (DDTree is DFlash 1 only), so a stage mixing both compares vanilla and prompt lookup only."""
    per_table = [task_methods(t) for seeds_of in by_opt.values() for s, t in seeds_of.items() if s in seeds]
    return [m for m in per_table[0] if all(m in other for other in per_table[1:])] if per_table else []


def _left_out_methods(by_opt: dict[str, dict[int, dict]], seeds: list[int], methods: list) -> list[str]:
    """A line naming the drafting methods some options have but the table leaves out (`common_methods`), and
    which options have them: a stage of DFlash 1 and DFlash 2 drafters has DDTree τ for DFlash 1 alone."""
    have: dict[tuple, set[str]] = {}  # in task_methods order
    for opt, seeds_of in by_opt.items():
        for m in (m for s, t in seeds_of.items() if s in seeds for m in task_methods(t)):
            have.setdefault(m, set()).add(opt)
    gone = [m for m in have if m not in methods]
    if not gone:
        return []
    owners = sorted(set().union(*(have[m] for m in gone)))
    return ["", "Left out, since not every option has it: " + ", ".join(f"τ {m[0]}" for m in gone) + " (only "
            + ", ".join(owners) + "; DDTree runs for DFlash 1 drafters only, docs/dflash2.md)."]


def stacked_rows(tables: list[dict], sum_col: str, count_col: str) -> Rows:
    """The rows of one option's tables, one table per training seed (in the order given, the same for every
    option), keyed (seed, prompt) for `hierarchical_ci`: the cells of one option at different seeds are its seed
    level."""
    keys, sums, counts = [], [], []
    for seed, t in enumerate(tables):
        rows = task_rows(t, sum_col, count_col, seed)
        keys += rows.keys
        sums += rows.sums
        counts += rows.counts
    return Rows(keys, sums, counts)


def paired_ci(tables_a: list[dict], tables_b: list[dict], cols_a: tuple[str, str], cols_b: tuple[str, str],
           n_boot: int = 2000) -> Interval:
    """Δ = τ_A − τ_B pooled over the tables, seed for seed (table i of A against table i of B) and prompt sample
    for prompt sample, with its seed × prompt × sample interval (`hierarchical_ci`); n_boot = 0: the point alone."""
    try:
        return hierarchical_ci(stacked_rows(tables_a, *cols_a), stacked_rows(tables_b, *cols_b), CI_LEVEL, n_boot)
    except ValueError as e:  # other prompts, in another order
        raise NotPaired(str(e)) from e


def _fmt(iv) -> str:
    return f"{iv.value:.3f} [{iv.low:.3f}, {iv.high:.3f}]"


def _verdict(iv) -> str:
    if iv.low > 0:
        return "better"
    if iv.high < 0:
        return "worse"
    return f"tie (within {iv.low:+.3f} … {iv.high:+.3f})"


def _by_option(cells: list[dict], suite: str, setting: str = "served") -> dict[str, dict[int, dict]]:
    by_opt: dict[str, dict[int, dict]] = {}
    for c in cells:
        t = _tables(Path(c["run_dir"]), setting).get(suite)
        if t is not None:
            by_opt.setdefault(c["option"], {})[int(c["seed"])] = t
    return by_opt


def _delta(seeds: dict[int, dict], ref: dict[int, dict], sum_col: str = "tau_sum_vanilla",
           count_col: str = "rounds") -> tuple[str, str]:
    """(Δτ with its CI, verdict) of one option's runs against `ref`'s, seed for seed, prompt for prompt
    (vanilla τ by default; any method's τ-sum and round-count columns). Only the seeds whose two runs share their
    ground truth pair; where another seed's do not, the Δ says which seeds it is of (`views2` at seed 0 ran before
    the pin, seed 1 on it: the stage had read "not paired" although seed 1 pairs)."""
    common = sorted(set(seeds) & set(ref))
    if not common:
        return "not paired", "no common seed"
    same = [s for s in common if ground_truth_of(seeds[s]) == ground_truth_of(ref[s])]
    if not same:
        return "not paired", "different ground truth"
    try:
        delta = paired_ci([seeds[s] for s in same], [ref[s] for s in same], (sum_col, count_col), (sum_col, count_col))
    except NotPaired as e:
        return "not paired", str(e)
    verdict = _verdict(delta)
    if verdict in ("better", "worse") and len(same) > 1:
        verdict = _seeds_disagree(seeds, ref, same, delta.value, sum_col, count_col) or verdict
    if len(same) < len(common):
        paired, others = (", ".join(map(str, xs)) for xs in (same, [s for s in common if s not in same]))
        return f"{_fmt(delta)} (seed {paired} alone; seed {others}: other ground truth)", verdict
    return _fmt(delta), verdict


def _seeds_disagree(seeds: dict[int, dict], ref: dict[int, dict], common: list[int], pooled: float,
                    sum_col: str, count_col: str) -> str | None:
    """A tie when a seed's own Δ has the other sign than the pooled one: the prompt-bootstrap interval holds the
    seeds fixed, and a training seed moves a 64 M-token run by up to 0.52 τ (benchmarks/ABLATIONS.md:
    streak led dpace by +0.336 at seed 0 and trailed it by −0.126 at seed 1), so a difference one seed reverses is
    not a result."""
    per_seed = {s: paired_ci([seeds[s]], [ref[s]], (sum_col, count_col), (sum_col, count_col), n_boot=0).value
                for s in common}
    if all(d * pooled > 0 for d in per_seed.values()):
        return None
    return "tie (the seeds disagree: " + ", ".join(f"seed {s} {d:+.3f}" for s, d in per_seed.items()) + ")"


def _reused_lines(cells: list[dict]) -> list[str]:
    """A line naming the options of a stage whose run is an earlier cell's (its composed config is that cell's),
    seed by seed: the seeds of one option may reuse different stages' runs (the pin decides it per seed)."""
    reused = sorted({(x["option"], int(x["seed"]), x["reused_from"]) for x in cells if x.get("reused_from")})
    if not reused:
        return []
    return [", ".join(f"`{o}` (seed {seed}) is `{src}`'s run" for o, seed, src in reused)
            + " (the same composed config: reused, not trained again).", ""]


BELOW_PL = "↓PL"  # the flag on a τ below prompt lookup's on the same prompts (a drafter that does not pay off)


def shared_seeds(by_opt: dict[str, dict[int, dict]]) -> list[int]:
    """The seeds every option has: pooled τ means only over these, so a row with an extra seed never reads better
    or worse for it (the data stage once mixed two-seed and one-seed rows)."""
    return sorted(set.intersection(*(set(s) for s in by_opt.values()))) if by_opt else []


def pooled(tables: list[dict], sum_col: str = "tau_sum_vanilla", count_col: str = "rounds"):
    """τ pooled over the tables' prompt samples (Σ τ-sums / Σ rounds; one table per training seed) with its
    seed × prompt × sample interval (`hierarchical_ci`)."""
    return hierarchical_ci(stacked_rows(tables, sum_col, count_col), None, CI_LEVEL)


def below_prompt_lookup(tables: list[dict]) -> bool:
    """Whether vanilla τ pooled over `tables` is below prompt lookup's on the same prompts (False where the tables
    carry no prompt-lookup columns)."""
    if "tau_sum_prompt_lookup" not in ((tables[0].get("tasks") or [{}])[0] if tables else {}):
        return False
    return pooled(tables).value < pooled(tables, "tau_sum_prompt_lookup", "rounds_prompt_lookup").value


def stage_table(cells: list[dict], suite: str, reference: str,
                baseline: tuple[str, list[dict]] | None = None, setting: str = "served") -> list[str]:
    """Markdown rows for one stage and suite, over the seeds every option has (`shared_seeds`); each option's seeds
    paired with the reference's seeds, and, when `baseline` = (name, its cells) is given (the campaign's first
    option), with the baseline's too. A τ vanilla below prompt lookup's carries `BELOW_PL`. `setting`: the
    served tables (the objective's) or the greedy ones ("t0")."""
    by_opt = _by_option(cells, suite, setting)
    if reference not in by_opt:
        return [f"_no {suite} task tables for the reference option {reference}_"]
    shared = shared_seeds(by_opt)
    if not shared:
        return [f"_no seed that every option of this stage has run on {suite}_"]
    base = _by_option(baseline[1], suite, setting).get(baseline[0], {}) if baseline else None
    methods = common_methods(by_opt, shared)
    head = ["option", "n seeds", *[f"τ {m[0]}" for m in methods], "Δτ vanilla vs " + reference, "verdict"]
    if base is not None:
        head += [f"Δτ vanilla vs {baseline[0]}", "verdict"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flagged = False
    for opt, all_seeds in by_opt.items():
        seeds = {s: all_seeds[s] for s in shared}
        tables = list(seeds.values())
        cols = [_fmt(pooled(tables, sc, cc)) for _, sc, cc in methods]
        if below_prompt_lookup(tables):
            cols[0] += f" {BELOW_PL}"
            flagged = True
        # the reference against itself is no comparison: a dash, not a "0.000 [0.000, 0.000]"
        ref = {s: by_opt[reference][s] for s in shared}
        cols += ["—", "reference"] if opt == reference else list(_delta(seeds, ref))
        if base is not None:
            cols += ["—", "baseline"] if seeds == base else list(_delta(seeds, base))
        rows.append("| " + " | ".join([opt, str(len(shared)), *cols]) + " |")
    rows += _left_out_methods(by_opt, shared, methods)
    extra = {o: sorted(set(s) - set(shared)) for o, s in by_opt.items() if set(s) - set(shared)}
    if extra:
        rows += ["", "Pooled over seed " + ", ".join(map(str, shared)) + ", the seeds every option has; also run, "
                 "not pooled: " + "; ".join(f"{o} seed {', '.join(map(str, x))}" for o, x in extra.items()) + "."]
    if flagged:
        rows += ["", f"{BELOW_PL}: vanilla τ below prompt lookup's on the same prompts (prompt lookup needs no "
                 "drafter: such a drafter does not pay for itself)."]
    return rows


def delta_table(cells: list[dict], suite: str, reference: str) -> list[str]:
    """Markdown rows: each option's paired Δτ against `reference` for every drafting method (vanilla and each
    DDTree budget), so a loss that helps vanilla drafting but not tree search (or the reverse) shows as such."""
    by_opt = _by_option(cells, suite)
    if reference not in by_opt:
        return []
    methods = [m for m in common_methods(by_opt, shared_seeds(by_opt) or [min(by_opt[reference])])
               if m[0] != "prompt-lookup"]
    rows = ["| option | " + " | ".join(f"Δτ {m[0]} vs {reference}" for m in methods) + " |",
            "|---|" + "---|" * len(methods)]
    for opt, seeds in by_opt.items():
        if opt == reference:
            continue
        cols = []
        for _, sc, cc in methods:
            d, v = _delta(seeds, by_opt[reference], sc, cc)
            word = "tie, the seeds disagree" if "seeds disagree" in v else "tie"
            cols.append(d if d == "not paired" else f"{d} {'**' + v + '**' if v in ('better', 'worse') else word}")
        rows.append("| " + " | ".join([opt, *cols]) + " |")
    return rows


def _objective_suite(cells: list[dict], objective: str) -> str | None:
    """The suite label of the objective's task tables (`eval/suite/<name>/...`, else the objective suite's own)."""
    m = re.match(r"^eval/suite/([^/]+)/", objective)
    if m:
        return m[1]
    for c in cells:
        f = Path(c["run_dir"]) / "eval" / "served" / "tasks.json"
        f = f if f.is_file() else Path(c["run_dir"]) / "eval" / "tasks.json"
        if f.is_file():
            t = json.loads(f.read_text())
            return str((t.get("info") or {}).get("suite_label") or "eval")
        # runs that name their evaluation's setting keep the objective suite's table in eval/<setting>/
        for f in sorted((Path(c["run_dir"]) / "eval").glob("*/tasks.json")):
            info = json.loads(f.read_text()).get("info") or {}
            if info.get("setting") == f.parent.name:
                return str(info.get("suite_label") or "eval")
    return None


def stage_call(cells: list[dict], objective: str, best: str) -> dict[str, Any]:
    """The stage's verdict beside its highest-mean option `best` (which later stages build on): the options tied
    with it, whose paired Δ of the objective against it (seed for seed, prompt for prompt) has an interval
    containing 0 or is reversed by one seed's own run (`_delta`). `checked` is False where the task tables cannot
    say (then `tied` is empty)."""
    from dflash.evaluation.pairing import metric_columns
    cells = at_best_lr(cells)  # an option with an lr grid is compared at its best lr
    cols = metric_columns(objective)
    suite = _objective_suite(cells, objective)
    by_opt = _by_option(cells, suite) if suite else {}
    if cols is None or best not in by_opt:
        return {"best": best, "tied": [], "checked": False}
    tied = [opt for opt, seeds in by_opt.items() if opt != best
            and _delta(seeds, by_opt[best], cols.sum_col, cols.count_col)[1].startswith("tie")]
    return {"best": best, "tied": tied, "checked": True,
            "order": stated_order(by_opt, _mean_values(cells), (cols.sum_col, cols.count_col))}


def _mean_values(cells: list[dict]) -> dict[str, float]:
    """Each option's mean objective over its finished cells (what `best_option` ranks by)."""
    values: dict[str, list[float]] = {}
    for x in cells:
        if x.get("value") is not None:
            values.setdefault(x["option"], []).append(float(x["value"]))
    return {o: sum(v) / len(v) for o, v in values.items()}


def stated_order(by_opt: dict[str, dict[int, dict]], means: dict[str, float], cols: tuple[str, str]) -> str:
    """The options from the highest mean objective down, each adjacent pair joined by ">" only where the tie rule
    separates them (their paired Δ interval excludes 0 and no seed reverses it, `_delta`), else by "≈" (tied
    with): "dpace ≈ soft_kl_streak > soft_kl ≈ streak > hard_ce". A stated order is only what the rule separates;
    "≈" is not transitive, so "a ≈ b ≈ c" may hold a and c apart."""
    ranked = sorted((o for o in by_opt if o in means), key=lambda o: -means[o])
    if not ranked:
        return ""
    out = [ranked[0]]
    for upper, lower in zip(ranked, ranked[1:]):
        verdict = _delta(by_opt[upper], by_opt[lower], *cols)[1]
        out += [">" if verdict == "better" else "≈", lower]
    return " ".join(out)


def describe_calls(summary: dict) -> dict[str, str]:
    """factor -> what its stage found, ties called ties: `dpace`, or `uniform (tied with none, cosine; the next
    stages built on uniform)`."""
    calls = summary.get("calls") or {}
    out = {}
    for factor, best in (summary.get("winners") or {}).items():
        call = calls.get(factor) or {}
        if call.get("tied"):
            out[factor] = (f"tie: {best} ~ {', '.join(call['tied'])} (paired Δ intervals contain 0, or a seed "
                           f"reverses the Δ; later stages built on {best}, the highest mean)")
        else:
            out[factor] = best if call.get("checked") else f"{best} (highest mean; ties not checked)"
    return out


def lr_lines(stage, cells: list[dict], suite: str | None = None) -> list[str]:
    """Where a stage's options carry an `lr_grid`: that each is compared at its best of it, the mean objective over
    seeds at every lr, so a reader sees how far from the grid's edge the best lies, and (`suite`: the objective's)
    the best lr's paired Δ against the next best with the tie rule's verdict: a best lr tied with another is a
    point of a plateau, not a step size the option needs."""
    if not stage.lr_grid:
        return []
    means = lr_means(cells)
    said, edge, against = [], [], []
    for opt, grid in stage.lr_grid.items():
        got = means.get(opt, {})
        if not got:
            continue
        best = max(got, key=lambda lr: got[lr])
        said.append(f"{opt} at lr {best:g} of {{{', '.join(f'{lr:g}' for lr in grid)}}} ("
                    + ", ".join(f"{lr:g}: {got[lr]:.3f}" if lr in got else f"{lr:g}: not run" for lr in grid) + ")")
        if len(grid) > 1 and best in (min(grid), max(grid)):
            edge.append(f"{opt} ({'largest' if best == max(grid) else 'smallest'})")
        if suite is not None and len(got) > 1:
            second = max((lr for lr in got if lr != best), key=lambda lr: got[lr])
            tables = {lr: _by_option([x for x in cells if x["option"] == opt and x.get("lr") == lr], suite).get(opt, {})
                      for lr in (best, second)}
            if tables[best] and tables[second]:
                delta, verdict = _delta(tables[best], tables[second])
                against.append(f"{opt} {best:g} − {second:g}: {delta} {verdict}")
    out = ["**Learning rate**: each option with an lr grid at its best of it (the highest mean objective over its "
           "seeds; the tables, Δs and the call compare it there): " + "; ".join(said) + "."]
    if edge:  # the optimum may lie beyond the grid: the option is compared at a point, not at its best
        out[0] += (f" At the edge of its grid: {', '.join(edge)}; a step further was not tried, so that option's "
                   f"best lr is not known.")
    if against:
        out[0] += (f" The best lr against the next best (paired Δτ on `{suite}`, the tie rule's verdict): "
                   + "; ".join(against) + ".")
    return [*out, ""]


def _budget_line(cells: list[dict]) -> str:
    tok = [c.get("consumed_tokens") or 0 for c in cells]
    ep = [c.get("epochs") for c in cells if c.get("epochs") is not None]
    epochs = f"{min(ep):.2f}–{max(ep):.2f}" if ep else "not logged"
    return (f"consumed tokens per run {min(tok):,.0f}–{max(tok):,.0f}; epochs of data seen {epochs}; "
            f"{len(cells)} runs")


def _speed_lines(summary: dict) -> list[str]:
    """How the campaign used its GPU: the shared inputs made up front, then each stage's cells side by side."""
    out = []
    launches = summary.get("launches") or []
    if len(launches) > 1:  # the lines after this one are the last launch's alone
        out.append(f"Launches ({len(launches)}; the lines below are the last one's): " + "; ".join(
            f"{k}. {x['started']}: {x['cells_run']} cells, {x['wall_s']:.0f} s (shared inputs {x['shared_inputs_s']:.0f}"
            f" s), {x['consumed_tokens'] / max(x['wall_s'], 1e-9):,.0f} consumed tok/s over its cells"
            for k, x in enumerate(launches, 1)) + ".")
    wa = summary.get("write_ahead") or {}
    if wa:
        data = (f"{int(wa['data/write_ahead_batches'])} online batches ({int(wa['data/write_ahead_items']):,} "
                f"sequences; {int(wa['data/written_batches'])} written at {wa['perf/write_tok_s']:,.0f} written "
                f"tok/s, {int(wa['data/shard_reads'])} read from shards), " if wa.get("data/write_ahead_batches")
                else "")  # stored data: nothing to write ahead
        out.append(f"Shared inputs, made once before the cells (`dflash.app.write_ahead`): {data}eval ground "
                   f"truth, {wa.get('sys/write_ahead_s', 0):.0f} s in all.")
    for st in summary.get("stages", []):
        if st.get("cells_run"):
            shared = (f" (one pool with the other {st['stages_sharing_wall'] - 1} stage(s) of its group: the time "
                      f"and rate are the group's)" if st.get("stages_sharing_wall", 1) > 1 else "")
            out.append(f"Stage {st['stage']} ({st['factor']}): {st['cells_run']} cells trained in this launch "
                       f"in {st['wall_s']:.0f} s, {st['consumed_tok_s_all_cells']:,} consumed tok/s over all of "
                       f"them together{shared}.")
    phases = [c["phases_s"] for c in summary.get("cells", []) if c.get("phases_s") and not c.get("reused_from")]
    if phases:
        mean = {k: sum(p.get(k) or 0 for p in phases) / len(phases) for k in phases[0]}
        wall = [c["wall_s_this_leg"] for c in summary["cells"] if c.get("phases_s") and not c.get("reused_from")]
        out.append(f"A cell's wall time, mean of {len(phases)}: {sum(wall) / len(wall):.0f} s, of which setup "
                   f"{mean.get('setup_s', 0):.0f} s, training {mean.get('loop_s', 0):.0f} s, saving "
                   f"{mean.get('save_s', 0):.0f} s, final evaluation {mean.get('final_eval_s', 0):.0f} s (the rest: "
                   f"process start and imports).")
    out += _gpu_memory_lines(summary.get("cells", []))
    if not summary.get("complete", True):
        out.append("**The campaign is not complete**: the stages below are what it finished.")
    return [*(f"- {x}" for x in out), ""] if out else []


def _gpu_memory_lines(cells: list[dict]) -> list[str]:
    """The GPU memory the cells' processes reserved at their peak, the largest per option (what sizes `workers`
    on another GPU), and the cells that ran out of it beside others and started again with fewer at once."""
    peaks: dict[str, float] = {}
    for x in cells:
        if x.get("gpu_reserved_peak_gb") and not x.get("reused_from"):
            k = f"{x['factor']}/{x['option']}"
            peaks[k] = max(peaks.get(k, 0.0), x["gpu_reserved_peak_gb"])
    lines = []
    if peaks:
        lines.append("GPU memory a cell reserved at its peak (`perf/gpu_reserved_peak_gb`, the largest of its seeds), "
                     "the sum of the cells that ran at once is what their GPU had to hold: " + ", ".join(
                         f"{k} {v:.1f} GiB" for k, v in sorted(peaks.items(), key=lambda kv: -kv[1])) + ".")
    again = [f"{x['cell']} ({x['oom_restarts']}×)" for x in cells if x.get("oom_restarts")]
    if again:
        lines.append("Started again after running out of GPU memory beside other cells, with fewer at once "
                     "(`sweeps.launcher.LocalLauncher`): " + ", ".join(again) + ".")
    return lines


def _target_line(cells: list[dict]) -> str:
    """Which target the cells' drafters were trained for (a campaign's comparisons hold for that target)."""
    fps: dict[str, int] = {}
    for x in cells:
        if not x.get("reused_from") and x.get("value") is not None:  # a failed cell trained no drafter to count
            fp = x.get("target_fingerprint") or trained_for(Path(x["run_dir"])) or "not recorded"
            fps[fp] = fps.get(fp, 0) + 1
    return "- Target fingerprint (`dflash.target_fingerprint`) of the runs: " + ", ".join(
        f"`{fp}` ({n} runs)" for fp, n in fps.items()) + "."


def render_report(c, summary: dict, with_summary: bool = True, figures: dict[int, str] | None = None,
                  out: Path | None = None) -> str:
    """The campaign's markdown (module doc) from a summary: `summary.json`, or `summary_from_mlflow`; its results
    summary (`sweeps.results_summary`) first unless `with_summary` is False (a page that shows it elsewhere);
    `figures`: {stage index: image path relative to the report}, shown after the stage's call; `out`: the store,
    where the campaigns of `c.compare_with` are read for the protocol agreement (sweeps/protocol_agreement.py)."""
    from sweeps.protocol_agreement import agreement_section, ground_truth_lines, greedy_section, setting_title
    from sweeps.least_degenerate import least_degenerate_section
    from sweeps.results_summary import render_summary
    # the verdict first (the results summary), then how it was made: what the campaign is, its command, budget
    lines = [f"# Ablation campaign `{c.name}`", "", *(render_summary(c, summary, level=2) if with_summary else []),
             "## How it ran" if with_summary else "", "", c.description, "",
             f"Command: `python -m sweeps.campaign {c.name}` (then `… {c.name} report`). Budget: "
             f"{c.budget_tokens:,} consumed training tokens per run, seeds {c.seeds}, objective `{c.objective}`. "
             f"τ: pooled over seeds with its {CI_LEVEL:.0%} seed × prompt × sample bootstrap interval; Δτ paired "
             f"with the reference option's run of the same seed; a tie is a Δ interval containing 0, or a Δ that one "
             f"seed's own run reverses.", "", _target_line(summary["cells"]), *_speed_lines(summary)]
    if not with_summary:  # a section of a longer page: no empty heading line
        lines = [lines[0], *lines[3:]]
    winners = summary.get("winners", {})
    objective_suite = _objective_suite(summary["cells"], c.objective)
    first = c.stages[0].options[0]
    for i, stage in enumerate(c.stages):
        grid = [x for x in summary["cells"] if x["stage"] == i]
        cells = at_best_lr(grid)  # the tables compare each option at its best lr; `lr_lines` shows the grid
        on = f" (on best {', '.join(f'{f}={winners.get(f)}' for f in stage.on_best)})" if stage.on_best else ""
        lines += [f"## Stage {i}: {stage.factor}{on}", ""]
        if not cells:  # a stage not started (or one the campaign file gained after a run): said, not left out
            lines += [f"**Not run yet**: 0 of {len(stage.options) * len(c.seeds)} cells ({', '.join(stage.options)}; "
                      f"`python -m sweeps.campaign {c.name} only=[{stage.factor}]`).", ""]
            continue
        lines += [_stage_verdict(c, summary, i, grid), "", *lr_lines(stage, grid, objective_suite), _budget_line(grid), "",
                  *_data_lines(grid)]
        if figures and i in figures:
            lines += [f"![stage {i}: {stage.factor}]({figures[i]})", ""]
        baseline = None if i == 0 else (first, [x for x in summary["cells"] if x["stage"] == 0])
        # the objective's suite first: it is what the verdict is called on; the others after it
        suites = sorted({s for x in cells for s in _tables(Path(x["run_dir"]))},
                        key=lambda s: (s != objective_suite, s))
        for suite in suites:
            lines += [f"### suite `{suite}`{setting_title(cells, suite)}", "", *ground_truth_lines(cells, suite),
                      *stage_table(cells, suite, stage.options[0], baseline), ""]
            deltas = delta_table(cells, suite, stage.options[0])
            if len(deltas) > 2:
                lines += ["Paired Δτ per drafting method:", "", *deltas, ""]
            if suite == objective_suite:  # the ranking again where the ground truth repeats itself least
                lines += headroom_section(_by_option(cells, suite), read_headroom(out / c.name if out else None))
                lines += least_degenerate_section(cells, suite, stage.options[0])
                greedy = greedy_section(cells, suite, stage.options[0], baseline)
                lines += greedy
                if greedy:
                    lines += least_degenerate_section(cells, suite, stage.options[0], "t0")
                lines += agreement_section(c, out, i, cells, suite)
        # every option of the stage, its reference too where that is an earlier stage's run (reused, not trained
        # again): left out, the rank agreement ranked the other options only (the noise stage's table had no `none`
        # row)
        lines += curve_section(cells, c.objective, stage.factor)
        lines += [*cost_lines(cells), *equal_gpu_time_lines(cells, c.objective)]
        lines += _reused_lines(cells)
    return "\n".join(lines) + "\n"


def data_sets(cells: list[dict]) -> dict[str, list[str]]:
    """The finished cells' ids by the digest of the online data they read (`data_digest`; cells recorded before
    digests were kept: "not recorded"). Sampled data (T > 0) written again in a later launch, on another machine,
    need not repeat bit for bit."""
    groups: dict[str, list[str]] = {}
    for x in cells:
        if x.get("value") is not None and not x.get("reused_from"):
            groups.setdefault(x.get("data_digest") or "not recorded", []).append(x["cell"])
    return groups


def _data_lines(cells: list[dict]) -> list[str]:
    """A stage whose finished cells read more than one data set (`data_sets`): said before its tables, since a Δ
    between them carries the data's difference too."""
    groups = data_sets(cells)
    if len(groups) < 2:
        return []
    return ["**Not one data set**: the stage's cells read different online data (written again in another launch), "
            "so a Δ between cells of different data carries that difference too: " + "; ".join(
                f"data `{d}`: {', '.join(sorted(ids))}" for d, ids in groups.items()) + ".", ""]


def _stage_verdict(c, summary: dict, i: int, cells: list[dict]) -> str:
    """The stage's call, before its tables: its winner and the options tied with it, or what is left to run.

    A stage given more options or seeds after its winner was called (the campaign file grew, or the report reads
    it with more seeds than it ran) is open again: reference_64m's report without `campaign.seeds=[0]` called its
    stages done with seed 1 of none of them run."""
    stage, winners = c.stages[i], summary.get("winners", {})
    ran = {(x["option"], int(x["seed"])) for x in cells}
    finished = [x for x in cells if x.get("value") is not None]  # a failed cell ran but is not finished
    done = {(x["option"], int(x["seed"])) for x in finished}
    if stage.factor in winners and all((o, s) in done for o in stage.options for s in c.seeds):
        if len(stage.options) == 1:  # nothing to rank: the results summary weighs it against earlier winners
            return (f"One option, **{stage.options[0]}**: no winner of this stage; its paired Δ against the earlier "
                    f"stages' winners is in the results summary.")
        tied = ((summary.get("calls") or {}).get(stage.factor) or {}).get("tied") or []
        tie = (f" **Tied with it: {', '.join(tied)}** (their paired Δ interval against it contains 0): no "
               f"winner among these." if tied else "")
        order = ((summary.get("calls") or {}).get(stage.factor) or {}).get("order")
        said = f" Order, adjacent options separated only where the tie rule does (≈: tied with): {order}." if order \
            else ""
        return (f"Highest mean objective: **{winners[stage.factor]}** (a winner only where its Δ interval below "
                f"excludes 0).{tie}{said}")
    name = (lambda o, s: o) if len(c.seeds) == 1 else (lambda o, s: f"{o} (seed {s})")
    left = ", ".join(name(o, s) for o in stage.options for s in c.seeds if (o, s) not in ran)
    # a cell that ran and failed (no objective) is neither finished nor "not run": it is named with its cause
    failed = [x for x in cells if x.get("value") is None]
    fail = "; ".join(f"{name(x['option'], int(x['seed']))}: {_failure_cause(x)}" for x in failed)
    return (f"**Stage incomplete**: {len(finished)} of {len(stage.options) * len(c.seeds)} cells finished; highest "
            f"mean objective so far: {best_option(finished) if finished else 'none'} (not a winner until every "
            f"option has run)." + (f" Failed (run again to retry): {fail}." if failed else "")
            + (f" Not run yet: {left}." if left else "")
            + f" (`python -m sweeps.campaign {c.name} only=[{stage.factor}]`)")


def _failure_cause(cell: dict) -> str:
    """Why a cell that ran has no objective, from its record (`sweeps.cells.run_cell`)."""
    if cell.get("oom"):
        beside = cell.get("at_once", 1) - 1
        return f"out of GPU memory beside {beside} other cells" if beside > 0 else "out of GPU memory"
    failed = cell.get("failed")
    if isinstance(failed, str):  # a job that died without a result (`CellTask.lost`): its reason, cut short
        return f"job lost: {failed[:200]}"
    return f"exit status {failed}"


def _found_here(out: Path, c, cell: dict) -> dict:
    """The cell with its run folder as it lies under `out` now: the campaign may have run elsewhere, and its
    recorded folder is relative to that launch's working folder (a stage's call pairs the runs' task tables there:
    read before this, the report of an unpacked store called the loss stage without its ties)."""
    here = out / c.name / "runs" / cell.get("reused_from", cell["cell"])
    return {**cell, "run_dir": str(here)} if here.is_dir() else cell


def with_recorded_cells(c, out: Path, summary: dict) -> dict:
    """The summary's cells of the campaign's seeds (`c.seeds`, edits included), with every finished cell of its
    grid that has its own record on disk (`cell.json`) and is not in the summary; a stage's winner and call made
    again from its cells wherever every (option, seed) of it is there.

    `summary.json` holds the cells of its last launch only: a launch with `campaign.seeds=[1]` writes seed 1's,
    and cells copied in from another store (`dflash.tracking.copy_runs`) are in no summary until the
    next launch. The records on disk are what ran; a winner called on one seed is called again on both."""
    cells = [_found_here(out, c, x) for x in summary["cells"] if int(x["seed"]) in c.seeds]
    listed = {x["cell"] for x in cells}
    grid_winners = dict(summary.get("winners") or {})  # what later stages' runs were built on
    winners, calls = {}, dict(summary.get("calls") or {})
    lrs = dict(summary.get("winner_lrs") or {})
    complete = True  # every stage called on every seed of the campaign (the launch's flag was for its own seeds)
    for i, stage in enumerate(c.stages):
        if any(f not in grid_winners for f in stage.on_best):
            complete = False
            break  # its cells' names depend on a winner not called yet
        for cell in stage_cells(c, i, grid_winners, summary.get("winner_lrs")):
            record = None if cell.id in listed else cell_result(cell_dir(out, c, cell))
            if record is not None and record_matches(record, cell):  # not a run on another winner
                cells.append(_found_here(out, c, {**record, "earlier_launch": True}))
                listed.add(cell.id)
        mine = [x for x in cells if x["stage"] == i and not x.get("failed")]
        need = {(x.option, x.lr, x.seed) for x in stage_cells(c, i, grid_winners, summary.get("winner_lrs"))}
        if {(x["option"], x.get("lr"), int(x["seed"])) for x in mine} >= need:
            winners[stage.factor] = best_option(mine)
            calls[stage.factor] = stage_call(mine, c.objective, winners[stage.factor])
            grid_winners[stage.factor] = winners[stage.factor]
            record_winner_lr({"winners": winners, "winner_lrs": lrs}, stage.factor, mine)
        else:
            complete = False
            if stage.factor in grid_winners:
                winners[stage.factor] = grid_winners[stage.factor]  # the launch's call; the report marks it incomplete
    return {**summary, "cells": cells, "winners": winners, "calls": calls, "complete": complete, "winner_lrs": lrs}


def load_summary(c, out: Path) -> dict[str, Any]:
    """The campaign's summary as the report reads it: `summary.json` with every recorded cell of its seeds
    (`with_recorded_cells`) and each called stage's ties."""
    summary_f = out / c.name / "summary.json"
    if not summary_f.is_file():
        raise FileNotFoundError(f"{summary_f}: the campaign has not finished a stage yet (run it first)")
    summary = with_recorded_cells(c, out, json.loads(summary_f.read_text()))
    for i, stage in enumerate(c.stages):  # a summary written before the calls were recorded
        if stage.factor in summary["winners"] and stage.factor not in summary.setdefault("calls", {}):
            summary["calls"][stage.factor] = stage_call([x for x in summary["cells"] if x["stage"] == i],
                                                        c.objective, summary["winners"][stage.factor])
    return summary


def write_report(c, out: Path, dest: Path | None = None) -> dict[str, Any]:
    """Render `<out>/<campaign>/ABLATIONS.md` (and `dest` when given) from the campaign's summary; its results
    summary also to `<out>/<campaign>/SUMMARY.md` and onto the campaign's summary run in `<out>/mlflow.db`."""
    from sweeps.results_summary import log_summary, render_summary
    from sweeps.stage_figures import save_stage_figures
    summary = load_summary(c, out)
    figures = {i: f"figures/{name}" for i, name in save_stage_figures(c, summary, out / c.name / "figures").items()}
    text = render_report(c, summary, figures=figures, out=out)
    atomic_write_text(out / c.name / "ABLATIONS.md", text)
    short = "\n".join(render_summary(c, summary, level=1))
    atomic_write_text(out / c.name / "SUMMARY.md", short)
    run_id = log_summary(c, out, short, summary)
    if dest is not None:
        atomic_write_text(dest, text)
    # the terminal gets the verdict and where the rest is: the whole report is markdown with image links
    print(f"{short.rstrip()}\n\nThe whole report (tables per stage and suite, figures): {out / c.name / 'ABLATIONS.md'}")
    return {"report": str(out / c.name / "ABLATIONS.md"), "summary": str(out / c.name / "SUMMARY.md"),
            "summary_run": run_id, "winners": summary["winners"]}
