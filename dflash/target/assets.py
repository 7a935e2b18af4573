"""Shipped package assets (`dflash/assets/NAME`, what `builtin:NAME` names) as folders transformers can load.

A shipped target's weights are committed xz-compressed: `model.safetensors.xz` beside `model.safetensors.sha256`
(the decompressed file's digest, in `sha256sum` format). bf16 weights shrink by about a third, and the working tree
is copied whole, under a size cap, to every GPU machine. `shipped_folder(NAME)` gives:

- the asset folder itself when none of its weights are packed, or each packed file's weights lie beside it too (a
  folder `experiments.pretrain_target` just wrote, or a developer's `xz -dk`; a raw file whose digest differs from
  the packed one's record is used, with a warning);
- else `<cache>/assets/NAME-<16 hex digits>` under the user's cache folder (`dflash.devices.cache_root`:
  `$DFLASH_CACHE`, else `~/.cache/dflash`): the weights decompressed once, checked against their recorded digest,
  and the asset's other files copied beside them. The digits are the sha256 of every file shipped (the packed
  weights, their record, tokenizer, config: `shipped_digest`), so an edited tokenizer or config in the asset folder
  gets a folder of its own instead of a stale copy. The folder is built in a temp folder beside it and renamed into
  place: another process sees it whole or not at all, and of two processes building it at once the second uses the
  first's.

A target's fingerprint hashes its files' names and bytes, never their folder (`dflash.target.model.
target_fingerprint`), so the cached folder is the same target as the raw one, and drafters trained on either match.

`python -m dflash.target.assets pack FOLDER` turns a folder the pretrain recipe wrote into the shipped form;
`python -m dflash.target.assets path NAME` prints the folder `builtin:NAME` resolves to (for tools outside dflash,
such as llama.cpp's converter).
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import lzma
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from dflash.atomic import atomic_write, atomic_write_text, dir_mode
from dflash.devices import cache_root

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parents[1] / "assets"
PACKED = ".xz"  # the suffix of a packed weights file (`model.safetensors.xz`)
DIGEST = ".sha256"  # the suffix of its record (`model.safetensors.sha256`: `<sha256>  model.safetensors`)
# LZMA2 at the default preset with literal/position bits for 2-byte values: bf16 weights pack ~5% smaller than with
# `xz -6` (`xz -9e` gains 0.2%, for a 64 MiB dictionary every reader must then allocate). stdlib lzma reads either.
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6, "lc": 3, "lp": 1, "pb": 1}]
CHUNK = 1 << 20
STALE_TEMP_S = 3600.0  # a temp folder this old was left by a killed process (an unpack takes seconds)


class AssetError(ValueError):
    """A shipped asset that cannot be unpacked: damaged packed weights, or a missing or disagreeing digest record."""


def asset_folder(name: str) -> Path:
    """`dflash/assets/NAME` as committed (its tokenizer, config and records; weights maybe packed)."""
    return ASSETS / name


def raw_name(packed: Path) -> Path:
    """`model.safetensors.xz` -> `model.safetensors`, beside it."""
    return packed.with_name(packed.name.removesuffix(PACKED))


def digest_record(weights: Path) -> Path:
    """`model.safetensors` (or its `.xz`) -> `model.safetensors.sha256`, beside it."""
    return weights.with_name(weights.name.removesuffix(PACKED) + DIGEST)


def packed_files(folder: Path) -> list[Path]:
    """The packed weights of `folder`, sorted by name ([] for a folder of raw files or none)."""
    return sorted(folder.glob(f"*.safetensors{PACKED}")) if folder.is_dir() else []


def _is_packing_file(p: Path) -> bool:
    """The packed weights and their records: not copied into an unpacked folder (it holds the weights themselves)."""
    return p.name.endswith(f".safetensors{PACKED}") or p.name.endswith(f".safetensors{DIGEST}")


def _stamp(folder: Path) -> tuple:
    """Each file's name, size and mtime: what the per-process memo of resolved folders is keyed on."""
    return tuple((p.name, st.st_size, st.st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()
                 for st in [p.stat()])


def recorded_digest(packed: Path) -> str:
    """The sha256 that `packed`'s decompressed bytes must have, from its record."""
    record = digest_record(packed)
    try:
        digest = record.read_text(encoding="utf-8").split(maxsplit=1)[0].lower()
    except (OSError, IndexError) as e:
        raise AssetError(f"{packed}: no readable digest record {record.name} beside it ({e}); the packed weights "
                         f"cannot be checked: restore both from git, or pack the folder again "
                         f"(python -m dflash.target.assets pack {packed.parent})") from e
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise AssetError(f"{record}: not a `<sha256>  {raw_name(packed).name}` line")
    return digest


def _stream_sha256(chunks: Iterable[bytes], sink: Callable[[bytes], object] | None = None) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
        if sink is not None:
            sink(chunk)
    return h.hexdigest()


def _file_chunks(f) -> Iterable[bytes]:
    return iter(lambda: f.read(CHUNK), b"")


def shipped_digest(folder: Path) -> str:
    """sha256 of every file of `folder` (name, size and bytes, in name order): names its unpacked folder, so any
    change to what is shipped (weights, their record, tokenizer, config) unpacks afresh instead of reusing a copy."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(f"\0{p.name}\0{p.stat().st_size}\0".encode())
            with open(p, "rb") as f:
                for chunk in _file_chunks(f):
                    h.update(chunk)
    return h.hexdigest()


def decompress_checked(packed: Path, out: Path) -> None:
    """`packed` decompressed into `out` in chunks, fsynced; AssetError naming `packed` when it is not a whole xz
    stream or its bytes differ from the recorded digest (`out` is then left for the caller to remove)."""
    want = recorded_digest(packed)
    try:
        with lzma.open(packed, "rb") as src, open(out, "wb") as dst:
            got = _stream_sha256(_file_chunks(src), dst.write)
            dst.flush()
            os.fsync(dst.fileno())
    except (lzma.LZMAError, EOFError) as e:
        raise AssetError(f"{packed}: damaged xz data ({e}); restore it from git "
                         f"(git checkout -- {packed})") from e
    if got != want:
        raise AssetError(f"{packed}: decompresses to sha256 {got[:16]}..., but {digest_record(packed).name} records "
                         f"{want[:16]}...: the packed weights or their record are damaged or out of step; restore "
                         f"both from git, or pack the folder again (python -m dflash.target.assets pack "
                         f"{packed.parent})")


def _clear_stale_temps(cache: Path, final_name: str) -> None:
    """Temp folders of this unpack that a killed process left (a live one is minutes younger)."""
    for stale in cache.glob(f".{final_name}.tmp-*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _publish(tmp: Path, final: Path) -> None:
    """`tmp` renamed to `final`, or left for the caller to remove when another process published `final` first
    (its folder is checked the same way as ours)."""
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
            raise


def unpack(folder: Path, cache: Path) -> Path:
    """`folder`'s packed weights decompressed (and checked) with its other files copied, as
    `cache/<folder name>-<16 hex of shipped_digest>`; built once, then reused as it is."""
    final = cache / f"{folder.name}-{shipped_digest(folder)[:16]}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    _clear_stale_temps(cache, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
    try:
        for p in sorted(folder.iterdir()):
            if p.is_file() and not _is_packing_file(p):
                shutil.copyfile(p, tmp / p.name)
        for p in packed_files(folder):
            decompress_checked(p, tmp / raw_name(p).name)
        os.chmod(tmp, dir_mode())
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("unpacked %s into %s", folder, final)
    return final


def _warn_if_stale(packed: list[Path]) -> None:
    """A raw weights file beside its packed form whose bytes differ from the packed one's record: used (a fresh
    pretraining's output, or weights being worked on), but said, since git ignores the raw file."""
    for p in packed:
        raw = raw_name(p)
        with open(raw, "rb") as f:
            got = _stream_sha256(_file_chunks(f))
        if got != recorded_digest(p):
            log.warning("%s differs from the shipped %s (sha256 %s..., recorded %s...): using the raw file; "
                        "`python -m dflash.target.assets pack %s` ships it, removing it restores the shipped one",
                        raw, p.name, got[:16], recorded_digest(p)[:16], p.parent)


_RESOLVED: dict[tuple, Path] = {}  # (folder, cache, its files' stamp) -> the folder `shipped_folder` returned


def shipped_folder(name: str) -> Path:
    """The folder `builtin:NAME` means (module doc): the asset folder when its weights are there raw, else its
    unpacked copy in the user's cache, built on first use. A name with no asset folder is returned as that path
    (the caller's "no config.json there" names it)."""
    folder = asset_folder(name)
    packed = packed_files(folder)
    if not packed:
        return folder
    key = (folder, cache_root(), _stamp(folder))
    hit = _RESOLVED.get(key)
    if hit is not None and hit.is_dir():
        return hit
    if all(raw_name(p).is_file() for p in packed):
        _warn_if_stale(packed)
        out = folder
    else:
        out = unpack(folder, cache_root() / "assets")
    _RESOLVED[key] = out
    return out


def pack(folder: Path, filters: list[dict] | None = None) -> list[tuple[Path, int, int]]:
    """Every `*.safetensors` of `folder` replaced by its shipped form: `X.safetensors.xz` and `X.safetensors.sha256`
    (the raw file's digest), the packed file read back and checked before the raw one is removed. Returns
    (packed file, raw bytes, packed bytes) for each."""
    done = []
    for raw in sorted(folder.glob("*.safetensors")):
        packed = raw.with_name(raw.name + PACKED)
        with open(raw, "rb") as f:
            digest = _stream_sha256(_file_chunks(f))

        def write(tmp: str, raw: Path = raw) -> None:
            with open(raw, "rb") as src, lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                                                   filters=filters or XZ_FILTERS) as dst:
                shutil.copyfileobj(src, dst, CHUNK)

        atomic_write(packed, write)
        with lzma.open(packed, "rb") as f:
            if _stream_sha256(_file_chunks(f)) != digest:
                raise AssetError(f"{packed}: reads back differently from {raw.name} (left in place, with the raw file)")
        atomic_write_text(digest_record(raw), f"{digest}  {raw.name}\n")
        done.append((packed, raw.stat().st_size, packed.stat().st_size))
        raw.unlink()
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.target.assets", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="replace each *.safetensors of FOLDER by its .xz and .sha256 (the shipped form)")
    pk.add_argument("folders", nargs="+", type=Path, metavar="FOLDER")
    pa = sub.add_parser("path", help="print the folder builtin:NAME resolves to (unpacking it on first use)")
    pa.add_argument("name", metavar="NAME")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "path":
            print(shipped_folder(args.name))
            return 0
        for folder in args.folders:
            done = pack(folder)
            if not done:
                print(f"{folder}: no *.safetensors to pack", file=sys.stderr)
            for packed, raw_bytes, packed_bytes in done:
                print(f"{packed}: {raw_bytes:,} -> {packed_bytes:,} bytes ({packed_bytes / raw_bytes:.1%})")
    except (OSError, AssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
