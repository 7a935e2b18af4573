"""Faults of a run's lifecycle, one test per probe: signals as `timeout` and schedulers send them (a process
group's second copy is the same stop), Ctrl-C during the final evaluation and during setup, a config error found
late and a failure after the MLflow run opened (closed FAILED, no half-made folder)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dflash.app.run import train
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent


def _store_runs(db: Path) -> list:
    if not db.exists():
        return []
    client = MlflowClient(f"sqlite:///{db}")
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def _cli(tmp_path, *overrides, prelude: str = "", **kw) -> subprocess.Popen:
    """`python -m experiments.run` with FAST overrides, after `prelude` (a patch) runs in the same process."""
    script = textwrap.dedent(prelude) + textwrap.dedent("""
        import sys
        from experiments.config import run_cli
        from experiments.run import main
        run_cli(main)
    """)
    args = [sys.executable, "-c", script, *FAST, f"run_dir={tmp_path / 'run'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *overrides]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


# ------------------------------------------------------------------ a second signal within a second
def test_a_process_groups_second_copy_of_a_signal_is_the_same_stop(monkeypatch):
    """`timeout` sends SIGTERM to the child, then to its process group: two copies within milliseconds."""
    from dflash.training import interrupts
    monkeypatch.setattr(interrupts, "REPEAT_S", 0.3, raising=False)
    stop = interrupts.StopOnSignal()
    raised = []
    with stop:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # both handled by now
        except BaseException as e:  # noqa: BLE001  (RunInterrupted is a KeyboardInterrupt: keep pytest alive)
            raised.append(e)
        assert not raised and stop.requested and stop.signum == signal.SIGTERM
        time.sleep(0.35)
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # a deliberate second one, later: stop at once
            time.sleep(0.05)
        except interrupts.RunInterrupted as e:
            raised.append(e)
    assert len(raised) == 1 and raised[0].exit_code == 128 + signal.SIGTERM


def test_a_copy_arriving_after_the_run_stopped_is_dropped_too(monkeypatch):
    """The loop may stop, checkpoint and leave its handlers before the group's copy lands: that copy must not
    meet the default handler (for SIGTERM: the end of the process before the run is closed)."""
    from dflash.training import interrupts
    monkeypatch.setattr(interrupts, "REPEAT_S", 0.5, raising=False)
    # Python's own Ctrl-C handler, as a fresh CLI process has it (an earlier stopped run in this process may have
    # left its own late-copy handler in place)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _late_copy_dropped(interrupts)
    finally:
        signal.signal(signal.SIGINT, previous)


def _late_copy_dropped(interrupts):
    before = signal.getsignal(signal.SIGINT)
    raised = []
    with interrupts.StopOnSignal():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.02)
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the copy, after the stop's handlers are gone
        time.sleep(0.02)
    except BaseException as e:  # noqa: BLE001
        raised.append(e)
    assert not raised
    time.sleep(0.5)
    with pytest.raises(KeyboardInterrupt):  # a Ctrl-C later is Python's own again
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before


def test_two_sigterms_at_once_still_checkpoint_through_the_cli(tmp_path):
    proc = _cli(tmp_path, "trainer.max_steps=5000", "trainer.checkpoint_every=100000")
    run_dir = tmp_path / "run"
    deadline = time.time() + 180
    while time.time() < deadline and not (run_dir / "metrics.jsonl").is_file():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    while time.time() < deadline and len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # two signals sent together coalesce; `timeout`'s group-wide copy can land a step later
    proc.send_signal(signal.SIGTERM)  # the process group's copy
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "mid-step" not in err and "after step" in err
    assert (run_dir / "checkpoints" / "latest.json").is_file()


def test_a_copy_of_the_stop_signal_landing_while_the_process_exits_keeps_its_exit_status(tmp_path):
    """A stopped run's process exits 128 + signal even when a copy of the signal lands as it exits (a small run
    can stop and exit between `timeout`'s two copies): from the CLI's stop on, SIGTERM is ignored, and SIG_IGN
    outlives Python's finalization, which puts the handlers it set back to SIG_DFL (a death by the signal,
    returncode -15: seen once in the test above under a full suite's load). The copy is sent from an exit hook,
    after the CLI has chosen its exit status."""
    script = textwrap.dedent("""
        import atexit, os, signal, sys, time
        from experiments.config import run_cli
        from dflash.training.interrupts import RunInterrupted
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))
        def main():
            raise RunInterrupted(signal.SIGTERM, 4, "ckpt")
        run_cli(main)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "stopped by SIGTERM after step 4; checkpoint ckpt" in proc.stderr


# ------------------------------------------------------------------ Ctrl-C during the final evaluation
def test_one_ctrl_c_during_the_final_eval_stops_it_killed(fast_cfg, tmp_path):
    from dflash.training.interrupts import RunInterrupted
    seen = []

    def evaluator(drafter, target, step, final, logger=None):
        if final:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # a long evaluation: the signal must not wait for it
            seen.append("finished")
        return {"eval/tau": 1.0}
    t0 = time.perf_counter()
    with pytest.raises(RunInterrupted) as e:
        train(fast_cfg(), evaluator)
    assert time.perf_counter() - t0 < 60 and not seen
    assert e.value.exit_code == 130 and "final evaluation" in str(e.value) and e.value.checkpoint is not None
    info = json.loads((tmp_path / "run" / "mlflow_run.json").read_text())
    assert MlflowClient(info["tracking_uri"]).get_run(info["run_id"]).info.status == "KILLED"
    assert (tmp_path / "run" / "final" / "config.json").is_file()  # the export before it stands


# ------------------------------------------------------------------ a signal while the step waits for data
def test_a_signal_while_waiting_for_data_stops_there(fast_cfg, tmp_path, monkeypatch):
    """A writer in the loop can keep the next batch minutes away (a 27B target writes 64 rows in 87 s): a SIGTERM
    then stops the run at once, at its newest checkpoint, instead of waiting for the data and a step after it."""
    from dflash.training import pipeline
    from dflash.training.interrupts import RunInterrupted
    real, calls, slept = pipeline.ProducerPool.next_item, [], []

    def stalls_after_step_4(self):
        calls.append(1)
        if len(calls) > 4 * 2:  # sequences_per_step=2: step 5's data never comes
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            slept.append(1)
        return real(self)
    monkeypatch.setattr(pipeline.ProducerPool, "next_item", stalls_after_step_4)
    t0 = time.perf_counter()
    with pytest.raises(RunInterrupted) as e:
        train(fast_cfg("trainer.max_steps=50", "trainer.sequences_per_step=2", "trainer.checkpoint_every=2"),
              lambda *a, **k: {})
    assert time.perf_counter() - t0 < 25 and not slept  # the grace (5 s), not the 30 s wait
    assert "while waiting for data after step 4" in str(e.value) and e.value.checkpoint.name == "step_00000004.pt"
    assert e.value.exit_code == 128 + signal.SIGTERM


def test_a_signal_during_a_short_wait_for_data_still_stops_exactly_after_the_step(fast_cfg, monkeypatch):
    """Data that comes within the grace: the stop is the usual one, at the step boundary with its checkpoint."""
    from dflash.training import pipeline
    from dflash.training.interrupts import RunInterrupted
    real, calls = pipeline.ProducerPool.next_item, []

    def short_wait_at_step_5(self):
        calls.append(1)
        if len(calls) == 4 * 2 + 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        return real(self)
    monkeypatch.setattr(pipeline.ProducerPool, "next_item", short_wait_at_step_5)
    with pytest.raises(RunInterrupted) as e:
        train(fast_cfg("trainer.max_steps=50", "trainer.sequences_per_step=2", "trainer.checkpoint_every=100"),
              lambda *a, **k: {})
    assert "after step 5" in str(e.value) and "waiting" not in str(e.value)
    assert e.value.checkpoint.name == "step_00000005.pt"


# ------------------------------------------------------------------ a signal during setup
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_setup_exits_cleanly_and_leaves_no_folder(tmp_path, sig):
    prelude = f"""
        import os, time
        import dflash.target.model as tm
        real = tm.Target.__init__
        def slow_load(self, *a, **k):  # the signal arrives while the target loads
            os.kill(os.getpid(), {int(sig)})
            time.sleep(5)
            real(self, *a, **k)
        tm.Target.__init__ = slow_load
    """
    proc = _cli(tmp_path, prelude=prelude)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and signal.Signals(sig).name in err and "during setup" in err
    assert not (tmp_path / "run").exists()
    assert not [r for r in _store_runs(tmp_path / "mlflow.db") if r.info.status == "RUNNING"]


# ------------------------------------------------------------------ errors after the MLflow run would open
def test_a_config_error_found_late_exits_2_with_no_folder_and_no_running_run(tmp_path):
    proc = _cli(tmp_path, "+loss=soft_kl", "target.soft_top_k=0")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2 and "target.soft_top_k" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "run").exists()
    assert not _store_runs(tmp_path / "mlflow.db")  # checked before the MLflow run opens


def test_a_failure_after_the_mlflow_run_opened_closes_it_failed_and_leaves_no_folder(fast_cfg, tmp_path,
                                                                                      monkeypatch):
    from dflash.training import pipeline

    def broken_start(self):
        raise RuntimeError("producer failed to start")
    monkeypatch.setattr(pipeline.ProducerPool, "start", broken_start)
    with pytest.raises(RuntimeError, match="producer failed to start"):
        train(fast_cfg())
    runs = _store_runs(tmp_path / "mlflow.db")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not (tmp_path / "run").exists()
