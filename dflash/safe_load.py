"""The one way the project reads a saved tensor file: plain data only, never code.

Every file dflash reads back — step checkpoints, pretraining state, data caches and shards, eval ground truth,
serving weights — goes through `load_plain` (torch's zip/pickle format, read with `weights_only=True`: tensors,
numbers, strings, lists, tuples, dicts) or `load_tensors` (safetensors, which has no code path at all). A file
that holds anything else (a crafted `__reduce__`, a class instance) is refused before any of it runs, with an
`UnsafeFileError` naming the file. `tests/test_faults.py` walks the source and fails on any other `torch.load`
or pickle call, so a new reader cannot quietly bypass this.
"""
from __future__ import annotations

import io
import os
from typing import Any

import torch


class UnsafeFileError(ValueError):
    """A file that cannot be read as plain data: it would run code, or it is torn / not a tensor file."""


def _refusal(e: BaseException) -> str | None:
    """The line of torch's message that names the object it refused (never its advice to load with
    weights_only=False); None when the failure is not a refusal."""
    text = str(e)
    if "weights_only" not in text and "Unsupported global" not in text:
        return None
    lines = [ln.strip() for ln in text.strip().splitlines()]
    return next((ln for ln in lines if "Unsupported global" in ln or "GLOBAL" in ln), "not plain data")


def load_plain(source: str | os.PathLike | io.BytesIO, map_location: Any = "cpu", what: str = "file",
               name: str | None = None) -> Any:
    """The plain data in a torch-saved file (or buffer). Raises UnsafeFileError naming `name` (default: the
    path) and `what` it is, when the file holds objects other than plain data or cannot be read at all."""
    label = name or (str(source) if isinstance(source, (str, os.PathLike)) else what)
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every way a file fails to unpickle is the same answer here
        why = _refusal(e)
        if why is not None:
            raise UnsafeFileError(f"{label}: refused, it holds objects other than plain data (tensors, numbers, "
                                  f"strings, containers); loading it would run code ({why[:200]})") from e
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsafeFileError(f"{label}: unreadable {what} ({type(e).__name__}: {first[:300]})") from e


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (a format that cannot carry code); UnsafeFileError when unreadable."""
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a torn or foreign file
        raise UnsafeFileError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from e


# ------------------------------------------------------------------ checksum manifests of weight folders
MANIFEST = "checksums.sha256"  # `sha256sum -c checksums.sha256` format: "<hex>  <file name>" per line
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def file_sha256(path: str | os.PathLike) -> str:
    """The file's sha256, read in 4 MiB chunks (checkpoints and exported weights are gigabytes)."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_text(folder: str | os.PathLike) -> str:
    """The manifest of every file directly in `folder` (but the manifest itself), sorted by name."""
    from pathlib import Path
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name not in (MANIFEST, f".{MANIFEST}.tmp"))
    return "".join(f"{file_sha256(p)}  {p.name}\n" for p in files)


def verify_manifest(folder: str | os.PathLike) -> bool:
    """True when `folder` has a manifest and every file it lists is there with that sha256; False without one (a
    published folder: the caller checks its structure). UnsafeFileError naming the file that differs or is gone."""
    from pathlib import Path
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False
    for n, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), 1):
        digest, _, name = line.partition("  ")
        if not line.strip():
            continue
        if len(digest) != 64 or not name or "/" in name:
            raise UnsafeFileError(f"{manifest}:{n}: not a `<sha256>  <file>` line ({line[:80]!r})")
        f = folder / name
        if not f.is_file():
            raise UnsafeFileError(f"{f}: listed in {MANIFEST} but missing")
        if file_sha256(f) != digest:
            raise UnsafeFileError(f"{f}: its sha256 differs from {MANIFEST} (the file changed or is damaged "
                                  f"since it was written); export or copy it again")
    return True


def pickled_weights(folder: str | os.PathLike) -> list[str]:
    """The pickle-format weight files of a model folder that holds no safetensors (what `from_pretrained` would
    unpickle); [] when it has safetensors weights or none of these."""
    from pathlib import Path
    folder = Path(folder)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return []
    return sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern))


def write_manifest(folder: str | os.PathLike) -> None:
    """Write `folder`'s checksum manifest (atomically), once every other file in it is final: what every export
    calls last, and `verify_manifest` checks on load."""
    from pathlib import Path
    tmp = Path(folder) / f".{MANIFEST}.tmp"
    tmp.write_text(manifest_text(folder), encoding="utf-8")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, Path(folder) / MANIFEST)
