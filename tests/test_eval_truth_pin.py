"""Pinned ground-truth tokens (`eval.truth_dir`, dflash.evaluation.truth_pin): written by the first evaluation, used
by every later one (so evaluations on other machines pair), edits honoured, bad pins refused naming the file."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation import EvalConfig, validate_eval_config
from dflash.evaluation import ground_truth as gt
from dflash.evaluation.pairing import DifferentGroundTruth, paired_delta
from dflash.evaluation.prompts import Task
from dflash.evaluation.report import evaluate, ground_truth_key
from dflash.evaluation.truth_pin import PinError, tasks_digest

ROOT = Path(__file__).resolve().parent.parent
N = 5
TASKS = [Task("add", "def add(a, b):\n"), Task("neg", "def neg(x):\n")]
VANILLA = ("tau_sum_vanilla", "rounds")


@pytest.fixture(scope="module")
def target(reference_target):
    return reference_target


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(block_size=4), target.hidden_size, target.info.num_layers,
                         target.mask_token_id, target.layer_ids)


def _cfg(tmp_path: Path, cache: str, truth: str = "truth") -> EvalConfig:
    return EvalConfig(max_new_tokens=N, tree_budgets=[2], bootstrap=50, extra_suites=[],
                      cache_dir=str(tmp_path / cache), truth_dir=str(tmp_path / truth) if truth else "")


def _drifting(real):
    """Greedy decoding that differs from this process's, as another GPU's may: the last token of every
    continuation moved by one."""
    def drifted(target, prompts, n, *a, **kw):
        return [c[:-1] + [(c[-1] + 1) % target.vocab_size] for c in real(target, prompts, n, *a, **kw)]
    return drifted


def _pin(tmp_path: Path) -> Path:
    pins = sorted((tmp_path / "truth").glob("*.json"))
    assert len(pins) == 1, pins
    return pins[0]


def test_pin_is_written_then_every_rebuild_runs_on_its_tokens(target, drafter, tmp_path, monkeypatch):
    first = evaluate(drafter, target, _cfg(tmp_path, "gt1"), TASKS)
    pin = _pin(tmp_path)
    data = json.loads(pin.read_text())
    assert (data["format"], data["target"], data["suite"], data["max_new_tokens"]) == (1, target.identity, "coding10", N)
    truths, _ = gt.load_or_build_ground_truth(target, TASKS, N, None)
    assert [t["name"] for t in data["tasks"]] == ["add", "neg"]
    assert [t["continuation"] for t in data["tasks"]] == [t.continuation.tolist() for t in truths]
    assert re.fullmatch(r"[0-9a-f]{24}\.json", pin.name)
    # the features were cached under the pinned key (never under the unpinned one)
    assert [p.name for p in (tmp_path / "gt1").glob("*.gt")] == \
        [gt.cache_path("", gt.cache_key(target, TASKS, N, data["sha256"])).name]

    # "another machine": a fresh cache (forcing a rebuild) whose greedy decode drifts. Unpinned, it no longer pairs.
    calls = []
    drifted = _drifting(gt.greedy_continuations)
    monkeypatch.setattr(gt, "greedy_continuations", lambda *a, **k: calls.append(1) or drifted(*a, **k))
    unpinned = evaluate(drafter, target, _cfg(tmp_path, "gt-other", truth=""), TASKS)
    assert calls and unpinned.info["ground_truth_key"] != first.info["ground_truth_key"]
    with pytest.raises(DifferentGroundTruth):
        paired_delta(first.to_dict(), unpinned.to_dict(), VANILLA, VANILLA)
    calls.clear()
    second = evaluate(drafter, target, _cfg(tmp_path, "gt2"), TASKS)
    assert not calls and second.info["cache_hit"] is False  # no greedy decode: the pin's tokens
    assert second.info["ground_truth_key"] == first.info["ground_truth_key"]
    d = paired_delta(first.to_dict(), second.to_dict(), VANILLA, VANILLA)
    assert d.value == 0.0
    assert second.metrics["eval/gt_consistency"] == first.metrics["eval/gt_consistency"] == 1.0
    assert evaluate(drafter, target, _cfg(tmp_path, "gt2"), TASKS).info["cache_hit"] is True
    assert json.loads(pin.read_text()) == data  # never rewritten


def _edit(pin: Path, change, checksum: bool = True) -> None:
    data = json.loads(pin.read_text())
    change(data)
    if checksum:
        data["sha256"] = tasks_digest(data["tasks"])
    pin.write_text(json.dumps(data))


def test_an_edited_pin_is_what_the_evaluation_runs_on(target, drafter, tmp_path):
    cfg = _cfg(tmp_path, "gt")
    before = evaluate(drafter, target, cfg, TASKS)
    pin = _pin(tmp_path)
    old = json.loads(pin.read_text())["tasks"][0]["continuation"][0]
    new = (old + 1) % target.vocab_size

    def bump(data):
        data["tasks"][0]["continuation"][0] = new
    _edit(pin, bump)
    truths, hit = gt.load_or_build_ground_truth(target, TASKS, N, cfg.cache_dir, cfg.truth_dir)
    assert not hit and truths[0].continuation[0].item() == new  # the old feature cache is not read
    after = evaluate(drafter, target, cfg, TASKS)
    assert after.info["ground_truth_key"] == ground_truth_key(target, truths) != before.info["ground_truth_key"]
    # the one-shot forward's argmax still sees the target's own first token: the drift shows
    assert after.table[0]["gt_consistency"] < 1.0 == after.table[1]["gt_consistency"]


def _garbage(pin: Path) -> None:
    pin.write_text("{not json")


def _truncate(pin: Path) -> None:
    pin.write_text(pin.read_text()[:40])


def _hand_edit(pin: Path) -> None:
    _edit(pin, lambda d: d["tasks"][1]["continuation"].__setitem__(0, 7), checksum=False)


def _other_target(pin: Path) -> None:
    _edit(pin, lambda d: d.__setitem__("target", "random:other"))


def _short(pin: Path) -> None:
    _edit(pin, lambda d: d["tasks"][0].__setitem__("continuation", d["tasks"][0]["continuation"][:-1]))


@pytest.mark.parametrize("spoil,why", [(_garbage, "unreadable"), (_truncate, "unreadable"),
                                       (_hand_edit, "checksum mismatch"), (_other_target, "pinned for target"),
                                       (_short, "continuation of 4 tokens, expected 5")])
def test_a_bad_pin_is_refused_naming_the_file(target, tmp_path, spoil, why):
    gt.load_or_build_ground_truth(target, TASKS, N, None, tmp_path / "truth")
    pin = _pin(tmp_path)
    spoil(pin)
    spoiled = pin.read_text()
    with pytest.raises(PinError, match=re.escape(str(pin)) + ".*" + re.escape(why)):
        gt.load_or_build_ground_truth(target, TASKS, N, None, tmp_path / "truth")
    assert pin.read_text() == spoiled  # not silently rebuilt


def test_a_pin_of_other_prompts_is_refused(target, tmp_path):
    """A pin file copied over another suite's (its name is the key, so only a copy or rename gets there)."""
    other = [TASKS[0], Task("neg", "def neg(y):\n")]
    gt.load_or_build_ground_truth(target, TASKS, N, None, tmp_path / "truth")
    mine = _pin(tmp_path)
    gt.load_or_build_ground_truth(target, other, N, None, tmp_path / "other")
    (theirs,) = (tmp_path / "other").glob("*.json")
    assert theirs.name != mine.name
    mine.write_text(theirs.read_text())
    with pytest.raises(PinError, match=re.escape(str(mine)) + ".*task 'neg': its prompt tokens differ"):
        gt.load_or_build_ground_truth(target, TASKS, N, None, tmp_path / "truth")


def test_racing_builders_end_on_the_first_pin(target, tmp_path, monkeypatch):
    """Two runs found no pin and both decode the suite: the one that pins last gives way to the first's tokens."""
    real_greedy, real_build = gt.greedy_continuations, gt.build_ground_truth
    monkeypatch.setattr(gt, "greedy_continuations", _drifting(real_greedy))
    first, _ = gt.load_or_build_ground_truth(target, TASKS, N, None, tmp_path / "truth")  # the other run's
    pin = _pin(tmp_path)
    text = pin.read_text()
    aside = pin.rename(tmp_path / "aside.json")
    monkeypatch.setattr(gt, "greedy_continuations", real_greedy)

    def build_while_the_other_pins(*a):
        out = real_build(*a)
        aside.rename(pin)
        return out
    monkeypatch.setattr(gt, "build_ground_truth", build_while_the_other_pins)
    second, _ = gt.load_or_build_ground_truth(target, TASKS, N, None, tmp_path / "truth")
    assert pin.read_text() == text and not list((tmp_path / "truth").glob(".*"))  # kept; no temp file left
    assert [t.continuation.tolist() for t in second] == [t.continuation.tolist() for t in first]
    assert second[0].continuation.tolist() != real_greedy(target, [second[0].prompt_ids.tolist()], N)[0]


def test_truth_dir_is_checked_at_config_time(tmp_path):
    validate_eval_config(EvalConfig(truth_dir=str(tmp_path / "pins")))  # a folder not made yet is fine
    with pytest.raises(ValueError, match="eval.truth_dir must be a folder path.*int 5"):
        validate_eval_config(EvalConfig(truth_dir=5))
    from dflash.config import ConfigError, from_dict, to_dict, validate
    from experiments.config import compose_config
    d = to_dict(compose_config(["+target=tiny_random"]))
    d["eval"]["truth_dir"] = ["a"]  # e.g. a resolved config on disk, edited
    with pytest.raises(ConfigError, match="eval.truth_dir"):
        validate(from_dict(d))
    # at the command line: exit 2 naming the key, before anything is written
    (tmp_path / "afile").write_text("")
    run_dir = tmp_path / "never"
    p = subprocess.run([sys.executable, "-m", "experiments.run", "+target=tiny_random",
                        f"eval.truth_dir={tmp_path / 'afile'}", f"run_dir={run_dir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 2 and "eval.truth_dir" in p.stderr, p.stderr[-2000:]
    assert not run_dir.exists()
