"""SIGTERM / SIGINT during training: finish the step, checkpoint, close the run KILLED, exit non-zero.

`timeout`, batch schedulers and `kill` send SIGTERM; Ctrl-C sends SIGINT. Python's default ends the process at
once (SIGTERM) or raises KeyboardInterrupt wherever the main thread happens to be (SIGINT), so the steps since the
last checkpoint were lost and the MLflow run stayed RUNNING. `StopOnSignal` turns the first signal
into a request the step loop reads at a step boundary; a second signal abandons the step at once.
"""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal; the trainer closes its run KILLED, the CLI exits 128 + signal number."""
    run_status = "KILLED"

    def __init__(self, signum: int, step: int | None = None, checkpoint=None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f" after step {step}" if step is not None else " mid-step (second signal)"
        saved = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}{saved}")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


class StopOnSignal:
    """While active (a context manager, main thread only: elsewhere it does nothing), the first SIGTERM/SIGINT
    sets `signum`; a second raises RunInterrupted where the main thread is."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise RunInterrupted(signum)
        self.signum = signum
        log.warning("%s received: stopping after this step with a checkpoint (send it again to stop at once)",
                    signal.Signals(signum).name)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()
