"""The promotion gate (docs/DESIGN.md, "Evaluation and the gate"): register an *evaluated* run's checkpoint in the
MLflow Model Registry and move the serving alias only when its acceptance beats the current holder.

    decision = promote(run_id, PromoteConfig(margin=0.05, floor=3.0), "sqlite:///mlflow.db")

Rules, in order:
1. The run must be FINISHED, have the gate metric (`eval/tau_served` by default: τ at the target's sampling
   setting, docs/evaluation.md) and a finite value,
   and have a `checkpoint` artifact. Otherwise the decision is "refused", nothing is registered, and the
   reason is written on the *run* as tags (`dflash.promotion.decision` / `dflash.promotion.reason`). A run of a
   store packed without weights gets its serving folder back first (`promote(..., checkpoint=DIR)`,
   `restore_checkpoint`: checked against the run before it is logged).
2. Otherwise a model version is registered under the registered model of the run's target, `<model_name>-<target
   fingerprint>` (`registry_name`: the run's `dflash.target_fingerprint` tag; a run that records none, from before
   fingerprints were kept, under `model_name` itself), so that one registered model and its `@champion` never mix
   drafters of different targets (source = the run's `checkpoint` artifact URI, `run_id` set)
   with a short set of tags: the headline `eval/` metrics (τ per budget and prompt lookup's τ; intervals,
   per-task and per-position figures stay on the run), the run's name, loss / noise / buffer / target, links
   to the per-task table and the run's config, and the decision (decision, reason, holder, and the whole
   record as one JSON tag `dflash.promotion.record`). The run gains four tags: decision, reason, version, model.
3. The alias moves to it only if all of these hold (a refusal names every one that fails):
   - `value >= floor` (default 1.1: a dead drafter, τ = 1, is never promoted);
   - it beats prompt lookup (the zero-cost n-gram baseline the eval logs beside every τ): the lower end
     of the paired Δ(candidate − prompt-lookup) interval over prompts is above 0 — or, for a run whose
     task table lacks per-prompt columns, `value > eval/tau_prompt_lookup`; a run without any
     prompt-lookup figure (evaluated before it existed, or by hand) is only noted;
   - it beats the holder (the version the alias points at now): when both runs' task tables
     (`eval/tasks.json`) ran on the same ground truth, the lower end of the paired
     `promote.ci_level` bootstrap interval of Δ = candidate − holder must exceed `margin`; two tables on
     different ground truth refuse (re-evaluate both on one: `python -m experiments.eval <candidate>
     champion`); when either run has no per-prompt table, the recorded values decide
     (`value > holder + margin`; the holder's value is its version tag, else its run metric);
   - paired with the holder, it is not worse on the least-degenerate rows: the Δ interval on the prompt samples whose
     ground truth repeats the fewest of its 8-grams (at least a quarter, `dflash.evaluation.pairing`) must not lie
     wholly below 0. A candidate that wins overall but loses there wins by copying loops. A tie there is noted.
   Without a holder the holder rule is skipped.
4. The decision, its reason, Δ vs the holder and vs prompt lookup (with their intervals) are written on
   the version (and on the run) either way, and the version's description is that decision in one line
   (the registry's "latest version" may be a refused one: serve the alias).

Steps 2–4 run inside one exclusive lock per registry (an `fcntl` lock file beside the sqlite database;
a lock directory for other stores), so two promotions racing cannot both win: the second one reads the
first one's result as its holder. After moving the alias, it is read back as a last check.

`dry_run=True` reads only: it registers nothing, writes no tag and returns the decision it would take.

Only `mlflow.tracking.MlflowClient` is used (mlflow-skinny compatible); mlflow is imported lazily.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash.serving.registry_lock import registry_lock
from dflash.tracking.run_info import sqlite_db_path, truncate

log = logging.getLogger(__name__)

DECISION_TAG = "dflash.promotion.decision"
REASON_TAG = "dflash.promotion.reason"
RECORD_TAG = "dflash.promotion.record"  # a version's whole decision record, JSON (`decision_record`)
PREFIX = "dflash.promotion."
VERSION_TAG = PREFIX + "version"  # on the run: the model version the gate made of it
TARGET_FP = "dflash.target_fingerprint"  # run and version tag: the target the drafter was trained for
PROMOTED, REFUSED = "promoted", "refused"
LEGACY_OBJECTIVE = "eval/tau_vanilla"  # stores before sampled evaluation (dflash.evaluation.protocol)
_TAG_VALUE_LIMIT = 5000  # reasons and run tags: keeps the UI readable
# The eval metrics a version carries: τ per budget with its CI and the baseline, real decoding's verdict.
_HEADLINE_EVAL = ("eval/tau", "eval/real/lossless", "eval/real/speedup")


@dataclass
class PromoteConfig:
    model_name: str = "dflash-drafter"  # the stem: a run registers under `<model_name>-<target fingerprint>`
    alias: str = "champion"
    # the objective: τ at the target's served sampling setting (dflash.evaluation.protocol)
    metric: str = "eval/tau_served"
    margin: float = 0.0  # the lower end of the Δτ interval vs the holder must exceed this
    floor: float = 1.1  # and the candidate's value be >= this (τ = 1 is a drafter that never helps)
    ci_level: float = 0.95  # level of the paired Δτ intervals (prompt × sample bootstrap, `hierarchical_ci`)
    bootstrap: int = 2000  # bootstrap replicates of those intervals
    enabled: bool = False  # auto-promote at the end of a training run
    tracking_uri: str = ""  # registry store; empty → the run's own tracking URI


@dataclass
class Decision:
    promoted: bool
    reason: str
    version: str | None = None  # the registered version (None: nothing registered)
    candidate_value: float | None = None
    holder_version: str | None = None
    holder_value: float | None = None
    run_id: str = ""
    model_name: str = ""
    alias: str = ""
    metric: str = ""
    dry_run: bool = False
    comparison: str = ""  # "paired" (Δ interval on one ground truth), "point" (recorded values) or ""
    delta: float | None = None  # candidate − holder, with its interval when paired
    delta_ci_low: float | None = None
    delta_ci_high: float | None = None
    prompt_lookup: float | None = None  # the candidate's prompt-lookup baseline τ on the same suite
    # candidate − holder on the least-degenerate prompt samples (paired; dflash.evaluation.pairing)
    delta_least_degenerate: float | None = None
    delta_least_degenerate_ci_low: float | None = None
    delta_least_degenerate_ci_high: float | None = None
    delta_prompt_lookup_ci_low: float | None = None
    delta_prompt_lookup_ci_high: float | None = None
    holds_alias: bool = False  # the run already holds the alias: nothing to do, not a refusal

    def summary(self) -> str:
        head = ("[dry run] would promote" if self.promoted else "[dry run] would refuse") if self.dry_run \
            else ("PROMOTED" if self.promoted else "REFUSED")
        ver = f" as {self.model_name} v{self.version}" if self.version else ""
        target = f" → @{self.alias}" if self.promoted else ""
        return f"{head} run {self.run_id}{ver}{target}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PromotionError(ValueError):
    """Bad input (unknown run, missing store): no decision could be taken."""


# ----------------------------------------------------------------------------------------- helpers
def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:.4f}"


def _as_float(s: Any) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def check_store(uri: str) -> None:
    """A sqlite store must already exist: opening a missing one would silently create an empty db."""
    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise PromotionError(f"tracking store {uri!r}: no database file at {db} (pass the URI the run "
                             f"was tracked with, e.g. sqlite:////abs/path/mlflow.db)")


def registry_name(model_name: str, target_fp: str | None) -> str:
    """The registered model a drafter of target fingerprint `target_fp` goes to: one per target, so a champion is
    only ever weighed against drafters of its own target (`dflash-drafter-1f0c…`); `model_name` itself without a
    fingerprint (a run from before they were recorded)."""
    return f"{model_name}-{target_fp}" if target_fp else model_name


def _client(uri: str):
    """The store's client once it answers (dflash/tracking/store.py): a dead or silent server is a
    ConnectionError within seconds, not minutes of MLflow's retries."""
    from dflash.tracking.store import open_client
    return open_client(uri, registry=True)


def _error_code(e: BaseException) -> str:
    return str(getattr(e, "error_code", ""))


def _get_run(client, run_id: str, uri: str):
    from mlflow.exceptions import MlflowException
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if _error_code(e) == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(e).lower():
            raise PromotionError(f"run {run_id!r} not found in tracking store {uri!r}") from e
        raise


def _current_holder(client, cfg: PromoteConfig, name: str) -> tuple[Any | None, float | None]:
    """(holder ModelVersion of registered model `name` or None, its recorded metric value or None)."""
    from mlflow.exceptions import MlflowException
    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if _error_code(e) == "RESOURCE_DOES_NOT_EXIST":
            return None, None
        raise
    version = (model.aliases or {}).get(cfg.alias)
    if version is None:
        return None, None
    holder = client.get_model_version(name, str(version))
    value = None
    if holder.run_id:  # the run's metric has every digit; the version's tag is rounded for reading
        with contextlib.suppress(Exception):
            value = client.get_run(holder.run_id).data.metrics.get(cfg.metric)
    if value is None:  # the run gone: the version's own record
        value = _as_float(holder.tags.get(cfg.metric))
    return holder, value


def _eligibility(client, run, cfg: PromoteConfig, checkpoint_given: bool = False) -> tuple[str | None, float | None]:
    """(reason to refuse or None, candidate value)."""
    status = run.info.status
    if status != "FINISHED":
        return f"run status is {status}; only FINISHED runs can be promoted", None
    metrics = run.data.metrics
    if cfg.metric not in metrics:
        have = sorted(k for k in metrics if k.startswith("eval/")) or "none"
        return f"run has no {cfg.metric} metric (eval/ metrics present: {have}); evaluate it first", None
    value = float(metrics[cfg.metric])
    if not math.isfinite(value) or abs(value) >= sys.float_info.max:  # sql stores save ±inf as ±max
        shown = value if not math.isfinite(value) else math.copysign(math.inf, value)
        return f"{cfg.metric} is {shown} (not finite)", value
    if not checkpoint_given and not _has_checkpoint(client, run.info.run_id):
        return "run has no 'checkpoint' artifact (the serving folder logged at the end of training)", value
    return None, value


def checkpoint_mismatch(run, folder: str | os.PathLike) -> str | None:
    """Why serving folder `folder` is not run `run`'s drafter, or None: its manifest (`checksums.sha256`) must verify,
    and what its `config.json` records (the target's fingerprint, the architecture, the layer count and width, the
    loss) must agree with the run's tags and params."""
    from dflash.safe_load import UnsafeFileError, verify_manifest
    folder = Path(folder)
    try:
        if not verify_manifest(folder):
            return f"{folder}: no checksums.sha256 (a serving folder dflash exported has one)"
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, UnsafeFileError) as e:
        return f"{folder}: {e}"
    training = cfg.get("dflash_training") or {}
    params, tags = run.data.params, run.data.tags
    arch = "dflash2" if any("DFlash2" in a for a in cfg.get("architectures") or []) else "dflash"
    pairs = [("target fingerprint", training.get("target_fingerprint"), tags.get(TARGET_FP)),
             ("drafter.architecture", arch, params.get("drafter.architecture")),
             ("drafter.num_layers", cfg.get("num_hidden_layers"), params.get("drafter.num_layers")),
             ("drafter.intermediate_size", cfg.get("intermediate_size"), params.get("drafter.intermediate_size")),
             ("loss", training.get("loss"), params.get("loss.name") or tags.get("loss"))]
    differ = [f"{what}: folder {mine}, run {theirs}" for what, mine, theirs in pairs
              if theirs is not None and str(mine) != str(theirs)]
    return f"{folder} is not this run's drafter ({'; '.join(differ)})" if differ else None


def restore_checkpoint(client, run, folder: str | os.PathLike, uri: str, dry_run: bool = False) -> None:
    """Give `run` its serving folder back as its `checkpoint` artifact: a store packed for the repository carries no
    weights (docs/tracking.md), so its runs cannot pass the gate until the folder the run wrote, kept elsewhere, is
    logged again. Checked first (`checkpoint_mismatch`); a run that still has a checkpoint keeps it. A sqlite store
    whose artifact locations are relative to its folder (a committed store unpacked) gets absolute ones first, so
    the files land beside the database whatever folder this runs in. PromotionError where the folder does not fit."""
    problem = checkpoint_mismatch(run, folder)
    if problem:
        raise PromotionError(problem)
    if _has_checkpoint(client, run.info.run_id):
        raise PromotionError(f"run {run.info.run_id} already has a 'checkpoint' artifact; it is kept (promote "
                             f"without --checkpoint)")
    if dry_run:
        return
    from dflash.tracking.run_info import _relative_location, relocate_artifacts
    db = sqlite_db_path(uri)
    if db is not None and _relative_location(run.info.artifact_uri or ""):
        relocate_artifacts(db, relative=False)
        run = client.get_run(run.info.run_id)
    client.log_artifacts(run.info.run_id, str(folder), "checkpoint")


def _beside_store(client, run_id: str, path: str) -> Path | None:
    """Artifact `path` of a run in a sqlite store whose artifact locations are relative to the store's folder (a
    committed store unpacked, docs/tracking.md): MLflow resolves them against the working folder, so a gate run
    from anywhere else would not see them (and would compare recorded values only). None elsewhere."""
    from dflash.tracking.run_info import _relative_location, local_artifact_dir
    try:
        uri = str(getattr(client, "tracking_uri", "") or "")
        location = client.get_run(run_id).info.artifact_uri or ""
    except Exception:  # noqa: BLE001 - the caller's own read decides
        return None
    if sqlite_db_path(uri) is None or not _relative_location(location):
        return None
    folder = local_artifact_dir(location, uri, run_id)
    return None if folder is None or not (folder / path).exists() else folder / path


def _has_checkpoint(client, run_id: str) -> bool:
    try:
        if len(client.list_artifacts(run_id, "checkpoint")) > 0:
            return True
    except Exception:  # an unreadable artifact store: do not register something we cannot see
        pass
    found = _beside_store(client, run_id, "checkpoint")
    return found is not None and any(found.iterdir())


@dataclass
class Evidence:
    """What the gate compares beyond the recorded values (module doc, rule 3)."""
    comparison: str = ""  # paired / point / "" (no holder)
    delta: Any = None  # Interval of candidate − holder (paired) or None
    not_paired: str = ""  # why the holder comparison fell back to the recorded values
    different_truth: bool = False  # both tables exist but ran on different ground truth: refuse
    baseline: float | None = None  # the candidate's prompt-lookup τ
    baseline_delta: Any = None  # Interval of candidate − prompt lookup, or None
    least_degenerate: Any = None  # LeastDegenerateDelta of candidate − holder (paired), or None
    different_policy: str = ""  # both measured at T > 0 under different engines' proposal policies: refuse


def _task_table(client, run_id: str, artifact: str) -> dict | None:
    """The run's task table artifact as a dict, or None when it is absent or unreadable."""
    try:
        with tempfile.TemporaryDirectory() as d:
            return json.loads(Path(client.download_artifacts(run_id, artifact, d)).read_text())
    except Exception:  # noqa: BLE001 - absent or unreadable: the gate falls back to recorded values
        pass
    found = _beside_store(client, run_id, artifact)
    try:
        return None if found is None else json.loads(found.read_text())
    except (OSError, ValueError):
        return None


def _evidence(client, run, holder, cfg: PromoteConfig) -> Evidence:
    from dflash.evaluation.pairing import (DifferentGroundTruth, NotPaired, least_degenerate_delta, metric_columns,
                                           paired_delta)
    ev = Evidence()
    cols = metric_columns(cfg.metric)
    table = _task_table(client, run.info.run_id, cols.artifact) if cols else None
    if cols is not None:
        ev.baseline = _as_float(run.data.metrics.get(cols.baseline_metric))
        if table is not None and ev.baseline is not None:
            with contextlib.suppress(NotPaired):
                ev.baseline_delta = paired_delta(table, table, (cols.sum_col, cols.count_col),
                                                 ("tau_sum_prompt_lookup", "rounds_prompt_lookup"),
                                                 cfg.ci_level, cfg.bootstrap)
    if holder is None:
        return ev
    holder_table = _task_table(client, holder.run_id, cols.artifact) if (cols and holder.run_id) else None
    if table is None or holder_table is None:
        ev.comparison = "point"
        ev.not_paired = "no per-prompt task table for " + ("the candidate" if table is None else "the holder")
        return ev
    ev.different_policy = policy_mismatch(table, holder_table)
    try:
        ev.delta = paired_delta(table, holder_table, (cols.sum_col, cols.count_col),
                                (cols.sum_col, cols.count_col), cfg.ci_level, cfg.bootstrap)
        ev.comparison = "paired"
        ev.least_degenerate = least_degenerate_delta(table, holder_table, (cols.sum_col, cols.count_col),
                                                     (cols.sum_col, cols.count_col), cfg.ci_level, cfg.bootstrap)
    except NotPaired as e:
        ev.comparison, ev.not_paired = "point", str(e)
        ev.different_truth = isinstance(e, DifferentGroundTruth)
    return ev


def policy_mismatch(table: dict, holder_table: dict) -> str:
    """Why two task tables' τ do not compare as served (docs/evaluation.md, "The engine's proposal policy"): both
    sampled, scored for different engines (or with a different `eval.proposal` override); '' when they compare.
    A table from before `eval.engine` recorded its policy drew DFlash 1's drafts from q (`textbook`)."""
    from dflash.evaluation.engines import serving_identity
    infos = [t.get("info", {}) for t in (table, holder_table)]
    if any(i.get("setting", "t0") == "t0" for i in infos):  # greedy: one rule for every engine
        return ""
    a, b = (i.get("serving", serving_identity("textbook", "auto")) for i in infos)
    return "" if a == b else f"the candidate was scored for {a!r}, the holder for {b!r}"


def _compare(value: float, holder, holder_value: float | None, cfg: PromoteConfig,
             ev: Evidence | None = None, target_fp: str | None = None) -> tuple[bool, str]:
    """(promote?, reason): every failed rule, or what the candidate cleared (module doc, rule 3)."""
    ev = ev or Evidence(comparison="point" if holder is not None else "")
    m, lvl = cfg.metric, f"{100 * cfg.ci_level:g}%"
    fails, notes = [], []
    if value < cfg.floor:
        fails.append(f"{m}={_fmt(value)} is below the floor {_fmt(cfg.floor)}")
    else:
        notes.append(f"{m}={_fmt(value)} clears the floor {_fmt(cfg.floor)}")
    bd = ev.baseline_delta
    if bd is not None and math.isfinite(bd.low):
        text = (f"Δ vs prompt-lookup ({_fmt(ev.baseline)}) {bd.value:+.4f}, {lvl} CI "
                f"[{bd.low:+.4f}, {bd.high:+.4f}]")
        if bd.low > 0:
            notes.append(f"beats prompt-lookup: {text}")
        else:  # the interval contains 0, or lies wholly below it (worse than prompt lookup)
            where = "lies wholly below 0" if bd.high < 0 else "contains 0"
            fails.append(f"does not beat prompt-lookup: {text} {where}")
    elif ev.baseline is not None:
        ok = value > ev.baseline
        (notes if ok else fails).append(f"{m}={_fmt(value)} {'beats' if ok else 'does not beat'} prompt-lookup "
                                        f"({_fmt(ev.baseline)})")
    else:
        notes.append("no prompt-lookup figure recorded")
    if holder is None:
        notes.append(f"no current @{cfg.alias} holder")
    else:
        hv = f"@{cfg.alias} v{holder.version}"
        d = ev.delta
        holder_fp = (holder.tags or {}).get(TARGET_FP)
        if target_fp and holder_fp != target_fp:  # a champion of another target: its τ does not compare
            notes.append(f"holder {hv} was trained for target {holder_fp or 'unrecorded'}, this run for "
                         f"{target_fp}: the champion is replaced")
        elif ev.different_policy:
            fails.append(f"cannot compare with holder {hv}: {ev.different_policy}, and τ depends on how drafts are "
                         f"proposed; re-evaluate both with one eval.engine (python -m experiments.eval <candidate> "
                         f"{cfg.alias})")
        elif ev.different_truth:
            fails.append(f"cannot compare with holder {hv}: {ev.not_paired}; re-evaluate both on one ground "
                         f"truth (python -m experiments.eval <candidate> {cfg.alias})")
        elif d is not None and math.isfinite(d.low):
            text = (f"Δ {d.value:+.4f} vs holder {hv}, {lvl} CI [{d.low:+.4f}, {d.high:+.4f}], margin "
                    f"{_fmt(cfg.margin)}")
            ld = ev.least_degenerate.delta if ev.least_degenerate is not None else None
            ld_text = "" if ld is None or not math.isfinite(ld.low) else (
                f"on the {ev.least_degenerate.rows} least-degenerate prompt samples Δ {ld.value:+.4f}, {lvl} CI "
                f"[{ld.low:+.4f}, {ld.high:+.4f}]")
            if d.low > cfg.margin and ld_text and ld.high < 0:
                fails.append(f"beats holder {hv} overall ({text}) but is worse {ld_text}, wholly below 0: the gain "
                             f"comes from ground truth that repeats itself")
            elif d.low > cfg.margin:
                notes.append(f"beats holder {hv}: {text}" + (f"; {ld_text}" if ld_text else ""))
            else:
                fails.append(f"does not beat holder {hv}: the lower end of the interval does not clear the "
                             f"margin ({text})")
        elif holder_value is None or not math.isfinite(holder_value):
            legacy = (holder.tags or {}).get(LEGACY_OBJECTIVE)
            notes.append(f"holder {hv} has no recorded {m}" + (
                f" (it carries only {LEGACY_OBJECTIVE}={legacy}, the old protocol: greedy, fixed-length ground truth "
                f"that loops; it does not compare, so the champion is replaced)" if legacy and m != LEGACY_OBJECTIVE
                else ""))
        elif value > holder_value + cfg.margin:
            notes.append(f"{m}={_fmt(value)} beats holder {hv} ({_fmt(holder_value)}) by more than margin "
                         f"{_fmt(cfg.margin)} (point comparison: {ev.not_paired or 'no task tables'})")
        else:
            fails.append(f"{m}={_fmt(value)} does not beat holder {hv} ({_fmt(holder_value)}) by more than "
                         f"margin {_fmt(cfg.margin)} (point comparison: {ev.not_paired or 'no task tables'})")
    return (False, "; ".join(fails)) if fails else (True, "; ".join(notes))


def _record(d: Decision, ev: Evidence) -> Decision:
    d.comparison = ev.comparison
    if ev.delta is not None:
        d.delta, d.delta_ci_low, d.delta_ci_high = ev.delta.value, ev.delta.low, ev.delta.high
    elif d.holder_value is not None and d.candidate_value is not None:
        d.delta = d.candidate_value - d.holder_value
    if ev.least_degenerate is not None:
        ld = ev.least_degenerate.delta
        d.delta_least_degenerate, d.delta_least_degenerate_ci_low, d.delta_least_degenerate_ci_high = \
            ld.value, ld.low, ld.high
    d.prompt_lookup = ev.baseline
    if ev.baseline_delta is not None:
        d.delta_prompt_lookup_ci_low, d.delta_prompt_lookup_ci_high = ev.baseline_delta.low, ev.baseline_delta.high
    return d


def _task_table_ref(client, run_id: str) -> str:
    """runs:/ URI of the per-task table the evaluation logged (an `eval/` artifact named like a table)."""
    try:
        files, stack = [], ["eval"]
        while stack:
            for f in client.list_artifacts(run_id, stack.pop()):
                (stack if f.is_dir else files).append(f.path)
    except Exception:
        return ""
    tables = [p for p in files if p.endswith((".json", ".csv", ".md", ".txt", ".parquet"))]
    tasks = [p for p in tables if "task" in os.path.basename(p).lower()]
    pick = (tasks or tables or [""])[0]
    return f"runs:/{run_id}/{pick}" if pick else ""


def _headline(metric: str) -> bool:
    """A version carries the run's headline figures only: τ per drafting method and prompt lookup's τ, real
    decoding's verdict; intervals, ratios and the training-prompt τ stay on the run."""
    return metric.startswith(_HEADLINE_EVAL) and not metric.endswith(("_ci_low", "_ci_high")) \
        and not metric.startswith(("eval/tau_train", "eval/tau_over"))


PROTOCOL_TAG = "dflash.protocol"  # a version's evaluation protocol, in words: which τ its figures are


def protocol_of(metric: str) -> str:
    """The evaluation protocol a gate metric belongs to, for a version's `dflash.protocol` tag."""
    if metric == LEGACY_OBJECTIVE or metric.startswith("eval/tau_tree_"):
        return "old protocol: greedy (T=0), fixed-length ground truth that loops"
    if metric.startswith("eval/tau_served"):
        return "served: τ at the target's sampling setting, lossless rejection sampling (docs/evaluation.md)"
    return f"gated on {metric}"


def _version_tags(client, run, cfg: PromoteConfig, value: float) -> dict[str, str]:
    run_id = run.info.run_id
    # three decimals, as every τ is read (the run's metrics keep every digit, and the gate reads those)
    tags = {k: f"{float(v):.3f}" for k, v in run.data.metrics.items() if _headline(k)}
    tags[cfg.metric] = f"{float(value):.3f}"
    tags.update({
        PROTOCOL_TAG: protocol_of(cfg.metric),
        "dflash.run_id": run_id,
        "dflash.run_name": run.info.run_name or "",
        "dflash.task_table": _task_table_ref(client, run_id),
        "dflash.config_uri": f"runs:/{run_id}/config.yaml",  # the whole config: one click, not a tag blob
    })
    for k in ("loss", "noise", "buffer", "target", "git_sha", "dflash.run_dir", TARGET_FP):
        if k in run.data.tags:
            tags[k if k.startswith("dflash.") else f"dflash.{k}"] = truncate(run.data.tags[k], _TAG_VALUE_LIMIT)
    return tags


def decision_record(d: Decision, cfg: PromoteConfig) -> dict[str, Any]:
    """Everything the gate weighed, as one record (the version's `dflash.promotion.record` tag, JSON)."""
    num = {k: getattr(d, k) for k in ("holder_value", "delta", "delta_ci_low", "delta_ci_high", "prompt_lookup",
                                      "delta_prompt_lookup_ci_low", "delta_prompt_lookup_ci_high",
                                      "delta_least_degenerate", "delta_least_degenerate_ci_low",
                                      "delta_least_degenerate_ci_high")}
    return {"alias": cfg.alias, "metric": cfg.metric, "margin": float(cfg.margin), "floor": float(cfg.floor),
            "ci_level": float(cfg.ci_level), "comparison": d.comparison, "holder_version": d.holder_version,
            **{k: None if v is None else float(v) for k, v in num.items()},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _decision_tags(d: Decision, cfg: PromoteConfig) -> dict[str, str]:
    """A short set (the README's promise): the decision, its one-line reason, the holder it was weighed
    against, and the whole record as one JSON tag."""
    return {
        DECISION_TAG: PROMOTED if d.promoted else REFUSED,
        REASON_TAG: truncate(d.reason, _TAG_VALUE_LIMIT),
        PREFIX + "holder_version": d.holder_version or "",
        RECORD_TAG: json.dumps(decision_record(d, cfg)),
    }


def _run_decision_tags(d: Decision, version: str | None = None, model: str | None = None) -> dict[str, str]:
    """What the gate adds to the run: its decision and reason, and the version it made (the record is on it)."""
    tags = {DECISION_TAG: PROMOTED if d.promoted else REFUSED, REASON_TAG: truncate(d.reason, _TAG_VALUE_LIMIT)}
    if version is not None:
        tags.update({VERSION_TAG: version, PREFIX + "model": model or ""})
    return tags


def version_description(d: Decision, run_name: str = "") -> str:
    """The version's description: the gate's decision in one line."""
    head = f"PROMOTED to @{d.alias}" if d.promoted else f"REFUSED (not @{d.alias})"
    return f"{head}: {d.reason}" + (f" (run {run_name})" if run_name else "")


def _tag_run(client, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag
    try:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as e:  # the registry is the record; a run tag is a convenience
        log.warning("could not tag run %s with the promotion decision: %s", run_id, e)


def model_description(alias: str, target: str | None, fp: str | None) -> str:
    """A registered model's description: which target its drafters are for, and which version to serve."""
    of = (f" of target {target + ' ' if target else ''}(fingerprint {fp}, `{TARGET_FP}`)" if fp
          else " whose runs record no target fingerprint")
    return (f"DFlash drafters{of}. Serve the version @{alias} points at: the alias moves only through the gate, and a "
            "later version may be a refused one (each version's description says which)")


def _register(client, cfg: PromoteConfig, name: str, run, tags: dict[str, str]):
    from mlflow.exceptions import MlflowException
    fp = run.data.tags.get(TARGET_FP)
    try:
        client.create_registered_model(name, tags={TARGET_FP: fp} if fp else None,
                                       description=model_description(cfg.alias, run.data.tags.get("target"), fp))
    except MlflowException as e:
        if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{run.info.artifact_uri.rstrip('/')}/checkpoint"
    return client.create_model_version(name, source, run_id=run.info.run_id, tags=tags)


# ------------------------------------------------------------------------------------------- API
def promote(run_id: str, cfg: PromoteConfig, tracking_uri: str | None, dry_run: bool = False,
            lock_timeout: float = 300.0, checkpoint: str | os.PathLike | None = None) -> Decision:
    """Gate `run_id` (see module doc). The store is `cfg.tracking_uri` if set, else `tracking_uri`
    (the run's own). `checkpoint`: the run's serving folder, logged as its `checkpoint` artifact first where its
    store was packed without weights (`restore_checkpoint`). Returns the decision; raises `PromotionError` when the
    run or store is missing, or the folder is not the run's."""
    uri = cfg.tracking_uri or tracking_uri or ""
    if not uri:
        raise PromotionError("no tracking URI: set promote.tracking_uri or pass the run's tracking URI")
    if not (math.isfinite(cfg.margin) and math.isfinite(cfg.floor)):
        raise PromotionError(f"promote.margin={cfg.margin} and promote.floor={cfg.floor} must be finite")
    if not 0.0 < cfg.ci_level < 1.0 or cfg.bootstrap < 1:
        raise PromotionError(f"promote.ci_level={cfg.ci_level} must lie in (0, 1) and promote.bootstrap="
                             f"{cfg.bootstrap} be >= 1")
    check_store(uri)
    client = _client(uri)
    run = _get_run(client, run_id, uri)
    name = registry_name(cfg.model_name, run.data.tags.get(TARGET_FP))  # one registered model per target
    base = dict(run_id=run_id, model_name=name, alias=cfg.alias, metric=cfg.metric, dry_run=dry_run)
    if checkpoint is not None:
        restore_checkpoint(client, run, checkpoint, uri, dry_run)
        run = client.get_run(run_id)  # its artifact location as it is now

    refusal, value = _eligibility(client, run, cfg, checkpoint_given=checkpoint is not None)
    if refusal is not None:
        d = Decision(False, refusal, candidate_value=value, **base)
        if not dry_run:
            _tag_run(client, run_id, _run_decision_tags(d))
        log.info(d.summary())
        return d

    if dry_run:
        holder, holder_value = _current_holder(client, cfg, name)
        if holder is not None and holder.run_id == run_id:
            return Decision(False, f"run already holds @{cfg.alias} (v{holder.version})", None, value,
                            str(holder.version), holder_value, **base, holds_alias=True)
        ev = _evidence(client, run, holder, cfg)
        ok, reason = _compare(value, holder, holder_value, cfg, ev, run.data.tags.get(TARGET_FP))
        return _record(Decision(ok, reason, None, value, holder and str(holder.version), holder_value, **base), ev)

    with registry_lock(uri, timeout=lock_timeout):
        holder, holder_value = _current_holder(client, cfg, name)  # read inside the lock: the re-check
        hv = None if holder is None else str(holder.version)
        if holder is not None and holder.run_id == run_id:
            d = Decision(False, f"run already holds @{cfg.alias} (v{hv}); nothing registered", None, value,
                         hv, holder_value, **base, holds_alias=True)
            log.info(d.summary())
            return d
        ev = _evidence(client, run, holder, cfg)
        ok, reason = _compare(value, holder, holder_value, cfg, ev, run.data.tags.get(TARGET_FP))
        mv = _register(client, cfg, name, run, _version_tags(client, run, cfg, value))
        version = str(mv.version)
        d = _record(Decision(ok, reason, version, value, hv, holder_value, **base), ev)
        if ok:
            client.set_registered_model_alias(name, cfg.alias, version)
            now = client.get_registered_model(name).aliases.get(cfg.alias)
            if str(now) != version:  # only possible if something bypassed the lock
                d.promoted = False
                d.reason = f"lost a race: @{cfg.alias} points at v{now} after setting it; {reason}"
            elif holder is not None:
                with contextlib.suppress(Exception):
                    client.set_model_version_tag(name, hv, PREFIX + "superseded_by", version)
        for k, v in _decision_tags(d, cfg).items():
            client.set_model_version_tag(name, version, k, v)
        client.update_model_version(name, version, description=version_description(d, run.info.run_name))
        _tag_run(client, run_id, _run_decision_tags(d, version, name))
    log.info(d.summary())
    return d


def auto_promote(run_id: str | None, cfg: PromoteConfig, tracking_uri: str | None) -> Decision | None:
    """End-of-run hook: promotes when `cfg.enabled`. Call it after the MLflow run is closed FINISHED.
    Never raises (the training run already succeeded); problems are logged and give None."""
    if not cfg.enabled:
        return None
    if not run_id:
        log.warning("promote.enabled but the run has no MLflow run id (tracking disabled or down)")
        return None
    try:
        d = promote(run_id, cfg, tracking_uri)
    except Exception as e:
        log.warning("auto-promotion of run %s failed: %s: %s", run_id, type(e).__name__, e)
        return None
    print(d.summary(), flush=True)
    return d


__all__ = ["PromoteConfig", "Decision", "PromotionError", "promote", "auto_promote", "registry_lock",
           "registry_name", "check_store", "DECISION_TAG", "REASON_TAG", "VERSION_TAG"]
