"""Runs of one sqlite MLflow store copied into another, with their run ids, metric histories, params, tags and
artifacts: a job that ran in the wrong store joins the right one.

    python -m dflash.tracking.copy_runs SRC_DB DST_DB [RUN_ID ...] [--finished]

Why it exists: a campaign job (2026-12-03) took a folder holding only the pinned ground truth for its store, skipped
the committed store and ran the loss stage's seed-1 cells in a new, empty one (benchmarks/leased_gpu/job_env.sh's
use_store now refuses that folder). Three cells finished there; copying their runs and run folders into the
committed campaign store keeps every cell of the campaign in one store, where `mlflow ui` compares them and the gate
pairs them, without training them again.

The copy keeps each run's id, so the run folders' `mlflow_run.json` still name it. An experiment is matched by name
(made in the destination if it is not there, with the destination's artifact convention); artifacts go into the
destination's `mlartifacts/<run id>/artifacts` beside its database, as the GPU jobs keep them
(`dflash.tracking.run_info.relocate_artifacts`). Rows are copied table by table in SQL, which needs both stores on
the same MLflow schema (their alembic versions are compared). Only runs with params, tags and metrics are copied: a
run with rows elsewhere (registered model versions, dataset inputs, logged models, traces) is refused, because
those rows carry ids of their own that this copy would not keep consistent.

Atomic: every row goes in one sqlite transaction on the destination (committed last, rolled back on any error,
in place: a process with the store open, `mlflow ui` or a job, keeps seeing the one database file); each run's
artifacts are copied into a folder that was not there, under a temporary name, and removed again when the
transaction is rolled back. A run id already in the destination is refused before anything is written.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
from pathlib import Path

RUN_TABLES = {"runs": "run_uuid", "params": "run_uuid", "tags": "run_uuid", "metrics": "run_uuid",
              "latest_metrics": "run_uuid"}
# rows that would tie a run to other entities with ids of their own: a run that has any is not copied
ENTANGLED = {"model_versions": "run_id", "inputs": "source_id", "logged_models": "source_run_id",
             "assessments": "run_id", "issues": "source_run_id"}
FINISHED = "FINISHED"


class CopyError(ValueError):
    """A copy refused before anything was written."""


def _schema(con: sqlite3.Connection) -> str:
    return con.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def _columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


def _has_table(con: sqlite3.Connection, table: str) -> bool:
    return con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def _select_runs(src: sqlite3.Connection, run_ids: list[str], finished: bool) -> list[str]:
    known = {rid: status for rid, status in src.execute("SELECT run_uuid, status FROM runs")}
    missing = [r for r in run_ids if r not in known]
    if missing:
        raise CopyError(f"runs {missing} are not in the source store (it has {len(known)})")
    chosen = run_ids or sorted(known)
    return [r for r in chosen if not finished or known[r] == FINISHED]


def _check_copyable(src: sqlite3.Connection, dst: sqlite3.Connection, runs: list[str]) -> None:
    if _schema(src) != _schema(dst):
        raise CopyError(f"the stores are on different MLflow schemas ({_schema(src)} against {_schema(dst)}): "
                        f"open both with one MLflow version first (`mlflow db upgrade`)")
    marks = ",".join("?" * len(runs))
    there = [r for (r,) in dst.execute(f"SELECT run_uuid FROM runs WHERE run_uuid IN ({marks})", runs)]
    if there:
        raise CopyError(f"runs {there} are already in the destination store")
    for table, col in ENTANGLED.items():
        if _has_table(src, table):
            rows = src.execute(f"SELECT DISTINCT {col} FROM {table} WHERE {col} IN ({marks})", runs).fetchall()
            if rows:
                raise CopyError(f"runs {[r for (r,) in rows]} have rows in {table}: only runs with params, tags "
                                f"and metrics are copied")


def _experiment_ids(src: sqlite3.Connection, dst: sqlite3.Connection, runs: list[str]) -> dict[int, int]:
    """Source experiment id → destination id, matched by name; an experiment the destination lacks is made there
    as the source has it, but with the destination's artifact convention (`mlartifacts`, beside its database)."""
    marks = ",".join("?" * len(runs))
    cols = [c for c in _columns(src, "experiments") if c in _columns(dst, "experiments")]
    wanted = src.execute(f"SELECT {','.join('e.' + c for c in cols)} FROM experiments e WHERE e.experiment_id IN "
                         f"(SELECT experiment_id FROM runs WHERE run_uuid IN ({marks}))", runs).fetchall()
    mapping = {}
    for row in wanted:
        exp = dict(zip(cols, row))
        there = dst.execute("SELECT experiment_id FROM experiments WHERE name=?", (exp["name"],)).fetchone()
        if there is None:
            exp["experiment_id"] = dst.execute("SELECT COALESCE(MAX(experiment_id), 0) + 1 FROM experiments"
                                               ).fetchone()[0]
            exp["artifact_location"] = "mlartifacts"
            dst.execute(f"INSERT INTO experiments ({','.join(exp)}) VALUES ({','.join('?' * len(exp))})",
                        list(exp.values()))
            tags = src.execute("SELECT key, value FROM experiment_tags WHERE experiment_id=?",
                               (row[cols.index("experiment_id")],)).fetchall()  # the runs-table view, as made
            dst.executemany("INSERT INTO experiment_tags (key, value, experiment_id) VALUES (?, ?, ?)",
                            [(k, v, exp["experiment_id"]) for k, v in tags])
            there = (exp["experiment_id"],)
        mapping[row[cols.index("experiment_id")]] = there[0]
    return mapping


def _artifact_base(dst: sqlite3.Connection, eid: int, folder: Path) -> str:
    """The destination experiment's artifact location, which must be `folder` (the `mlartifacts/` beside its
    database, where the artifacts are copied): relative as a committed store keeps it, or that folder's path."""
    loc = (dst.execute("SELECT artifact_location FROM experiments WHERE experiment_id=?", (eid,)).fetchone()[0]
           or "").rstrip("/")
    if loc not in ("mlartifacts", folder.resolve().as_uri(), str(folder.resolve())):  # relocate_artifacts' forms
        raise CopyError(f"destination experiment {eid} keeps artifacts at {loc!r}, not in {folder} beside its "
                        f"database: copy artifacts there by hand")
    return loc


def _copy_rows(src: sqlite3.Connection, dst: sqlite3.Connection, runs: list[str], eids: dict[int, int],
               folder: Path) -> None:
    marks = ",".join("?" * len(runs))
    for table, col in RUN_TABLES.items():
        cols = [c for c in _columns(src, table) if c in _columns(dst, table)]
        rows = src.execute(f"SELECT {','.join(cols)} FROM {table} WHERE {col} IN ({marks})", runs).fetchall()
        if table == "runs":
            e, a, rid = cols.index("experiment_id"), cols.index("artifact_uri"), cols.index("run_uuid")
            rows = [list(r) for r in rows]
            for r in rows:
                r[e] = eids[r[e]]
                r[a] = f"{_artifact_base(dst, r[e], folder)}/{r[rid]}/artifacts"
        dst.executemany(f"INSERT INTO {table} ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})", rows)


def copy_runs(src_db: str | os.PathLike, dst_db: str | os.PathLike, run_ids: list[str] | None = None,
              finished: bool = False) -> list[str]:
    """Copy runs (all of `src_db`'s, or `run_ids`; with `finished`, FINISHED ones only) into `dst_db`, with their
    artifacts from `mlartifacts/<run id>/` beside `src_db`. Returns the run ids copied."""
    src_db, dst_db = Path(src_db), Path(dst_db)
    for db in (src_db, dst_db):
        if not db.is_file():
            raise FileNotFoundError(f"{db}: no sqlite store")
    src = sqlite3.connect(f"file:{src_db}?mode=ro", uri=True)
    dst = sqlite3.connect(dst_db, isolation_level=None, timeout=60)
    made: list[Path] = []
    try:
        dst.execute("BEGIN IMMEDIATE")  # one transaction: every row of every run, or none
        runs = _select_runs(src, list(run_ids or []), finished)
        if runs:
            _check_copyable(src, dst, runs)
            _copy_rows(src, dst, runs, _experiment_ids(src, dst, runs), dst_db.parent / "mlartifacts")
        for rid in runs:
            if _copy_artifacts(src_db.parent / "mlartifacts" / rid, dst_db.parent / "mlartifacts" / rid):
                made.append(dst_db.parent / "mlartifacts" / rid)
        dst.execute("COMMIT")
    except BaseException:
        dst.execute("ROLLBACK")
        for folder in made:  # the runs are not in the destination: neither are their artifacts
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        src.close()
        dst.close()
    return runs


def _copy_artifacts(src: Path, dst: Path) -> bool:
    """`src` copied whole to `dst` (under a temporary name, then renamed); False when the run logged no artifact."""
    if not src.is_dir():
        return False
    if dst.exists():
        raise CopyError(f"{dst}: artifacts of this run id are already in the destination")
    part = dst.with_name(dst.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(src, part)
    os.replace(part, dst)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.tracking.copy_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("src_db")
    ap.add_argument("dst_db")
    ap.add_argument("run_ids", nargs="*", help="default: every run of the source store")
    ap.add_argument("--finished", action="store_true", help="only runs that ended FINISHED")
    args = ap.parse_args(argv)
    try:
        runs = copy_runs(args.src_db, args.dst_db, args.run_ids, args.finished)
    except (FileNotFoundError, CopyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"copied {len(runs)} run(s) into {args.dst_db}: {' '.join(runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
