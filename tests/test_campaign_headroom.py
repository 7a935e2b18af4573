"""The oracle τ of a campaign measured after the fact (sweeps/campaign_headroom.py) and read by its report's headroom
section (sweeps/headroom_section.py): a tiny random target of the real model class, a campaign store with a pinned
ground truth and two cells' objective tables (a DFlash 1 cell scored under argmax drafts, a DFlash 2 cell under
sampled ones), as `eval.engine=vllm` scores them."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from dflash.evaluation.prompts import objective_suite
from dflash.evaluation.protocol import truth_specs
from tests.conftest import FAST

OUT_NAME = "tiny_headroom"
TINY = [o for o in FAST if not o.startswith(("drafter.block_size", "+eval="))] + [
    "eval.suite=heldout", "eval.extra_suites=[]", "eval.heldout.num_prompts=3", "eval.heldout.max_new_tokens=12",
    "eval.sampling.temperature=0.3", "eval.sampling.top_p=1.0", "eval.sampling.top_k=0", "eval.samples=2",
    "eval.engine=vllm", "eval.bootstrap=200", "drafter.block_size=4",
    "eval.stop_at_eos=false", "eval.stop.dedent=[]"]  # the random target's text would end at once
CELLS = {"d1": "argmax", "d2": "sampled"}  # option -> the policy its cells were scored under


def _campaign_file(tmp_path: Path) -> Path:
    import yaml
    f = tmp_path / f"{OUT_NAME}.yaml"
    f.write_text(yaml.safe_dump({"name": OUT_NAME, "experiment": "t", "budget_tokens": 1000, "max_steps": 5,
                                 "objective": "eval/tau_served", "base": TINY, "seeds": [0],
                                 "stages": [{"factor": "drafter", "options": {o: [] for o in CELLS}}]}))
    return f


def _row(name: str, i: int) -> dict:
    """A made-up task row: the option's τ sums and prompt lookup's, distinct per task."""
    return {"task": name, "rounds": 4, "tau_sum_vanilla": 5 + i, "tau_sum_prompt_lookup": 4 + (i % 2),
            "rounds_prompt_lookup": 4}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(campaign file, out folder, the target, the whole suite's truths through TruthMemo, its ground-truth key):
    the pin written by a cell's own evaluation path, and each cell's objective table recording its policy."""
    from dflash.evaluation.evaluator import TruthMemo
    from dflash.evaluation.report import ground_truth_key
    from dflash.target.model import Target
    from sweeps.campaign_headroom import HeadroomArgs, compose
    from sweeps.campaign_spec import load_campaign
    tmp = tmp_path_factory.mktemp("hr")
    f = _campaign_file(tmp)
    out = tmp / "out"
    folder = out / OUT_NAME
    (folder / "truth").mkdir(parents=True)
    cfg = compose(load_campaign(str(f)), folder, HeadroomArgs(device="cpu"), [f"eval.cache_dir={tmp / 'cache'}"])
    target = Target(cfg.target)
    suite, spec = objective_suite(cfg.eval), truth_specs(cfg.eval, target)[0]
    TruthMemo(cfg.eval.cache_dir, cfg.eval.truth_dir).get(target, suite, spec)  # built and pinned, as a first cell
    truths = TruthMemo("", cfg.eval.truth_dir).get(target, suite, spec)  # read from the pin, as every later cell
    key = ground_truth_key(target, truths)
    for opt, policy in CELLS.items():
        table = {"info": {"suite_label": "heldout", "policy": policy, "block_size": 4, "ground_truth_key": key},
                 "tasks": [_row(t.name, i) for i, t in enumerate(truths)],
                 "stats": {"eval/reach_pos02": 0.3, "eval/reach_pos03": 0.1}}
        served = folder / "runs" / f"s0-drafter-{opt}-seed0" / "eval" / "served"
        served.mkdir(parents=True)
        (served / "tasks.json").write_text(json.dumps(table))
    return f, out, target, truths, key, cfg


def _run(f, out, *more):
    from sweeps.campaign_headroom import main
    return main([str(f), f"out={out}", "device=cpu", "samples=3", *more])


def test_the_command_writes_the_oracle_of_each_policy_the_cells_were_scored_under(store, tmp_path):
    """headroom.json's oracle τ is what `oracle_and_entropy` gives directly on TruthMemo's truths of the same
    prompts (the plain reference, uncached), pooled by hand; prompts=2 measures the first 2 prompts' samples."""
    from dflash.evaluation.headroom import entropy_metrics, oracle_and_entropy
    f, out, target, truths, key, cfg = store
    got = _run(f, out, "prompts=2", f"eval.cache_dir={tmp_path / 'c'}")
    on_disk = json.loads((out / OUT_NAME / "headroom.json").read_text())
    assert on_disk == json.loads(json.dumps(got))
    assert got["ground_truth_key"] == key and got["prompts"] == 2 and got["prompts_in_suite"] == 3
    assert got["samples"] == 3 and got["samples_per_prompt"] == 2 and got["device"] == "cpu"
    assert got["command"].startswith("python -m sweeps.campaign_headroom ") and "prompts=2" in got["command"]
    first = [t for t in truths if t.group in {truths[0].group, truths[2].group}]  # the first 2 prompts, 2 samples each
    assert len(first) == 4
    assert {o["policy"]: o["cells"] for o in got["oracles"]} == {"argmax": ["s0-drafter-d1-seed0"],
                                                                 "sampled": ["s0-drafter-d2-seed0"]}
    for o in got["oracles"]:
        ref, entropy, _ = oracle_and_entropy(target, first, truths_sampling(cfg, target), 3, cfg.eval.seed, 4,
                                             o["policy"], "reference", "")
        assert [x["task"] for x in o["tasks"]] == [t.name for t in first]
        assert [x["tau_sum"] for x in o["tasks"]] == [sum(r.taus_vanilla) for r in ref]
        assert math.isclose(o["tau"], sum(sum(r.taus_vanilla) for r in ref) / sum(len(r.taus_vanilla) for r in ref))
        assert o["ci_low"] <= o["tau"] <= o["ci_high"] and o["reach"][0] == 1.0 and len(o["reach"]) == 3
        assert math.isclose(got["entropy"]["mean"], entropy_metrics(entropy)["eval/target_entropy_mean"])
    from sweeps.campaign_headroom import first_prompts, read_pin
    pin = read_pin(target, objective_suite(cfg.eval), truth_specs(cfg.eval, target)[0], cfg.eval.truth_dir)
    assert pin.key == key and first_prompts(pin, 2) == [0, 1, 2, 3] and first_prompts(pin, 0) == list(range(6))


def truths_sampling(cfg, target):
    return truth_specs(cfg.eval, target)[0].sampling


def _exit(monkeypatch, capsys, argv) -> str:
    """The command run as `python -m` runs it: exit status 2 and the message, with the target never built."""
    import dflash.target.model
    from experiments.config import run_cli
    from sweeps.campaign_headroom import main

    def no_target(*a, **k):
        raise AssertionError("the target was built before the input was checked")
    monkeypatch.setattr(dflash.target.model, "Target", no_target)
    monkeypatch.setattr(sys, "argv", ["campaign_headroom", *argv])
    with pytest.raises(SystemExit) as e:
        run_cli(main)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_input_exits_2_naming_the_key_or_file_before_any_work(store, monkeypatch, capsys, tmp_path):
    f, out, *_ = store
    assert "campaign 'no_such_campaign'" in _exit(monkeypatch, capsys, ["no_such_campaign", f"out={out}"])
    assert "samples=0" in _exit(monkeypatch, capsys, [str(f), f"out={out}", "samples=0"])
    assert "prompts=-1" in _exit(monkeypatch, capsys, [str(f), f"out={out}", "prompts=-1"])
    assert "no campaign folder" in _exit(monkeypatch, capsys, [str(f), f"out={tmp_path}"])
    bare = tmp_path / "bare" / OUT_NAME
    (bare / "runs").mkdir(parents=True)
    assert "no cell's objective table" in _exit(monkeypatch, capsys, [str(f), f"out={bare.parent}"])
    (bare / "runs").rmdir()
    (out / OUT_NAME / "runs").rename(bare / "runs")  # the cells, without their campaign's truth folder
    try:
        err = _exit(monkeypatch, capsys, [str(f), f"out={bare.parent}"])
    finally:
        (bare / "runs").rename(out / OUT_NAME / "runs")
    assert f"eval.truth_dir={bare / 'truth'}: no pinned ground truth" in err
    assert not (bare / "headroom.json").exists()


def test_another_suites_pin_is_named_and_not_replaced(store, tmp_path):
    """A truth folder without this suite's pin: the error names the pin it looked for, and none is written."""
    import shutil

    from dflash.config import ConfigError
    from sweeps.campaign_headroom import main
    f, out, *_ = store
    other = tmp_path / "o" / OUT_NAME
    shutil.copytree(out / OUT_NAME / "runs", other / "runs")
    (other / "truth").mkdir()
    (other / "truth" / "0123.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no pinned ground truth \w+\.json of suite 'heldout'.*0123\.json"):
        main([str(f), f"out={other.parent}", "device=cpu"])
    assert sorted(p.name for p in (other / "truth").iterdir()) == ["0123.json"]


def test_the_report_section_shows_the_oracle_and_the_gap_closed_on_the_oracles_prompts(store, tmp_path):
    from dflash.evaluation.headroom import gap_closed
    from sweeps.headroom_section import headroom_section, read_headroom
    f, out, _, truths, key, _ = store
    _run(f, out, "prompts=1", f"eval.cache_dir={tmp_path / 'c'}")
    hr = read_headroom(out / OUT_NAME)
    by = {opt: {0: json.loads((out / OUT_NAME / "runs" / f"s0-drafter-{opt}-seed0" / "eval" / "served"
                                / "tasks.json").read_text())} for opt in CELLS}
    text = "\n".join(headroom_section(by, hr))
    oracle = {o["policy"]: o for o in hr["oracles"]}
    for policy, o in oracle.items():
        assert f"under {policy} drafts **{o['tau']:.3f}** [{o['ci_low']:.3f}, {o['ci_high']:.3f}]" in text
    assert "the first 1 of 3 prompts × 2 samples, 3 target samples a round" in text and "What the oracle bounds" in text
    rows = [_row(t.name, i) for i, t in enumerate(truths)][:2]  # prompt 1's two samples: tasks 0 and 1
    tau = sum(r["tau_sum_vanilla"] for r in rows) / 8
    pl = sum(r["tau_sum_prompt_lookup"] for r in rows) / 8
    for opt, policy in CELLS.items():
        gap = gap_closed(tau, pl, oracle[policy]["tau"])
        want = "—" if math.isnan(gap) else f"{100 * gap:.1f}%"
        assert f"| {opt} | 30.0% | 10.0% | — | — | — | — | {tau:.3f} | {pl:.3f} | {want} ({policy}) |" in text
    assert "not measured" not in text
    moved = {"d1": {0: {**by["d1"][0], "info": {**by["d1"][0]["info"], "ground_truth_key": "other"}}}}
    assert "measured on another ground truth" in "\n".join(headroom_section(moved, hr))
    assert "not measured in this campaign" in "\n".join(headroom_section(by, None))


def test_the_two_policies_oracles_compute_the_marginals_at_an_anchor_once(store):
    """The command's shared memo (`oracle_and_entropy(..., memo)`): one marginal per (task, anchor) over both
    policies' rounds; the results are the unshared ones (the first test)."""
    from dflash.evaluation.headroom import oracle_and_entropy
    _, _, target, truths, _, cfg = store
    first = truths[:4]
    memo: dict = {}

    def anchors(results) -> set:
        out = set()
        for r in results:
            p = r.prompt_len
            for tau in r.taus_vanilla:
                out.add((r.name, p))
                p += tau
        return out
    args = (target, first, truths_sampling(cfg, target), 3, cfg.eval.seed, 4)
    argmax = oracle_and_entropy(*args, "argmax", "memo", "", memo)[0]
    assert len(memo) == len(anchors(argmax))
    sampled = oracle_and_entropy(*args, "sampled", "memo", "", memo)[0]
    assert len(memo) == len(anchors(argmax) | anchors(sampled)) < len(anchors(argmax)) + len(anchors(sampled))


def test_one_policy_measured_again_on_more_prompts_keeps_the_others_own(store, tmp_path, monkeypatch, capsys):
    """`policy=argmax prompts=2` after a run of both policies on 1 prompt: argmax's entry is the 2-prompt one (as a
    whole run on 2 prompts writes it), sampled's the 1-prompt one, each saying its own prompts, and the report
    names each policy's; a file of another ground truth keeps nothing; an unknown policy exits 2 before any work."""
    import shutil

    from sweeps.headroom_section import measured_after, read_headroom
    f, out, *_ = store
    mine = tmp_path / "o"
    shutil.copytree(out / OUT_NAME, mine / OUT_NAME)
    (mine / OUT_NAME / "headroom.json").unlink(missing_ok=True)
    cache = f"eval.cache_dir={tmp_path / 'c'}"
    one = _run(f, mine, "prompts=1", cache)
    both_on_2 = _run(f, mine, "prompts=2", cache)
    _run(f, mine, "prompts=1", cache)
    got = _run(f, mine, "prompts=2", "policy=argmax", cache)
    by = {o["policy"]: o for o in got["oracles"]}
    want_argmax = next(o for o in both_on_2["oracles"] if o["policy"] == "argmax")
    want_sampled = next(o for o in one["oracles"] if o["policy"] == "sampled")
    assert by["argmax"]["prompts"] == 2 and by["argmax"]["tasks"] == want_argmax["tasks"]
    assert by["sampled"]["prompts"] == 1 and by["sampled"]["tasks"] == want_sampled["tasks"]
    assert by["sampled"]["tau"] == want_sampled["tau"] and "policy=argmax" in by["argmax"]["command"]
    text = "\n".join(measured_after(read_headroom(mine / OUT_NAME)))
    assert "each policy on its own prompts" in text
    assert f"under argmax drafts **{by['argmax']['tau']:.3f}**" in text and "the first 2 of 3 prompts" in text
    assert f"under sampled drafts **{by['sampled']['tau']:.3f}**" in text and "the first 1 of 3 prompts" in text
    hr = json.loads((mine / OUT_NAME / "headroom.json").read_text())
    hr["ground_truth_key"] = "another"
    (mine / OUT_NAME / "headroom.json").write_text(json.dumps(hr))
    alone = _run(f, mine, "prompts=1", "policy=sampled", cache)
    assert [o["policy"] for o in alone["oracles"]] == ["sampled"]
    assert "policy='greedy'" in _exit(monkeypatch, capsys, [str(f), f"out={mine}", "policy=greedy"])


def test_an_oracle_read_from_the_cache_says_the_device_and_seconds_it_was_computed_with(store, tmp_path):
    """A GPU's oracle read back on a CPU (its cache file carried over) is still the GPU's measurement."""
    f, out, *_ = store
    cache = tmp_path / "c"
    first = _run(f, out, "prompts=1", "policy=argmax", f"eval.cache_dir={cache}")
    assert first["oracles"][0]["device"] == "cpu"
    (path,) = [p for p in (cache / "headroom").glob("*.json")]
    data = json.loads(path.read_text())
    assert data["device"] == "cpu"
    path.write_text(json.dumps({**data, "device": "cuda:0", "seconds": 123.0}))
    again = _run(f, out, "prompts=1", "policy=argmax", f"eval.cache_dir={cache}")
    assert again["oracles"][0]["device"] == "cuda:0" and again["oracles"][0]["seconds"] == 123.0
    assert again["oracles"][0]["tasks"] == first["oracles"][0]["tasks"]


def test_an_entropy_that_rounding_put_below_zero_reads_zero():
    """A one-hot marginal's entropy is 0 up to a float's rounding (-1e-9): the report read "median -0.00"."""
    from sweeps.headroom_section import nats
    assert nats(-1e-9) == "0.00" and nats(-0.0) == "0.00" and nats(0.114) == "0.11" and nats(1.8149) == "1.81"
