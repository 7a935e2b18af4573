"""Atomic step checkpoints that load without executing code, each with its own digest.

A checkpoint is `step_NNNNNNNN.pt`: plain data only (tensors, numbers, strings, lists, tuples, dicts), read
back through `dflash.safe_load.load_plain` (`weights_only=True`), so a crafted pickle in the folder is refused
rather than run. Beside it `step_NNNNNNNN.pt.sha256` holds the file's digest, written after the file itself, so a
garbled or truncated file is recognised before it is unpickled. `latest.json` names the newest one and is replaced
atomically after the checkpoint it names exists. A run killed at any moment (SIGKILL included) leaves either the
previous checkpoint or the new one, never a torn file in its place.

`intact_checkpoint(dir)` is what resume, eval and export use: the newest checkpoint that verifies and loads,
with a warning naming each newer one it had to pass over (and why).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from dflash.atomic import DiskFullError, atomic_write, atomic_write_text
from dflash.safe_load import UnsafeFileError, file_sha256, load_plain

log = logging.getLogger(__name__)

POINTER = "latest.json"
DIGEST_SUFFIX = ".sha256"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: unreadable, torn, failing its digest, or not plain data."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def _digest_file(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Writes `state` (plain data) as step `step`, then its digest, then the pointer; keeps the newest `keep`
    (0: all)."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / checkpoint_name(step)
    digest: dict[str, str] = {}

    def write(tmp: str) -> None:
        torch.save(state, tmp)
        digest["sha256"] = file_sha256(tmp)

    newest = latest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    existed = path.exists()
    try:
        atomic_write(path, write)
        atomic_write_text(_digest_file(path), f"{digest['sha256']}  {path.name}\n")
        atomic_write_text(ckpt_dir / POINTER, json.dumps({"step": step, "file": path.name, **digest}))
    except DiskFullError as e:
        if not existed:  # a file without its digest or pointer would be a second, unlisted newest checkpoint
            path.unlink(missing_ok=True)
            _digest_file(path).unlink(missing_ok=True)
        raise _no_room(e, ckpt_dir, step, newest) from e
    old = sorted(ckpt_dir.glob("step_*.pt"))[:-keep] if keep > 0 else []
    for f in old:
        f.unlink(missing_ok=True)
        _digest_file(f).unlink(missing_ok=True)
    return path


def _no_room(e: DiskFullError, ckpt_dir: Path, step: int, newest: Path | None) -> DiskFullError:
    """The disk-full error of a checkpoint, saying what a resume would find."""
    try:
        free = f"{shutil.disk_usage(ckpt_dir).free} bytes free"
    except OSError:
        free = "free space unknown"
    left = (f"the newest checkpoint {newest.name} is intact (resume=<run dir> continues from it)" if newest
            else "no checkpoint has been written yet, so there is nothing to resume from")
    return DiskFullError(e.errno, f"the disk is full: checkpoint step {step} could not be written to {ckpt_dir} "
                                  f"({free}); {left}", str(ckpt_dir / checkpoint_name(step)))


def remove_torn_writes(ckpt_dir: str | os.PathLike) -> None:
    """Temp files of writes cut short by a kill (`.step_*`); the files they were replacing are intact."""
    for tmp in Path(ckpt_dir).glob(".step_*"):
        tmp.unlink(missing_ok=True)


def _pointer_file(ckpt_dir: Path) -> tuple[Path | None, str | None]:
    """(the file latest.json names, why it could not be read)."""
    pointer = ckpt_dir / POINTER
    if not pointer.is_file():
        return None, None
    try:
        return ckpt_dir / str(json.loads(pointer.read_text())["file"]), None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{pointer} is unreadable ({type(e).__name__}: {e})"


def checkpoint_candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint files newest first: the one latest.json names, then the step files by step."""
    ckpt_dir = Path(ckpt_dir)
    named, _ = _pointer_file(ckpt_dir)
    files = sorted(ckpt_dir.glob("step_*.pt"), reverse=True)
    return ([named] if named is not None else []) + [f for f in files if f != named]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint file by name (latest.json, else the highest step); not verified, nothing removed."""
    ckpt_dir = Path(ckpt_dir)
    return next((f for f in checkpoint_candidates(ckpt_dir) if f.is_file()), None)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint's state, checked against its digest (when it has one) and unpickled as plain data only:
    a file that would run code, a torn or garbled file raise CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    digest = _digest_file(path)
    if digest.is_file():
        want = digest.read_text().split()[0] if digest.read_text().strip() else ""
        got = file_sha256(path)
        if want != got:
            raise CheckpointError(f"{path}: sha256 {got[:12]}… does not match {digest.name} ({want[:12]}…): "
                                  f"torn or corrupt")
    try:
        state = load_plain(path, map_location, what="checkpoint")
    except UnsafeFileError as e:
        raise CheckpointError(str(e)) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of checkpoint state, got {type(state).__name__}")
    return state


def intact_checkpoint(ckpt_dir: str | os.PathLike, check: Callable[[Path, dict], None] | None = None,
                      map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, loads and passes `check(path, state)` (which raises CheckpointError
    for a file that is not the expected kind); None when there is no checkpoint at all. Each newer file passed
    over is named in a warning together with the one used; when none is intact, CheckpointError names them all."""
    ckpt_dir = Path(ckpt_dir)
    named, pointer_problem = _pointer_file(ckpt_dir)
    problems = [pointer_problem] if pointer_problem else []
    if named is not None and not named.is_file():
        problems.append(f"{ckpt_dir / POINTER} names {named.name}, which is missing")
    candidates = [f for f in checkpoint_candidates(ckpt_dir) if f.is_file()]
    for path in candidates:
        try:
            state = load_checkpoint(path, map_location)
            if check is not None:
                check(path, state)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            msg = f"using the newest intact checkpoint {path} instead: " + "; ".join(problems)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
        return path, state
    if problems:
        raise CheckpointError(f"{ckpt_dir}: no intact checkpoint: " + "; ".join(problems))
    return None
