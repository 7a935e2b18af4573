"""SIGTERM / SIGINT during training: finish the step, checkpoint, close the run KILLED, exit non-zero.

`timeout`, batch schedulers and `kill` send SIGTERM; Ctrl-C sends SIGINT. Python's default ends the process at
once (SIGTERM) or raises KeyboardInterrupt wherever the main thread happens to be (SIGINT), so the steps since the
last checkpoint were lost and the MLflow run stayed RUNNING. `StopOnSignal` turns the first signal into a
request the step loop reads at a step boundary; a second signal abandons the step at once, but only when it comes
at least `REPEAT_S` after the first: GNU `timeout` and batch schedulers send SIGTERM to the child and then to its
whole process group, two copies of one stop within milliseconds. Where there is no step boundary to wait for
(the run's setup, its final evaluation) `at_once()` makes the first signal stop it where it is.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_S = 1.0  # a second signal sooner than this after the first is the same stop (a process group's copy)


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal; the trainer closes its run KILLED, the CLI exits 128 + signal number."""
    run_status = "KILLED"

    def __init__(self, signum: int, step: int | None = None, checkpoint=None, where: str = ""):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = where or (f" after step {step}" if step is not None else " mid-step (second signal)")
        saved = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}{saved}")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


class StopOnSignal:
    """While active (a context manager, main thread only: elsewhere it does nothing), the first SIGTERM/SIGINT
    sets `signum`; a second one, `REPEAT_S` or more later, raises RunInterrupted where the main thread is. Inside
    `at_once(...)` the first one raises at once (and a stop already requested raises on entry)."""

    def __init__(self):
        self.signum: int | None = None
        self._first_s = 0.0
        self._at_once: dict | None = None  # RunInterrupted's step / checkpoint / where, inside at_once()
        self._previous: dict[int, object] = {}
        self._patient: tuple[float, dict] | None = None  # inside patient(): its grace, RunInterrupted's fields
        self._alarm_previous: object | None = None  # SIGALRM's handler while patient()'s alarm is armed

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is not None:
            if now - self._first_s < REPEAT_S:
                log.info("%s again within %.1f s: the same stop", signal.Signals(signum).name, REPEAT_S)
                return
            raise RunInterrupted(signum)
        self.signum, self._first_s = signum, now
        if self._at_once is not None:
            raise RunInterrupted(signum, **self._at_once)
        if self._patient is not None:
            self._arm_alarm()
        log.warning("%s received: stopping after this step with a checkpoint (send it again to stop at once)",
                    signal.Signals(signum).name)

    @contextmanager
    def at_once(self, step: int | None = None, checkpoint=None, where: str = ""):
        """The first signal inside raises RunInterrupted(signum, step, checkpoint) where the main thread is;
        a stop requested before raises on entry. Nests in an active `with self:` or installs the handlers."""
        installed = not self._previous
        if installed:
            self.__enter__()
        saved, self._at_once = self._at_once, {"step": step, "checkpoint": checkpoint, "where": where}
        try:
            if self.signum is not None:
                raise RunInterrupted(self.signum, **self._at_once)
            yield self
        finally:
            self._at_once = saved
            if installed:
                self.__exit__(None, None, None)

    @contextmanager
    def patient(self, grace_s: float, step: int | None = None, checkpoint=None, where: str = ""):
        """Inside, the first signal is the usual request for a stop at the next step boundary, but if the main
        thread is still inside `grace_s` seconds later (a wait that may last minutes: data a writer has not
        written yet), RunInterrupted(signum, step, checkpoint, where) is raised there. A short wait thus still
        ends in the exact checkpoint of the step boundary. Main thread and an active `with self:` only; else a
        no-op."""
        if threading.current_thread() is not threading.main_thread() or not self._previous:
            yield self
            return
        self._patient = (grace_s, {"step": step, "checkpoint": checkpoint, "where": where})
        try:
            yield self
        finally:
            self._patient = None
            self._disarm_alarm()

    def _arm_alarm(self) -> None:
        grace_s, fields = self._patient

        def expired(_signum, _frame):
            self._disarm_alarm()
            raise RunInterrupted(self.signum, **fields)
        self._alarm_previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, max(float(grace_s), 1e-3))
        log.warning("%s received while waiting: stopping at once unless the wait ends within %.0f s",
                    signal.Signals(self.signum).name, grace_s)

    def _disarm_alarm(self) -> None:
        if self._alarm_previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._alarm_previous)
            self._alarm_previous = None

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        # a stop requested moments ago may still have its process group's copy on the way: it must not find
        # the default handler (SIGTERM's ends the process before the run is closed)
        late = self.signum is not None and time.monotonic() - self._first_s < REPEAT_S
        for s, prev in self._previous.items():
            signal.signal(s, self._late_copy(prev) if late else prev)
        self._previous.clear()

    def _late_copy(self, previous):
        """A handler that drops signals until REPEAT_S after the first, then gives way to `previous`."""
        def handle(signum, frame):
            if time.monotonic() - self._first_s < REPEAT_S:
                return
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
        return handle
