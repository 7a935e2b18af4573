"""Fault injection, third round (beside tests/test_faults.py): one safe loader for every file read, a fresh
sqlite store under a lock, eval's fallback past a damaged latest checkpoint, loss edge values checked where the
loss reads them, a tracking server that accepts and never answers, promote's exit codes, a full disk at the
first checkpoint, and `data.max_len` named when it is too short."""
from __future__ import annotations

import ast
import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dflash.config import ConfigError, validate
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent


def _compose(tmp, run, *overrides):
    from experiments.config import compose_config
    return compose_config(FAST + [f"run_dir={tmp / run}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                  *overrides])


# ------------------------------------------------------------------ one loader for every file read
LOADER = "dflash/safe_load.py"
SCANNED = ("dflash", "experiments", "sweeps", "benchmarks")
PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def unsafe_loads(source: str, rel: str) -> list[str]:
    """Every place in `source` that could unpickle code: any pickle-family import, `torch.load` outside the
    loader (and there, only with weights_only=True), `numpy.load(allow_pickle=True)`, `read_pickle`, and any
    `weights_only=False` (e.g. handed to transformers' `from_pretrained`, which otherwise loads safely)."""
    tree = ast.parse(source)
    torch_names, numpy_names, found = {"torch"}, {"numpy"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLERS:
                    found.append(f"{rel}:{node.lineno}: import {a.name}")
                if a.name in ("torch", "torch.serialization"):
                    torch_names.add(a.asname or a.name)
                if a.name == "numpy":
                    numpy_names.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLERS:
                found.append(f"{rel}:{node.lineno}: from {node.module} import ...")
            if node.module in ("torch", "torch.serialization") and any(a.name == "load" for a in node.names):
                found.append(f"{rel}:{node.lineno}: from {node.module} import load")
            if node.module == "torch" and any(a.name == "serialization" for a in node.names):
                torch_names.add("serialization")
    safe = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and rel == LOADER and any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in n.keywords)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "load":
            base = _dotted(node.value)
            if (base in torch_names or base.split(".")[0] in torch_names) and id(node) not in safe:
                found.append(f"{rel}:{node.lineno}: {base}.load")
        if isinstance(node, ast.keyword) and node.arg == "weights_only" and not (
                isinstance(node.value, ast.Constant) and node.value.value is True):
            found.append(f"{rel}:{node.value.lineno}: weights_only={ast.unparse(node.value)}")
        if isinstance(node, ast.Attribute) and node.attr == "read_pickle":
            found.append(f"{rel}:{node.lineno}: {_dotted(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and _dotted(node.func.value) in numpy_names and any(
                    k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in node.keywords):
            found.append(f"{rel}:{node.lineno}: numpy.load(allow_pickle=...)")
    return found


@pytest.mark.parametrize("src", [
    "import torch\nx = torch.load(p)", "import torch\nx = torch.load(p, weights_only=False)",
    "import torch as T\nT.load(p, weights_only=True)", "from torch import load", "import pickle",
    "from pickle import loads", "import numpy as np\nnp.load(p, allow_pickle=True)", "import dill",
    "import torch\nf = torch.serialization.load", "import pandas as pd\npd.read_pickle(p)",
    "M.from_pretrained(p, weights_only=False)",
])
def test_the_source_walk_catches_every_way_to_unpickle(src):
    assert unsafe_loads(src, "dflash/x.py")
    if "weights_only=True" in src:
        assert unsafe_loads(src.replace("T.", "torch.").replace("as T", ""), LOADER) == []


def test_every_file_read_goes_through_the_one_safe_loader():
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50 and any(str(p).endswith(LOADER) for p in files)
    found = [hit for p in files for hit in unsafe_loads(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "load these through dflash.safe_load:\n" + "\n".join(found)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def test_a_crafted_pretraining_state_is_refused_naming_the_file(tmp_path):
    from experiments import pretrain_target
    marker = tmp_path / "PWNED"
    state = tmp_path / "st" / "pretrain_state.pt"
    state.parent.mkdir()
    torch.save({"signature": {}, "x": _Payload(marker)}, state)
    with pytest.raises(ConfigError, match=r"pretrain_state\.pt: refused.*would run code"):
        pretrain_target.main([f"state_dir={state.parent}", f"run_dir={tmp_path / 'pr'}", f"out_dir={tmp_path / 'o'}",
                              "tracking.enabled=false", "max_steps=1", "results_path="])
    assert not marker.exists()


def test_a_crafted_cache_is_rebuilt_not_run(tmp_path):
    from dflash.atomic import load_checked, save_checked
    from dflash.safe_load import UnsafeFileError
    marker = tmp_path / "PWNED"
    save_checked(tmp_path / "c.bin", b"DFTEST\n", 1, "k", {"x": _Payload(marker)})
    with pytest.raises(UnsafeFileError, match=r"c\.bin: refused"):
        load_checked(tmp_path / "c.bin", b"DFTEST\n", 1, "k")
    assert not marker.exists()


# ------------------------------------------------------------- a fresh sqlite store, four processes at once
_TRACK_ONE = textwrap.dedent("""
    import sys, warnings
    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ml = MLflowLogger(TrackingConfig(tracking_uri=sys.argv[1], run_name=sys.argv[2], console=False,
                                         system_metrics=False))
        ml.log({"train/loss": 1.0}, 1)
        ml.close("FINISHED")
    print("HEALTHY" if ml.healthy else "DISABLED", ml.run_id, [str(w.message)[:300] for w in seen])
""")


@pytest.mark.slow  # 4 interpreters importing mlflow at once: about a minute on 2 cores
def test_four_processes_on_a_fresh_sqlite_store_all_track(tmp_path):
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _TRACK_ONE, uri, f"p{i}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(4)]
    outs = [p.communicate(timeout=170)[0] for p in procs]
    assert all("HEALTHY" in o for o in outs), "\n".join(outs)
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("dflash").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["p0", "p1", "p2", "p3"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["train/loss"] == 1.0 for r in runs)


# ----------------------------------------------------- a tracking server that accepts and never answers
def test_a_server_that_never_answers_is_disabled_within_seconds(monkeypatch):
    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    from dflash.tracking.transport import HTTP_DEFAULTS
    for k in HTTP_DEFAULTS:
        monkeypatch.delenv(k, raising=False)  # the library's own bounds, not the test suite's
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
    port = mute.getsockname()[1]
    try:
        t0 = time.perf_counter()
        with pytest.warns(RuntimeWarning, match=rf"127\.0\.0\.1:{port} accepts connections but sends no response"):
            ml = MLflowLogger(TrackingConfig(tracking_uri=f"http://127.0.0.1:{port}", system_metrics=False))
        assert time.perf_counter() - t0 < 8 and not ml.healthy  # 5 s bound, the rest import
    finally:
        mute.close()


def test_a_server_that_answers_passes_the_check():
    import http.server
    import threading

    from dflash.tracking.transport import http_preflight
    srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501: an answer

    def two_requests():  # GET /health, then the tracking API's probe
        srv.handle_request()
        srv.handle_request()
    threading.Thread(target=two_requests, daemon=True).start()
    try:
        http_preflight(f"http://127.0.0.1:{srv.server_address[1]}", total=5)
    finally:
        srv.server_close()


# ------------------------------------------------------- eval falls back past a torn or refused latest checkpoint
@pytest.mark.parametrize("damage", ["torn", "refused"])
def test_eval_of_a_run_without_final_uses_the_newest_intact_checkpoint(tmp_path, reference_target, damage):
    import yaml

    from dflash.config import RunConfig, to_dict
    from dflash.drafter.model import DrafterConfig, build_drafter
    from dflash.target.model import TargetConfig, read_target_info, resolve_layer_ids, resolve_mask_token
    from dflash.tracking.loggers import TrackingConfig
    from dflash.training.checkpoint import save_checkpoint
    from experiments import eval as eval_cli
    run_dir = tmp_path / "crashed"
    cfg = RunConfig(run_dir=str(run_dir), target=TargetConfig(device="cpu"), drafter=DrafterConfig(block_size=3),
                    tracking=TrackingConfig(enabled=False, console=False))
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    info = read_target_info(cfg.target)
    d = build_drafter(cfg.drafter, info.hidden_size, info.num_layers, resolve_mask_token(cfg.target),
                      resolve_layer_ids(cfg.target, info))
    for step in (3, 7):
        save_checkpoint(run_dir / "checkpoints", step, {"step": step, "drafter": d.state_dict(), "config": to_dict(cfg),
                                                        "target_fingerprint": reference_target.fingerprint})
    latest = run_dir / "checkpoints" / "step_00000007.pt"
    marker = tmp_path / "PWNED"
    if damage == "torn":
        latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    else:
        torch.save({"step": 7, "drafter": _Payload(marker)}, latest)
        (latest.parent / (latest.name + ".sha256")).unlink()
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps([{"name": "sq", "prompt": "def sq(x):\n"}]))
    with pytest.warns(RuntimeWarning, match=r"step_00000003\.pt instead.*step_00000007\.pt"):
        metrics = eval_cli.main([str(run_dir), f"eval.suite={suite}", "eval.max_new_tokens=4", "eval.tree_budgets=[2]",
                                 f"eval.cache_dir={tmp_path / 'gt'}", f"--out={tmp_path / 'out'}"])
    assert "eval/tau_served" in metrics and not marker.exists()
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


# --------------------------------------------------------- every loss with its edge values, checked where read
def _edges(b) -> tuple[list[float], list[float]]:
    """(values just outside `b`, values on or just inside its ends)."""
    bad = [b.low - 1.0] + ([b.low] if b.low_open else [b.low - 0.01]) + ([b.high + 0.01] if b.high < 1e9 else [])
    good = [b.low + 1e-3 if b.low_open else b.low] + ([b.high] if b.high < 1e9 else [1e3])
    return bad, good


def _loss_on_random_blocks(loss_cfg) -> torch.Tensor:
    from types import SimpleNamespace

    from dflash.training.losses import build_loss
    g = torch.Generator().manual_seed(0)
    V, H, k = 16, 8, 3
    batch = SimpleNamespace(labels_BNK=torch.randint(0, V, (1, 2, 4), generator=g),
                            soft_vals_BNKk=torch.randn(1, 2, 4, k, generator=g),
                            soft_idx_BNKk=torch.randint(0, V, (1, 2, 4, k), generator=g))
    hidden = torch.randn(1, 2, 4, H, generator=g, requires_grad=True)
    loss, _ = build_loss(loss_cfg)(hidden, torch.randn(V, H, generator=g), batch)
    loss.backward()
    assert torch.isfinite(hidden.grad).all()
    return loss


@pytest.mark.parametrize("option", sorted(p.stem for p in (ROOT / "conf" / "loss").glob("*.yaml")))
def test_every_loss_option_rejects_its_edge_values_before_work(tmp_path, option):
    from dflash.training.losses import BOUNDS, LOSSES
    reads = [k for k in LOSSES[option].config_keys if k in BOUNDS]
    assert reads, option  # every loss reads some bounded number (gamma or dpace_a at least)
    for key in reads:
        bad, good = _edges(BOUNDS[key])
        for value in bad:
            with pytest.raises(ConfigError, match=rf"loss\.{key}={value}"):
                validate(_compose(tmp_path, "r", f"+loss={option}", f"loss.{key}={value}"))
        for value in good:
            cfg = _compose(tmp_path, "r", f"+loss={option}", f"loss.{key}={value}")
            validate(cfg)
            assert torch.isfinite(_loss_on_random_blocks(cfg.loss)), (option, key, value)
    # the selector's weight is read beside every block loss (a DFlash 2 drafter composes with any): checked for all
    with pytest.raises(ConfigError, match=r"loss\.selector_alpha=-5"):
        validate(_compose(tmp_path, "r", f"+loss={option}", "loss.selector_alpha=-5"))
    for key in sorted(set(BOUNDS) - set(reads) - {"selector_alpha"}):  # a key this loss does not read: no error
        validate(_compose(tmp_path, "r", f"+loss={option}", f"loss.{key}=-5"))


def test_a_negative_temperature_on_the_cli_exits_2_before_any_work(tmp_path):
    run_dir = tmp_path / "neg"
    out = subprocess.run([sys.executable, "-m", "experiments.run", *FAST, "+loss=soft_kl", "loss.temperature=-1",
                          f"run_dir={run_dir}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "loss.temperature=-1" in out.stderr and "Traceback" not in out.stderr
    assert not run_dir.exists()


def test_the_soft_stats_refuse_a_temperature_they_would_divide_by():
    from dflash.training.position_stats import compute_position_stats
    with pytest.raises(ValueError, match=r"loss\.temperature must be > 0"):
        compute_position_stats(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long),
                               soft_vals_NKk=torch.randn(2, 3, 2), soft_idx_NKk=torch.zeros(2, 3, 2, dtype=torch.long),
                               temperature=0.0, need_soft=True)


# --------------------------------------------------------------------------- a max_len too short for a block
@pytest.mark.parametrize("max_len", [3, 7])
def test_a_max_len_too_short_names_data_max_len(tmp_path, max_len):
    with pytest.raises(ConfigError, match=rf"^data\.max_len={max_len} is shorter than drafter\.block_size=8") as e:
        validate(_compose(tmp_path, "r", f"data.max_len={max_len}", "data.min_len=2"))
    assert "num_anchors" not in str(e.value)


# ------------------------------------------------------------------------------- promote's exit codes
def _finished_or_failed_run(tmp_path, status: str, tau: float | None) -> tuple[str, Path]:
    from dflash.tracking.loggers import MLflowLogger, TrackingConfig
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ml = MLflowLogger(TrackingConfig(tracking_uri=uri, console=False, system_metrics=False))
    if tau is not None:
        ml.log({"eval/tau_vanilla": tau}, 1)
    ml.close(status)
    run_dir = tmp_path / f"run-{status}"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 0\n")
    (run_dir / "mlflow_run.json").write_text(json.dumps({"tracking_uri": uri, "run_id": ml.run_id}))
    return uri, run_dir


def test_promote_exits_3_when_it_refuses(tmp_path):
    _, run_dir = _finished_or_failed_run(tmp_path, "FAILED", 1.0)
    for extra in ([], ["--dry-run"]):
        out = subprocess.run([sys.executable, "-m", "experiments.promote", str(run_dir), *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 3, out.stdout + out.stderr
        assert "REFUSED" in out.stdout or "would refuse" in out.stdout
        assert "only FINISHED runs" in out.stdout


def test_promote_exit_codes_of_each_outcome():
    from dflash.serving.promotion import Decision
    from experiments.promote import exit_code
    assert exit_code(Decision(True, "beats the holder")) == 0
    assert exit_code(Decision(False, "run already holds @champion (v1)", holds_alias=True)) == 0
    assert exit_code(Decision(False, "below the floor")) == 3


# ------------------------------------------------------------------------ a full disk at the first checkpoint
_FULL_AT_CHECKPOINTS = textwrap.dedent("""
    import errno, sys, torch
    real = torch.save
    def save(obj, f, *a, **k):  # the run's filesystem fills up when the first checkpoint is written
        if isinstance(f, str) and "/checkpoints/" in f:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)
    torch.save = save
    from experiments.config import run_cli
    from experiments.run import main
    sys.argv = ["experiments.run", *sys.argv[1:]]
    run_cli(main)
""")


def test_a_full_disk_at_the_first_checkpoint_is_one_line_and_exit_1(tmp_path):
    from mlflow.tracking import MlflowClient
    run_dir = tmp_path / "full"
    out = subprocess.run([sys.executable, "-c", _FULL_AT_CHECKPOINTS, *FAST, f"run_dir={run_dir}",
                          f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and "the disk is full: checkpoint step 3" in errors[0], out.stderr[-3000:]
    assert "no checkpoint has been written yet" in errors[0] and "intact" not in errors[0]
    assert list((run_dir / "checkpoints").iterdir()) == []  # no temp file, no pointer, no digest
    info = json.loads((run_dir / "mlflow_run.json").read_text())
    assert MlflowClient(info["tracking_uri"]).get_run(info["run_id"]).info.status == "FAILED"


def test_a_full_disk_at_a_later_checkpoint_names_the_intact_one(tmp_path, monkeypatch):
    from dflash.atomic import DiskFullError
    from dflash.training import checkpoint as ck
    ck.save_checkpoint(tmp_path, 1, {"step": 1, "w": torch.ones(2)})
    real = ck.atomic_write_text

    def pointer_fails(path, text):  # the step file and its digest fit, the pointer does not
        if path.name == ck.POINTER:
            raise DiskFullError(errno.ENOSPC, "the disk is full writing latest.json", str(path))
        real(path, text)
    monkeypatch.setattr(ck, "atomic_write_text", pointer_fails)
    with pytest.raises(DiskFullError, match=r"checkpoint step 2 .*the newest checkpoint step_00000001\.pt is intact"):
        ck.save_checkpoint(tmp_path, 2, {"step": 2, "w": torch.zeros(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "step_00000001.pt", "step_00000001.pt.sha256"]
