"""A campaign cell's run: its folder `<out>/<campaign>/runs/<cell id>`, the `experiments.run` subprocess that trains
(or resumes) it, and its record `cell.json`, which a later launch reuses and the report reads."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from dflash.atomic import atomic_write_text
from sweeps.campaign_spec import Campaign, Cell
from sweeps.launcher import call
from sweeps.shared_inputs import sets_truth_dir
from sweeps.support import is_gpu_oom, last_logged

PHASES = ("sys/setup_s", "sys/loop_s", "sys/save_s", "sys/final_eval_s")  # a cell's wall time, by the trainer
log = logging.getLogger("sweeps.campaign")


def cell_dir(out: Path, c: Campaign, cell: Cell) -> Path:
    return out / c.name / "runs" / cell.id


def cell_result(run_dir: Path) -> dict | None:
    f = run_dir / "cell.json"
    return json.loads(f.read_text()) if f.is_file() else None


# a cell process's GPU memory outside torch's reserve (CUDA context, cuBLAS workspaces): 0.74-0.80 GiB between the
# recorded peaks and nvidia-smi's per-process figures of the served campaign's cells (2026-12-05)
CONTEXT_GIB = 0.8


def expected_need_gib(c: Campaign, out: Path, cell: Cell) -> float | None:
    """The GPU memory `cell` is expected to hold (GiB), plus CONTEXT_GIB: the largest peak (`gpu_reserved_peak_gb`)
    that its option recorded in this campaign on any seed, else the largest of its stage's options; where its stage
    recorded none (a new campaign), the largest peak of an option of that name in any other campaign of the store,
    else the largest any cell of the store recorded; None where the store recorded none at all (the launcher then
    places it by count alone: `sweeps.launcher.LocalLauncher`). A new campaign placed by count alone put 18 cells on
    one 80 GiB H100 at once (2026-12-06): every cell ran out of memory or failed in cuDNN's attention."""
    own: dict[str, float] = {}
    others: dict[str, float] = {}
    for f in out.glob("*/runs/*/cell.json"):
        r = cell_result(f.parent)
        if not r.get("gpu_reserved_peak_gb"):
            continue
        peak = float(r["gpu_reserved_peak_gb"])
        if f.parent.parent.parent.name == c.name:
            if r.get("stage") == cell.stage:
                own[r["option"]] = max(own.get(r["option"], 0.0), peak)
        else:
            others[r.get("option", "")] = max(others.get(r.get("option", ""), 0.0), peak)
    peak = own.get(cell.option, max(own.values(), default=None))
    if peak is None:
        peak = others.get(cell.option, max(others.values(), default=None))
    return None if peak is None else peak + CONTEXT_GIB


def _lacking_overrides(record: dict, cell: Cell) -> list[str]:
    """The overrides of `cell` as the campaign composes it now (the base, the winners it builds on, its option, seed
    and budget) that a finished cell's record (`cell.json`) lacks. None lacking for a record that names no
    overrides (it cannot say) or one reused from another cell's run (`reused_from`: the same composed config, under
    that cell's overrides, matched by its composed config)."""
    if "overrides" not in record or record.get("reused_from"):
        return []
    have = set(record["overrides"])
    return [o for o in cell.overrides if o not in have]


def record_matches(record: dict, cell: Cell) -> bool:
    """Whether a finished cell's record is a run of `cell` as the campaign composes it now."""
    return not _lacking_overrides(record, cell)


def stale_records(c: Campaign, out: Path, cells: list[Cell]) -> list[str]:
    """The folders of `cells` that hold a finished run of other overrides than the cell needs now, each with the
    overrides it lacks; logged as a warning.

    A cell's folder is named by its stage, option and seed, not by the winners it builds on: when a later launch
    calls an earlier stage's winner differently (seed 1 put dpace ahead of seed 0's streak at 64 M; a
    resumed near-tie can flip on the CPU smoke campaign), the later stage's finished cells were trained on the old
    winner, and the campaign reuses them by their folder. Said, not refused: the launch goes on, and moving such a
    folder away makes the next launch train the cell on the new winner."""
    stale = []
    for cell in cells:
        record = cell_result(cell_dir(out, c, cell))
        missing = _lacking_overrides(record, cell) if record is not None else []
        if missing:
            stale.append(f"{cell_dir(out, c, cell)} (needs {', '.join(missing)})")
    if stale:
        log.warning("campaign %s: these folders hold finished runs of other overrides than their cells need now "
                    "(an earlier stage's winner or the campaign file changed since they ran), reused as they are: "
                    "%s. Move them away to train the cells as they are now", c.name, "; ".join(stale))
    return stale


def tokens_at_resume(run_dir: Path) -> float:
    """Consumed tokens at the newest checkpoint a cut cell resumes from (0 for a new cell): the tokens this launch
    trains are the rest, and a launch's consumed tok/s counts only those (a resumed cell's whole budget over one
    launch's wall time overstated the rate)."""
    from dflash.run_dir import RunDir
    step = RunDir(run_dir).newest_checkpoint_step()
    return 0.0 if step is None else (last_logged(run_dir, "data/consumed_tokens", max_step=step) or 0.0)


def cell_command(cell: Cell, run_dir: Path) -> list[str]:
    from dflash.run_dir import RunDir
    if RunDir(run_dir).newest_checkpoint_step() is not None:
        return [sys.executable, "-m", "experiments.run", f"resume={run_dir}"]
    return [sys.executable, "-m", "experiments.run", *cell.overrides, f"run_dir={run_dir}"]


def cell_env(workers: int) -> dict[str, str]:
    """A cell's environment: unbuffered output, and its share of the CPU's cores for torch's and the BLAS's
    thread pools unless the caller set them (every process defaults to all cores: `workers` cells at once would
    run workers × cores threads through their CPU parts, the evaluation's bootstrap and process start)."""
    share = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, share)
    return env


@dataclasses.dataclass
class CellTask:
    """One cell as a launcher task (`sweeps.launcher`): picklable, so a Slurm job runs it; `share` is how many
    cells split this machine's cores (1 in a job of its own)."""
    campaign: Campaign
    cell: Cell
    out: Path
    share: int
    oom_restarts: int = 0  # starts of this launch after it ran out of GPU memory beside other cells

    def __call__(self, gpu: str | None) -> dict:
        return run_cell(self.campaign, self.cell, self.out, gpu, self.share, self.oom_restarts)

    def lost(self, reason: str) -> dict:
        """The record of a cell whose job died (this launch only: the next one resumes it from its checkpoint)."""
        log.error("cell %s: %s", self.cell.id, reason)
        return {**self.cell.labels(), "run_dir": str(cell_dir(self.out, self.campaign, self.cell)), "value": None,
                "consumed_tokens": None, "failed": reason}


def run_cell(c: Campaign, cell: Cell, out: Path, gpu: str | None = None, share: int = 0,
             oom_restarts: int = 0) -> dict:
    """Run (or resume) one cell to its end in a subprocess (on `gpu` when given); record its final metrics in
    `cell.json`. `share`: cells splitting this machine's cores (default: the campaign's workers); `oom_restarts`:
    how often it started again after running out of GPU memory, recorded with it."""
    run_dir = cell_dir(out, c, cell)
    done = cell_result(run_dir)
    if done is not None:
        return done
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = cell_command(cell, run_dir)
    start_tokens = tokens_at_resume(run_dir)
    log.info("cell %s: %s", cell.id, " ".join(cmd[1:]))
    t0 = time.time()
    log_path = run_dir.parent / f"{cell.id}.log"
    with open(log_path, "a") as logf:
        leg_start = logf.tell()
        rc = call(cmd, gpu, stdout=logf, stderr=subprocess.STDOUT, env=cell_env(share or c.workers))
    restarts = {"oom_restarts": oom_restarts} if oom_restarts else {}
    if rc != 0:  # recorded for this launch only (no cell.json): the next launch runs it again
        log.error("cell %s exited %d; see %s", cell.id, rc, log_path)
        oom = {"oom": True} if ran_out_of_gpu_memory(log_path, leg_start) else {}
        return {**cell.labels(), "run_dir": str(run_dir), "value": None, "consumed_tokens": None, "failed": rc, **oom,
                **restarts}
    result = {**cell.labels(), "overrides": cell.overrides, "run_dir": str(run_dir),
              "objective": c.objective, "value": last_logged(run_dir, c.objective),
              "consumed_tokens": last_logged(run_dir, "data/consumed_tokens"),
              "leg_tokens": (last_logged(run_dir, "data/consumed_tokens") or 0.0) - start_tokens,
              "epochs": last_logged(run_dir, "data/epochs"),
              "consumed_tok_s": last_logged(run_dir, "perf/consumed_tok_s"),
              "gpus": int(last_logged(run_dir, "perf/world_size") or 1),  # GPUs of its training (sweeps/cost.py)
              "gpu_reserved_peak_gb": last_logged(run_dir, "perf/gpu_reserved_peak_gb"),
              "phases_s": {k.removeprefix("sys/"): last_logged(run_dir, k) for k in PHASES},
              "wall_s_this_leg": round(time.time() - t0, 1), "resumed": any(a.startswith("resume=") for a in cmd),
              "target_fingerprint": trained_for(run_dir), "data_digest": data_digest(out, c), **restarts}
    atomic_write_text(run_dir / "cell.json", json.dumps(result, indent=2))
    return result


def data_digest(out: Path, c: Campaign) -> str | None:
    """The digest of the online data this launch's cells read (`data/digest` of `write_ahead.json`, the shared
    inputs made before they started; None without online data or a record of it)."""
    f = out / c.name / "write_ahead.json"
    try:
        return json.loads(f.read_text()).get("data/digest") if f.is_file() else None
    except (OSError, ValueError):
        return None


def ran_out_of_gpu_memory(log_path: Path, offset: int) -> bool:
    """Whether the cell's log from `offset` on (this leg's output) ends in a GPU out-of-memory error: its last
    64 KiB hold the traceback."""
    with open(log_path, "rb") as f:
        f.seek(max(offset, f.seek(0, os.SEEK_END) - (64 << 10)))
        tail = f.read()
    return is_gpu_oom(tail.decode(errors="replace"))


def trained_for(run_dir: Path) -> str | None:
    """The target fingerprint a run folder's drafter was trained for (its `dflash.target_fingerprint` tag)."""
    f = Path(run_dir) / "tags.json"
    return json.loads(f.read_text()).get("dflash.target_fingerprint") if f.is_file() else None


def pinned(result: dict) -> bool:
    """Whether a cell ran on the campaign's pinned ground truth (`eval.truth_dir` among its overrides). Cells of
    launches before pinning (`reference_64m`'s first loss, noise and data cells) evaluated on tokens of their own
    machine, so their τ does not pair, prompt for prompt, with cells evaluated on the pin."""
    return sets_truth_dir(result.get("overrides", []))


def cell_ids(c: Campaign) -> set[str]:
    """Every cell folder name the campaign file makes now (a cell's id does not depend on the winners it builds
    on)."""
    return {Cell(i, st.factor, opt, seed, [], lr).id for i, st in enumerate(c.stages) for opt in st.options
            for lr in st.lr_grid.get(opt, [None]) for seed in c.seeds}


def renamed_runs(c: Campaign, out: Path) -> dict[str, dict]:
    """Finished runs in the campaign's folder that no cell of the campaign file names any more, by their composed
    config (`config_key`; pinned runs first): a cell whose composed config is one of them is that run, not a new
    one. A stage that gains an `lr_grid` renames its cells (`s1-drafter-dflash1_muon-seed0` becomes
    `…-dflash1_muon-lr0.0006-seed0`), and the grid's point at the option's own lr trained again without this (the
    engine campaign's six such cells on 2026-12-06: the same τ to 0.015, 500 GPU-seconds)."""
    runs = out / c.name / "runs"
    names = cell_ids(c)
    found: dict[str, dict] = {}
    for d in sorted(runs.iterdir()) if runs.is_dir() else []:
        r = cell_result(d) if d.name not in names else None
        if r is None or r.get("failed") or r.get("value") is None or "overrides" not in r:
            continue
        key = config_key(r["overrides"])
        if key not in found or (pinned(r) and not pinned(found[key])):
            found[key] = r
    return found


def config_key(overrides: list[str]) -> str:
    """What a cell trains, as a hash of its composed config (its run folder aside): two cells with the same key
    are the same run, e.g. `+noise=none` on the best loss and that loss's own cell of the loss stage."""
    from experiments.config import compose_config
    return composed_config_key(compose_config(overrides))


def composed_config_key(cfg) -> str:
    """`config_key` of a config already composed."""
    import hashlib

    from dflash.config import to_dict
    d = to_dict(cfg)
    # where a run is written and tracked is not what it trains: a run tracked at another store path (another
    # machine's /tmp) is the same run
    for k in ("run_dir", "resume", "tracking"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()
