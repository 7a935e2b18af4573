"""The run folder: its layout, its resume state, and "which drafter does this path mean".

A training run owns one folder (`runs/<timestamp>-<loss>/` unless `run_dir=` names it):

    config.yaml        the resolved run config (written once the run, or its resume, has validated)
    checkpoints/       step_NNNNNNNN.pt (+ .sha256) and latest.json: `dflash.training.checkpoint`
    final/             the drafter in the serving format (docs/serving.md)
    mlflow_run.json    where the run is tracked: tracking_uri, experiment, run_id, run_name
    metrics.jsonl      every logged step, the log of record (also when the tracking store is down)
    eval/              evaluation outputs (reports, the eval CLI's runs)

`RunDir` knows the layout; the run it holds is composed in dflash/app/run.py, which hands the trainer only its
checkpoint folder, and the eval, export and promote CLIs and sweeps ask it. It sits above training and tracking
(their checkpoint format and the loggers' two files, dflash/tracking/records.py, are theirs) and below config.
`resolve_drafter_source(path)` turns a run folder, a serving folder or a checkpoint file into a drafter source
(eval and export). Resume reads everything it needs through `ResumeState` before anything is written; a folder stopped before its
first checkpoint (config.yaml, no step file) resumes from step 0.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dflash.atomic import atomic_write_text
from dflash.tracking.records import METRICS_FILE, MLFLOW_FILE, read_metric_records, read_mlflow_record

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
EVAL_DIR = "eval"
SERVING_CONFIG = "config.json"  # a serving folder's marker (docs/serving.md)


def missing_folders(path: str | os.PathLike) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first (what making it would make)."""
    root = Path(path).absolute()
    return [p for p in (root, *root.parents) if not p.exists()]


def remove_empty_folders(folders: list[Path]) -> None:
    """Removes `folders` (deepest first) while each is empty: another process may have started in one meanwhile."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def probe_folder(path: str | os.PathLike) -> None:
    """OSError when the folder `path` cannot be made or written (`/proc/x/y`, a file on the way, no permission),
    found before any work: it is made and its new folders are removed again, so nothing is left behind."""
    made = missing_folders(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable", str(path))
    finally:
        remove_empty_folders(made)


class RunDir:
    """Paths and records of one run folder (nothing is created until `create()` or a write)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    @classmethod
    def for_config(cls, run_dir: str, label: str) -> "RunDir":
        """`run_dir` when set, else `runs/<label>-<timestamp>` (the label says what the run is)."""
        if run_dir:
            return cls(run_dir)
        from dflash.tracking.run_info import default_run_name
        return cls(Path("runs") / default_run_name(label))

    # ---- paths
    @property
    def config_file(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINT_DIR

    @property
    def final(self) -> Path:
        return self.root / FINAL_DIR

    @property
    def mlflow_file(self) -> Path:
        return self.root / MLFLOW_FILE

    @property
    def eval_dir(self) -> Path:
        return self.root / EVAL_DIR

    def newest_checkpoint_step(self) -> int | None:
        """The highest step among `checkpoints/step_NNNNNNNN.pt` by name (not verified); None without one: where a
        cut run resumes from, for the campaign's and the sweep's continuations."""
        found = (re.fullmatch(r"step_(\d+)\.pt", f.name) for f in self.checkpoints.glob("step_*.pt"))
        steps = [int(m[1]) for m in found if m]
        return max(steps, default=None)

    def is_run(self) -> bool:
        """A training run's folder (config.yaml or metrics.jsonl there)."""
        return self.config_file.is_file() or (self.root / METRICS_FILE).is_file()

    def has_final(self) -> bool:
        return (self.final / SERVING_CONFIG).is_file()

    def create(self) -> "RunDir":
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    # ---- config.yaml
    def write_config(self, cfg_dict: Mapping[str, Any]) -> Path:
        import yaml
        atomic_write_text(self.config_file, yaml.safe_dump(dict(cfg_dict), sort_keys=False))
        return self.config_file

    def read_config(self) -> dict:
        """The saved resolved config as a dict; ValueError naming the file when missing or not YAML."""
        import yaml
        if not self.config_file.is_file():
            raise FileNotFoundError(f"{self.root}: no {CONFIG_FILE} there")
        try:
            d = yaml.safe_load(self.config_file.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{self.config_file}: not valid YAML ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"{self.config_file}: expected a mapping, got {type(d).__name__}")
        return d

    # ---- mlflow_run.json, metrics.jsonl (the loggers' files: dflash/tracking/records.py)
    def mlflow_info(self) -> dict:
        """{} when absent; an unreadable file warns and reads as absent."""
        return read_mlflow_record(self.root)

    # ---- checkpoints (their format: dflash/training/checkpoint.py)
    def remove_torn_writes(self) -> None:
        from dflash.training.checkpoint import remove_torn_writes
        if self.checkpoints.is_dir():
            remove_torn_writes(self.checkpoints)


def _logged_keys(run_dir: RunDir) -> dict[int, set[str]]:
    """step -> the metric keys metrics.jsonl already holds at that step (what a resume must not log again)."""
    seen: dict[int, set[str]] = {}
    for rec in read_metric_records(run_dir.root):
        if isinstance(rec.get("step"), int):
            seen.setdefault(rec["step"], set()).update(k for k in rec if k not in ("step", "time"))
    return seen


def _intact_checkpoint(run_dir: RunDir, check=None) -> tuple[Path, dict] | None:
    """(path, state) of the newest checkpoint that verifies (warning naming any newer one passed over)."""
    from dflash.training.checkpoint import intact_checkpoint
    return intact_checkpoint(run_dir.checkpoints, check) if run_dir.checkpoints.is_dir() else None


@dataclass
class ResumeState:
    """What a resume read from the run folder before changing anything in it. `checkpoint` None: a run folder
    stopped before its first checkpoint (a kill -9 while it set up): it trains again from step 0 there."""
    checkpoint: Path | None
    state: dict
    run_id: str | None
    logged: dict[int, set[str]] = field(default_factory=dict)


_TRAINING_KEYS = ("step", "drafter", "optimizer", "scheduler", "ranks", "config")


def _check_training_state(path: Path, state: dict) -> None:
    from dflash.training.checkpoint import CheckpointError
    missing = [k for k in _TRAINING_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a full training checkpoint (missing {missing})")


def read_resume_state(run_dir: RunDir) -> ResumeState:
    """The newest intact training checkpoint, the run's MLflow id and the steps already logged; reads only.
    CheckpointError (a ValueError) when no checkpoint there can be trusted."""
    from dflash.training.checkpoint import CheckpointError
    if run_dir.newest_checkpoint_step() is None and run_dir.config_file.is_file():
        log.warning("resume=%s: the run stopped before its first checkpoint; it trains from step 0 in this folder",
                    run_dir.root)
        return ResumeState(None, {}, run_dir.mlflow_info().get("run_id"), _logged_keys(run_dir))
    found = _intact_checkpoint(run_dir, _check_training_state)
    if found is None:
        raise CheckpointError(f"resume={str(run_dir.root)!r}: no checkpoint in {CHECKPOINT_DIR}/")
    path, state = found
    return ResumeState(path, state, run_dir.mlflow_info().get("run_id"), _logged_keys(run_dir))


# ----------------------------------------------------------------------------- drafter sources
class DrafterSourceError(ValueError):
    """A path that is neither a run folder, a serving folder nor a checkpoint file (the message says which)."""


@dataclass
class DrafterSource:
    """A drafter named by a path: a serving folder (`serving`), or a training checkpoint (`checkpoint`, with
    its loaded `state`). `run` is the training run folder it belongs to, when there is one."""
    path: Path
    run: RunDir | None = None
    serving: Path | None = None
    checkpoint: Path | None = None
    state: dict | None = None

    @property
    def step(self) -> int | None:
        return int(self.state.get("step", 0)) if self.state is not None else None

    @property
    def run_serving(self) -> Path | None:
        """The serving folder (final/) of the run a checkpoint belongs to, when the run has one."""
        return self.run.final if self.run is not None and self.run.has_final() else None

    @property
    def run_config(self) -> dict | None:
        """The run config that goes with the drafter: a checkpoint file's own; a run folder's config.yaml."""
        if self.path.is_file():
            return self.state.get("config") if self.state is not None else None
        if self.run is not None and self.run.config_file.is_file():
            return self.run.read_config()
        return self.state.get("config") if self.state is not None else None


def _load_checkpoint_source(pt: Path) -> DrafterSource:
    from dflash.training.checkpoint import load_checkpoint
    state = load_checkpoint(pt)
    run = RunDir(pt.parent.parent) if pt.parent.name == CHECKPOINT_DIR else None
    return DrafterSource(pt, run=run, checkpoint=pt, state=state)


def resolve_drafter_source(path: str | os.PathLike) -> DrafterSource:
    """A checkpoint file; a serving folder (config.json); a run folder (its final/, else its newest intact
    checkpoint). Raises DrafterSourceError / CheckpointError (both ValueError) or FileNotFoundError, naming it."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".pt":
            raise DrafterSourceError(f"{p}: expected a run directory, a serving folder or a checkpoint .pt file")
        return _load_checkpoint_source(p)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such run directory, serving folder or checkpoint")
    if (p / SERVING_CONFIG).is_file():
        return DrafterSource(p, serving=p)
    run = RunDir(p)
    if run.has_final():
        return DrafterSource(p, run=run, serving=run.final)
    found = _intact_checkpoint(run)
    if found is not None:
        return DrafterSource(p, run=run, checkpoint=found[0], state=found[1])
    raise FileNotFoundError(f"{p}: neither a serving folder ({SERVING_CONFIG}), a run directory with {FINAL_DIR}/ "
                            f"nor one with {CHECKPOINT_DIR}/step_*.pt")


class SkipLogged:
    """A logger that drops what a resumed run's metrics.jsonl already holds (`logged`: step -> keys), so a
    resume after a kill never writes a step twice, to metrics.jsonl or to MLflow: the first value logged for a
    (step, key) stays (nothing already written is lost), the replayed steps' new values are not logged. Every
    other call goes to `inner` unchanged."""

    def __init__(self, inner, logged: dict[int, set[str]]):
        self.inner, self.logged = inner, logged

    def log(self, metrics, step: int) -> None:
        seen = self.logged.get(int(step))
        if seen:
            metrics = {k: v for k, v in metrics.items() if k not in seen}
            if not metrics:
                return
        self.inner.log(metrics, step)

    def __getattr__(self, name):
        return getattr(self.inner, name)
