"""The one override parser (dflash/overrides.py) and every entry point's bad override: an unknown key, a value of
the wrong type and a malformed token each exit 2 with `error: …` naming the key, before any work starts."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from dflash.config import ConfigError, RunConfig, to_dict
from dflash.overrides import OverrideError, apply_overrides, parse_value
from experiments.config import run_cli

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- the parser
@dataclass
class _Inner:
    n: int = 1
    names: list[str] = field(default_factory=list)


@dataclass
class _Outer:
    x: float = 0.5
    flag: bool = False
    label: str = "a"
    ids: list[int] = field(default_factory=lambda: [1])
    probes: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    inner: _Inner = field(default_factory=_Inner)


def test_values_parse_as_the_declared_type_and_the_input_is_not_changed():
    base = _Outer()
    out = apply_overrides(base, ["x=1e-3", "flag=yes", "label='b c'", "ids=[2,3]", "probes={p: 'a/*.py'}",
                                 "timeout=null", "inner.n=7", "inner.names=u,v"])
    assert (out.x, out.flag, out.label, out.ids, out.probes) == (1e-3, True, "b c", [2, 3], {"p": "a/*.py"})
    assert out.timeout is None and (out.inner.n, out.inner.names) == (7, ["u", "v"])
    assert base == _Outer(), "overrides return a new config"
    assert apply_overrides(base, ["timeout=30"]).timeout == 30.0
    assert parse_value("0", bool) is False and parse_value("[]", list[int]) == []


@pytest.mark.parametrize("token,match", [
    ("inner.m=1", r"override 'inner.m=1': unknown key 'm' in inner \(known: n, names\)"),
    ("nope=1", r"unknown key 'nope' in the config \(known: flag, ids, inner"),
    ("inner.n=1.5", r"override 'inner.n=1.5': expected int, got '1.5'"),
    ("flag=maybe", r"expected bool \(true/false\), got 'maybe'"),
    ("ids=[1,x]", r"'ids=\[1,x\]': expected int, got 'x'"),
    ("probes=[1]", r"expected a mapping"),
    ("inner=3", r"'inner' is a config section; set its keys \(inner.<key>=value\)"),
    ("x.y=3", r"'x' is a value, not a config section"),
    ("inner.n", r"override 'inner.n': expected key=value"),
    ("=3", r"override '=3': expected key=value"),
])
def test_errors_quote_the_token_and_name_the_key(token, match):
    with pytest.raises(OverrideError, match=match):
        apply_overrides(_Outer(), [token])
    assert issubclass(OverrideError, ConfigError)


def test_prefix_is_stripped_and_named():
    from dflash.bench.config import BenchConfig
    assert apply_overrides(BenchConfig(), ["bench.seq_len=64"], prefix="bench.").seq_len == 64
    with pytest.raises(OverrideError, match="unknown key 'sq_len' in bench"):
        apply_overrides(BenchConfig(), ["bench.sq_len=64"], prefix="bench.")


# ------------------------------------------------------------------------------- every entry point
def _exits_2_naming(main, argv, key, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "error:" in err and key in err, err


def _serving_folder(tmp_path: Path) -> Path:
    d = tmp_path / "served"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    return d


def _run_folder(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    (d / "final").mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(to_dict(RunConfig())))
    (d / "final" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    return d


BAD_RUN = [("trainer.max_stpes=3", "max_stpes"), ("trainer.max_steps=many", "trainer.max_steps"),
           ("trainer.max_steps", "trainer.max_steps")]


@pytest.mark.parametrize("token,key", BAD_RUN)
def test_run(token, key, tmp_path, capsys):
    from experiments.run import main
    _exits_2_naming(main, [token, f"run_dir={tmp_path / 'never'}"], key, capsys)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("token,key", BAD_RUN)
def test_run_resume(token, key, tmp_path, capsys):
    from experiments.run import main
    _exits_2_naming(main, [f"resume={_run_folder(tmp_path)}", token], key, capsys)


@pytest.mark.parametrize("token,key", BAD_RUN)
def test_eval(token, key, tmp_path, capsys):
    from experiments.eval import main
    _exits_2_naming(main, [str(_serving_folder(tmp_path)), token], key, capsys)  # composed from conf/
    _exits_2_naming(main, [str(_run_folder(tmp_path)), token], key, capsys)  # a run's saved config


@pytest.mark.parametrize("token,key", [*BAD_RUN, ("bench.seq_lne=64", "seq_lne"), ("bench.seq_len=long", "bench.seq_len"),
                                       ("bench.seq_len", "bench.seq_len")])
def test_bench(token, key, capsys):
    from experiments.bench import main
    _exits_2_naming(main, [token, "results="], key, capsys)


@pytest.mark.parametrize("token,key", [*BAD_RUN, ("regen.bathces=2", "bathces"), ("regen.batches=two", "regen.batches"),
                                       ("regen.batches", "regen.batches")])
def test_regen(token, key, capsys):
    from experiments.regen import main
    _exits_2_naming(main, [token], key, capsys)


@pytest.mark.parametrize("token,key", [("batch_sise=4", "batch_sise"), ("batch_size=1.5", "batch_size"),
                                       ("batch_size", "batch_size"), ("corpus.scpoe=x", "scpoe")])
def test_pretrain_target(token, key, capsys):
    from experiments.pretrain_target import main
    _exits_2_naming(main, [token], key, capsys)


@pytest.mark.parametrize("argv,key", [(["--margni", "0.1"], "--margni"), (["--margin", "abc"], "margin"),
                                      (["--margin"], "--margin")])
def test_promote(argv, key, tmp_path, capsys):
    from experiments.promote import main
    _exits_2_naming(main, [str(tmp_path), *argv], key, capsys)


@pytest.mark.parametrize("argv,key", [(["--dtpye", "bfloat16"], "--dtpye"), (["--dtype", "float8"], "--dtype"),
                                      (["--out"], "--out")])
def test_export(argv, key, tmp_path, capsys):
    from experiments.export import main
    _exits_2_naming(main, [str(tmp_path), *([] if argv == ["--out"] else ["--out", str(tmp_path / "x")]), *argv],
                    key, capsys)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("token,key", [*BAD_RUN, ("n_trials=many", "n_trials"), ("n_trials", "n_trials")])
def test_sweeps_launch(token, key, tmp_path, capsys):
    from sweeps.launch import main
    _exits_2_naming(main, ["cpu_smoke", "--check", token, f"out={tmp_path}"], key, capsys)


@pytest.mark.parametrize("token,key", [*BAD_RUN, ("deadline_s=soon", "deadline_s")])
def test_sweeps_campaign(token, key, tmp_path, capsys):
    from sweeps.campaign import main
    _exits_2_naming(main, ["cpu_smoke", "--check", token, f"out={tmp_path}"], key, capsys)


@pytest.mark.parametrize("argv", [["experiments.pretrain_target", "batch_size=1.5"],
                                  ["sweeps.launch", "cpu_smoke", "--check", "n_trials=many"]])
def test_the_process_exits_2(argv):
    p = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: ") and argv[-1].split("=")[0] in p.stderr


def test_the_parser_keeps_the_library_free_of_hydra():
    code = ("import sys, dflash.overrides, dflash.config, dflash.bench.config; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf'}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout
