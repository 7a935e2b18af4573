"""Target identity: a changed target misses every cache keyed by it, and a drafter or champion of another
target is refused (eval) or replaced (registry) with a clear reason."""
import shutil
from types import SimpleNamespace

import pytest
import torch

from dflash.config import ConfigError
from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation.ground_truth import cache_key
from dflash.evaluation.prompts import Task
from dflash.serving.export import save_drafter
from dflash.serving.promotion import TARGET_FP, PromoteConfig, _compare
from dflash.target.model import Target, TargetConfig, TinyTargetSpec, build_random_model, check_drafter_target
from experiments.eval import _check_target

SPEC = TinyTargetSpec(hidden_size=32, num_layers=4, intermediate_size=64, head_dim=16, linear_head_dim=16)


def _saved_target(folder, seed):
    model = build_random_model(TinyTargetSpec(**{**SPEC.__dict__, "seed": seed}), torch.device("cpu"),
                               torch.float32)
    model.save_pretrained(str(folder))
    return TargetConfig(path=str(folder), tokenizer="bytes", mask_token_id=255, layer_ids=[1, 2])


def test_fingerprint_follows_the_weights_not_the_path(tmp_path):
    a = Target(_saved_target(tmp_path / "a", 0))
    b = Target(_saved_target(tmp_path / "b", 1))  # same shape and size, other weights
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    a2 = Target(TargetConfig(path=str(tmp_path / "a_copy"), tokenizer="bytes", mask_token_id=255, layer_ids=[1, 2]))
    assert a.fingerprint == a2.fingerprint != b.fingerprint
    tasks = [Task("t", "def f():\n")]
    assert cache_key(a, tasks, 8) != cache_key(b, tasks, 8)  # eval ground truth is rebuilt for a new target
    # the same checkpoint in another folder (another checkout, a GPU machine's copy) is the same target for every
    # cache and ground-truth key: pinned ground truth written in one place pairs in the other
    assert a.identity == a2.identity != b.identity and str(tmp_path) not in a.identity
    assert cache_key(a, tasks, 8) == cache_key(a2, tasks, 8)


def test_drafter_of_another_target_is_refused(tmp_path):
    t = Target(_saved_target(tmp_path / "t", 0))
    check_drafter_target(t.fingerprint, t, "x")
    with pytest.raises(ValueError, match="the target changed"):
        check_drafter_target("0123456789abcdef", t, "x")
    with pytest.raises(ValueError, match="records no target fingerprint"):
        check_drafter_target(None, t, "x")
    d = build_drafter(DrafterConfig(block_size=4), 32, 4, 255, [1, 2])
    save_drafter(d, tmp_path / "ours", extra={"target": "reference", "target_fingerprint": "0123456789abcdef"})
    with pytest.raises(ConfigError, match=str(tmp_path / "ours")):
        _check_target(tmp_path / "ours", t)
    save_drafter(d, tmp_path / "fits", extra={"target": "reference", "target_fingerprint": t.fingerprint})
    _check_target(tmp_path / "fits", t)
    save_drafter(d, tmp_path / "published")  # not trained here: nothing recorded, nothing to refuse
    _check_target(tmp_path / "published", t)


def test_champion_of_another_target_is_replaced():
    cfg = PromoteConfig(metric="eval/tau", margin=0.0, floor=0.0)
    holder = SimpleNamespace(version="3", tags={TARGET_FP: "old0000000000000"})
    ok, reason = _compare(1.0, holder, 5.0, cfg, target_fp="new0000000000000")
    assert ok and "old0000000000000" in reason and "replaced" in reason
    same = SimpleNamespace(version="3", tags={TARGET_FP: "new0000000000000"})
    assert not _compare(1.0, same, 5.0, cfg, target_fp="new0000000000000")[0]  # same target: the metric decides


def test_random_target_drafter_without_fingerprint_is_accepted():
    t = Target(TargetConfig(random=SPEC))  # a random target is its spec, carried by the run's config
    check_drafter_target(None, t, "x")
    with pytest.raises(ValueError, match="the target changed"):
        check_drafter_target("0123456789abcdef", t, "x")
