"""Promote an evaluated run through the gate (`dflash/serving/promotion.py`; docs/evaluation.md).

    python -m experiments.promote runs/20260101-120000-ab12-soft_kl
    python -m experiments.promote <mlflow run id> --tracking-uri sqlite:////abs/mlflow.db --dry-run
    python -m experiments.promote <run dir> --margin 0.05 --floor 3.0 --alias champion --ci-level 0.95
    python -m experiments.promote <run id> --tracking-uri sqlite:////abs/campaign_out/mlflow.db --checkpoint DIR

`--checkpoint DIR`: a run of a store packed without weights (the committed stores) gets the serving folder it wrote,
kept elsewhere, back as its `checkpoint` artifact before the gate, once the folder's checksums verify and its
config agrees with the run (target fingerprint, architecture, layers, loss); a folder that does not fit is bad input.

Exit codes, so a script can tell the outcomes apart (the decision and its reason are printed either way):
  0  promoted (with --dry-run: would promote), or the run already holds the alias;
  3  refused by the gate (with --dry-run: would refuse): not FINISHED, not evaluated, below the floor or margin;
  2  bad input: no such run or store, a run dir without MLflow tracking, bad gate settings;
  1  the tracking store does not answer (a dead or silent server: one line within seconds), or anything else
     that failed (a traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from dflash.config import ConfigError
from dflash.overrides import apply_overrides
from dflash.run_dir import MLFLOW_FILE, RunDir
from dflash.serving.promotion import Decision, PromoteConfig, PromotionError, promote
from dflash.tracking.run_info import resolve_relative_sqlite
from dflash.tracking.store import StoreError
from experiments.config import ArgParser

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
DEFAULT_URI = "sqlite:///mlflow.db"


EXIT_PROMOTED, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_REFUSED = 0, 1, 2, 3


class BadInput(Exception):
    pass


def exit_code(decision: Decision) -> int:
    """The process exit status of a decision (see the module doc)."""
    return EXIT_PROMOTED if decision.promoted or decision.holds_alias else EXIT_REFUSED


def _find_run_dir(path: Path) -> Path:
    """A run dir, its `final/` folder, or a checkpoint inside it → the dir holding mlflow_run.json."""
    p = path.resolve()
    for cand in [p, *p.parents][:4]:
        if RunDir(cand).mlflow_file.is_file():
            return cand
    if RunDir(p).is_run():
        raise BadInput(f"{path}: a run directory without {MLFLOW_FILE} (tracked with "
                       f"tracking.enabled=false, or MLflow was down); it cannot be promoted")
    raise BadInput(f"{path}: not a run directory (no mlflow_run.json here or in the folders above)")


def resolve_target(target: str, tracking_uri: str | None) -> tuple[str, str]:
    """(run_id, tracking_uri) from a run dir / checkpoint path or a run id."""
    path = Path(target)
    if path.exists():
        run_dir = _find_run_dir(path)
        info_file = RunDir(run_dir).mlflow_file
        try:
            info = json.loads(info_file.read_text())
            run_id = info["run_id"]
        except (ValueError, KeyError) as e:
            raise BadInput(f"{info_file}: unreadable or without run_id ({e})") from e
        uri = tracking_uri or info.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
        return run_id, resolve_relative_sqlite(uri, run_dir)
    if _RUN_ID.match(target):
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
        return target, resolve_relative_sqlite(uri, None)
    raise BadInput(f"{target!r} is neither an existing run directory nor an MLflow run id (32 hex chars)")


def build_parser() -> ArgParser:
    d = PromoteConfig()
    head, *rest = __doc__.split("\n\n")
    p = ArgParser(prog="python -m experiments.promote", description=head, epilog="\n\n".join(rest),
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="run directory (or its final/ or a checkpoint inside it), or an MLflow run id")
    p.add_argument("--dry-run", action="store_true", help="show the decision; register and tag nothing")
    # numbers stay text here: the one override parser (dflash/overrides.py) types them, naming the key
    p.add_argument("--margin", default=str(d.margin),
                   help="the lower end of the paired Δτ interval vs the holder must exceed this")
    p.add_argument("--floor", default=str(d.floor), help="and the candidate's value be at least this")
    p.add_argument("--ci-level", default=str(d.ci_level), help="level of the paired Δτ intervals")
    p.add_argument("--bootstrap", default=str(d.bootstrap), help="bootstrap replicates of those intervals")
    p.add_argument("--alias", default=d.alias)
    p.add_argument("--model-name", default=d.model_name,
                   help="registered model stem: the run registers under <name>-<its target fingerprint>")
    p.add_argument("--metric", default=d.metric, help="gate metric (default %(default)s)")
    p.add_argument("--tracking-uri", default="", help="default: the run's own (mlflow_run.json)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="the run's serving folder, logged as its checkpoint artifact first (a store packed without "
                        "weights)")
    return p


def main(argv: list[str] | None = None) -> Decision:
    args = build_parser().parse_args(argv)
    try:
        cfg = apply_overrides(PromoteConfig(model_name=args.model_name, alias=args.alias, metric=args.metric),
                              [f"margin={args.margin}", f"floor={args.floor}", f"ci_level={args.ci_level}",
                               f"bootstrap={args.bootstrap}"], "promote")
        run_id, uri = resolve_target(args.target, args.tracking_uri or None)
        cfg = dataclasses.replace(cfg, tracking_uri=uri)
        decision = promote(run_id, cfg, uri, dry_run=args.dry_run, checkpoint=args.checkpoint)
    except (BadInput, PromotionError, ConfigError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from e
    except ConnectionError as e:  # a dead or silent tracking server: one line within seconds
        print(f"error: the tracking store does not answer: {e}", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from e
    print(decision.summary())
    print(f"  {cfg.metric}: candidate {decision.candidate_value}, holder "
          f"{'v' + decision.holder_version if decision.holder_version else 'none'} ({decision.holder_value}); "
          f"margin {cfg.margin}, floor {cfg.floor}; store {uri}")
    if decision.delta is not None:
        ci = "" if decision.delta_ci_low is None else f" [{decision.delta_ci_low:+.4f}, {decision.delta_ci_high:+.4f}]"
        print(f"  Δ vs holder ({decision.comparison}): {decision.delta:+.4f}{ci}")
    if decision.prompt_lookup is not None:
        ci = "" if decision.delta_prompt_lookup_ci_low is None else \
            f", Δ interval [{decision.delta_prompt_lookup_ci_low:+.4f}, {decision.delta_prompt_lookup_ci_high:+.4f}]"
        print(f"  prompt-lookup τ {decision.prompt_lookup:.4f}{ci}")
    return decision


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
