"""Carry a resumable run from one lent GPU machine to the next, through the device tool's limits.

A device call brings back at most 8 files of 16 MiB each (under $OUT), and carries in at most 64 MiB, of which the
working tree takes 54.4 MB (2026-12-03: the reference target's weights and the committed stores). A checkpoint of the recipe's 2-layer drafter (weights and AdamW moments) is 38 MB: it
fits neither way whole, so a 30-minute run could not resume on the next fresh machine. Here it travels in
parts, each checked:

    # on the GPU, after a job: the run folder (its newest intact checkpoint, no final/) and any other files, in parts
    python benchmarks/leased_gpu/carry.py pack $OUT/carry gpu_work/recipe gpu_work/recipe.db
    # here: one folder per later call, each a part and the manifest (git-ignored: .carry/)
    python benchmarks/leased_gpu/carry.py folders /work/.device/<N>/carry .carry
    # later, one call per folder (carry [".carry/01"], then [".carry/02"], ...): each keeps its part on the
    # warm machine, outside the carried paths (a carried path is replaced on every call)
    mkdir -p /tmp/carry && cp .carry/01/* /tmp/carry/
    # the call that resumes: every part checked against the manifest, then extracted beside the old paths
    python benchmarks/leased_gpu/carry.py unpack /tmp/carry gpu_work && python -m experiments.run resume=gpu_work/recipe

Each part and the whole carry a sha256 in `carry.manifest.json`; a missing or damaged part is named, and nothing is
extracted until all of them check out. `unpack` refuses to replace an existing path unless `--replace`, and then
moves the new one in only after the whole archive is extracted. The machine's checkout path is the same on every
call (/work/main), so the absolute paths a run folder records (its tracking store) still hold.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a file on a machine where the checkout is not installed: dflash from here
    sys.path.insert(0, str(ROOT))

MANIFEST = "carry.manifest.json"
# under the 16 MiB a returned file may have, and beside the tree in a 64 MiB carry: 15 MiB parts fitted beside the
# 44 MiB tree they were sized for, not beside the 54.4 MB of 2026-12-03 (15.7 + 54.4 > 67.1 MB); 8 MiB leave 4.3 MB for
# the stores' growth (`benchmarks/leased_gpu/wheel_folders.py --check` prints the tree), and 7 parts still hold 56 MiB
PART_MIB = 8
MAX_FILES = 8  # files a call brings back under $OUT


class CarryError(ValueError):
    """A carry that cannot be packed or restored; the message names the file."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _run_members(root: Path) -> list[Path]:
    """A run folder's files, with only the newest intact checkpoint of checkpoints/ (older ones are not needed to
    resume, and each is as large as the newest) and, when there is one, without final/ (the serving drafter a
    resumed job writes again at its end)."""
    from dflash.run_dir import RunDir
    from dflash.training.checkpoint import DIGEST_SUFFIX, POINTER, intact_checkpoint
    run = RunDir(root)
    keep: set[Path] = set()
    if run.checkpoints.is_dir():
        found = intact_checkpoint(run.checkpoints)
        if found is None:
            raise CarryError(f"{run.checkpoints}: no intact checkpoint to carry")
        ckpt = found[0]
        keep = {ckpt, ckpt.with_name(ckpt.name + DIGEST_SUFFIX), run.checkpoints / POINTER}
    return [f for f in sorted(root.rglob("*"))
            if f.is_file() and (f.parent != run.checkpoints or f in keep) and not (keep and run.final in f.parents)]


def _archive(paths: list[Path]) -> bytes:
    from dflash.run_dir import RunDir
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # uncompressed: checkpoints are float data
        for p in paths:
            if not p.exists():
                raise CarryError(f"{p}: no such file or folder to carry")
            if p.is_dir() and RunDir(p).is_run():
                for f in _run_members(p):
                    tar.add(f, arcname=str(Path(p.name) / f.relative_to(p)))
            else:
                tar.add(p, arcname=p.name)
    return buf.getvalue()


def pack(out_dir: str | Path, paths: list[str | Path], part_mib: float = PART_MIB,
         max_files: int = MAX_FILES) -> dict:
    """`paths` (run folders pruned to their newest checkpoint) as one tar in parts of `part_mib` MiB under
    `out_dir`, with the manifest. More files than `max_files` is an error before anything is written."""
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths]
    if len(set(names)) != len(names):
        raise CarryError(f"carry.py pack: two paths share a name ({', '.join(names)}); they would collide")
    data = _archive(paths)
    size = max(int(part_mib * 2**20), 1)
    chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    if len(chunks) + 1 > max_files:
        raise CarryError(f"carry.py pack: {len(data) / 2**20:.1f} MiB makes {len(chunks)} parts of {part_mib:g} MiB "
                         f"and a manifest, more than the {max_files} files a call brings back")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, chunk in enumerate(chunks):
        name = f"carry.part{i:02d}"
        (out / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
    manifest = {"paths": names, "bytes": len(data), "sha256": _sha256(data), "parts": parts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: a manifest means every part is there
    return manifest


def _manifest(folder: Path) -> dict:
    f = folder / MANIFEST
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        raise CarryError(f"{f}: no manifest (was `carry.py pack` run, and its folder brought back whole?)") from None
    except json.JSONDecodeError as e:
        raise CarryError(f"{f}: not valid JSON ({e})") from e


def folders(packed: str | Path, dest: str | Path) -> list[Path]:
    """One folder per part under `dest` (01, 02, ...), each with the manifest: what one call carries."""
    packed, dest = Path(packed), Path(dest)
    manifest = _manifest(packed)
    made = []
    for i, part in enumerate(manifest["parts"], 1):
        d = dest / f"{i:02d}"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(packed / part["name"], d / part["name"])
        shutil.copyfile(packed / MANIFEST, d / MANIFEST)
        made.append(d)
    return made


def _checked_archive(staged: Path) -> tuple[dict, bytes]:
    manifest = _manifest(staged)
    missing = [p["name"] for p in manifest["parts"] if not (staged / p["name"]).is_file()]
    if missing:
        raise CarryError(f"{staged}: missing {', '.join(missing)} of {len(manifest['parts'])} parts (carry and "
                         f"stage each part's folder first)")
    chunks = []
    for p in manifest["parts"]:
        chunk = (staged / p["name"]).read_bytes()
        if len(chunk) != p["bytes"] or _sha256(chunk) != p["sha256"]:
            raise CarryError(f"{staged / p['name']}: damaged ({len(chunk)} bytes, digest differs from the manifest's)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if _sha256(data) != manifest["sha256"]:
        raise CarryError(f"{staged}: the parts join to an archive whose digest differs from the manifest's "
                         f"(parts from two different packs?)")
    return manifest, data


def unpack(staged: str | Path, dest_root: str | Path, replace: bool = False) -> list[Path]:
    """Check every part, extract the archive beside `dest_root`'s contents, then move each carried path in.
    An existing path is an error unless `replace` (then it is removed only once the new one is ready)."""
    staged, dest_root = Path(staged), Path(dest_root)
    manifest, data = _checked_archive(staged)
    targets = [dest_root / name for name in manifest["paths"]]
    taken = [t for t in targets if t.exists()]
    if taken and not replace:
        raise CarryError(f"{', '.join(map(str, taken))}: already there (pass --replace to swap it for the carried one)")
    dest_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_root, prefix=".carry-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(tmp, filter="data")  # no absolute paths, no links out of the folder
        for t in targets:
            if t.exists():
                shutil.rmtree(t) if t.is_dir() else t.unlink()
            (Path(tmp) / t.name).rename(t)
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="paths -> parts and a manifest in OUT_DIR")
    p.add_argument("out_dir")
    p.add_argument("paths", nargs="+")
    p.add_argument("--part-mib", type=float, default=PART_MIB)
    f = sub.add_parser("folders", help="a packed folder -> one folder per part (what one call carries)")
    f.add_argument("packed")
    f.add_argument("dest")
    u = sub.add_parser("unpack", help="staged parts -> the carried paths under DEST_ROOT")
    u.add_argument("staged")
    u.add_argument("dest_root")
    u.add_argument("--replace", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            m = pack(a.out_dir, a.paths, a.part_mib)
            print(f"packed {', '.join(m['paths'])}: {m['bytes'] / 2**20:.1f} MiB in {len(m['parts'])} parts")
        elif a.cmd == "folders":
            print("\n".join(map(str, folders(a.packed, a.dest))))
        else:
            print("restored " + ", ".join(map(str, unpack(a.staged, a.dest_root, a.replace))))
    except CarryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
