"""Fault injection, fifth round (issue 74's rows, one test or more per row): a DFlash 1 vs DFlash 2 compare that
ends with its Δτ, DFlash 2 keys checked against the target's shapes up front, `eval --out` and SIGTERM / Ctrl-C
during an eval, a tracking server whose /health answers while its API hangs, an MLflow store on a full disk, bad
input that leaves nothing behind, a Ctrl-C while a command imports and a cut sweep trial, and the README's promises
(the drafter in a run's name, a `tracking.tracking_uri=` override honoured by eval, `.venv/` ignored)."""
from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from dflash.config import ConfigError, validate
from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.serving.export import save_drafter
from dflash.target.model import TargetConfig, read_target_info, resolve_layer_ids, resolve_mask_token
from tests.conftest import FAST
from tests.test_faults_round3 import _FULL_AT_CHECKPOINTS

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _compose(tmp, *overrides, run="r"):
    from experiments.config import compose_config
    return compose_config(FAST + [f"run_dir={tmp / run}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                  *overrides])


def _serving_folder(folder: Path, seed: int = 0, **drafter) -> Path:
    """A random drafter for the library's default tiny target, saved as a serving folder."""
    tcfg = TargetConfig()
    info = read_target_info(tcfg)
    torch.manual_seed(seed)
    d = build_drafter(DrafterConfig(block_size=4, **drafter), info.hidden_size, info.num_layers,
                      resolve_mask_token(tcfg), resolve_layer_ids(tcfg, info), info.vocab_size)
    save_drafter(d, folder, vocab_size=info.vocab_size)
    return folder


def _suite(tmp: Path) -> Path:
    suite = tmp / "suite.json"
    suite.write_text(json.dumps([{"name": f"t{i}", "prompt": f"def f{i}(x):\n"} for i in range(3)]))
    return suite


def _eval_args(tmp: Path) -> list[str]:
    return ["+target=tiny_random", "target.device=cpu", "eval.extra_suites=[]", f"eval.suite={_suite(tmp)}",
            "eval.max_new_tokens=6", "eval.tree_budgets=[2]", "eval.bootstrap=200", f"eval.cache_dir={tmp / 'gt'}"]


DFLASH2 = {"architecture": "dflash2", "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4,
           "layer_types": ["sliding_attention"] * 2, "num_layers": 2, "sliding_window": 16, "sliding_causal": False}


# ------------------------------------------------------------------ row 1: DFlash 1 vs DFlash 2
def test_dflash1_vs_dflash2_compare_ends_with_the_paired_delta_on_what_both_have(tmp_path):
    from experiments import eval as eval_cli
    a = _serving_folder(tmp_path / "d1")
    b = _serving_folder(tmp_path / "d2", seed=1, **DFLASH2)
    m = eval_cli.main([str(a), str(b), *_eval_args(tmp_path), "tracking.enabled=false", f"--out={tmp_path / 'o'}"])
    lo, d, hi = (m[f"eval/t0/compare/delta_tau_vanilla{s}"] for s in ("_ci_low", "", "_ci_high"))
    assert lo <= d <= hi
    assert "eval/t0/tree_nodes_2" in m  # A (DFlash 1) ran its tree; B (DFlash 2) has none to pair with
    assert not any("compare/delta_tau_tree" in k for k in m)
    text = (tmp_path / "o" / "report" / "compare.md").read_text()
    assert "DDTree is DFlash 1 only" in text


# ------------------------------------------------------------------ row 2: DFlash 2 keys against the target
def test_dflash2_keys_are_checked_against_the_targets_shapes(tmp_path):
    hidden = read_target_info(_compose(tmp_path).target).hidden_size  # 64
    d2 = ["+drafter=dflash2", "drafter.num_layers=2"]  # FAST has one layer, dflash2.yaml names two
    with pytest.raises(ConfigError, match=rf"drafter\.conv_group_size=7 must divide .* hidden size {hidden}"):
        validate(_compose(tmp_path, *d2, "drafter.conv_group_size=7"))
    with pytest.raises(ConfigError, match=r"drafter\.conv_kernel_size=9 must be <= drafter\.block_size=8"):
        validate(_compose(tmp_path, *d2, "drafter.conv_kernel_size=9", "drafter.block_size=8"))
    with pytest.raises(ConfigError, match=r"drafter\.selector_top_k=100000 must be <= the target's vocabulary"):
        validate(_compose(tmp_path, *d2, "drafter.selector_top_k=100000"))
    validate(_compose(tmp_path, "drafter.conv_group_size=7"))  # DFlash 1 never reads it


def test_a_dflash2_key_the_target_cannot_take_exits_2_in_seconds_leaving_nothing(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "experiments.run", "+drafter=dflash2", "drafter.conv_group_size=7"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "error: drafter.conv_group_size=7" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no mlflow.db, no lock, no runs/
    assert time.monotonic() - t0 < 60  # the imports; no target is loaded


# ------------------------------------------------------------------ row 3: eval --out that cannot be made
def test_eval_out_that_cannot_be_made_is_named_before_the_target_loads(tmp_path, monkeypatch):
    from experiments import eval as eval_cli
    a = _serving_folder(tmp_path / "d1")
    monkeypatch.setattr(eval_cli, "Target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ConfigError, match=r"^--out=/proc/x/y: the output folder cannot be made"):
        eval_cli.main([str(a), *_eval_args(tmp_path), f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
                       "--out=/proc/x/y"])
    assert not (tmp_path / "m.db").exists()


# ------------------------------------------------------------------ row 4: a signal during an eval
_SIGNAL_MID_EVAL = textwrap.dedent("""
    import os, signal, sys
    from experiments import eval as eval_cli
    real, sig = eval_cli.evaluate_suites, getattr(signal, sys.argv[1])
    def evaluate_suites(*a, **k):  # the signal lands while the drafter is evaluated
        os.kill(os.getpid(), sig)
        return real(*a, **k)
    eval_cli.evaluate_suites = evaluate_suites
    from experiments.config import run_cli
    sys.argv = ["experiments.eval", *sys.argv[2:]]
    run_cli(eval_cli.main)
""")


@pytest.mark.slow  # an interpreter that imports torch and MLflow: 20-40 s on 2 loaded cores
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_eval_is_one_line_and_closes_its_run_killed(tmp_path, sig):
    from mlflow.tracking import MlflowClient
    a = _serving_folder(tmp_path / "d1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = subprocess.run([sys.executable, "-c", _SIGNAL_MID_EVAL, sig, str(a), *_eval_args(tmp_path),
                          f"tracking.tracking_uri={uri}", f"--out={tmp_path / 'o'}"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert out.returncode == 128 + getattr(signal, sig) and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"stopped by {sig} during experiments.eval" in out.stderr
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.data.tags.get("dflash.kind"), r.info.status) for r in runs] == [("eval", "KILLED")]


# ------------------------------------------------------------------ row 5: /health answers, the API hangs
class _HalfAlive(http.server.BaseHTTPRequestHandler):
    release = threading.Event()

    def do_GET(self):  # noqa: N802
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"OK")
            return
        self.release.wait(60)  # the tracking API hangs (its database or workers stuck)

    do_POST = do_GET  # noqa: N815

    def log_message(self, *a):
        pass


@pytest.fixture
def half_alive():
    _HalfAlive.release = threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HalfAlive)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    _HalfAlive.release.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def library_bounds(monkeypatch):
    from dflash.tracking.transport import HTTP_DEFAULTS
    for k in HTTP_DEFAULTS:
        monkeypatch.delenv(k, raising=False)  # the library's own bounds, not the test suite's


def test_a_half_alive_server_is_found_by_the_preflight_within_seconds(half_alive, library_bounds):
    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    from dflash.tracking.transport import http_preflight
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"sends no response to its tracking API while GET /health answers"):
        http_preflight(half_alive)
    assert time.monotonic() - t0 < 8
    import mlflow.tracking  # noqa: F401  (its import is no part of the bound)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="MLflow tracking disabled"):  # training: disabled in seconds
        ml = MLflowLogger(TrackingConfig(tracking_uri=half_alive, system_metrics=False))
    assert not ml.healthy and time.monotonic() - t0 < 8


def test_promote_against_a_half_alive_server_is_one_line_within_seconds(half_alive):
    env = {k: v for k, v in ENV.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "experiments.promote", "0" * 32, "--dry-run", "--tracking-uri",
                          half_alive], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "does not answer" in err[0] and "tracking API" in err[0]
    assert took < 40, took  # a 5 s bound per probe, the rest the interpreter's imports on loaded cores


def test_champion_on_a_half_alive_server_is_an_outage_not_bad_input(half_alive, library_bounds, tmp_path,
                                                                    monkeypatch):
    from experiments import eval as eval_cli
    a = _serving_folder(tmp_path / "d1")
    monkeypatch.setattr(eval_cli, "Target", lambda *a, **k: pytest.fail("the target loaded first"))
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="tracking API") as e:
        eval_cli.main([str(a), "champion", *_eval_args(tmp_path), f"tracking.tracking_uri={half_alive}"])
    assert not isinstance(e.value, ConfigError) and time.monotonic() - t0 < 15


def test_a_registry_that_fails_is_not_called_a_missing_champion():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, RESOURCE_DOES_NOT_EXIST

    from experiments.eval import _not_found
    assert _not_found(MlflowException("no such alias", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not _not_found(MlflowException("API request failed: read timed out", error_code=INTERNAL_ERROR))
    assert not _not_found(TimeoutError("read timed out"))


# ------------------------------------------------------------------ row 6: the MLflow store on a full disk
def test_a_store_disabled_by_a_failed_write_still_closes_its_run(tmp_path):
    """A full disk fails MLflow's inserts (tracking is disabled with one warning); when the run ends (FAILED by the
    checkpoint's full disk, whose temp file is gone by then) the close is tried once more, so the run does not stay
    RUNNING until a resume takes it over."""
    from mlflow.tracking import MlflowClient

    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ml = MLflowLogger(TrackingConfig(tracking_uri=uri, console=False, system_metrics=False))
    real = ml.client.log_batch

    def full(*a, **k):
        from mlflow.exceptions import MlflowException
        raise MlflowException("(sqlite3.OperationalError) database or disk is full\n[SQL: INSERT INTO metrics "
                              "(key, value) VALUES (?, ?)]\n[parameters: [('train/loss', 1.0)]]")
    ml.client.log_batch = full
    with pytest.warns(RuntimeWarning) as seen:
        ml.log({"train/loss": 1.0}, 1)
    assert not ml.healthy
    msg = str(seen[0].message)
    assert "database or disk is full" in msg and "[SQL:" not in msg and "\n" not in msg
    ml.client.log_batch = real
    ml.close("FAILED")
    assert MlflowClient(uri).get_run(ml.run_id).info.status == "FAILED"


_FULL_STORE = textwrap.dedent("""
    import sqlite3, threading
    import mlflow.tracking
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    FULL = threading.Event()
    @event.listens_for(Engine, "before_cursor_execute")
    def full(conn, cursor, statement, params, context, executemany):  # the store's disk fills: inserts fail
        if FULL.is_set() and statement.lstrip().upper().startswith("INSERT"):
            raise sqlite3.OperationalError("database or disk is full")
    real_batch = mlflow.tracking.MlflowClient.log_batch
    def log_batch(self, run_id, metrics=(), *a, **k):
        if any(m.key == "train/loss" and m.step >= 2 for m in metrics):
            FULL.set()
        return real_batch(self, run_id, metrics, *a, **k)
    mlflow.tracking.MlflowClient.log_batch = log_batch
""") + _FULL_AT_CHECKPOINTS  # ... and then the run's first checkpoint


@pytest.mark.slow  # a 3-step training run in a fresh interpreter: about a minute on 2 loaded cores
def test_a_full_disk_under_the_store_is_one_warning_one_error_and_a_failed_run(tmp_path):
    from mlflow.tracking import MlflowClient
    run_dir = tmp_path / "full"
    out = subprocess.run([sys.executable, "-c", _FULL_STORE, *FAST, f"run_dir={run_dir}",
                          f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "[SQL:" not in out.stderr, out.stderr[-3000:]
    assert [ln for ln in out.stderr.splitlines() if "ERROR" in ln] == []
    assert len([ln for ln in out.stderr.splitlines() if "MLflow tracking disabled" in ln]) == 1
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "the disk is full: checkpoint step 3" in errors[0]
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    assert MlflowClient(info["tracking_uri"]).get_run(info["run_id"]).info.status == "FAILED"


# ------------------------------------------------------------------ row 7: bad input leaves nothing behind
def test_a_run_dir_that_cannot_be_made_leaves_no_store(tmp_path):
    from dflash.app.run import TrainingRun
    with pytest.raises(ConfigError, match=r"run_dir=/proc/x/y: the run folder cannot be made"):
        TrainingRun(_compose(tmp_path, "run_dir=/proc/x/y"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no mlflow.db, no mlflow.db.lock


BAD_CHATS = {
    "not_json": ('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n', "line 2"),
    "not_an_object": ('[1, 2]\n', "line 1"),
    "empty": ("\n\n", "the file is empty"),
    "no_conversation_field": ('{"text": "hi"}\n', "no field fits a conversation format"),
    "unknown_role": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}\n',
                     "line 1: .*role 'robot'"),
    "content_not_text": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}\n'
                         '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
                         "line 1"),
}


@pytest.mark.parametrize("kind", sorted(BAD_CHATS))
def test_malformed_chat_records_are_named_before_the_target_loads_and_nothing_is_written(tmp_path, monkeypatch,
                                                                                          kind):
    from dflash.app import run as app_run
    text, where = BAD_CHATS[kind]
    data = tmp_path / "data"
    data.mkdir()
    (data / "bad.jsonl").write_text(text)
    monkeypatch.chdir(tmp_path)  # the datasets cache (data.conversations.cache_dir) is relative: .cache/ here
    monkeypatch.setattr(app_run, "Target", lambda *a, **k: pytest.fail("the target loaded first"))
    from experiments.config import compose_config
    cfg = compose_config(["+target=tiny_random_chat", "+data=conversations", f"data.path={data / 'bad.jsonl'}",
                          "+eval=off", "trainer.max_steps=1", f"run_dir={tmp_path / 'r'}",
                          f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    with pytest.raises(ConfigError, match=rf"bad\.jsonl: (.*)?{where}"):
        app_run.TrainingRun(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no store, no runs/, no .cache/


# ------------------------------------------------------------------ row 8: Ctrl-C while importing, a cut trial
def test_ctrl_c_while_a_command_imports_is_one_line():
    # numpy first: torch's C extension imports numpy itself and swallows any exception raised meanwhile (it warns
    # "Failed to initialize NumPy" and goes on), a KeyboardInterrupt included, so a Ctrl-C that lands in that window
    # is lost to every hook (a run where the timer hit it slept its 30 s and exited 0)
    code = ("import experiments, numpy, os, signal, threading, time; "
            "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start(); "
            "import dflash.app.run; time.sleep(30)")  # Ctrl-C lands in torch's import (or, were it faster, the sleep)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGINT  # ended by SIGINT, as Python ends on Ctrl-C (130 in a shell)
    assert out.stderr.strip() == "stopped by SIGINT while starting (nothing was done)"


def test_a_trial_cut_by_a_signal_closes_killed_with_no_traceback(tmp_path, monkeypatch, capfd):
    from mlflow.tracking import MlflowClient

    import dflash.app.run
    from dflash.training.interrupts import RunInterrupted
    from sweeps import launch
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def cut(cfg, evaluator=None, *, run_id=None):  # what the trainer does on SIGTERM: run KILLED, then raise
        MlflowClient(uri).set_terminated(run_id, "KILLED")
        raise RunInterrupted(signal.SIGTERM, step=2, checkpoint="step_00000002.pt")
    monkeypatch.setattr(dflash.app.run, "train", cut)
    # Optuna's own handler keeps the stream it was made with (an earlier test's capture, in a whole-suite run): read
    # its trial log through a handler of this test's
    import io
    import logging
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("optuna").addHandler(handler)
    try:
        with pytest.raises(RunInterrupted):
            launch.main(["cpu_smoke", "n_trials=1", "workers=1", f"out={tmp_path / 'out'}",
                         f"tracking.tracking_uri={uri}"])
    finally:
        logging.getLogger("optuna").removeHandler(handler)
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [(r.info.status, r.data.tags.get("optuna.state")) for r in children] == [("KILLED", "FAIL")]
    err = capfd.readouterr().err + seen.getvalue()
    assert "RunInterrupted" in err and "Traceback" not in err, err[-3000:]


# ------------------------------------------------------------------ row 9: what the README says
def test_a_dflash2_run_has_the_drafter_in_its_name(tmp_path):
    from dflash.app.run import run_label
    assert run_label(_compose(tmp_path)) == "hard_ce-none-r10_20-s0"
    assert run_label(_compose(tmp_path, "+drafter=dflash2", "drafter.num_layers=2")) == "hard_ce-none-r10_20-dflash2-s0"


def test_eval_honours_a_tracking_uri_override_over_the_runs_own_store(tmp_path):
    import yaml
    from mlflow.tracking import MlflowClient

    from dflash.config import to_dict
    from experiments import eval as eval_cli
    run = tmp_path / "run"
    cfg = _compose(tmp_path, run="run")
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    info = read_target_info(cfg.target)
    d = build_drafter(cfg.drafter, info.hidden_size, info.num_layers, resolve_mask_token(cfg.target),
                      resolve_layer_ids(cfg.target, info), info.vocab_size)
    save_drafter(d, run / "final")
    own = tmp_path / "own.db"  # the store the run trained in (never made here)
    (run / "mlflow_run.json").write_text(json.dumps({"run_id": "0" * 32, "tracking_uri": f"sqlite:///{own}",
                                                     "experiment": "dflash"}))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    eval_cli.main([str(run), f"eval.suite={_suite(tmp_path)}", "eval.max_new_tokens=4", "eval.tree_budgets=[]",
                   f"eval.cache_dir={tmp_path / 'gt'}", f"tracking.tracking_uri={other}", f"--out={tmp_path / 'o'}"])
    assert not own.exists()
    client = MlflowClient(other)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.data.tags.get("dflash.kind") for r in runs] == ["eval"]


def test_a_venv_in_the_clone_is_ignored_by_git():
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()
