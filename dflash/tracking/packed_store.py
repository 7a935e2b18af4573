"""A tracking store packed for the repository: its MLflow sqlite file as SQL text, and unpacked back to a database.

    python -m dflash.tracking.packed_store unpack benchmarks/ablations/campaign_out.tar.xz [DEST]   # then mlflow ui
    python -m dflash.tracking.packed_store dump campaign_out/mlflow.db campaign_out/mlflow.sql      # what packing does

The committed stores (`benchmarks/ablations/campaign_out.tar.xz`, `benchmarks/sweeps/sweeps_out.tar.xz`) ride in
every GPU call's 64 MiB working tree beside the wheels (`benchmarks/leased_gpu/wheel_folders.py`), and each GPU job's
runs grow them. The sqlite file packs poorly: its B-tree pages, and the metric table's primary-key index, which
repeats every row. The campaign store of 2026-12-03 (48 runs, 446 K metric rows): the vacuumed database packed by
xz -9 to 7.34 MB, its SQL dump (`iterdump`: rows and schema; indexes as CREATE statements) to 3.04 MB. Rebuilding
the database from the dump took 10 s on the dev machine. So an archive holds `<name>.sql` in place of
`<name>.db`, and `unpack` extracts it and rebuilds each database beside its dump (an archive of the older kind,
with the database itself, unpacks as it is).

Writes are atomic: a database is built under a temporary name and renamed, so a failed rebuild leaves no
half-written store, and an existing database is never overwritten (unpacking over a store in use is refused).
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tarfile
from pathlib import Path

from dflash.atomic import atomic_write

DUMP_SUFFIX = ".sql"


def dump_store(db: str | os.PathLike, sql: str | os.PathLike) -> int:
    """Write the sqlite database `db` as SQL text to `sql` (atomically). Returns the dump's size in bytes."""
    db, sql = Path(db), Path(sql)
    if not db.is_file():
        raise FileNotFoundError(f"{db}: no sqlite store to dump")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for statement in con.iterdump():
                f.write(statement + "\n")
    try:
        atomic_write(sql, write)
    finally:
        con.close()
    return sql.stat().st_size


def restore_store(sql: str | os.PathLike, db: str | os.PathLike) -> Path:
    """Build the sqlite database `db` from the SQL dump `sql` (atomically: under a temporary name, then renamed).
    Refuses to replace an existing `db`: a store that is there is the newer one."""
    sql, db = Path(sql), Path(db)
    if db.exists():
        raise FileExistsError(f"{db}: a store is already there; move it away to rebuild it from {sql}")

    def build(tmp: str) -> None:
        con = sqlite3.connect(tmp)
        try:
            con.executescript(sql.read_text(encoding="utf-8"))
            con.commit()
        except sqlite3.Error as e:
            raise ValueError(f"{sql}: not a complete SQL dump of a store ({e})") from e
        finally:
            con.close()
    atomic_write(db, build)
    return db


def unpack(archive: str | os.PathLike, dest: str | os.PathLike = ".") -> list[Path]:
    """Extract `archive` into `dest` and rebuild every database from its dump there (`<x>.sql` → `<x>.db`; the
    dump is removed once the database is built). Returns the databases built. An archive that holds a database
    itself (packed before 2026-12-03) unpacks as it is."""
    archive, dest = Path(archive), Path(dest)
    if not archive.is_file():
        raise FileNotFoundError(f"{archive}: no packed store")
    with tarfile.open(archive) as t:
        dumps = [m.name for m in t.getmembers() if m.isfile() and m.name.endswith(DUMP_SUFFIX)]
        clash = [dest / d for d in dumps if (dest / d).with_suffix(".db").exists()]
        if clash:
            raise FileExistsError(f"{', '.join(map(str, clash))}: a store is already there (the newer one); "
                                  f"unpack {archive} somewhere else")
        t.extractall(dest, filter="data")
    built = []
    for d in dumps:
        built.append(restore_store(dest / d, (dest / d).with_suffix(".db")))
        (dest / d).unlink()
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.tracking.packed_store", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack", help="extract a packed store and rebuild its databases")
    u.add_argument("archive")
    u.add_argument("dest", nargs="?", default=".")
    d = sub.add_parser("dump", help="write a sqlite store as SQL text")
    d.add_argument("db")
    d.add_argument("sql")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "unpack":
            for db in unpack(args.archive, args.dest):
                print(f"rebuilt {db}")
        else:
            print(f"{args.sql}: {dump_store(args.db, args.sql):,} bytes")
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
