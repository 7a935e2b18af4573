"""Spread the GPU machine's missing wheels over the folders a device call carries, and say the room left.

    bash ../shared/tools/gpu-wheels.sh /tmp/wheels && python benchmarks/leased_gpu/wheel_folders.py /tmp/wheels
    python benchmarks/leased_gpu/wheel_folders.py /tmp/wheels --folders 4   # a set number of folders
    python benchmarks/leased_gpu/wheel_folders.py --check          # the room left beside the folders there now

A call carries the working tree (tracked files and untracked ones git does not ignore) and the paths it names, 64 MiB
in all. The tree holds the reference target's weights (36.9 MB) and the committed campaign and sweep stores, which
grow with every GPU job; the wheels (about 22 MB) do not fit beside it at once. So they travel in folders
(`.whl`, `.whl2`, ... `.whlN`), one per call on the same warm machine: `wheels.sh` installs whichever folder a call
carries into `/tmp/site`, which lasts until the machine goes back. By default the script makes the fewest folders
that each leave `MARGIN` beside the tree, for the stores' growth. History: the 2026-12-03 campaign store (9.5 MB)
left 0.2 / 0.05 MB beside the two folders of 2026-12-02 (11.1 / 11.3 MB); three of about 7.5 MB left 3.9 MB, then
1.7 MB beside the 2026-12-03 store as the call packed it (11.7 MB, 2.2 MB more for five runs), and 5.2 MB once both
stores were vacuumed (9.4 and 5.1 MB); then two of 11.2 MB left 7.8 MB once both stores held their databases as SQL
text (5.5 and 2.7 MB, 2026-12-03; `dflash.tracking.packed_store`).

The split is balanced by size (largest first, into the lightest folder), deterministic for a given set, and it
keeps wheels that install into one top-level folder together (the opentelemetry-* namespace, fla-core with
flash-linear-attention): `pip install --target --upgrade` replaces a top-level folder that is already there, so a
later call's opentelemetry-api removed the opentelemetry-sdk an earlier call had put in /tmp/site, and mlflow did
not import (the first three-folder machine, 2026-12-03).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CARRY_LIMIT = 64 * 1024 * 1024  # bytes a device call carries: the working tree and the carried paths together
# room each folder leaves beside the tree: five campaign runs of 2026-12-03 grew the store 2.2 MB, and a folder that
# does not fit fails the call before anything runs
MARGIN = 3_000_000


def folder_names(n: int) -> list[str]:
    """The names of n wheel folders, in the order the calls carry them (`wheels.sh` installs any of them)."""
    return [".whl"] + [f".whl{i}" for i in range(2, n + 1)]


def present(repo: Path) -> list[str]:
    """The wheel folders there now, in carrying order."""
    found = [d.name for d in repo.glob(".whl*") if d.is_dir() and (d.name == ".whl" or d.name[4:].isdigit())]
    return sorted(found, key=lambda name: int(name[4:] or 1))


def balance(sizes: dict[str, int], n: int) -> list[list[str]]:
    """Names into n groups of near-equal total size: each name, largest first, to the group lightest so far."""
    groups: list[list[str]] = [[] for _ in range(n)]
    totals = [0] * n
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        i = totals.index(min(totals))
        groups[i].append(name)
        totals[i] += sizes[name]
    return groups


def top_level(wheel: Path) -> set[str]:
    """The top-level names a wheel installs (packages, modules), its metadata folders left out."""
    with zipfile.ZipFile(wheel) as z:
        names = {n.split("/", 1)[0] for n in z.namelist()}
    return {n for n in names if not n.endswith((".dist-info", ".data"))}


def install_groups(tops: dict[str, set[str]]) -> list[list[str]]:
    """Wheels joined where they install into a shared top-level name (transitively), each group sorted."""
    groups: list[tuple[set[str], list[str]]] = []
    for wheel in sorted(tops):
        names, members = set(tops[wheel]), [wheel]
        for g in [g for g in groups if g[0] & names]:
            groups.remove(g)
            names |= g[0]
            members += g[1]
        groups.append((names, sorted(members)))
    return sorted(members for _, members in groups)


def spread(wheels: dict[str, int], tops: dict[str, set[str]], n: int) -> list[list[str]]:
    """Wheels into n folders of near-equal size, each install group whole."""
    groups = {"+".join(g): g for g in install_groups(tops)}
    packed = balance({k: sum(wheels[w] for w in g) for k, g in groups.items()}, n)
    return [sorted(w for k in folder for w in groups[k]) for folder in packed]


def fewest_folders(wheels: dict[str, int], tops: dict[str, set[str]], room: int) -> list[list[str]]:
    """The fewest folders (`spread`) whose heaviest fits in `room` bytes; an error naming the wheels when even one
    install group per folder does not fit."""
    n_groups = len(install_groups(tops))
    for n in range(1, n_groups + 1):
        folders = spread(wheels, tops, n)
        if max(sum(wheels[w] for w in f) for f in folders) <= room:
            return folders
    heaviest = max(install_groups(tops), key=lambda g: sum(wheels[w] for w in g))
    raise ValueError(f"wheels {heaviest} ({sum(wheels[w] for w in heaviest) / 1e6:.2f} MB) do not fit in the "
                     f"{room / 1e6:.2f} MB a call has beside the working tree and MARGIN")


def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree a call carries: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         check=True, capture_output=True).stdout
    return sum((repo / f).stat().st_size for f in out.decode().split("\0") if f and (repo / f).is_file())


def folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.whl"))


def report(repo: Path) -> int:
    """Print each folder's size and the room left beside it; 1 when a folder does not fit, else 0."""
    tree = tree_bytes(repo)
    print(f"working tree {tree / 1e6:.2f} MB of {CARRY_LIMIT / 1e6:.2f} MB")
    worst = 0
    for name in present(repo):
        d = repo / name
        if d.is_dir():
            size = folder_bytes(d)
            room = CARRY_LIMIT - tree - size
            worst = min(worst, room)
            print(f"{name}: {size / 1e6:.2f} MB, {room / 1e6:+.2f} MB left beside the tree")
    return 1 if worst < 0 else 0


def write_folders(repo: Path, source: Path, groups: list[list[str]]) -> None:
    """Each group of wheels into its folder (made aside, then moved in); folders of an earlier, larger split go."""
    names = folder_names(len(groups))
    for name, group in zip(names, groups):
        d = repo / name
        tmp = d.with_name(d.name + ".new")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for w in group:
            shutil.copy2(source / w, tmp / w)
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)
    for stale in set(present(repo)) - set(names):
        shutil.rmtree(repo / stale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", type=Path, help="a folder of wheels (gpu-wheels.sh's output) to spread")
    ap.add_argument("--check", action="store_true", help="only report the folders there now")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--folders", type=int, default=None,
                    help="how many folders (default: the fewest that each leave MARGIN beside the tree)")
    args = ap.parse_args(argv)
    if not args.check:
        if args.source is None or not args.source.is_dir():
            ap.error(f"source: expected a folder of .whl files, got {args.source}")
        files = sorted(args.source.glob("*.whl"))
        if not files:
            ap.error(f"source: no .whl files in {args.source}")
        if args.folders is not None and args.folders < 1:
            ap.error(f"--folders: expected at least 1, got {args.folders}")
        wheels = {f.name: f.stat().st_size for f in files}
        tops = {f.name: top_level(f) for f in files}
        if args.folders is None:
            try:
                groups = fewest_folders(wheels, tops, CARRY_LIMIT - tree_bytes(args.repo) - MARGIN)
            except ValueError as e:
                ap.error(str(e))
        else:
            groups = spread(wheels, tops, args.folders)
        write_folders(args.repo, args.source, groups)
    return report(args.repo)


if __name__ == "__main__":
    sys.exit(main())
