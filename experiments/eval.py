"""Evaluated acceptance of a drafter: `python -m experiments.eval <run dir | serving folder | checkpoint.pt>
[key=value ...]`.

- A run directory (has `config.yaml`): its resolved config, then `key=value` overrides on top (type-checked
  against the schema, e.g. `eval.real_decode=true eval.max_new_tokens=128 target.device=cpu`); the drafter is
  `final/` (the serving folder), or the newest `checkpoints/step_*.pt` when the run has no `final/`.
- A serving folder (`config.json` with `DFlashDraftModel`, ours or a published drafter): the run config is
  composed from `conf/` with Hydra overrides (`experiments.config.compose_config`), so the target comes from
  the overrides (`target=...`, `target.path=...`, `target.mask_token_id=...`).
- A training checkpoint file (`checkpoints/step_*.pt`): the config stored in it, plus overrides.

It prints the per-task table, writes tasks.json / tasks.md / acceptance_per_position.png to `report/` in the
output folder (`--out=DIR`; default `<run dir>/eval/<timestamp>` or `runs/eval-<timestamp>`), and logs to
MLflow.

MLflow: a NEW run, tagged `dflash.kind=eval`, `dflash.evaluated_path=<path>` and, when the run dir has
`mlflow_run.json`, `dflash.evaluated_run=<run_id>` in the training run's own tracking store and experiment;
the training run only gets a pointer tag `dflash.last_eval_run`. Why not log into the training run by
default: it is finished and reopening it flips its status (a concurrent promotion would see RUNNING); an
eval with other settings (suite, length, budgets) would write a second, different value into the `eval/*`
series the promotion gate reads, at the same step; several evals of one run stay separate and comparable,
found by tag. The trainer's own end-of-run eval is what normally puts `eval/*` on the training run.
`--into-run` also writes this eval's metrics (at the run's final step) and artifacts into the evaluated
training run, without touching its status: for a run trained without eval that must go through
`experiments.promote`. `main(argv)` returns the metrics.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path


from dflash.config import ConfigError, RunConfig, from_dict
from dflash.evaluation import validate_eval_config
from dflash.evaluation.report import evaluate
from dflash.target.model import Target
from dflash.devices import resolve_device
from dflash.tracking.loggers import (
    build_loggers,
    default_run_name,
    flatten_config,
    resolve_relative_sqlite,
)

log = logging.getLogger(__name__)


def _merge_dotlist(schema_obj, base: dict, dotlist: list[str]) -> dict:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    bad = [o for o in dotlist if o.startswith(("+", "~")) or "=" not in o]
    if bad:
        raise ConfigError(f"overrides on a saved run config must be plain key=value, got {bad}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema_obj), base, OmegaConf.from_dotlist(dotlist))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config override: {e}") from e


def _saved_config(d: dict, overrides: list[str]) -> RunConfig:
    return from_dict(_merge_dotlist(RunConfig, d, overrides))


def resolve_source(path: Path, overrides: list[str]):
    """-> (RunConfig, EvalConfig, drafter loader, training run dir or None, default step).
    `dflash.run_dir.resolve_drafter_source` decides what the path names."""
    from dflash.run_dir import resolve_drafter_source
    from dflash.serving.export import drafter_from_checkpoint, load_drafter
    try:
        src = resolve_drafter_source(path)
        saved = src.run_config
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a run directory (config.yaml), a serving folder (config.json) or a "
                          f"checkpoint file: {e}") from e
    if saved is None and src.run is not None:
        raise ConfigError(f"{path}: a run directory without config.yaml")
    if saved is None:  # a bare serving folder: the target comes from the overrides
        from experiments.config import compose_config
        cfg = compose_config(overrides)
        return cfg, cfg.eval, lambda dev: load_drafter(src.serving, dev), None, 0
    cfg = _saved_config(saved, overrides)
    run_dir = src.run.root if src.run is not None else None
    if src.serving is not None:
        return cfg, cfg.eval, lambda dev: load_drafter(src.serving, dev), run_dir, cfg.trainer.max_steps
    return (cfg, cfg.eval, lambda dev: drafter_from_checkpoint(src.checkpoint, src.state).drafter.to(dev),
            run_dir, src.step)


def _mlflow_info(run_dir: Path | None) -> dict:
    from dflash.run_dir import RunDir
    return RunDir(run_dir).mlflow_info() if run_dir is not None else {}


def _log_into_run(uri: str, run_id: str, metrics: dict[str, float], step: int, art_dir: Path) -> None:
    """Adds the eval metrics and artifacts to an existing (finished) run through the plain client, so its
    status never changes (a reopened run would read RUNNING to a concurrent promotion)."""
    import time

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    ts = int(time.time() * 1000)
    ms = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()]
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i:i + 1000])
    client.log_artifacts(run_id, str(art_dir), "eval")
    client.set_tag(run_id, "dflash.eval.source", "experiments.eval")


def _parse_argv(argv: list[str]) -> tuple[Path, list[str], Path | None, bool]:
    out, rest, into = None, [], False
    for a in argv:
        if a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
        elif a == "--into-run":
            into = True
        elif a in ("-h", "--help"):
            from experiments.config import exit_on_help
            exit_on_help([a], __doc__)
        else:
            rest.append(a)
    if not rest:
        raise ConfigError("usage: python -m experiments.eval <run dir | serving folder | checkpoint.pt> "
                          "[key=value ...] [--out=DIR] [--into-run]")
    return Path(rest[0]), rest[1:], out, into


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    path, overrides, out, into_run = _parse_argv(argv)
    cfg, ecfg, load, run_dir, step = resolve_source(path, overrides)
    ml = _mlflow_info(run_dir)
    if into_run and not ml.get("run_id"):
        raise ConfigError(f"--into-run: {path} is not a tracked run directory (no mlflow_run.json)")
    try:
        validate_eval_config(ecfg)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    target = Target(cfg.target)
    dev = target.device if ecfg.device == "auto" else resolve_device(ecfg.device)
    drafter = load(dev)

    stamp = default_run_name()
    from dflash.run_dir import RunDir
    out = out or ((RunDir(run_dir).eval_dir / stamp) if run_dir else Path("runs") / f"eval-{stamp}")
    tracking = cfg.tracking
    if ml.get("tracking_uri"):
        ml["tracking_uri"] = resolve_relative_sqlite(ml["tracking_uri"], run_dir)
        tracking = dataclasses.replace(tracking, tracking_uri=ml["tracking_uri"],
                                       experiment=ml.get("experiment", tracking.experiment))
    tracking = dataclasses.replace(tracking, run_name=f"eval-{ml.get('run_name') or path.name}-{stamp[-4:]}",
                                   system_metrics=False)
    tags = {"dflash.kind": "eval", "dflash.evaluated_path": str(path.resolve()), "target": cfg.target.name,
            "eval.suite": ecfg.suite}
    if ml.get("run_id"):
        tags["dflash.evaluated_run"] = ml["run_id"]
    params = {"eval": dataclasses.asdict(ecfg), "target": dataclasses.asdict(cfg.target),
              "drafter": {"block_size": drafter.block_size, "num_layers": len(drafter.layers)}}
    loggers = build_loggers(tracking, out, flatten_config(params), tags, None)
    status = "FAILED"
    try:
        report = evaluate(drafter, target, ecfg)
        print(report.console_table(), flush=True)
        loggers.log(report.metrics, step)
        report.log_artifacts(loggers)
        paths = report.save(out / "report")
        if into_run:
            _log_into_run(ml["tracking_uri"], ml["run_id"], report.metrics, step, out / "report")
            print(f"eval metrics and artifacts also logged into the evaluated run {ml['run_id']}")
        status = "FINISHED"
    finally:
        loggers.close(status)
    if ml.get("run_id") and loggers.run_id and loggers.mlflow is not None and loggers.mlflow.healthy:
        try:
            loggers.mlflow.client.set_tag(ml["run_id"], "dflash.last_eval_run", loggers.run_id)
        except Exception as e:  # noqa: BLE001 - a pointer tag is a convenience
            log.warning("could not tag the evaluated run %s: %s", ml["run_id"], e)
    print(f"eval output: {out / 'report'} ({', '.join(p.name for p in paths.values())})\n"
          f"mlflow eval run: {loggers.run_id}")
    return report.metrics


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(main)
