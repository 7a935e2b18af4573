"""MLflow calls on a worker thread: a slow or dead tracking server costs the training loop nothing.

The trainer wraps its MLflow logger (`in_background(loggers)`); metrics.jsonl and the console stay on the caller's
thread (the jsonl file is the log of record: its disk errors must reach the trainer).
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash.tracking.loggers import Logger, MLflowLogger, MultiLogger
from dflash.tracking.run_info import json_default


class BackgroundLogger(Logger):
    """Runs an `MLflowLogger`'s calls on a worker thread, in order, so a slow or dead tracking server costs the
    training loop nothing: `log` and friends only enqueue. `close` waits up to `close_timeout_s` for the queue to
    drain, then closes the run (status set by the worker's logger). A full queue drops the newest call with one
    warning; metrics.jsonl (written on the caller's thread) keeps everything."""

    def __init__(self, inner: MLflowLogger, max_pending: int = 10_000, close_timeout_s: float = 60.0):
        self.inner, self.close_timeout_s = inner, close_timeout_s
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._dropped = 0
        self._closed = False
        self._worker = threading.Thread(target=self._drain, name="dflash-mlflow", daemon=True)
        self._worker.start()

    def _drain(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                fn, args = item
                fn(*args)
            except Exception as e:  # noqa: BLE001 - the inner logger disables itself on store errors
                warnings.warn(f"MLflow call failed on the logging thread: {type(e).__name__}: {e}", RuntimeWarning)
            finally:
                self._q.task_done()

    def _put(self, fn: Any, *args: Any) -> None:
        if self._closed or not self.inner.healthy:
            return
        try:
            self._q.put_nowait((fn, args))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                warnings.warn(f"MLflow logging queue full ({self._q.maxsize} calls pending: the store at "
                              f"{self.inner.tracking_uri!r} is too slow); later calls are dropped, metrics.jsonl "
                              f"has them", RuntimeWarning, stacklevel=3)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call ran (at most `timeout` s); True when the queue drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._put(self.inner.log, dict(metrics), step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._put(self.inner.log_params, dict(params))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put(self.inner.set_tags, dict(tags))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._put(self.inner.log_artifact, path, artifact_path)

    def log_text(self, text: str, name: str) -> None:
        self._put(self.inner.log_text, text, name)

    def log_dict(self, d: Mapping[str, Any], name: str) -> None:
        self._put(self.inner.log_dict, json.loads(json.dumps(d, default=json_default)), name)

    def log_figure(self, fig: Any, name: str) -> None:
        """Rendered here (the figure may change after this call), uploaded on the worker."""
        import io
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
        data = buf.getvalue()
        name = name if name.lower().endswith(".png") else name + ".png"
        self._put(self.inner._log_generated, name, lambda p: Path(p).write_bytes(data))

    @property
    def run_id(self) -> str | None:
        return self.inner.run_id

    def close(self, status: str = "FINISHED") -> None:
        if self._closed:
            return
        self._closed = True
        drained = self.flush(self.close_timeout_s)
        if not drained:
            warnings.warn(f"MLflow store {self.inner.tracking_uri!r} did not take the last "
                          f"{self._q.unfinished_tasks} logging calls within {self.close_timeout_s:g} s; they are "
                          f"dropped (metrics.jsonl has them)", RuntimeWarning, stacklevel=2)
            self.inner._healthy = False  # the worker may still be blocked in a call: do not wait for it
        self._q.put(None)
        if drained:
            self._worker.join(timeout=self.close_timeout_s)
        self.inner.close(status)


def in_background(loggers: "MultiLogger") -> "MultiLogger":
    """`loggers` with its MLflow logger moved onto a worker thread (jsonl and console stay on the caller's)."""
    loggers.loggers = [BackgroundLogger(lg) if isinstance(lg, MLflowLogger) and lg.healthy else lg
                       for lg in loggers.loggers]
    return loggers
