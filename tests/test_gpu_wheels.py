"""benchmarks/leased_gpu/wheels.sh, the wheel folders a GPU call carries installed into SITE: one install at a time,
and a folder whose wheels are all installed already is not installed again (a second job on a warm machine once
re-installed a folder under the first job's import: pip's --target --upgrade replaces the package folders). Real pip
on tiny wheels built by the test, no network."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

WHEELS_SH = Path(__file__).resolve().parents[1] / "benchmarks" / "leased_gpu" / "wheels.sh"


def _wheel(folder: Path, name: str) -> Path:
    """A pure-Python wheel of one package `name` (version 0.1), as pip reads one."""
    files = {f"{name}/__init__.py": f"NAME = {name!r}\n",
             f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{name}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in files.items()]
    files[f"{name}-0.1.dist-info/RECORD"] = "\n".join(record + [f"{name}-0.1.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
    return path


def _source(cwd: Path, site: Path) -> str:
    """PYTHONPATH after sourcing wheels.sh in `cwd` (where the call's wheel folders lie)."""
    out = subprocess.run(["bash", "-c", f'source "{WHEELS_SH}" && echo "$PYTHONPATH"'], cwd=cwd, check=True,
                         capture_output=True, text=True, env={**os.environ, "SITE": str(site)})
    return out.stdout.strip()


def test_a_folder_installed_once_is_not_installed_again_until_it_changes(tmp_path):
    call, site = tmp_path / "call", tmp_path / "site"
    _wheel(call / ".whl", "tinya")
    assert _source(call, site) == f"{site}:{call}"
    assert (site / "tinya" / "__init__.py").is_file()
    assert (site / ".installed").read_text().split() == ["tinya-0.1-py3-none-any.whl"]
    sentinel = site / "tinya" / "in_use"  # a file pip's --upgrade would remove with the folder
    sentinel.write_text("x")
    _source(call, site)  # the same folder again (a second job on the warm machine): nothing reinstalled
    assert sentinel.is_file()
    _wheel(call / ".whl", "tinyb")  # the folder changed: installed whole, as wheel_folders.py groups it
    _source(call, site)
    assert not sentinel.exists() and (site / "tinyb" / "__init__.py").is_file()
    assert sorted((site / ".installed").read_text().split()) == ["tinya-0.1-py3-none-any.whl"] * 2 + [
        "tinyb-0.1-py3-none-any.whl"]


def test_two_jobs_at_once_take_turns(tmp_path):
    """Two shells sourcing it together (the oracle job beside a campaign): both end with the package importable."""
    call, site = tmp_path / "call", tmp_path / "site"
    _wheel(call / ".whl", "tinyc")
    env = {**os.environ, "SITE": str(site)}
    script = f'source "{WHEELS_SH}" && python3 -c "import tinyc; print(tinyc.NAME)"'
    jobs = [subprocess.Popen(["bash", "-c", script], cwd=call, env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    assert [j.communicate(timeout=120)[0].strip() for j in jobs] == ["tinyc", "tinyc"]
    assert all(j.returncode == 0 for j in jobs)
    assert (site / ".installed").read_text().split() == ["tinyc-0.1-py3-none-any.whl"]


def test_a_half_written_folder_is_not_installed(tmp_path):
    call, site = tmp_path / "call", tmp_path / "site"
    _wheel(call / ".whl2.new", "tinyd")  # wheel_folders.py's folder before its rename
    assert _source(call, site) == str(call)  # no site made: nothing installed
    assert not site.exists()
