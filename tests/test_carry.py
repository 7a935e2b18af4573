"""benchmarks/leased_gpu/carry.py: a run folder carried in checked parts resumes exactly where it stopped."""
import importlib.util
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.conftest import interrupted_copy

ROOT = Path(__file__).resolve().parent.parent


def _carry():
    spec = importlib.util.spec_from_file_location("carry", ROOT / "benchmarks" / "leased_gpu" / "carry.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


carry = _carry()


def _losses(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _stage(packed: Path, tmp: Path) -> Path:
    """What the later calls do: one folder per call, each copied into one staging folder."""
    staged = tmp / "staged"
    staged.mkdir()
    for folder in carry.folders(packed, tmp / ".carry"):
        for f in folder.iterdir():
            shutil.copyfile(f, staged / f.name)
    return staged


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    from experiments.config import compose_config

    from dflash.app.run import train
    from tests.conftest import FAST
    tmp = tmp_path_factory.mktemp("carry")
    cfg = compose_config(FAST + [f"run_dir={tmp / 'full'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                 "+buffer=deterministic", "buffer.max_depth=4", "buffer.min_ready=4",
                                 "+noise=uniform", "+loss=streak"])
    return train(cfg).run_dir, tmp


def test_pack_keeps_only_the_newest_checkpoint_and_extra_files(full_run, tmp_path):
    run_dir, tmp = full_run
    assert len(list((run_dir / "checkpoints").glob("step_*.pt"))) == 2  # steps 3 and 6 (keep 2)
    m = carry.pack(tmp_path / "out", [run_dir, tmp / "mlflow.db"], part_mib=0.5)
    assert len(m["parts"]) > 1 and m["paths"] == ["full", "mlflow.db"]
    data = b"".join((tmp_path / "out" / p["name"]).read_bytes() for p in m["parts"])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = set(tar.getnames())
    assert "full/checkpoints/step_00000006.pt" in names and "full/checkpoints/step_00000006.pt.sha256" in names
    assert "full/checkpoints/step_00000003.pt" not in names
    assert {"full/config.yaml", "full/metrics.jsonl", "full/checkpoints/latest.json", "mlflow.db"} <= names
    assert not any(n.startswith("full/final/") for n in names)  # written again at the resumed job's end


def test_a_carried_run_resumes_exactly(full_run, tmp_path):
    """The run folder as it stood after its step-3 checkpoint, packed, gone with its machine, carried back in parts
    to the same path: steps 4-6 give the uninterrupted run's losses."""
    from experiments.config import compose_config

    from dflash.app.run import train
    from tests.conftest import FAST
    run_dir, tmp = full_run
    ref = _losses(run_dir)
    part = interrupted_copy(run_dir, 3, tmp_path / "work" / "part")
    carry.pack(tmp_path / "out", [part], part_mib=0.25)
    shutil.rmtree(part)  # the machine went back
    restored = carry.unpack(_stage(tmp_path / "out", tmp_path), tmp_path / "work")
    assert restored == [part]
    res = train(compose_config(FAST + [f"resume={part}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}"]))
    got = _losses(res.run_dir)
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), (s, got, ref)


def _packed_file(tmp_path) -> Path:
    src = tmp_path / "blob.bin"
    src.write_bytes(bytes(range(256)) * 1000)
    carry.pack(tmp_path / "out", [src], part_mib=0.1)
    src.unlink()
    return tmp_path / "out"


def test_missing_or_damaged_parts_are_named_and_nothing_is_extracted(tmp_path):
    out = _packed_file(tmp_path)
    staged = _stage(out, tmp_path)
    dest = tmp_path / "dest"
    (staged / "carry.part02").unlink()
    with pytest.raises(carry.CarryError, match=r"missing carry\.part02 of 3 parts"):
        carry.unpack(staged, dest)
    shutil.copyfile(out / "carry.part02", staged / "carry.part02")
    damaged = bytearray((staged / "carry.part01").read_bytes())
    damaged[10] ^= 1
    (staged / "carry.part01").write_bytes(bytes(damaged))
    with pytest.raises(carry.CarryError, match=r"carry\.part01: damaged"):
        carry.unpack(staged, dest)
    assert not dest.exists()
    shutil.copyfile(out / "carry.part01", staged / "carry.part01")
    assert carry.unpack(staged, dest) == [dest / "blob.bin"]
    assert (dest / "blob.bin").read_bytes() == bytes(range(256)) * 1000


def test_an_existing_path_is_replaced_only_when_asked(tmp_path):
    staged = _stage(_packed_file(tmp_path), tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "blob.bin").write_bytes(b"newer work")
    with pytest.raises(carry.CarryError, match="already there"):
        carry.unpack(staged, dest)
    assert (dest / "blob.bin").read_bytes() == b"newer work"
    carry.unpack(staged, dest, replace=True)
    assert (dest / "blob.bin").read_bytes() == bytes(range(256)) * 1000
    assert [p.name for p in dest.iterdir()] == ["blob.bin"]  # no staging folder left behind


def test_too_many_parts_fail_before_writing_and_the_cli_exits_2(tmp_path, capsys):
    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * 100_000)
    with pytest.raises(carry.CarryError, match="more than the 8 files"):
        carry.pack(tmp_path / "out", [src], part_mib=0.01)
    assert not (tmp_path / "out").exists()
    assert carry.main(["unpack", str(tmp_path / "nowhere"), str(tmp_path / "d")]) == 2
    assert "no manifest" in capsys.readouterr().err
    assert carry.main(["pack", str(tmp_path / "o"), str(tmp_path / "absent")]) == 2
    assert "absent: no such file" in capsys.readouterr().err
