"""Atomic checkpoint files: write to a temp file in the same folder, fsync, then os.replace.

A run killed at any moment (SIGKILL included) leaves either the previous checkpoint or the new one,
never a torn file; `latest` is itself replaced atomically after the checkpoint it names exists.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(text)
    atomic_write(path, write)


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


def save_checked(path: str | os.PathLike, magic: bytes, fmt: int, key: str, obj: dict) -> None:
    """A cache file that can be verified before it is trusted: `magic`, a JSON header (format, key, payload
    size and sha256), then the torch-saved payload. Written atomically."""
    import hashlib
    import io
    buf = io.BytesIO()
    torch.save({"format": fmt, "key": key, **obj}, buf)
    payload = buf.getvalue()
    header = json.dumps({"format": fmt, "key": key, "nbytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    data = magic + header + b"\n" + payload
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def load_checked(path: str | os.PathLike, magic: bytes, fmt: int, key: str) -> dict:
    """The payload of a `save_checked` file; raises ValueError (or an I/O error) on anything not exactly as
    written for `key` (wrong magic, format, key, size or checksum), so a corrupt cache is rebuilt."""
    import hashlib
    import io
    raw = Path(path).read_bytes()
    if not raw.startswith(magic):
        raise ValueError(f"{path}: not a {magic.strip().decode()} file")
    end = raw.index(b"\n", len(magic))
    header = json.loads(raw[len(magic):end])
    payload = raw[end + 1:]
    if header.get("format") != fmt or header.get("key") != key:
        raise ValueError(f"{path}: format or key mismatch")
    if len(payload) != header.get("nbytes") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError(f"{path}: checksum mismatch (truncated or corrupt)")
    data = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if data.get("key") != key:
        raise ValueError(f"{path}: key mismatch in payload")
    return data
