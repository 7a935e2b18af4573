"""Atomic checkpoint files: write to a temp file in the same folder, fsync, then os.replace.

A run killed at any moment (SIGKILL included) leaves either the previous checkpoint or the new one,
never a torn file; `latest` is itself replaced atomically after the checkpoint it names exists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dflash.atomic import atomic_write, atomic_write_text


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / f"step_{step:08d}.pt"
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    atomic_write_text(ckpt_dir / "latest.json", json.dumps({"step": step, "file": path.name}))
    old = sorted(ckpt_dir.glob("step_*.pt"))[:-keep] if keep > 0 else []
    for f in old:
        f.unlink(missing_ok=True)
    return path


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest.json` names; falls back to the newest readable step file."""
    ckpt_dir = Path(ckpt_dir)
    for tmp in ckpt_dir.glob(".step_*"):  # a write cut short by a kill; the previous file is intact
        tmp.unlink(missing_ok=True)
    pointer = ckpt_dir / "latest.json"
    if pointer.is_file():
        f = ckpt_dir / json.loads(pointer.read_text())["file"]
        if f.is_file():
            return f
    files = sorted(ckpt_dir.glob("step_*.pt"))
    return files[-1] if files else None


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    return torch.load(path, map_location=map_location, weights_only=False)
