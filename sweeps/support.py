"""Library helpers for hyperparameter sweeps (no Hydra here; `sweeps/` composes configs).

- `PruningEvaluator`: wraps the trainer's evaluator; at every intermediate eval (trainer.eval_every) it
  reports the objective metric to an Optuna trial and raises `EvalPruned` (an `optuna.TrialPruned`) when
  the pruner says stop. A metric the evaluator does not return (e.g. `train/loss`) is read from the run's
  `metrics.jsonl` (the log of record, flushed every line).
- `SweepTracker`: the MLflow side of a study through `MlflowClient`: one parent run per study, each
  trial's training run pre-created as its child (tag `mlflow.parentRunId`), trial state tags, the best
  trial's value / params / checkpoint on the parent.
"""
from __future__ import annotations

import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna

from dflash.evaluation.evaluator import subset_key
from dflash.tracking.loggers import read_jsonl_metrics
from dflash.tracking.run_info import get_or_create_experiment
from dflash.tracking.transport import prepare_store

log = logging.getLogger(__name__)

PARENT_KIND = "sweep"
TAG_PARENT = "mlflow.parentRunId"
TAG_STUDY = "optuna.study_name"
TAG_TRIAL = "optuna.trial_number"
TAG_STATE = "optuna.state"
TAG_PRUNED_STEP = "optuna.pruned_step"
# The MLflow run status a finished trial's child run ends with. A pruned trial did what the study asked of it (the
# pruner stopped it): FINISHED, not MLflow's KILLED with its red ✗; its `optuna.state` tag (a column of the
# key-metrics view) and its Description say pruned. MLflow has no status of that name.
RUN_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED"}
PRUNED_NOTE = "**Pruned**"  # the head of a pruned trial's Description
TAG_VALUE = "optuna.value"


class EvalPruned(optuna.TrialPruned):
    """Raised from inside `train()` when the pruner stops a trial. `run_status` is the MLflow status the trainer
    closes the run with (`RUN_STATUS`: a pruned trial is not a failure)."""

    run_status = RUN_STATUS["PRUNED"]

    def __init__(self, step: int, value: float, metric: str):
        super().__init__(f"pruned at step {step}: {metric}={value:.6g}")
        self.step, self.value, self.metric = step, value, metric


# torch's caching allocator (its message and its type), then allocations outside it that fail the same way (a CUDA
# context or a kernel's own buffer: "CUDA error: out of memory"; cuBLAS's workspace); a Triton shared-memory limit
# ("out of resource") is a kernel's, not the GPU's
GPU_OOM_MARKS = ("CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_gpu_oom(text: str) -> bool:
    """Whether an error's text (a traceback, an exception's `Type: message`) says the GPU ran out of memory."""
    return any(m in text for m in GPU_OOM_MARKS)


def last_logged(run_dir: str | os.PathLike, key: str, max_step: int | None = None) -> float | None:
    """The latest value of `key` in `<run_dir>/metrics.jsonl` (at a step <= max_step), or None."""
    for rec in reversed(read_jsonl_metrics(run_dir)):
        if key in rec and (max_step is None or int(rec.get("step", 0)) <= max_step):
            v = rec[key]
            return float(v) if isinstance(v, (int, float)) else None
    return None


class PruningEvaluator:
    """`evaluator(drafter, target, step, final, logger=None)` for `dflash.app.run.train`.

    Calls `base` (the real evaluator, may be None), then — for intermediate calls only — reports the
    objective `metric`'s subset figure (`subset_key`: `eval/subset/tau_served` for `eval/tau_served`) at `step` to `trial` and raises `EvalPruned` when `trial.should_prune()`. The
    final call's value is the trial's result (the caller reads it from the run's metrics)."""

    def __init__(self, trial: Any, metric: str, run_dir: str | os.PathLike,
                 base: Callable[..., Mapping[str, float]] | None = None):
        self.trial, self.metric, self.run_dir, self.base = trial, metric, Path(run_dir), base
        self.reports: list[tuple[int, float]] = []
        self._warned = False

    def use_train_sequences(self, sequences) -> None:
        """Forwarded to the real evaluator (eval/tau_train, dflash.evaluation.evaluator)."""
        if hasattr(self.base, "use_train_sequences"):
            self.base.use_train_sequences(sequences)

    def add_suites(self, suites, note: str = "") -> None:
        """Forwarded to the real evaluator (the data's own suites: a chat dataset's chat_heldout)."""
        if hasattr(self.base, "add_suites"):
            self.base.add_suites(suites, note)

    def __call__(self, drafter, target, step: int, final: bool, logger=None) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.base is not None:
            res = self.base(drafter, target, step, final) if logger is None else \
                self.base(drafter, target, step, final, logger)
            out = dict(res or {})
        if final:
            return out
        key = subset_key(self.metric)  # the in-training figure: the eval subset's, under its own name
        value = out.get(key)
        if value is None:
            value = last_logged(self.run_dir, key, max_step=step)
        if value is None or not math.isfinite(float(value)):
            if not self._warned:
                warnings.warn(f"objective metric {key!r} not available at step {step}; "
                              f"nothing reported to the pruner", RuntimeWarning, stacklevel=2)
                self._warned = True
            return out
        value = float(value)
        self.trial.report(value, step)
        self.reports.append((step, value))
        if self.trial.should_prune():
            raise EvalPruned(step, value, key)
        return out


def redact_uri(uri: str) -> str:
    """postgresql://user:secret@host/db -> postgresql://user:***@host/db"""
    import re
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", uri)


class SweepTracker:
    """MLflow bookkeeping of one study (all calls through `MlflowClient`; failures warn, never raise,
    except in `ensure_parent`, which the launcher needs)."""

    def __init__(self, tracking_uri: str, experiment: str):
        from mlflow.tracking import MlflowClient

        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self._experiment_id: str | None = None

    # ---- plumbing
    def _retry(self, what: str, fn: Callable, *args, quiet: bool = True, **kwargs):
        last: Exception | None = None
        for attempt in range(4):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - sqlite "database is locked" and friends
                last = e
                time.sleep(0.3 * (attempt + 1))
        if not quiet:
            raise last  # type: ignore[misc]
        warnings.warn(f"MLflow: {what} failed ({self.tracking_uri}): {type(last).__name__}: {last}",
                      RuntimeWarning, stacklevel=3)
        return None

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            # a fresh sqlite store is made once, whole, under a lock; a dead or silent server fails here in seconds
            # (not retried: each try would wait out the bounded check again)
            prepare_store(self.tracking_uri)

            def create():
                return get_or_create_experiment(self.client, self.experiment, self.tracking_uri)
            self._experiment_id = self._retry("get/create experiment", create, quiet=False)
        return self._experiment_id  # type: ignore[return-value]

    def _tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        from dflash.tracking.run_info import MAX_TAG_VAL_LENGTH, truncate
        rt = [RunTag(k, truncate("" if v is None else str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        if rt:
            self._retry("set tags", self.client.log_batch, run_id, tags=rt)

    # ---- parent
    def ensure_parent(self, study_name: str, run_id: str | None, tags: Mapping[str, Any],
                      params: Mapping[str, Any]) -> str:
        """Reopen the study's parent run (`run_id`, else found by tag) or create it; status RUNNING."""
        from mlflow.exceptions import MlflowException

        run = None
        if run_id:
            try:
                run = self.client.get_run(run_id)
                if run.info.experiment_id != self.experiment_id:
                    run = None
            except MlflowException:
                run = None
        if run is None:
            found = self._retry("search parent", self.client.search_runs, [self.experiment_id],
                                filter_string=f"tags.`dflash.kind` = '{PARENT_KIND}' and "
                                              f"tags.`{TAG_STUDY}` = '{study_name}'",
                                order_by=["attributes.start_time ASC"], max_results=1, quiet=False)
            run = found[0] if found else None
        if run is None:
            run = self._retry("create parent run", self.client.create_run, self.experiment_id,
                              run_name=f"sweep-{study_name}",
                              tags={"dflash.kind": PARENT_KIND, TAG_STUDY: study_name}, quiet=False)
            from mlflow.entities import Param

            from dflash.tracking.run_info import MAX_PARAM_VAL_LENGTH, truncate
            ps = [Param(k, truncate(str(v), MAX_PARAM_VAL_LENGTH)) for k, v in params.items()]
            for i in range(0, len(ps), 100):
                self._retry("log parent params", self.client.log_batch, run.info.run_id, params=ps[i:i + 100])
        else:
            self._retry("reopen parent", self.client.update_run, run.info.run_id, status="RUNNING")
        self._tags(run.info.run_id, tags)
        return run.info.run_id

    def tags_of(self, run_id: str) -> dict[str, str]:
        run = self._retry("get run", self.client.get_run, run_id)
        return dict(run.data.tags) if run is not None else {}

    def delete_tags(self, run_id: str, keys) -> None:
        for k in keys:
            self._retry(f"delete tag {k}", self.client.delete_tag, run_id, k)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self._retry(f"log artifact {name}", self.client.log_text, run_id, text, name)

    def update_parent(self, run_id: str, tags: Mapping[str, Any], metrics: Mapping[str, float],
                      step: int) -> None:
        from mlflow.entities import Metric

        self._tags(run_id, tags)
        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()
              if v is not None and math.isfinite(float(v))]
        if ms:
            self._retry("log parent metrics", self.client.log_batch, run_id, metrics=ms)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self._retry("end run", self.client.set_terminated, run_id, status)

    # ---- children
    def create_child(self, parent_id: str, study_name: str, trial_number: int, run_name: str,
                     tags: Mapping[str, Any] | None = None) -> str | None:
        t = {TAG_PARENT: parent_id, TAG_STUDY: study_name, TAG_TRIAL: str(trial_number), TAG_STATE: "RUNNING"}
        t.update({k: str(v) for k, v in (tags or {}).items()})
        run = self._retry("create child run", self.client.create_run, self.experiment_id, run_name=run_name,
                          tags=t)
        return run.info.run_id if run is not None else None

    def retag_child(self, run_id: str, trial_number: int, tags: Mapping[str, Any] | None = None) -> None:
        """A child run taken over by a continuing trial: it now stands for that trial, RUNNING again."""
        self._tags(run_id, {TAG_TRIAL: str(trial_number), TAG_STATE: "RUNNING", **(tags or {})})

    def finish_child(self, run_id: str, state: str, tags: Mapping[str, Any] | None = None,
                     run_dir: str | os.PathLike | None = None, status: str | None = None) -> None:
        """Trial outcome on the child: `optuna.state`, extra tags, and the run status it implies
        (COMPLETE and PRUNED → FINISHED, FAIL → FAILED; `status` when given: KILLED for a trial a signal cut)
        when it is not that already; a pruned trial's Description
        opens with what stopped it. The trial's run folder (`run_dir`, where it is on this machine) gets the same
        tags in its tags.json: the folder says what MLflow shows."""
        tags = dict(tags or {})
        run = self._retry("get child", self.client.get_run, run_id)
        if state == "PRUNED" and run is not None:
            note = run.data.tags.get("mlflow.note.content", "")
            if not note.startswith(PRUNED_NOTE):
                step = tags.get(TAG_PRUNED_STEP)
                at = f" at step {step}" if step is not None else ""
                tags["mlflow.note.content"] = (f"{PRUNED_NOTE}{at}: the sweep's pruner stopped this trial (Optuna "
                                               f"state PRUNED; not a failure).\n\n{note}").rstrip()
        self._tags(run_id, {TAG_STATE: state, **tags})
        if run_dir and (Path(run_dir) / "tags.json").is_file():
            from dflash.tracking.loggers import merge_json
            merge_json(Path(run_dir) / "tags.json", {TAG_STATE: state, **tags})
        want = status or RUN_STATUS.get(state)
        if want and run is not None and run.info.status != want:
            self.end(run_id, want)

    def children(self, parent_id: str) -> list[Any]:
        out = self._retry("search children", self.client.search_runs, [self.experiment_id],
                          filter_string=f"tags.`{TAG_PARENT}` = '{parent_id}'", max_results=50000)
        return list(out or [])
