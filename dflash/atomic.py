"""Files that are either wholly written or not there: every checkpoint, cache, registry move and export
goes through these.

`atomic_write` writes to a temp file in the same folder, fsyncs, then `os.replace`s it, so a run killed at any
moment (SIGKILL included) leaves the previous file or the new one, never a torn one. The file gets the mode an
ordinary `open()` would give it (0666 less the umask: `mkstemp` alone makes it 0600, which a separate MLflow server
or a colleague cannot read), and a write that fails because the disk is full says so (torch's zip writer reports
only `unexpected pos …`). `save_checked` /
`load_checked` add a magic, a JSON header and the payload's sha256, so a cache is verified before it is trusted.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch


_UMASK: int | None = None


def umask() -> int:
    """The process umask, read once (os.umask can only be read by setting it)."""
    global _UMASK
    if _UMASK is None:
        try:  # Linux: readable without touching it (no window where another thread sees umask 0)
            line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("Umask:"))
            _UMASK = int(line.split()[1], 8)
        except (OSError, StopIteration, ValueError, IndexError):
            _UMASK = os.umask(0o022)
            os.umask(_UMASK)
    return _UMASK


def file_mode() -> int:
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


# Free space below this on a failed write's filesystem means the write failed because the disk filled up.
_FULL_BELOW_BYTES = 1 << 20


class DiskFullError(OSError):
    """A write that failed because its filesystem is full (errno ENOSPC); the message says what is left intact.
    The command-line entry points print it as one line and exit 1."""


def disk_full_error(path: Path, exc: BaseException, existed: bool = True) -> DiskFullError | None:
    """A DiskFullError when `exc` (or what caused it) is ENOSPC / EDQUOT, or the filesystem is left with almost
    no free space (torch's writer then reports only `unexpected pos …`); else None. `existed`: whether `path`
    was there before the write (only then is there a previous file to speak of)."""
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            break
        e = e.__cause__ or e.__context__
    full = e is not None
    if not full:
        try:
            full = shutil.disk_usage(path.parent).free < _FULL_BELOW_BYTES
        except OSError:
            full = False
    if not full:
        return None
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = -1
    left = "the previous file there is intact" if existed else "no partial file was left there"
    return DiskFullError(errno.ENOSPC, f"the disk is full writing {path} ({free} bytes free on its filesystem); "
                                       f"{left} ({type(exc).__name__}: {str(exc).strip()[:200]})", str(path))


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], exclusive: bool = False) -> bool:
    """`write(tmp)` fills a temporary file beside `path`, which then takes its place whole or not at all.
    `exclusive`: only if no file is there yet (False, the existing file left as it is, when one is): of several
    processes racing to write the same file the first wins and the others can read what it wrote. True otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.exists()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        if exclusive:
            return _publish_new(tmp, path)
        os.replace(tmp, path)
        return True
    except BaseException as e:
        full = disk_full_error(path, e, existed) if isinstance(e, Exception) else None  # before the temp goes
        if full is not None:
            raise full from e
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _publish_new(tmp: str, path: Path) -> bool:
    """`tmp` under the name `path` unless that name exists: a hard link is atomic and, unlike `os.replace`,
    refuses an existing name."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    if path.exists():  # a filesystem without hard links: check, then replace (a narrow race, never a torn file)
        return False
    os.replace(tmp, path)
    return True


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_create_text(path: str | os.PathLike, text: str) -> bool:
    """`text` written to `path` whole, only if no file is there yet: True when this call made it, False when one
    was already there (left as it is)."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text), exclusive=True)


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
    from dflash.safe_load import load_plain
    data = load_plain(io.BytesIO(payload), "cpu", name=str(path))
    if data.get("key") != key:
        raise ValueError(f"{path}: key mismatch in payload")
    return data
