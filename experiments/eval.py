"""Evaluated acceptance of a drafter: `python -m experiments.eval A [B] [key=value ...]`, A and B each a
run dir, a serving folder or a checkpoint.pt; B may also be `champion` (any `@alias`, or
`models:/<name>@<alias>`: the registry's holder, in A's tracking store).

With B: both drafters run on the SAME ground truth (A's config: target, suites, lengths), and each suite
gets the paired Δτ = τ_A − τ_B with its `eval.ci_level` prompt × sample bootstrap interval
(`dflash.evaluation.stats.hierarchical_ci`; vanilla and per tree budget; trees at T = 0 only), printed, logged as `eval/<setting>/compare/delta_<metric>[_ci_low|_ci_high]`
(and per suite `eval/suite/<name>/<setting>/compare/...`; setting `t1`, `t0`: docs/evaluation.md) and written to
`compare.json` / `compare.md`, with the vanilla Δ again on the least-degenerate rows
(`.../compare/least_degenerate/delta_tau_vanilla`: the ground truths that repeat the fewest of their 8-grams, at least
a quarter; `dflash.evaluation.pairing.least_degenerate_tasks`). B can be a published drafter
(a serving folder `dflash.serving.export.load_drafter` reads): that is the published baseline. Prompt lookup
(the zero-cost baseline) stands beside τ in every table, with or without B.

- A run directory (has `config.yaml`): its resolved config, then `key=value` overrides on top (type-checked
  against the schema, e.g. `eval.real_decode=true eval.max_new_tokens=128 target.device=cpu`); the drafter is
  `final/` (the serving folder), or when the run has no `final/` its newest intact `checkpoints/step_*.pt`
  (as resume does: a torn or refused latest one is passed over with a warning naming both files).
- A serving folder (`config.json` with `DFlashDraftModel`, ours or a published drafter): the run config is
  composed from `conf/` with Hydra overrides (`experiments.config.compose_config`), so the target comes from
  the overrides (`target=...`, `target.path=...`, `target.mask_token_id=...`).
- A training checkpoint file (`checkpoints/step_*.pt`): the config stored in it, plus overrides.

It prints the per-task table, writes tasks.json / tasks.md / acceptance_per_position.png to `report/` in the
output folder (`--out=DIR`; default `<run dir>/eval/<timestamp>` or `runs/eval-<timestamp>`), and logs to
MLflow.

MLflow: a NEW run, tagged `dflash.kind=eval`, `dflash.evaluated_path=<path>` and, when the run dir has
`mlflow_run.json`, `dflash.evaluated_run=<run_id>` in the training run's own tracking store and experiment (or the
store a `tracking.tracking_uri=` override names; `champion` is looked up there too);
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
import json
import logging
import sys
from pathlib import Path


from dflash.config import ConfigError, RunConfig, from_dict
from dflash.overrides import apply_overrides
from dflash.evaluation import validate_eval_config
from dflash.evaluation.evaluator import evaluate_suites, merged_metrics, summary_table
from dflash.evaluation.protocol import table_places
from dflash.evaluation.pairing import NotPaired, least_degenerate_delta, paired_delta
from dflash.target.model import Target
from dflash.devices import check_device, resolve_device
from dflash.safe_load import verify_manifest
from dflash.tracking.store import StoreError, check_tracking_uri, open_client, signals_deferred
from dflash.tracking.loggers import build_loggers
from dflash.tracking.run_info import default_run_name, flatten_config, resolve_relative_sqlite
from dflash.training.interrupts import StopOnSignal

log = logging.getLogger(__name__)


def _saved_config(d: dict, overrides: list[str]) -> RunConfig:
    bad = [o for o in overrides if o.startswith(("+", "~"))]
    if bad:
        raise ConfigError(f"overrides on a saved run config must be plain key=value, got {bad}")
    return apply_overrides(from_dict(d), overrides)


def resolve_source(path: Path, overrides: list[str]):
    """-> (RunConfig, EvalConfig, drafter loader, training run dir or None, default step, the DrafterSource).
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
        return cfg, cfg.eval, lambda dev: load_drafter(src.serving, dev), None, 0, src
    cfg = _saved_config(saved, overrides)
    run_dir = src.run.root if src.run is not None else None
    if src.serving is not None:
        return cfg, cfg.eval, lambda dev: load_drafter(src.serving, dev), run_dir, cfg.trainer.max_steps, src

    def load(dev):
        return drafter_from_checkpoint(src.checkpoint, src.state, src.run_serving).drafter.to(dev)
    return cfg, cfg.eval, load, run_dir, src.step, src


def recorded_target_fingerprint(path: Path) -> tuple[bool, str | None]:
    """(trained here, its target fingerprint) of a run dir, serving folder or checkpoint: of the drafter eval
    evaluates there (`dflash.run_dir.resolve_drafter_source`: a run's final/, else its newest intact checkpoint,
    past a torn or refused latest one). A serving folder without `dflash_training` (a published drafter) is not
    ours: (False, None)."""
    from dflash.run_dir import resolve_drafter_source
    return _recorded(resolve_drafter_source(path))


def _recorded(src) -> tuple[bool, str | None]:
    from dflash.serving.export import read_serving_config
    if src.state is not None:
        return True, src.state.get("target_fingerprint")
    training = read_serving_config(src.serving).get("dflash_training")
    return training is not None, (training or {}).get("target_fingerprint")


def _check_target(path: Path, target, src=None) -> None:
    """The drafter at `path` (`src`: as resolve_source already read it) was trained on `target`."""
    from dflash.target.model import check_drafter_target
    ours, recorded = recorded_target_fingerprint(path) if src is None else _recorded(src)
    if ours:
        try:
            check_drafter_target(recorded, target, str(path))
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _mlflow_info(run_dir: Path | None) -> dict:
    from dflash.run_dir import RunDir
    return RunDir(run_dir).mlflow_info() if run_dir is not None else {}


def _log_into_run(uri: str, run_id: str, metrics: dict[str, float], step: int, art_dir: Path) -> None:
    """Adds the eval metrics and artifacts to an existing (finished) run through the plain client, so its
    status never changes (a reopened run would read RUNNING to a concurrent promotion)."""
    import time

    from mlflow.entities import Metric
    client = open_client(uri)
    ts = int(time.time() * 1000)
    ms = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()]
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i:i + 1000])
    client.log_artifacts(run_id, str(art_dir), "eval")
    client.set_tag(run_id, "dflash.eval.source", "experiments.eval")


def _is_source(a: str) -> bool:
    return "=" not in a and not a.startswith(("+", "~"))


def _parse_argv(argv: list[str]) -> tuple[Path, str | None, list[str], Path | None, bool]:
    out, rest, into = None, [], False
    for a in argv:
        if a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
        elif a == "--into-run":
            into = True
        elif a == "--allow-other-target":
            continue  # read by main
        elif a in ("-h", "--help"):
            from experiments.config import exit_on_help
            exit_on_help([a], __doc__)
        else:
            rest.append(a)
    if not rest:
        raise ConfigError("usage: python -m experiments.eval <run dir | serving folder | checkpoint.pt> "
                          "[B: the same, or champion] [key=value ...] [--out=DIR] [--into-run]")
    other = rest[1] if len(rest) > 1 and _is_source(rest[1]) else None
    if other is not None and not (Path(other).exists() or other == "champion" or other.startswith(("@", "models:/"))):
        raise ConfigError(f"override {other!r}: expected key=value (or, as the second drafter B, an existing run "
                          f"dir, serving folder or checkpoint, or champion)")
    return Path(rest[0]), other, rest[2 if other else 1:], out, into


def _check_out(out: Path) -> None:
    """--out: a folder that can be made (probed, nothing left), before the target loads."""
    from dflash.run_dir import probe_folder
    try:
        probe_folder(out)
    except OSError as e:
        raise ConfigError(f"--out={out}: the output folder cannot be made ({type(e).__name__}: "
                          f"{e.strerror or e})") from e


def main(argv: list[str] | None = None) -> dict:
    """SIGTERM / Ctrl-C anywhere: one line, the eval's MLflow run (once open) closed KILLED, exit 128 + signal."""
    with StopOnSignal().at_once(where=" during experiments.eval"):
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> dict:
    path, other, overrides, out, into_run = _parse_argv(argv)
    cfg, ecfg, load, run_dir, step, src = resolve_source(path, overrides)
    ml = _mlflow_info(run_dir)
    if other is not None and into_run:
        raise ConfigError("--into-run writes one drafter's eval into its run; not with a second drafter B")
    if into_run and not ml.get("run_id"):
        raise ConfigError(f"--into-run: {path} is not a tracked run directory (no mlflow_run.json)")
    try:
        validate_eval_config(ecfg)
        check_device("eval.device", ecfg.device)
        if src.serving is not None:
            verify_manifest(src.serving)  # weights checked before the target loads (minutes on a large one)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    if out is not None:
        _check_out(out)
    if ml.get("tracking_uri"):
        ml["tracking_uri"] = resolve_relative_sqlite(ml["tracking_uri"], run_dir)
    # the training run's store, unless tracking.tracking_uri= names another (then that one, B's lookup included)
    store = {} if any(o.startswith("tracking.tracking_uri=") for o in overrides) else ml
    # B (a registry alias is looked up here, with the store's bounded checks) and the store: before the target
    load_other, other_label = (None, "") if other is None else _resolve_other(other, overrides, cfg, store)
    tracking = cfg.tracking
    if store.get("tracking_uri"):
        tracking = dataclasses.replace(tracking, tracking_uri=store["tracking_uri"],
                                       experiment=store.get("experiment", tracking.experiment))
    if tracking.enabled:
        try:
            check_tracking_uri(tracking.tracking_uri)
        except StoreError as e:
            raise ConfigError(f"tracking.tracking_uri={tracking.tracking_uri}: {e}") from e
    target = Target(cfg.target)
    if "--allow-other-target" not in argv:
        _check_target(path, target, src)
    dev = target.device if ecfg.device == "auto" else resolve_device(ecfg.device)
    drafter = load(dev)
    other_drafter = None if load_other is None else load_other(dev)

    stamp = default_run_name()
    from dflash.run_dir import RunDir
    out = out or ((RunDir(run_dir).eval_dir / stamp) if run_dir else Path("runs") / f"eval-{stamp}")
    tracking = dataclasses.replace(tracking, run_name=f"eval-{ml.get('run_name') or path.name}-{stamp[-4:]}",
                                   system_metrics=False)
    tags = {"dflash.kind": "eval", "dflash.evaluated_path": str(path.resolve()), "target": cfg.target.name,
            "eval.suite": ecfg.suite}
    if ml.get("run_id"):
        tags["dflash.evaluated_run"] = ml["run_id"]
    if other is not None:
        tags["dflash.compared_with"] = other_label
    params = {"eval": dataclasses.asdict(ecfg), "target": dataclasses.asdict(cfg.target),
              "drafter": {"block_size": drafter.block_size, "num_layers": len(drafter.layers)}}
    loggers, status = None, "FAILED"
    try:
        with signals_deferred():  # the MLflow run opens whole, so that a stop can close it KILLED
            loggers = build_loggers(tracking, out, flatten_config(params), tags, None)
        reports = evaluate_suites(drafter, target, ecfg)
        metrics = merged_metrics(reports)
        for i, (report, (prefix, folder)) in enumerate(zip(reports, table_places(reports))):
            print(report.console_table(), flush=True)
            report.log_artifacts(loggers, prefix)
            saved = report.save(out / "report" / folder)
            if i == 0:  # the objective's tables: what the lines below point to
                paths = saved
        print(summary_table(metrics, ecfg.ci_level), flush=True)
        if other_drafter is not None:
            metrics.update(_compare(reports, evaluate_suites(other_drafter, target, ecfg), ecfg, path.name,
                                    other_label, out / "report", loggers))
        loggers.log(metrics, step)
        if into_run:
            _log_into_run(ml["tracking_uri"], ml["run_id"], metrics, step, out / "report")
            print(f"eval metrics and artifacts also logged into the evaluated run {ml['run_id']}")
        status = "FINISHED"
    except KeyboardInterrupt:  # RunInterrupted (a signal): run_cli prints its one line
        status = "KILLED"
        raise
    finally:
        if loggers is not None:
            loggers.close(status)
    if store.get("run_id") and loggers.run_id and loggers.mlflow is not None and loggers.mlflow.healthy:
        try:
            loggers.mlflow.client.set_tag(ml["run_id"], "dflash.last_eval_run", loggers.run_id)
        except Exception as e:  # noqa: BLE001 - a pointer tag is a convenience
            log.warning("could not tag the evaluated run %s: %s", ml["run_id"], e)
    print(f"eval output: {out / 'report'} ({', '.join(p.name for p in paths.values())})\n"
          f"mlflow eval run: {loggers.run_id}")
    return metrics


# -- B: a second drafter on the same ground truth -------------------------------------------------------
def _target_model(client, cfg: RunConfig) -> str:
    """The registered model `champion` names: the configured target's (`<promote.model_name>-<fingerprint>`,
    dflash.serving.promotion.registry_name), else `promote.model_name` itself (a store from before one registered
    model per target)."""
    from dflash.serving.promotion import registry_name
    from dflash.target.model import target_fingerprint
    try:
        name = registry_name(cfg.promote.model_name, target_fingerprint(cfg.target))
        client.get_registered_model(name)
        return name
    except Exception:  # noqa: BLE001 - no such model (or no target files to fingerprint): the configured name
        return cfg.promote.model_name


def _resolve_other(other: str, overrides: list[str], cfg: RunConfig, ml: dict):
    """(a loader of drafter B for a device, its label), resolved before the target loads: a run dir / serving
    folder / checkpoint, or the registry's alias holder (looked up and fetched now: a missing `champion` is
    bad input found in seconds)."""
    from dflash.serving.export import load_drafter
    if other.startswith(("models:/", "@")) or other == "champion":
        uri = cfg.promote.tracking_uri or ml.get("tracking_uri") or cfg.tracking.tracking_uri
        from mlflow.artifacts import download_artifacts
        client = open_client(uri, registry=True)  # a dead or silent server: ConnectionError within seconds
        name, alias = _target_model(client, cfg), other.lstrip("@")
        if other.startswith("models:/"):
            name, _, alias = other.removeprefix("models:/").partition("@")
        try:
            mv = client.get_model_version_by_alias(name, alias)
            folder = download_artifacts(artifact_uri=mv.source, tracking_uri=uri)
        except Exception as e:  # noqa: BLE001 - MLflow's exceptions: bad input only when the store says "no such"
            if not _not_found(e):  # an outage (a timeout, a 5xx) is no statement about the registry's content
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                raise ConnectionError(f"{uri}: the registry lookup of {name}@{alias} failed "
                                      f"({type(e).__name__}: {first})") from e
            raise ConfigError(f"B={other!r}: no {name}@{alias} in the registry {uri!r} ({e})") from e
        return (lambda dev: load_drafter(folder, dev)), f"{name}@{alias} (v{mv.version}, run {mv.run_id})"
    p = Path(other)
    _, _, load_b, _, _, src_b = resolve_source(p, [o for o in overrides if not o.startswith("eval.")])
    if src_b.serving is not None:
        try:
            verify_manifest(src_b.serving)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return load_b, str(p)


def report_pairs(reports_a, reports_b) -> list[tuple]:
    """(A's report, B's report, the setting label of their Δ) for each suite and setting both evaluated. Reports
    of one setting, suite and proposal policy pair (`t1/argmax` with `t1/argmax`); at a sampled setting the two
    objective reports pair too when each drafter kind was scored under its engine's own policy (DFlash 1's argmax
    drafts against DFlash 2's sampled walk under vllm): that pair's label names the engine (`t1/vllm`)."""
    key = lambda r: (r.info["suite_label"], r.info["setting"])  # noqa: E731
    by_b = {key(r): r for r in reports_b}
    out = []
    for i, ra in enumerate(reports_a):
        if key(ra) in by_b:
            out.append((ra, by_b[key(ra)], ra.info["setting"]))
        elif i < len(reports_b) and i == 0:  # the objectives, each under its engine's policy for its kind
            rb = reports_b[0]
            sa, sb = ra.info["setting"].partition("/"), rb.info["setting"].partition("/")
            if sa[0] == sb[0] and ra.info["suite_label"] == rb.info["suite_label"]:
                out.append((ra, rb, f"{sa[0]}/{ra.info.get('engine', 'engine')}"))
    return out


def _not_found(e: Exception) -> bool:
    """The store answered that the model, alias or its files do not exist (bad input), not that it failed."""
    code = getattr(e, "error_code", "")
    return code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE") or isinstance(e, FileNotFoundError)


def _compare(reports_a, reports_b, ecfg, label_a: str, label_b: str, out: Path, loggers) -> dict[str, float]:
    """Paired Δτ = A − B per suite and method; printed, logged as eval/compare/..., saved as compare.*"""
    metrics, rows, seen = {}, [], set()
    for ra, rb, label in report_pairs(reports_a, reports_b):
        ta, tb, suite = ra.to_dict(), rb.to_dict(), ra.info["suite_label"]
        first = label not in seen
        seen.add(label)
        row = {"suite": suite, "setting": label, "prompts": len(ra.table), "tau_a": ra.metrics["eval/tau_vanilla"],
               "tau_b": rb.metrics["eval/tau_vanilla"], "tau_prompt_lookup": ra.stats.get("eval/tau_prompt_lookup")}
        methods = [("tau_vanilla", ("tau_sum_vanilla", "rounds"))]
        # DDTree is DFlash 1 only: a tree budget is paired where both drafters ran it (A DFlash 1, B DFlash 2: none)
        methods += [(f"tau_tree_{b}", (f"tau_sum_tree_{b}", f"rounds_tree_{b}")) for b in ra.budgets
                    if b in rb.budgets]
        for key, cols in methods:
            try:
                d = paired_delta(ta, tb, cols, cols, ecfg.ci_level, ecfg.bootstrap)
            except NotPaired as e:  # the same target, config and methods: not expected; say so if it does
                raise ConfigError(f"suite {suite}: {e}") from e
            row[key] = [d.value, d.low, d.high]
            for pre in ([f"eval/{label}/compare/"] if first else []) + [f"eval/suite/{suite}/{label}/compare/"]:
                metrics.update({f"{pre}delta_{key}": d.value, f"{pre}delta_{key}_ci_low": d.low,
                                f"{pre}delta_{key}_ci_high": d.high})
        vanilla = ("tau_sum_vanilla", "rounds")
        ld = least_degenerate_delta(ta, tb, vanilla, vanilla, ecfg.ci_level, ecfg.bootstrap)  # the ranking again
        if ld is not None:  # where the ground truth repeats itself least
            d = ld.delta
            row["least_degenerate"] = {"tasks": ld.rows, "copy_rate_at_most": ld.copy_rate_at_most,
                                       "tau_vanilla": [d.value, d.low, d.high]}
            for pre in ([f"eval/{label}/compare/"] if first else []) + [f"eval/suite/{suite}/{label}/compare/"]:
                metrics.update({f"{pre}least_degenerate/delta_tau_vanilla": d.value,
                                f"{pre}least_degenerate/delta_tau_vanilla_ci_low": d.low,
                                f"{pre}least_degenerate/delta_tau_vanilla_ci_high": d.high})
        rows.append(row)
    text = _compare_table(rows, reports_a[0].budgets, ecfg.ci_level, label_a, label_b)
    print(text, flush=True)
    from dflash.atomic import atomic_write_text
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compare.json", json.dumps({"a": label_a, "b": label_b, "suites": rows}, indent=2))
    atomic_write_text(out / "compare.md", text + "\n")
    loggers.log_dict({"a": label_a, "b": label_b, "suites": rows}, "eval/compare.json")
    loggers.log_text(text + "\n", "eval/compare.md")
    return metrics


def _compare_table(rows: list[dict], budgets: list[int], level: float, a: str, b: str) -> str:
    def ci(v):
        return f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"
    head = ["suite", "setting", "tasks", "τ A", "τ B", "τ prompt-lookup", "Δ vanilla"]
    head += [f"Δ tree-{x} nodes" for x in budgets]
    head += ["Δ vanilla, least-degenerate rows (tasks; 8-gram copy rate ≤)"]
    lines = [f"paired Δτ = A − B, {100 * level:g}% prompt × sample bootstrap interval, same ground truth "
             f"(A = {a}, B = {b})", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pl = r["tau_prompt_lookup"]
        cells = [r["suite"], r["setting"], str(r["prompts"]), f"{r['tau_a']:.3f}", f"{r['tau_b']:.3f}",
                 "-" if pl is None else f"{pl:.3f}", ci(r["tau_vanilla"])]
        cells += [ci(r[f"tau_tree_{x}"]) if f"tau_tree_{x}" in r else "-" for x in budgets]
        ld = r.get("least_degenerate")
        cells.append(f"{ci(ld['tau_vanilla'])} ({ld['tasks']}; {ld['copy_rate_at_most']:.3f})" if ld else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if budgets:
        lines.append("Δ tree: trees run at T=0 only, and DDTree is DFlash 1 only: paired where both drafters ran it.")
    return "\n".join(lines + ["A ranking should hold on the least-degenerate rows too: those whose ground truth repeats "
                               "the fewest of its 8-grams, at least a quarter of them (a τ on text that loops measures "
                               "loop copying)."])


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(main)
