"""Fault injection (issue 15), one test per probe: crafted / torn / garbled checkpoints, signals, kill -9 then
resume, a dead or slow tracking server, bad numbers, a dead drafter, disk full, --help, file modes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dflash.config import ConfigError, validate
from dflash.app.run import train
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent


def _steps(run_dir, key="train/loss"):
    return [r["step"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if key in r]


def _compose(tmp, run, *overrides):
    from experiments.config import compose_config
    return compose_config(FAST + [f"run_dir={tmp / run}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                  *overrides])


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One finished 6-step run (checkpoints at 3 and 6), written under umask 027."""
    import dflash.atomic as atomic
    tmp = tmp_path_factory.mktemp("faults")
    old = os.umask(0o027)
    atomic._UMASK = None
    try:
        res = train(_compose(tmp, "base"))
    finally:
        os.umask(old)
        atomic._UMASK = None
    return tmp, res


def _copy(base_run, tmp_path, name="copy") -> Path:
    """A copy of the base run that resumes into a new MLflow run (its own mlflow_run.json removed)."""
    tmp, res = base_run
    dst = tmp_path / name
    shutil.copytree(res.run_dir, dst)
    (dst / "mlflow_run.json").unlink()
    cfg = (dst / "config.yaml").read_text().replace(str(res.run_dir), str(dst))
    (dst / "config.yaml").write_text(cfg.replace(str(tmp / "mlflow.db"), str(tmp_path / "mlflow.db")))
    return dst


def _resume(run_dir, **kw):
    from experiments.config import resume_config
    return train(resume_config(str(run_dir), [f"{k}={v}" for k, v in kw.items()]))


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _sha_sidecar(pt: Path) -> None:
    (pt.parent / (pt.name + ".sha256")).write_text(f"{hashlib.sha256(pt.read_bytes()).hexdigest()}  {pt.name}\n")


# ------------------------------------------------------------------------------ crafted pickle
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def test_crafted_pickle_never_runs_for_resume_eval_or_export(base_run, tmp_path):
    run = _copy(base_run, tmp_path)
    marker = tmp_path / "PWNED"
    evil = run / "checkpoints" / "step_00000006.pt"
    torch.save({"step": 6, "drafter": _Payload(marker), "optimizer": {}, "scheduler": {}, "ranks": [],
                "config": {}}, evil)
    _sha_sidecar(evil)  # a matching digest does not make it trusted: only plain data loads
    from dflash.app.export import export_drafter
    from experiments import eval as eval_cli
    with pytest.raises(ValueError, match="refused.*Unsupported global"):
        export_drafter(evil, tmp_path / "served")
    with pytest.raises(ConfigError, match="refused"):
        eval_cli.resolve_source(evil, [])
    assert not marker.exists()
    with pytest.warns(RuntimeWarning, match=r"step_00000003\.pt instead.*step_00000006\.pt: refused"):
        res = _resume(run, **{"trainer.max_steps": 7})
    assert not marker.exists()
    assert _steps(res.run_dir)[-1] == 7  # resumed from step 3; steps 4-6 were logged already


# ------------------------------------------------------------------ torn / garbled checkpoints
def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble(p: Path):
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 64] = bytes(64)
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["truncate", "garble", "truncate_no_digest", "torn_pointer"])
def test_damaged_latest_falls_back_to_the_newest_intact_one(base_run, tmp_path, damage):
    run = _copy(base_run, tmp_path)
    latest = run / "checkpoints" / "step_00000006.pt"
    if damage == "torn_pointer":
        (run / "checkpoints" / "latest.json").write_text('{"step": 6, "fi')
        latest.unlink()  # and the file it named is gone too
        match = r"latest\.json is unreadable"
    else:
        (_truncate if damage.startswith("truncate") else _garble)(latest)
        if damage == "truncate_no_digest":  # a checkpoint from before digests: torch's own reader must catch it
            (run / "checkpoints" / "step_00000006.pt.sha256").unlink()
        match = r"step_00000006\.pt: (sha256|unreadable)"
    with pytest.warns(RuntimeWarning, match=r"step_00000003\.pt instead.*") as rec:
        res = _resume(run)
    assert any(__import__("re").search(match, str(w.message)) for w in rec), [str(w.message) for w in rec]
    assert sorted(set(_steps(res.run_dir))) == [1, 2, 3, 4, 5, 6]


def test_no_intact_checkpoint_is_a_clear_error_and_changes_nothing(base_run, tmp_path):
    run = _copy(base_run, tmp_path)
    for p in (run / "checkpoints").glob("step_*.pt"):
        _garble(p)
    (run / "checkpoints" / ".step_00000009.pt.tmp123").write_bytes(b"torn temp file")
    before = _snapshot(run)
    with pytest.raises(ConfigError, match=r"no intact checkpoint.*step_00000006.*step_00000003"):
        _resume(run)
    assert _snapshot(run) == before  # config.yaml, metrics.jsonl, even the torn temp file: untouched


# -------------------------------------------------------------------------------------- signals
def _start_run(tmp_path, *extra):
    run_dir = tmp_path / "sig"
    args = [sys.executable, "-m", "experiments.run", *FAST, f"run_dir={run_dir}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, run_dir


def _wait_for(pred, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out")


def _logged(run_dir):
    f = run_dir / "metrics.jsonl"
    return _steps(run_dir) if f.is_file() else []


def _assert_killed_with_checkpoint(run_dir):
    last = _logged(run_dir)[-1]
    saved = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert saved >= last and saved < 5000  # the step it stopped after, not lost
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    run = MlflowClient(info["tracking_uri"]).get_run(info["run_id"])
    assert run.info.status == "KILLED"
    assert "dflash.heartbeat" in run.data.tags


def test_sigterm_checkpoints_closes_the_run_killed_and_exits_nonzero(tmp_path):
    """What `timeout` and schedulers send, through the real CLI."""
    sig = signal.SIGTERM
    proc, run_dir = _start_run(tmp_path, "trainer.max_steps=5000", "trainer.checkpoint_every=100000")
    _wait_for(lambda: len(_logged(run_dir)) >= 3, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert signal.Signals(sig).name in err
    _assert_killed_with_checkpoint(run_dir)


def test_ctrl_c_checkpoints_and_closes_the_run_killed(tmp_path):
    """SIGINT in this process (the handler runs on the main thread, inside the step loop: steps are logged)."""
    import threading

    from dflash.training.interrupts import RunInterrupted
    run_dir = tmp_path / "int"

    def interrupt_after_three_steps():
        deadline = time.time() + 120
        while time.time() < deadline and len(_logged(run_dir) if run_dir.exists() else []) < 3:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt_after_three_steps, daemon=True).start()
    with pytest.raises(RunInterrupted) as e:
        train(_compose(tmp_path, "int", "trainer.max_steps=5000", "trainer.checkpoint_every=100000"))
    assert e.value.exit_code == 130 and e.value.checkpoint is not None
    _assert_killed_with_checkpoint(run_dir)


def test_kill9_then_resume_logs_each_step_once_and_takes_the_run_over(tmp_path):
    proc, run_dir = _start_run(tmp_path, "trainer.max_steps=60", "trainer.checkpoint_every=5")

    def past_a_checkpoint():
        f = run_dir / "checkpoints" / "latest.json"
        try:
            saved = json.loads(f.read_text())["step"]
        except (OSError, ValueError):
            return False
        steps = _logged(run_dir)
        return bool(steps) and steps[-1] > saved + 1
    _wait_for(past_a_checkpoint, proc)
    proc.kill()
    proc.wait()
    killed_at = _logged(run_dir)[-1]
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    assert client.get_run(info["run_id"]).info.status == "RUNNING"
    with pytest.warns(RuntimeWarning, match="still RUNNING.*taken over"):
        res = _resume(run_dir)
    assert res.run_id == info["run_id"]
    steps = _steps(run_dir)
    assert steps == list(range(1, 61)), f"killed at {killed_at}"
    hist = [m.step for m in client.get_metric_history(res.run_id, "train/loss")]
    assert len(hist) == len(set(hist)) and set(range(killed_at + 1, 61)) <= set(hist)
    run = client.get_run(res.run_id)
    assert run.info.status == "FINISHED" and "dflash.taken_over" in run.data.tags


# --------------------------------------------------------------------------------- tracking
def test_dead_http_store_warns_within_seconds(tmp_path, monkeypatch):
    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    from dflash.tracking.transport import HTTP_DEFAULTS
    for k in HTTP_DEFAULTS:
        monkeypatch.delenv(k, raising=False)  # the library's own bounds, not the test suite's
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="127.0.0.1:9"):
        ml = MLflowLogger(TrackingConfig(tracking_uri="http://127.0.0.1:9"))
    assert time.perf_counter() - t0 < 5 and not ml.healthy


def test_slow_store_costs_the_step_loop_nothing(base_run, tmp_path):
    from dflash.tracking.background import in_background
    from dflash.tracking.loggers import TrackingConfig, build_loggers
    store = f"sqlite:///{base_run[0] / 'mlflow.db'}"  # an existing store: no table creation to wait for
    loggers = in_background(build_loggers(TrackingConfig(tracking_uri=store, console=False), tmp_path / "r",
                                          {}, {}, 5))
    ml = loggers.mlflow
    real = ml.client.log_batch

    def slow(*a, **k):
        time.sleep(0.5)
        return real(*a, **k)
    ml.client.log_batch = slow
    t0 = time.perf_counter()
    for step in range(1, 6):
        loggers.log({"train/loss": 1.0 / step}, step)
    assert time.perf_counter() - t0 < 0.3  # 5 calls of 0.5 s each went to the worker
    loggers.close("FINISHED")
    client = MlflowClient(store)
    assert [m.step for m in client.get_metric_history(ml.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert client.get_run(ml.run_id).info.status == "FINISHED"


# ----------------------------------------------------------------------------------- config
@pytest.mark.parametrize("override, key", [
    ("trainer.lr=nan", "trainer.lr"), ("trainer.lr=inf", "trainer.lr"), ("loss.temperature=-inf", "loss.temperature"),
    ("trainer.grad_clip=-1", "trainer.grad_clip"), ("trainer.warmup_steps=-5", "trainer.warmup_steps"),
    ("trainer.min_lr_ratio=5", "trainer.min_lr_ratio"), ("trainer.eval_every=-1", "trainer.eval_every"),
    ("trainer.num_anchors=100000", "trainer.num_anchors"),
])
def test_bad_numbers_are_rejected_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(_compose(tmp_path, "r", override))


def test_nan_lr_on_the_cli_exits_2_and_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "nan"
    out = subprocess.run([sys.executable, "-m", "experiments.run", *FAST, "trainer.lr=nan", f"run_dir={run_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "trainer.lr" in out.stderr and "Traceback" not in out.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("module, argv", [
    ("experiments.run", ["--help"]), ("experiments.eval", ["--help"]), ("experiments.bench", ["--help"]),
    ("experiments.pretrain_target", ["--help"]), ("sweeps.launch", ["--help"]),
    ("experiments.export", ["--help"]), ("experiments.promote", ["--help"]), ("experiments.size", ["--help"]),
])
def test_help_on_every_entry_point(module, argv, capsys):
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    if module in ("experiments.run", "experiments.eval", "experiments.bench", "sweeps.launch"):
        assert "loss: " in out and "hard_ce*" in out and "buffer: " in out  # the groups and their options
    if module in ("experiments.run", "experiments.eval", "experiments.bench", "experiments.size"):
        assert "trainer.lr=" in out  # and the keys
    assert "usage" in out.lower() or "keys" in out.lower()


def test_a_reader_that_goes_away_is_no_error_of_the_cli():
    """`python -m experiments.X --help | head`: the pipe's reader exits, the CLI's next write raises
    BrokenPipeError, a ConnectionError, which run_cli once reported as "the tracking store does not answer"."""
    script = ("from experiments.config import run_cli\n"
              "def main():\n"
              "    for i in range(100000):\n"
              "        print('line', i)\n"
              "run_cli(main)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline() == b"line 0\n"
    proc.stdout.close()  # the reader goes away with the writer blocked on a full pipe (100,000 lines > 64 KiB)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


# ------------------------------------------------------------------------------- dead drafter
def test_dead_drafter_warns_and_ends_failed(tmp_path):
    from dflash.training.health import DeadDrafterError
    cfg = _compose(tmp_path, "dead", "trainer.lr=1e6", "trainer.max_steps=20", "trainer.warmup_steps=0")
    with pytest.warns(RuntimeWarning, match=r"dead drafter.*ln V"), pytest.raises(DeadDrafterError):
        train(cfg)
    info = json.loads((tmp_path / "dead" / "mlflow_run.json").read_text())
    assert MlflowClient(info["tracking_uri"]).get_run(info["run_id"]).info.status == "FAILED"
    assert max(_steps(tmp_path / "dead")) < 20


def test_a_live_drafter_is_not_dead():
    from dflash.training.health import is_dead
    assert is_dead(5.5607, 0.0, 260) and not is_dead(5.5607, 0.9, 260) and not is_dead(3.0, 0.0, 260)


# --------------------------------------------------------------------------------- disk full
def test_disk_full_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    import dflash.atomic as atomic
    from dflash.training.checkpoint import load_checkpoint, save_checkpoint
    ck = tmp_path / "checkpoints"
    save_checkpoint(ck, 1, {"step": 1, "w": torch.ones(3)})

    def torch_writer_fails(*a, **k):  # what torch.save says when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 33677312 vs 33677200")
    monkeypatch.setattr(torch, "save", torch_writer_fails)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(OSError, match="the disk is full") as e:
        save_checkpoint(ck, 2, {"step": 2, "w": torch.zeros(3)})
    assert e.value.errno == errno.ENOSPC

    def enospc(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.undo()
    with pytest.raises(OSError, match="the disk is full"):
        atomic.atomic_write(ck / "x.bin", enospc)
    assert torch.equal(load_checkpoint(ck / "step_00000001.pt")["w"], torch.ones(3))
    assert sorted(p.name for p in ck.iterdir()) == ["latest.json", "step_00000001.pt", "step_00000001.pt.sha256"]


# -------------------------------------------------------------------------------- file modes
def test_run_artifacts_follow_the_umask(base_run):
    tmp, res = base_run
    files = [res.run_dir / "config.yaml", res.run_dir / "checkpoints" / "step_00000006.pt",
             res.run_dir / "final" / "model.safetensors", res.run_dir / "final" / "config.json"]
    art_root = tmp / "mlartifacts"
    files += [p for p in art_root.rglob("*") if p.is_file()]
    assert len(files) > 4
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f  # 0666 & ~027: group-readable, like open() gives
    assert stat.S_IMODE((res.run_dir / "final").stat().st_mode) & 0o050 == 0o050
