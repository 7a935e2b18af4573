"""The layering contract (pyproject.toml `[tool.importlinter]`): every import in dflash points down its layers.
`lint-imports` fails on a back-arrow or a cycle between packages; the second test shows that it does."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: `pip install -e '.[dev]'` installs import-linter")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_imports_keep_the_layers():
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "KEPT" in out.stdout and "BROKEN" not in out.stdout


def test_a_back_arrow_breaks_the_contract(tmp_path):
    """A copy of the package where the target imports the trainer (the back-arrow the LM-head chunk rule was)."""
    shutil.copytree(ROOT / "dflash", tmp_path / "dflash", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lm_head = tmp_path / "dflash" / "target" / "lm_head.py"
    lm_head.write_text(lm_head.read_text() + "\nfrom dflash.training import trainer  # noqa: E402\n")
    out = _lint_imports(tmp_path)
    assert out.returncode != 0 and "BROKEN" in out.stdout
    assert "dflash.target.lm_head -> dflash.training.trainer" in out.stdout, out.stdout[-3000:]
