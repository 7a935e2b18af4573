"""Files that are either wholly written or not there: every checkpoint, cache, registry move and export
goes through these.

`atomic_write` writes to a temp file in the same folder, fsyncs, then `os.replace`s it, so a run killed at any
moment (SIGKILL included) leaves the previous file or the new one, never a torn one. `save_checked` /
`load_checked` add a magic, a JSON header and the payload's sha256, so a cache is verified before it is trusted.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

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
