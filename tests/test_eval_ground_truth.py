"""Ground-truth cache (dflash.evaluation.ground_truth): hit, a miss on each key component, corrupt files."""
from __future__ import annotations

import copy

import pytest
import torch

from dflash.evaluation import ground_truth as gt
from dflash.evaluation.prompts import Task, load_suite
from dflash.evaluation.speculative import greedy_decode

N = 4
TASKS = [Task("add", "def add(a, b):\n"), Task("neg", "def neg(x):\n")]



@pytest.fixture(scope="module")
def target(reference_target):
    return reference_target


@pytest.fixture(scope="module")
def baseline(target, tmp_path_factory):
    """One cache file built once for the module; tests start from a copy of it."""
    d = tmp_path_factory.mktemp("gt-baseline")
    gt.load_or_build_ground_truth(target, TASKS, N, d)
    return gt.cache_path(d, gt.cache_key(target, TASKS, N))


def _seed_cache(baseline, tmp_path):
    import shutil
    shutil.copy(baseline, tmp_path / baseline.name)


@pytest.fixture
def builds(monkeypatch):
    calls = []
    real = gt.build_ground_truth

    def counting(target, tasks, n, *spec):
        calls.append((target.identity, tuple(target.layer_ids), tuple(t.prompt for t in tasks), n))
        return real(target, tasks, n, *spec)

    monkeypatch.setattr(gt, "build_ground_truth", counting)
    return calls


def test_builds_then_hits_and_content(target, tmp_path, builds):
    truths, hit = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    assert not hit and len(builds) == 1
    again, hit = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    assert hit and len(builds) == 1
    assert list(tmp_path.iterdir()) == [gt.cache_path(tmp_path, gt.cache_key(target, TASKS, N))]  # no temp left
    for a, b, task in zip(truths, again, TASKS):
        ids = target.tokenizer.encode(task.prompt)
        assert a.name == b.name == task.name and a.prompt_ids.tolist() == ids
        assert torch.equal(a.continuation, b.continuation) and torch.equal(a.features, b.features)
        assert a.continuation.tolist() == greedy_decode(target, ids, N).tokens  # the target's greedy output
        assert a.features.shape == (len(ids) + N, len(target.layer_ids), target.hidden_size)
        full = target.forward_features(a.tokens[None]).features_BTLH[0]
        torch.testing.assert_close(a.features, full)


def _variant(target, **attrs):
    t = copy.copy(target)  # shares the model; only the attributes the key reads change
    for k, v in attrs.items():
        setattr(t, k, v)
    return t


@pytest.mark.parametrize("change", ["identity", "layer_ids", "prompt", "name", "max_new_tokens", "format"])
def test_each_key_component_misses(target, baseline, tmp_path, builds, change, monkeypatch):
    _seed_cache(baseline, tmp_path)
    _, hit = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    assert hit and not builds
    tgt, tasks, n = target, TASKS, N
    if change == "identity":
        tgt = _variant(target, identity=target.identity + "-other")
    elif change == "layer_ids":
        tgt = _variant(target, layer_ids=[1, 2, 3, 4, 6])
    elif change == "prompt":
        tasks = [TASKS[0], Task("neg", "def neg(y):\n")]
    elif change == "name":
        tasks = [TASKS[0], Task("negate", TASKS[1].prompt)]
    elif change == "max_new_tokens":
        n = N + 1
    elif change == "format":
        monkeypatch.setattr(gt, "FORMAT_VERSION", gt.FORMAT_VERSION + 1)
    assert gt.cache_key(tgt, tasks, n) != gt.cache_key(target, TASKS, N) or change == "format"
    truths, hit = gt.load_or_build_ground_truth(tgt, tasks, n, tmp_path)
    assert not hit and len(builds) == 1
    assert truths[0].features.shape[1] == len(tgt.layer_ids) and truths[0].n_new == n
    if change == "layer_ids":
        torch.testing.assert_close(truths[0].features, tgt.forward_features(truths[0].tokens[None])
                                   .features_BTLH[0])  # features of the new layers, not the old ones
    _, hit = gt.load_or_build_ground_truth(tgt, tasks, n, tmp_path)  # and now that one hits
    assert hit and len(builds) == 1


def _corrupt(path, how):
    raw = path.read_bytes()
    if how == "flip":
        i = len(raw) - 100
        path.write_bytes(raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:])
    elif how == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00not a cache file")
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["flip", "truncate", "garbage", "empty"])
def test_corrupt_file_is_rebuilt_not_trusted(target, baseline, tmp_path, builds, how):
    _seed_cache(baseline, tmp_path)
    first, _ = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    path = gt.cache_path(tmp_path, gt.cache_key(target, TASKS, N))
    _corrupt(path, how)
    with pytest.warns(RuntimeWarning, match="unreadable or invalid"):
        truths, hit = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    assert not hit and len(builds) == 1
    assert all(torch.equal(a.continuation, b.continuation) for a, b in zip(first, truths))
    _, hit = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)  # rewritten whole
    assert hit and len(builds) == 1


def test_valid_checksum_but_wrong_shapes_is_rebuilt(target, baseline, tmp_path, builds):
    _seed_cache(baseline, tmp_path)
    truths, _ = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    key = gt.cache_key(target, TASKS, N)
    bad = [gt.TaskTruth(t.name, t.prompt_ids, t.continuation, t.features[:-1]) for t in truths]
    gt.save_ground_truth(gt.cache_path(tmp_path, key), key, bad)
    with pytest.warns(RuntimeWarning, match="features shape"):
        _, hit = gt.load_or_build_ground_truth(target, TASKS, N, tmp_path)
    assert not hit and len(builds) == 1


def test_builtin_suite_is_shipped():
    tasks = load_suite("coding10")
    names = [t.name for t in tasks]
    assert len(tasks) == 10 and len(set(names)) == 10
    for want in ("fizzbuzz", "binary_search", "merge_sort", "graph_bfs", "lru_cache", "trie_autocomplete",
                 "json_parser", "async_rate_limiter"):
        assert want in names
    for t in tasks:  # the start of Python source: a def line and an open-ended docstring-closed body
        assert "def " in t.prompt and t.prompt.rstrip().endswith('"""') and t.prompt.endswith("\n")
        compile(t.prompt + "    pass\n", t.name, "exec")


def test_suite_from_file_and_errors(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('[{"name": "x", "prompt": "def x():\\n"}]')
    assert load_suite(str(f)) == [Task("x", "def x():\n")]
    f.write_text('[{"name": "x", "prompt": "a"}, {"name": "x", "prompt": "b"}]')
    with pytest.raises(ValueError, match="duplicate"):
        load_suite(str(f))
    with pytest.raises(FileNotFoundError, match="eval.suite"):
        load_suite("no_such_suite")


def test_batched_continuations_are_each_prompts_own_greedy_decode(target):
    """The ground truth is written many prompts at a time; every row is what greedy decoding of its prompt
    alone gives (prompts of different lengths in one batch, groups smaller than the suite)."""
    from dflash.evaluation.speculative import greedy_decode
    prompts = [list(target.tokenizer.encode(t.prompt)) for t in TASKS]
    prompts.append(prompts[0][:3])  # a much shorter one
    got = gt.greedy_continuations(target, prompts, N, rows=2)
    assert got == [greedy_decode(target, p, N).tokens for p in prompts]
