"""An ablation campaign: one factor at a time, every option at an equal budget of consumed training tokens,
several seeds, every run an MLflow run in one experiment, resumable.

    python -m sweeps.campaign <campaign name | path.yaml> [workers=N] [out=campaign_out] [deadline_s=S]
                              [only=[factor | factor/option, ...]] [--check] [campaign.KEY=VALUE ...]
                              [any run override ...]
    python -m sweeps.campaign <campaign> report [out=...]     # tables from what the campaign wrote
    python -m sweeps.campaign <campaign> launcher=slurm [launcher.KEY=VALUE ...]   # cells as Slurm jobs

A campaign file (`conf/campaign/*.yaml`) names a base run config (`base`: overrides), a budget
(`budget_tokens`: consumed — trained-on — tokens per run, so runs sharing one GPU stay comparable; wall time
would favour whichever run got the GPU more often; an option whose overrides set `trainer.token_budget` and
`trainer.max_steps` trains at its own, and the report's budget line per stage says what each run consumed), the seeds, the objective metric, and stages. A stage varies
one config group (`factor`) over `options` (or, with `options` a mapping of name -> [overrides], whatever those
overrides set, e.g. how many views of how many distinct sequences); `on_best` names earlier factors whose winner it
builds on (the option with the highest mean objective over seeds). Each cell (stage, option, seed) is one `experiments.run`
subprocess with a fixed run folder `<out>/<campaign>/runs/<cell id>`:

- finished (its `cell.json` exists): skipped;
- cut off (checkpoints, no `cell.json`): resumed from its last checkpoint (`resume=`);
- new: started.

So re-running the same command after a cut (GPU jobs here end at ten minutes) continues where it stopped;
`deadline_s=S` starts no cell later than S seconds after launch, so a job with a hard limit ends with whole
cells; `only=[buffer]` starts only those cells in this launch (a GPU session that can finish some cells but not
all), and their stage's reference where it must train again on the pinned ground truth (below). Stages that
build only on factors already decided share one pool (`stage_groups`: the reference campaign's noise and buffer
stages both build on the loss, so they run as one wave). A cell whose composed
config equals an earlier cell's (`+noise=none` on the best loss is the loss stage's
run of that loss) is that cell: its result is reused, not trained again. `workers` cells run at once (several
small runs share one GPU; the budget is in tokens, so that is fair), through the launcher (`sweeps/launcher.py`:
one GPU each on this machine while there are GPUs enough, or with `launcher=slurm` one Slurm job each, requeued
and resumed from its checkpoint when preempted). Before the first cell, the inputs every
cell shares (prompt pool, online shards, eval ground truth) are made once (`dflash.app.write_ahead`). The ground
truth's tokens are pinned in `<out>/<campaign>/truth` (`eval.truth_dir`, unless given): a later launch on another
machine evaluates on the same tokens, so its cells pair with the earlier ones. A stage whose new cells evaluate on
the pin trains its reference again under it when that reference ran before pinning (`_run_stage`).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash.atomic import atomic_write_text
from dflash.config import ConfigError
from dflash.overrides import apply_overrides
from sweeps.campaign_report import stage_call, write_report
from sweeps.campaign_spec import (Campaign, Cell, best_option, check_only, load_campaign, record_winner_lr, stage_cells,
                                  start_order)
from sweeps.cells import (CellTask, cell_dir, cell_result, composed_config_key, config_key, expected_need_gib, pinned,
                          renamed_runs, stale_records, trained_for)
from sweeps.launcher import LocalLauncher, LauncherConfig, launcher_config, make_launcher
from sweeps.shared_inputs import make_shared_inputs, with_truth_pin

DEFAULT_OUT = "campaign_out"
log = logging.getLogger("sweeps.campaign")


def with_truth_dir(c: Campaign, out: Path, extra: list[str]) -> list[str]:
    """`extra` with `eval.truth_dir=<out>/<campaign>/truth` unless it sets eval.truth_dir itself
    (`sweeps.shared_inputs.with_truth_pin`): every cell and the shared-inputs step evaluate on the tokens pinned
    there. The same for every cell of a launch: `config_key` still tells identical cells apart only by what they
    train."""
    return with_truth_pin(extra, out / c.name / "truth")


def check_same_target(c: Campaign, out: Path, extra: list[str]) -> str:
    """The current target's fingerprint; refuses (before any work) to continue a campaign whose finished or
    cut-off cells were trained for another target: its later cells would be compared with runs of a different
    model, and its ground truth and data would silently change under it."""
    from dflash.target.model import target_fingerprint
    from experiments.config import compose_config
    now = target_fingerprint(compose_config([*stage_cells(c, 0, {})[0].overrides, *extra]).target)
    runs = out / c.name / "runs"
    other = {d.name: fp for d in sorted(runs.iterdir()) if d.is_dir() and (fp := trained_for(d)) not in (None, now)} \
        if runs.is_dir() else {}
    if other:
        cell, fp = next(iter(other.items()))
        raise ConfigError(f"{runs}: {len(other)} cell(s) were trained for target fingerprint {fp} (e.g. {cell}), "
                          f"but the target is now {now}; continue with the target those cells used "
                          f"(target.path=...), or start this campaign afresh in another out= folder")
    return now


def _option_cells(c: Campaign, winners: dict[str, str]) -> list[Cell]:
    """One cell (the first seed) of every option of every stage not in `winners`, built on those winners (an
    undecided factor's first option standing in for the winner to come)."""
    stand_in = {st.factor: winners.get(st.factor, st.options[0]) for st in c.stages}
    return [cell for i, st in enumerate(c.stages) if st.factor not in winners
            for cell in stage_cells(c, i, stand_in)[:: len(c.seeds)]]


def every_option_config(c: Campaign, extra: list[str]) -> list:
    """The composed config of every option of every stage (`_option_cells` with no winner decided)."""
    from experiments.config import compose_config
    return [compose_config([*cell.overrides, *extra]) for cell in _option_cells(c, {})]


def validate_cells(c: Campaign, extra: list[str]) -> None:
    """Compose every cell of every stage before any work, so a typo in the campaign fails in seconds, not after
    the first stage."""
    every_option_config(c, extra)


def prepare_store(c: Campaign, extra: list[str]) -> None:
    """Create the tracking store and the campaign's experiment once, here, before any cell starts: cells that
    start together on a fresh sqlite file race on its schema migration and all lose their tracking (seen in
    tests/test_campaign.py: `table _alembic_tmp_experiments already exists`)."""
    from experiments.config import compose_config
    tracking = compose_config([*stage_cells(c, 0, {})[0].overrides, *extra]).tracking
    if not tracking.enabled:
        return
    from dflash.tracking.run_info import absolute_sqlite_uri, get_or_create_experiment
    from dflash.tracking.store import open_client
    uri = absolute_sqlite_uri(tracking.tracking_uri)
    get_or_create_experiment(open_client(uri), c.experiment, uri)  # bounded: a dead server is one line in seconds


def configs_to_train(c: Campaign, extra: list[str], out: Path, previous: dict) -> list:
    """The composed configs of the options a launch after `previous` (the last summary.json, {} if none) may still
    train: stages it did not decide, on its winners (an undecided factor's first option stands in), less cells with
    a record of their own and options a finished cell already trained (a reused run reads nothing). A stage added to
    a finished campaign then makes the inputs of its new cells only, not the first stage's again (reference_recipe's
    prompts stage: ~140 s of pool and shards on a fresh H200 that no new cell would read)."""
    from experiments.config import compose_config
    trained = {config_key(r["overrides"]) for r in previous.get("cells", [])
               if r.get("value") is not None and not r.get("failed") and r.get("overrides")}
    todo = [compose_config([*cell.overrides, *extra]) for cell in _option_cells(c, previous.get("winners", {}))
            if cell_result(cell_dir(out, c, cell)) is None]
    return [cfg for cfg in todo if composed_config_key(cfg) not in trained]


def shared_inputs(c: Campaign, extra: list[str], out: Path, previous: dict | None = None) -> dict[str, float]:
    """The prompt pool, the online shards every cell reads and the eval ground truth, made once before any
    cell starts, for the cells still to train (`configs_to_train`); recorded in `<out>/<campaign>/write_ahead.json`."""
    cfgs = configs_to_train(c, extra, out, previous or {})  # the deepest buffer among them decides how far to write
    if not cfgs:
        return {"sys/write_ahead_s": 0.0}
    return make_shared_inputs(cfgs[0], cfgs[1:], out / c.name / "write_ahead.json")


def _run_stage(c: Campaign, cells: list[Cell], out: Path, done: dict[str, dict], deadline: float | None,
               only: Sequence[str] = (), before_run: Callable[[], None] = lambda: None, launcher=None):
    """Finished results of `cells` (reused where an earlier cell, or an earlier one of `cells`, is the same run);
    None for a cell not started because `deadline` (time.time()) had passed, or that `only` leaves out.
    `before_run` is called before each cell that starts (run_campaign's shared inputs, made once). `launcher`
    (`sweeps.launcher`; default: this machine) runs each cell; at most `c.workers` at once.

    A stage's seed that trains new cells on the pinned ground truth needs its reference there too, so an earlier
    stage's unpinned run (`pinned`) is not reused for it: that cell trains again under the pin (once, shared by
    every such stage of `cells`, and reused by them in later launches). A stage's seed with no pinned cell keeps
    reusing it. By (stage, seed), not by stage: a Δ pairs an option's run with the reference's run of the same
    seed, and seed 1's new noise cells on the pin had put seed 0's `none` on a pinned run, which
    left seed 0's noise cells, trained before the pin, "not paired: different ground truth"."""
    keys = [config_key(cell.overrides) for cell in cells]
    earlier = [cell_result(cell_dir(out, c, cell)) for cell in cells]  # a cell's own record from a past launch
    own_pinned: dict[str, dict] = {}
    for key, e in zip(keys, earlier):
        if e is not None and pinned(e):
            own_pinned.setdefault(key, e)
    on_pin = {(cell.stage, cell.seed) for cell, key, e in zip(cells, keys, earlier)
              if e is None and key not in done}  # new cells
    on_pin |= {(cell.stage, cell.seed) for cell, e in zip(cells, earlier) if e is not None and pinned(e)}

    def source(i: int) -> dict | None:
        """The record cell i reuses; None where it has its own or must run."""
        if earlier[i] is not None:
            return None
        r = done.get(keys[i])
        if (cells[i].stage, cells[i].seed) not in on_pin:
            return r
        return r if r is not None and pinned(r) else own_pinned.get(keys[i])

    sources = [source(i) for i in range(len(cells))]
    # each run once, labelled by its first cell
    first = {k: i for i, k in reversed([(i, k) for i, k in enumerate(keys) if sources[i] is None])}

    listed = {keys[i] for i, cell in enumerate(cells)
              if not only or cell.factor in only or f"{cell.factor}/{cell.option}" in only}
    if only:
        listed |= _references_to_pin(cells, keys, earlier, sources, listed)

    def one(i: int) -> dict | None:
        if earlier[i] is not None:
            return {**earlier[i], "earlier_launch": True}
        if keys[i] not in listed:
            log.warning("cell %s not started: not among only=%s (a later launch runs it)", cells[i].id, list(only))
            return None
        if deadline is not None and time.time() > deadline:
            log.warning("cell %s not started: the campaign's deadline has passed (run again to continue)",
                        cells[i].id)
            return None
        local = isinstance(runner, LocalLauncher)
        share = c.workers if local else 1
        # the memory its option held in an earlier launch: the launcher starts it where that fits (LocalLauncher)
        need = expected_need_gib(c, out, cells[i]) if local else None
        for again in itertools.count():
            before_run()
            r = runner.run(CellTask(c, cells[i], out, share, again), cells[i].id, need_gib=need)
            # out of GPU memory beside other cells: the launcher lets fewer share that GPU (LocalLauncher), and the
            # cell starts again (from its checkpoint, if it saved one) once there is room; alone, it does not fit
            if not (r.get("oom") and r.get("at_once", 1) > 1):
                return r
            if deadline is not None and time.time() > deadline:
                log.warning("cell %s ran out of GPU memory and is not started again: the campaign's deadline has "
                            "passed (run again to continue)", cells[i].id)
                return r
            log.warning("cell %s ran out of GPU memory with %d cells on its GPU: it starts again when fewer share it",
                        cells[i].id, r["at_once"])

    runner = launcher or LocalLauncher(LauncherConfig())

    runs = start_order(c, cells, sorted(set(first.values())))
    with ThreadPoolExecutor(max_workers=c.workers) as pool:
        ran = dict(zip(runs, pool.map(one, runs)))
    results = []
    for i, key in enumerate(keys):
        r = sources[i] if sources[i] is not None else ran[first[key]]
        if (sources[i] is not None or i != first[key]) and r is not None and not r.get("failed"):
            r = {**r, **cells[i].labels(), "reused_from": r["cell"]}
        results.append(r)
    for key, r in zip(keys, results):
        if r is not None and "reused_from" not in r and not r.get("failed"):
            if key not in done or (pinned(r) and not pinned(done[key])):
                done[key] = r
    return results


def _references_to_pin(cells: list[Cell], keys: list[str], earlier: list, sources: list, listed: set[str]) -> set[str]:
    """The runs `only=` must start besides the listed ones: a listed new cell's Δ pairs with its stage's reference
    (the first option, same seed), and where that reference has no run on the pin yet (it ran before pinning, so
    `source` gave it none) it trains with the listed cell. Without it, `only=[data/views4_pool112]`
    trained a cell whose report table had nothing to pair with."""
    first: dict[tuple[int, int], int] = {}
    for i, cell in enumerate(cells):
        first.setdefault((cell.stage, cell.seed), i)
    need = set()
    for i, cell in enumerate(cells):
        ref = first[(cell.stage, cell.seed)]
        if keys[i] in listed and earlier[i] is None and ref != i and earlier[ref] is None and sources[ref] is None:
            need.add(keys[ref])
            if keys[ref] not in listed:
                log.info("cell %s starts with only=: the reference %s pairs with, on the pinned ground truth",
                         cells[ref].id, cell.id)
    return need


def stage_groups(c: Campaign) -> list[list[int]]:
    """Stages in runs that can share one pool of workers: a stage joins the group before it unless it builds
    on (`on_best`) a factor of that group, whose winner is not known until the group ends. The reference
    campaign's noise and buffer stages both build on the loss alone, so their 14 new cells run as one wave
    instead of a wave of 6 and a wave of 8 (fewer GPU jobs of ten minutes)."""
    groups: list[list[int]] = []
    for i, stage in enumerate(c.stages):
        if groups and not set(stage.on_best) & {c.stages[j].factor for j in groups[-1]}:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def run_campaign(c: Campaign, out: Path, extra: list[str], deadline_s: float = 0.0,
                 only: list[str] = (), launcher: LauncherConfig | None = None) -> dict[str, Any]:
    """Every stage in order (a group of stages at once, `stage_groups`); `deadline_s` > 0: no cell starts later
    than that many seconds from now (the cells left are the next launch's); `only` (CampaignArgs.only): the
    cells that may start in this launch; `launcher`: where cells run (`sweeps.launcher`, default this machine). `summary.json` is rewritten after every group, so a cut campaign
    reports what it finished."""
    check_only(c, only)
    t_start = time.time()
    deadline = t_start + deadline_s if deadline_s > 0 else None
    extra = with_truth_dir(c, out, extra)
    summary_f = out / c.name / "summary.json"
    factors = [st.factor for st in c.stages]
    summary: dict[str, Any] = {"campaign": c.name, "winners": {}, "cells": [], "complete": False, "stages": [],
                               "stage_factors": factors}
    previous = json.loads(summary_f.read_text()) if summary_f.is_file() else {}
    # complete for these stages: a stage added to the file since (or a summary that does not say) has cells to run
    to_run = not (previous.get("complete") and previous.get("stage_factors") == factors)
    if to_run:  # refused before anything is written, the tracking store included
        summary["target_fingerprint"] = check_same_target(c, out, extra)
    prepare_store(c, extra)
    runner = make_launcher(launcher or LauncherConfig(), out / c.name / "submitit")
    made = threading.Lock()

    def inputs_once() -> None:
        """The shared inputs before the first cell that starts (workers wait for them): none at all in a launch
        that starts no cell, e.g. one that only rewrites the summary from the cells' records (done so on
        a CPU after the per-seed pin fix: the online shards are not in the committed store)."""
        with made:
            if to_run and "write_ahead" not in summary:
                summary["write_ahead"] = shared_inputs(c, extra, out, previous)
    done: dict[str, dict] = renamed_runs(c, out)  # runs of cells the campaign file has renamed since
    earlier = previous.get("launches", [])
    for group in stage_groups(c):
        per_stage = [stage_cells(c, i, summary["winners"], summary.get("winner_lrs")) for i in group]
        stale_records(c, out, [x for cells in per_stage for x in cells])
        for cell in (x for cells in per_stage for x in cells):
            cell.overrides += extra
        t0 = time.time()
        results = _run_stage(c, [x for cells in per_stage for x in cells], out, done, deadline, only, inputs_once,
                             runner)
        wall = time.time() - t0
        cut = False
        for i, cells in zip(group, per_stage):
            mine, results = results[:len(cells)], results[len(cells):]
            ran = [r for r in mine if r is not None and "reused_from" not in r and not r.get("earlier_launch")]
            tokens = sum(r.get("leg_tokens", r["consumed_tokens"]) or 0 for r in ran)  # this launch's tokens
            summary["stages"].append({"stage": i, "factor": c.stages[i].factor, "wall_s": round(wall, 1),
                                      "stages_sharing_wall": len(group), "cells_run": len(ran),
                                      "consumed_tokens": tokens})
            summary["cells"] += [r for r in mine if r is not None]
            if any(r is None or r.get("failed") for r in mine):
                cut = True  # a deadline or a failed cell: this stage's winner is not known yet (the next launch)
                continue
            summary["winners"][c.stages[i].factor] = best_option(mine)
            record_winner_lr(summary, c.stages[i].factor, mine)
            summary.setdefault("calls", {})[c.stages[i].factor] = stage_call(
                [r for r in mine if not r.get("failed")], c.objective, summary["winners"][c.stages[i].factor])
            log.info("stage %d (%s): best %s", i, c.stages[i].factor, summary["winners"][c.stages[i].factor])
        group_tokens = sum(st["consumed_tokens"] for st in summary["stages"][-len(group):])
        for st in summary["stages"][-len(group):]:
            st["consumed_tok_s_all_cells"] = round(group_tokens / max(wall, 1e-9))
        record_launch(summary, earlier, t_start)
        atomic_write_text(summary_f, json.dumps(summary, indent=2))
        if cut:
            break
    else:
        summary["complete"] = True
    summary["wall_s"] = round(time.time() - t_start, 1)
    record_launch(summary, earlier, t_start)
    atomic_write_text(summary_f, json.dumps(summary, indent=2))
    return summary


def record_launch(summary: dict, earlier: list[dict], t_start: float) -> None:
    """`summary["launches"]`: the earlier launches' records, then this one's where it trained a cell (a launch that
    only rewrites the summary adds none). The summary's stages, shared inputs and wall time are this launch's
    alone, so a campaign run in several GPU jobs kept only its last job's figures; the history keeps each one's
    cells, wall time, tokens and shared inputs for the report's "How it ran"."""
    ran = sum(st["cells_run"] for st in summary["stages"])
    tokens = sum(st["consumed_tokens"] for st in summary["stages"])
    wall = time.time() - t_start
    this = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "cells_run": ran,
            "wall_s": round(wall, 1), "consumed_tokens": tokens,
            "shared_inputs_s": round(float((summary.get("write_ahead") or {}).get("sys/write_ahead_s", 0.0)), 1)}
    summary["launches"] = [*earlier, this] if ran else list(earlier)


@dataclasses.dataclass
class CampaignArgs:
    out: str = DEFAULT_OUT
    deadline_s: float = 0.0  # start no cell later than this many seconds after launch (0: no deadline)
    # start only these cells in this launch: factors ("buffer") or factor/option ("data/views4_pool112"); the
    # others wait for a later launch, as after the deadline (a run several cells share starts if one is listed,
    # and a listed cell's stage reference where it has no run on the pinned ground truth yet). Empty: all. For a GPU
    # session that can finish some cells but not all.
    only: list[str] = dataclasses.field(default_factory=list)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return {}
    ref, rest = argv[0], argv[1:]
    report = "report" in rest
    check = "--check" in rest
    rest = [a for a in rest if a not in ("report", "--check")]
    edits = [a for a in rest if a.startswith("campaign.")]
    # this command's own keys go through the one override parser (dflash/overrides.py): typed, named
    own = ("out=", "deadline_s=", "only=")
    args = apply_overrides(CampaignArgs(), [a for a in rest if a.startswith(own)], "argument")
    out = Path(args.out)
    workers = [a for a in rest if a.startswith("workers=")]
    if workers:
        edits.append(f"campaign.workers={workers[-1].partition('=')[2]}")
    launcher, rest = launcher_config(rest)
    extra = [a for a in rest if not a.startswith(("campaign.", "workers=", *own))]
    c = load_campaign(ref, edits)
    if report:
        return write_report(c, out)
    extra = with_truth_dir(c, out, extra)
    check_only(c, args.only)
    validate_cells(c, extra)
    if check:
        print(f"campaign {c.name}: {sum(len(s.options) for s in c.stages) * len(c.seeds)} cells valid")
        return {}
    return run_campaign(c, out, extra, args.deadline_s, args.only, launcher)


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(main)
