"""benchmarks/leased_gpu/wheel_folders.py: the GPU machine's wheels spread over the folders a device call carries."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "leased_gpu" / "wheel_folders.py"


@pytest.fixture(scope="module")
def wf():
    spec = importlib.util.spec_from_file_location("wheel_folders", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _best_max(sizes: dict[str, int], n: int) -> int:
    """The smallest possible heaviest group, by trying every assignment (the plain reference)."""
    names = list(sizes)
    best = sum(sizes.values())
    for assign in product(range(n), repeat=len(names)):
        totals = [0] * n
        for name, g in zip(names, assign):
            totals[g] += sizes[name]
        best = min(best, max(totals))
    return best


def test_balance_keeps_every_wheel_once_and_near_the_best_split(wf):
    # the 2026-12-03 wheel sizes, rounded to kB, and a few small ones
    sizes = {"cryptography": 4753, "sqlalchemy": 4748, "mlflow_skinny": 4111, "pydantic_core": 2265,
             "databricks_sdk": 1250, "fla_core": 1085, "pydantic": 495, "optuna": 443, "fla": 404}
    groups = wf.balance(sizes, 3)
    assert sorted(n for g in groups for n in g) == sorted(sizes)
    heaviest = max(sum(sizes[n] for n in g) for g in groups)
    assert heaviest <= 4 / 3 * _best_max(sizes, 3)  # largest-first greedy's bound (Graham)
    assert heaviest < sum(sizes.values()) / 2  # what two folders cannot do
    assert wf.balance(dict(reversed(sizes.items())), 3) == groups  # the same set gives the same folders


def test_wheels_of_one_top_level_folder_stay_together(wf):
    """`pip install --target --upgrade` replaces a top-level folder already there: a three-folder
    machine lost opentelemetry-sdk to a later call's opentelemetry-api, and mlflow did not import."""
    tops = {"otel_api.whl": {"opentelemetry"}, "otel_sdk.whl": {"opentelemetry"}, "otel_proto.whl": {"opentelemetry"},
            "fla_core.whl": {"fla"}, "fla.whl": {"fla"}, "omegaconf.whl": {"omegaconf", "pydevd_plugins"},
            "plugin.whl": {"pydevd_plugins"}, "mlflow.whl": {"mlflow"}, "a.whl": {"a"}, "b.whl": {"b"}}
    assert wf.install_groups(tops) == [["a.whl"], ["b.whl"], ["fla.whl", "fla_core.whl"], ["mlflow.whl"],
                                       ["omegaconf.whl", "plugin.whl"], ["otel_api.whl", "otel_proto.whl", "otel_sdk.whl"]]
    sizes = {w: 100 for w in tops}
    folders = wf.spread(sizes, tops, 3)
    assert sorted(w for f in folders for w in f) == sorted(tops)
    for group in wf.install_groups(tops):
        assert sum(set(group) <= set(f) for f in folders) == 1


def test_the_script_spreads_a_folder_and_reports_the_room(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text("/.whl*/\n")
    (repo / "tracked.bin").write_bytes(b"x" * 1000)
    src = tmp_path / "wheels"
    src.mkdir()
    for i, size in enumerate([500, 400, 300, 200, 100]):
        with zipfile.ZipFile(src / f"pkg{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"pkg{i}/__init__.py", "w" * size)
            z.writestr(f"pkg{i}-1.0.dist-info/METADATA", "")
    (repo / ".whl5").mkdir()  # a folder of an earlier, larger split
    out = subprocess.run([sys.executable, str(SCRIPT), str(src), "--repo", str(repo), "--folders", "3"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    folders = [repo / d for d in (".whl", ".whl2", ".whl3")]
    assert sorted(f.name for d in folders for f in d.glob("*.whl")) == sorted(f.name for f in src.glob("*.whl"))
    assert not (repo / ".whl5").exists()  # gone: a call carrying it would install wheels twice
    assert "working tree 0.00 MB" in out.stdout  # 1 kB tracked, the ignored folders not counted
    assert out.stdout.count("left beside the tree") == 3
    # by default the fewest folders that fit: here one holds everything
    out = subprocess.run([sys.executable, str(SCRIPT), str(src), "--repo", str(repo)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.count("left beside the tree") == 1, out.stdout + out.stderr
    assert [d.name for d in sorted(repo.glob(".whl*"))] == [".whl"]


def test_fewest_folders_that_leave_the_room(wf):
    """Three folders of 7.5 MB left 1.7 MB beside an 11.7 MB store; the default is the fewest folders
    whose heaviest fits the room, install groups whole."""
    sizes = {"a.whl": 500, "b.whl": 400, "c.whl": 300, "d.whl": 200, "e.whl": 100}
    tops = {w: {w[0]} for w in sizes}
    assert len(wf.fewest_folders(sizes, tops, 1500)) == 1
    assert len(wf.fewest_folders(sizes, tops, 800)) == 2  # largest first: 500+200+100 / 400+300
    assert len(wf.fewest_folders(sizes, tops, 799)) == 3
    folders = wf.fewest_folders(sizes, tops, 500)
    assert len(folders) == 3 and max(sum(sizes[w] for w in f) for f in folders) <= 500
    with pytest.raises(ValueError, match=r"a.whl.*do not fit"):
        wf.fewest_folders(sizes, tops, 450)
    assert wf.folder_names(4) == [".whl", ".whl2", ".whl3", ".whl4"]


def test_the_script_names_a_bad_source(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nowhere"), "--repo", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "source: expected a folder of .whl files" in out.stderr
