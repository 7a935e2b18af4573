"""Shipped targets' packed weights (dflash/target/assets.py): `builtin:NAME` unpacks `model.safetensors.xz` once into
the user's cache, checked against its recorded sha256, whole or not at all; the unpacked target is the same target
(fingerprint, logits) as the raw file it was packed from."""
from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dflash.target import assets
from dflash.target.assets import AssetError, pack, shipped_folder, unpack

ROOT = Path(__file__).resolve().parents[1]

# Computed on the tree before the shipped weights were packed, from the raw dflash/assets/<name>/model.safetensors
# (`target_fingerprint(TargetConfig(path="builtin:<name>"))`): the committed MLflow stores and the model registry key
# drafters on these, so packing must leave them as they were.
REFERENCE_FINGERPRINT = "bead276919cb7b82"
MATH_FINGERPRINT = "89b6451897a8f853"
# The raw reference target's float32 CPU logits for PROBE before packing: greedy ids, and position 1's first four.
PROBE = [[1, 5, 17, 99, 400, 1000, 1500, 300, 7, 8, 9, 10]]
REFERENCE_ARGMAX = [0, 201, 201, 55, 531, 85, 343, 674, 85, 62, 201, 7]
REFERENCE_LOGITS_1 = [-1.31397, -10.60286, -10.9061, 3.03781]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache ($DFLASH_CACHE), and no folder remembered from an earlier resolve."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(assets, "_RESOLVED", {})
    return tmp_path / "cache"


def _tiny_asset(assets_dir: Path, name: str = "tiny") -> tuple[Path, bytes]:
    """A packed asset folder of a few bf16 tensors with a config and tokenizer beside them; the raw weights' bytes."""
    from safetensors.torch import save_file
    folder = assets_dir / name
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    save_file({"w": torch.randn(64, 48).to(torch.bfloat16), "b": torch.randn(48).to(torch.bfloat16)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (folder / "tokenizer.json").write_text("{}")
    raw = (folder / "model.safetensors").read_bytes()
    pack(folder)
    return folder, raw


@pytest.fixture
def tiny(tmp_path, monkeypatch, cache) -> tuple[Path, bytes]:
    """`builtin:tiny`: a tiny packed asset in a stand-in dflash/assets."""
    monkeypatch.setattr(assets, "ASSETS", tmp_path / "assets")
    return _tiny_asset(tmp_path / "assets")


def _left_in(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "assets").iterdir()) if (cache / "assets").is_dir() else []


def test_pack_writes_the_shipped_form(tiny):
    folder, raw = tiny
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors.sha256",
                                                       "model.safetensors.xz", "tokenizer.json"]
    digest = hashlib.sha256(raw).hexdigest()
    assert (folder / "model.safetensors.sha256").read_text() == f"{digest}  model.safetensors\n"  # sha256sum's format
    assert lzma.decompress((folder / "model.safetensors.xz").read_bytes()) == raw


def test_builtin_unpacks_once_into_the_cache(tiny, cache):
    folder, raw = tiny
    out = shipped_folder("tiny")
    assert out.parent == cache / "assets" and out.name.startswith("tiny-") and len(out.name) == len("tiny-") + 16
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_bytes() == raw
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    before = {p.name: p.stat().st_mtime_ns for p in [out, *out.iterdir()]}
    assets._RESOLVED.clear()  # a new process: found on disk, not rewritten
    assert shipped_folder("tiny") == out
    assert {p.name: p.stat().st_mtime_ns for p in [out, *out.iterdir()]} == before
    assert _left_in(cache) == [out.name]  # no temp folder left beside it


def test_an_edited_file_beside_the_weights_unpacks_afresh(tiny, cache):
    folder, _ = tiny
    first = shipped_folder("tiny")
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny", "edited": True}))
    second = shipped_folder("tiny")
    assert second != first and json.loads((second / "config.json").read_text())["edited"] is True


def test_raw_weights_in_the_asset_folder_are_used_as_they_are(tiny, cache, caplog):
    folder, raw = tiny
    (folder / "model.safetensors").write_bytes(raw)
    assert shipped_folder("tiny") == folder and _left_in(cache) == []
    assets._RESOLVED.clear()
    (folder / "model.safetensors").write_bytes(raw[:-2] + b"  ")  # a fresh output, not yet packed: used, and said
    with caplog.at_level(logging.WARNING, logger="dflash.target.assets"):
        assert shipped_folder("tiny") == folder
    assert "differs from the shipped model.safetensors.xz" in caplog.text


@pytest.mark.parametrize("damage", ["flipped", "truncated", "record"])
def test_damaged_weights_fail_naming_the_file_and_leave_no_folder(tiny, cache, damage):
    folder, _ = tiny
    xz, record = folder / "model.safetensors.xz", folder / "model.safetensors.sha256"
    data = bytearray(xz.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
        xz.write_bytes(bytes(data))
    elif damage == "truncated":
        xz.write_bytes(bytes(data[:len(data) // 2]))
    else:
        record.write_text("0" * 64 + "  model.safetensors\n")
    match = r"model\.safetensors\.sha256 records" if damage == "record" else r"damaged xz data|sha256"
    with pytest.raises(AssetError, match=rf"{folder / 'model.safetensors.xz'}: .*({match})"):
        shipped_folder("tiny")
    assert _left_in(cache) == []


def test_a_missing_record_is_refused_naming_it(tiny, cache):
    folder, _ = tiny
    (folder / "model.safetensors.sha256").unlink()
    with pytest.raises(AssetError, match=r"model\.safetensors\.xz: no readable digest record model\.safetensors"):
        shipped_folder("tiny")
    assert _left_in(cache) == []


def test_a_process_that_loses_the_race_uses_the_winners_folder(tiny, cache, monkeypatch):
    """Two processes unpack at once: the other one renames its folder into place between our unpack and rename."""
    folder, raw = tiny
    publish = assets._publish

    def other_process_first(tmp: Path, final: Path) -> None:
        shutil.copytree(tmp, final)
        (final / "winner").write_text("")
        publish(tmp, final)

    monkeypatch.setattr(assets, "_publish", other_process_first)
    out = unpack(folder, cache / "assets")
    assert (out / "winner").is_file() and (out / "model.safetensors").read_bytes() == raw
    assert _left_in(cache) == [out.name]


def test_stale_temp_folders_of_a_killed_unpack_are_cleared(tiny, cache):
    folder, _ = tiny
    name = f"tiny-{assets.shipped_digest(folder)[:16]}"
    stale, live = cache / "assets" / f".{name}.tmp-dead", cache / "assets" / f".{name}.tmp-live"
    stale.mkdir(parents=True)
    live.mkdir()
    os.utime(stale, (0, 0))
    shipped_folder("tiny")
    assert not stale.exists() and live.exists()


def test_the_cache_follows_os_environ_when_it_is_replaced(tiny, tmp_path, monkeypatch):
    """`datasets`' multi-process map replaces `os.environ` with a copy: the cache is where the current one says."""
    import copy
    monkeypatch.setattr(os, "environ", copy.deepcopy(os.environ))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "other"))
    assert shipped_folder("tiny").parent == tmp_path / "other" / "assets"


def test_the_pack_command(tmp_path, capsys):
    from dflash.target.assets import main
    folder = tmp_path / "written"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    assert main(["pack", str(folder)]) == 0
    assert "model.safetensors.xz: 4,096 ->" in capsys.readouterr().out
    assert not (folder / "model.safetensors").exists() and (folder / "model.safetensors.sha256").is_file()
    assert main(["pack", str(folder)]) == 0 and "no *.safetensors to pack" in capsys.readouterr().err


# -- the shipped targets ---------------------------------------------------------------------------------------
def test_the_repository_tracks_packed_weights_only():
    """No raw weights in git (the working tree is copied to GPU machines under a size cap), and the .gitignore rule
    that keeps unpacked files out ignores nothing that is tracked."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "dflash/assets"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert not [f for f in tracked if f.endswith(".safetensors")]
    for name in ("reference_target", "reference_math_target"):
        assert {f"dflash/assets/{name}/model.safetensors.xz", f"dflash/assets/{name}/model.safetensors.sha256"} \
            <= set(tracked)
    ignored = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert ignored == []


def test_shipped_fingerprints_are_those_of_the_raw_files(cache):
    from dflash.target.model import TargetConfig, checkpoint_path, target_fingerprint, tokenizer_path
    ref = TargetConfig(name="reference", path="builtin:reference_target", mask_token_id=2)
    assert target_fingerprint(ref) == REFERENCE_FINGERPRINT
    assert target_fingerprint(TargetConfig(path="builtin:reference_math_target", mask_token_id=2)) == MATH_FINGERPRINT
    assert Path(checkpoint_path(ref)).parent == cache / "assets"
    tokenizer = tokenizer_path(TargetConfig(tokenizer="builtin:reference_target"))
    assert Path(tokenizer) == ROOT / "dflash/assets/reference_target"  # tokenizer files need nothing unpacked


def test_the_shipped_reference_target_gives_the_raw_files_logits(cache, tmp_path):
    """Loaded through `Target` from `builtin:`, it gives the logits the raw file gave before packing, and a folder
    holding the raw file (unpacked here independently) gives the same target."""
    import warnings

    from dflash.target.model import Target, TargetConfig
    raw = tmp_path / "raw"
    shutil.copytree(ROOT / "dflash/assets/reference_target", raw,
                    ignore=shutil.ignore_patterns("*.xz", "*.sha256"))
    with lzma.open(ROOT / "dflash/assets/reference_target/model.safetensors.xz") as src, \
            open(raw / "model.safetensors", "wb") as dst:
        shutil.copyfileobj(src, dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shipped = Target(TargetConfig(name="reference", path="builtin:reference_target", mask_token_id=2,
                                      device="cpu"))
        direct = Target(TargetConfig(name="reference", path=str(raw), mask_token_id=2, device="cpu"))
    ids = torch.tensor(PROBE)
    a, b = shipped.logits(ids)[0], direct.logits(ids)[0]
    assert torch.equal(a, b)
    assert a.argmax(-1).tolist() == REFERENCE_ARGMAX
    assert torch.allclose(a[1, :4], torch.tensor(REFERENCE_LOGITS_1), atol=1e-3)
    assert shipped.fingerprint == direct.fingerprint == REFERENCE_FINGERPRINT
    assert shipped.identity == direct.identity  # caches and pinned ground truth keyed alike
