"""A registry of the old layout brought to the gate's current one: one registered model per target fingerprint.

    python -m dflash.serving.registry_split campaign_out/mlflow.db [--model-name dflash-drafter] [--dry-run]

Until the gate registered each drafter under `<model_name>-<target fingerprint>` (`promotion.registry_name`), every
version went to one model, `dflash-drafter`, whatever target it was trained for: the committed campaign store's held
versions of two fingerprints, all tagged `target: reference`, and its @champion could be weighed against a drafter
of another target. `split_registry` moves each version of `model_name` that records its target
(`dflash.target_fingerprint`, a version tag) into the model of that fingerprint, with its version number, tags,
description and aliases, so every record that names a version (`dflash.promotion.holder_version`,
`.superseded_by`, the decision record, the reasons' "holder @champion v3") still names the same one. Each new model
gets the description and the `dflash.target_fingerprint` tag the gate gives the models it makes. A version that
records no fingerprint stays where it is; `model_name` is removed once no version is left in it.

On the way, every moved version gets the current layout's tags: `dflash.protocol` (which τ its figures are, from
the metric its decision was gated on: the old greedy protocol or the served one) where it has none, and its `eval/`
figures rounded to three decimals, as the gate writes them (the run's metrics keep every digit; the gate reads
those). The runs' `dflash.promotion.model` tags follow their version.

MLflow's API has no way to move a version between models (a new one gets a new number), so this works on the
sqlite database: every row in one transaction, committed last, rolled back on any error. A server store (MLflow
behind PostgreSQL) is not covered. A version number the destination model already has is refused before anything
is written.
"""
from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.serving.promotion import (LEGACY_OBJECTIVE, PREFIX, PROTOCOL_TAG, RECORD_TAG, TARGET_FP,
                                      model_description, protocol_of, registry_name)

MODEL_TAG = PREFIX + "model"  # on a run: the registered model the gate made a version of it in
_FLOAT = re.compile(r"^[+-]?\d+\.\d{4,}$")  # a figure printed with more than three decimals


class SplitError(ValueError):
    """A split refused before anything was written."""


@dataclass
class Move:
    version: int
    source: str  # the model it was in
    dest: str  # the model it is in now
    fingerprint: str
    tags: dict[str, str]  # the tags it was given or changed: protocol, rounded figures


def _columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


def _version_tags(con: sqlite3.Connection, name: str, version: int) -> dict[str, str]:
    return dict(con.execute("SELECT key, value FROM model_version_tags WHERE name=? AND version=?", (name, version)))


def gated_metric(tags: dict[str, str]) -> str:
    """The metric a version's decision was gated on: its decision record's, else the older layout's
    `dflash.promotion.metric` tag, else the old protocol's objective (versions made before either was kept)."""
    try:
        metric = json.loads(tags.get(RECORD_TAG) or "{}").get("metric")
    except ValueError:
        metric = None
    return metric or tags.get(PREFIX + "metric") or LEGACY_OBJECTIVE


def current_tags(tags: dict[str, str]) -> dict[str, str]:
    """The tags a version of the old layout gets or changes: its protocol where it names none, its `eval/` figures
    at three decimals."""
    out = {} if tags.get(PROTOCOL_TAG) else {PROTOCOL_TAG: protocol_of(gated_metric(tags))}
    for k, v in tags.items():
        if k.startswith("eval/") and v and _FLOAT.match(v.strip()):
            out[k] = f"{float(v):.3f}"
    return out


def plan(con: sqlite3.Connection, model_name: str) -> list[Move]:
    """The moves `split_registry` would make (nothing written)."""
    moves = []
    versions = [v for (v,) in con.execute("SELECT version FROM model_versions WHERE name=? ORDER BY version",
                                          (model_name,))]
    for v in versions:
        tags = _version_tags(con, model_name, v)
        fp = tags.get(TARGET_FP)
        if not fp or registry_name(model_name, fp) == model_name:
            continue
        moves.append(Move(v, model_name, registry_name(model_name, fp), fp, current_tags(tags)))
    for m in moves:
        if con.execute("SELECT 1 FROM model_versions WHERE name=? AND version=?", (m.dest, m.version)).fetchone():
            raise SplitError(f"{m.dest} already has a version {m.version}: {m.source} v{m.version} cannot keep its "
                             f"number there (nothing written)")
    return moves


def _copy_model_row(con: sqlite3.Connection, source: str, dest: str, description: str) -> None:
    """Make registered model `dest` as a copy of `source`'s row (its workspace and any other column kept)."""
    cols = _columns(con, "registered_models")
    row = dict(zip(cols, con.execute(f"SELECT {', '.join(cols)} FROM registered_models WHERE name=?",
                                     (source,)).fetchone()))
    now = int(time.time() * 1000)
    row.update(name=dest, description=description, last_updated_time=now)
    con.execute(f"INSERT INTO registered_models ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                list(row.values()))


def _insert(con: sqlite3.Connection, table: str, row: dict, owner: str, where: str, args: tuple) -> None:
    """Insert `row` into `table`, in the workspace of its owner row (`owner` WHERE `where`) on schemas that have
    workspaces (MLflow 3.x), as MLflow would."""
    row = dict(row)
    if "workspace" in _columns(con, table) and "workspace" in _columns(con, owner):
        row["workspace"] = con.execute(f"SELECT workspace FROM {owner} WHERE {where}", args).fetchone()[0]
    con.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


def _target_of(con: sqlite3.Connection, name: str, version: int) -> str | None:
    row = con.execute("SELECT value FROM model_version_tags WHERE name=? AND version=? AND key='dflash.target'",
                      (name, version)).fetchone()
    return row[0] if row else None


def apply(con: sqlite3.Connection, moves: list[Move], alias: str = "champion") -> None:
    """Make `moves` inside the caller's transaction."""
    for m in moves:
        if not con.execute("SELECT 1 FROM registered_models WHERE name=?", (m.dest,)).fetchone():
            _copy_model_row(con, m.source, m.dest, model_description(alias, _target_of(con, m.source, m.version),
                                                                      m.fingerprint))
            _insert(con, "registered_model_tags", {"key": TARGET_FP, "value": m.fingerprint, "name": m.dest},
                    "registered_models", "name=?", (m.dest,))
        for table in ("model_versions", "model_version_tags", "registered_model_aliases"):
            con.execute(f"UPDATE {table} SET name=? WHERE name=? AND version=?", (m.dest, m.source, m.version))
        for k, v in m.tags.items():
            con.execute("DELETE FROM model_version_tags WHERE name=? AND version=? AND key=?", (m.dest, m.version, k))
            _insert(con, "model_version_tags", {"key": k, "value": v, "name": m.dest, "version": m.version},
                    "model_versions", "name=? AND version=?", (m.dest, m.version))
        run_id = con.execute("SELECT run_id FROM model_versions WHERE name=? AND version=?",
                             (m.dest, m.version)).fetchone()[0]
        if run_id:  # the run's pointer follows its version
            con.execute("UPDATE tags SET value=? WHERE run_uuid=? AND key=? AND value=? AND EXISTS (SELECT 1 FROM tags "
                        "WHERE run_uuid=? AND key=? AND value=?)",
                        (m.dest, run_id, MODEL_TAG, m.source, run_id, PREFIX + "version", str(m.version)))
    for source in {m.source for m in moves}:
        if not con.execute("SELECT 1 FROM model_versions WHERE name=?", (source,)).fetchone():
            for table in ("registered_model_aliases", "registered_model_tags", "registered_models"):
                con.execute(f"DELETE FROM {table} WHERE name=?", (source,))


def split_registry(db: str | Path, model_name: str = "dflash-drafter", alias: str = "champion",
                   dry_run: bool = False) -> list[Move]:
    """Move every version of registered model `model_name` into the model of its target fingerprint (module doc).
    Returns the moves (with `dry_run`, the moves it would make; nothing written)."""
    db = Path(str(db).removeprefix("sqlite:///"))
    if not db.is_file():
        raise FileNotFoundError(f"{db}: no sqlite store")
    con = sqlite3.connect(db, isolation_level=None)
    try:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='model_versions'").fetchone():
            return []  # a store that never registered a model
        con.execute("BEGIN IMMEDIATE")  # one writer from here to the commit
        try:
            moves = plan(con, model_name)
            if not dry_run:
                apply(con, moves, alias)
            con.execute("ROLLBACK" if dry_run else "COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()
    return moves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.serving.registry_split",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("db", help="the store's sqlite file (or its sqlite:/// URI)")
    ap.add_argument("--model-name", default="dflash-drafter", help="the one model of the old layout")
    ap.add_argument("--alias", default="champion", help="the serving alias the new models' descriptions name")
    ap.add_argument("--dry-run", action="store_true", help="print the moves; write nothing")
    args = ap.parse_args(argv)
    try:
        moves = split_registry(args.db, args.model_name, args.alias, args.dry_run)
    except (FileNotFoundError, SplitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head = "would move" if args.dry_run else "moved"
    for m in moves:
        print(f"{head} {m.source} v{m.version} -> {m.dest} v{m.version}"
              + (f" ({m.tags[PROTOCOL_TAG]})" if PROTOCOL_TAG in m.tags else ""))
    if not moves:
        print(f"nothing to move: {args.model_name} holds no version that records a target fingerprint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
