"""The engine check's pieces that need no llama.cpp build (dflash.evaluation.engine_check, dflash.serving.llamacpp,
dflash.serving.llamacpp_convert): rounds compared against an engine that follows llama-server's rules, the server
log's rounds, the pinned sdist's checksum, the cache, and the pre-tokenizer mapping. The engine itself: the slow
tests/test_serve_check.py."""
from __future__ import annotations

import hashlib
import sys
import types

import pytest
import torch

from dflash.evaluation.engine_check import EngineRequest, compare_request, format_results, simulate_requests
from dflash.serving import llamacpp
from dflash.serving.llamacpp import LlamaCppError, ensure_llamacpp, fetch_sdist, rounds_by_task
from dflash.target.sampling import GREEDY

BS = 4  # block size: drafts of at most 3 tokens


def right_for(p_gen: int) -> int:
    """How many leading draft positions the scripted drafter gets right in the round anchored at generated
    index p_gen."""
    return (p_gen * 7) % 5


def scripted_proposer(vocab: int):
    """Argmax = the path's token on the first `right_for(p)` positions of each block, a wrong token after."""
    def f(truth, p):
        toks = truth.tokens.tolist()
        out = torch.zeros(BS - 1, vocab)
        for k in range(1, BS):
            want = toks[p + k] if p + k < len(toks) else 0
            out[k - 1, want if k - 1 < right_for(p - truth.prompt_len) else (want + 1) % vocab] = 5.0
        return out
    return f


def engine_rounds(n_tokens: int, budget: int, at_budget: bool) -> list[tuple[int, int]]:
    """llama-server's rounds for the scripted drafter on a request of `n_tokens` generated tokens: drafts of
    min(bs−1, n_remaining−1) (get_n_draft_max), none once one token is left; accepted = the matching prefix, which
    past the stop token of a request that did not end at its budget can run on (the engine drops those tokens)."""
    rounds, p = [], 0
    while p < n_tokens - 1:
        d = min(BS - 1, budget - (p + 1) - 1)
        if d <= 0:
            break
        m = min(right_for(p), d)
        rounds.append((m, d))
        p += m + 1
    return rounds


def _requests(byte_target, budget: int):
    prompt = list(byte_target.tokenizer.encode("def f(x):\n    return"))
    gen = torch.Generator().manual_seed(0)
    full = torch.randint(3, 200, (budget,), generator=gen).tolist()
    at_budget = EngineRequest("budget", prompt, full, engine_rounds(budget, budget, True), budget, True)
    short = full[:budget - 6]  # ended at a stop token 6 short of the budget; its last round accepts past it
    at_stop = EngineRequest("stop", prompt, short, engine_rounds(len(short), budget, False), budget, False)
    return [at_budget, at_stop]


def test_the_simulation_reproduces_an_engine_that_follows_llama_servers_rules(byte_target):
    reqs = _requests(byte_target, budget=23)
    res = simulate_requests(byte_target, scripted_proposer(byte_target.info.vocab_size), BS, reqs, GREEDY)
    assert res.rounds == sum(len(r.rounds) for r in reqs) and res.mismatched == 0 and res.agrees
    budget, stop = res.requests
    assert budget.simulated == budget.engine and not budget.draft_limit_errors
    assert stop.simulated[:-1] == stop.engine[:-1] and not stop.draft_limit_errors
    assert stop.end_rule and stop.engine[-1] > stop.simulated[-1] and not budget.end_rule
    assert res.tau_engine == pytest.approx(1 + sum(m for r in reqs for m, _ in r.rounds) / res.rounds)
    assert "| yes |" in format_results([res])


def test_a_round_the_simulation_does_not_reproduce_is_a_mismatch(byte_target):
    req = _requests(byte_target, budget=23)[0]
    m, d = req.rounds[2]
    req.rounds[2] = (m + 1 if m < d else m - 1, d)  # one round off: a flipped near-tie or a wrong drafter
    res = simulate_requests(byte_target, scripted_proposer(byte_target.info.vocab_size), BS, [req], GREEDY)
    assert res.mismatched >= 1 and res.allowed == 0 and not res.agrees
    assert "| NO |" in format_results([res]) and "budget: engine rounds" in format_results([res])


def test_drafts_longer_than_the_budget_rule_are_reported():
    req = EngineRequest("r", [1, 2], [5, 6, 7, 8, 9, 10], [(0, 3), (0, 3), (0, 3), (0, 3)], 6, True)
    chk = compare_request(req, [0, 0, 0, 0], BS)
    assert chk.mismatched == [] and chk.draft_limit_errors == ["round 2 at 2: drafted 3, the budget rule says 2",
                                                               "round 3 at 3: drafted 3, the budget rule says 1"]


def test_server_log_rounds_are_read_per_task_in_order():
    log = "\n".join([
        "slot launch_slot_: id  0 | task 7 | processing task, is_child = 0",
        "slot update_slots: id  0 | task 7 | accepted  2/15 draft tokens",
        "slot update_slots: id  0 | task 7 | accepted  0/ 3 draft tokens",
        "slot launch_slot_: id  0 | task 9 | processing task, is_child = 0",
        "slot launch_slot_: id  0 | task 12 | processing task, is_child = 0",
        "slot update_slots: id  0 | task 12 | accepted 15/15 draft tokens",
    ])
    assert rounds_by_task(log) == [[(2, 15), (0, 3)], [], [(15, 15)]]
    with pytest.raises(LlamaCppError, match="restored a checkpoint"):
        rounds_by_task("slot x: id  0 | task 1 | accepted  1/15 draft tokens (restore checkpoint)")


def test_an_sdist_with_another_checksum_is_refused(tmp_path):
    fake = tmp_path / llamacpp.SDIST
    fake.write_bytes(b"not the sdist")
    with pytest.raises(LlamaCppError, match=f"{fake}: sha256 {hashlib.sha256(b'not the sdist').hexdigest()}"):
        fetch_sdist(tmp_path, fake, tmp_path / "log")
    with pytest.raises(LlamaCppError, match="no such file"):
        fetch_sdist(tmp_path, tmp_path / "missing.tar.gz", tmp_path / "log")


def test_a_cached_build_is_used_as_it_is_and_a_half_one_is_not(tmp_path, monkeypatch):
    root = tmp_path / llamacpp.VERSION
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("")
    (root / "manifest.json").write_text("{}")
    assert ensure_llamacpp(tmp_path).root == root  # no build: nothing else would succeed here
    (root / "manifest.json").unlink()  # a folder without its manifest was not renamed whole: build again
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(LlamaCppError, match="needs cmake and a C\\+\\+ compiler"):
        ensure_llamacpp(tmp_path)
    monkeypatch.setenv("DFLASH_LLAMACPP_CACHE", str(tmp_path / "c"))
    assert llamacpp.cache_root() == tmp_path / "c"


def test_the_pre_tokenizer_mapping_answers_only_for_its_hashes(monkeypatch):
    """`llamacpp_convert.install` in front of a stand-in for the converter's `get_vocab_base_pre` (same shape: a
    `chktxt` literal, NotImplementedError for an unknown hash)."""
    from dflash.serving import llamacpp_convert

    class TextModel:
        def get_vocab_base_pre(self, tokenizer) -> str:
            chktxt = "check \n text"
            if tokenizer.encode(chktxt) == [1, 2, 3]:
                return "known"
            raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")

    base = types.ModuleType("conversion.base")
    base.TextModel = TextModel
    monkeypatch.setitem(sys.modules, "conversion", types.ModuleType("conversion"))
    monkeypatch.setitem(sys.modules, "conversion.base", base)

    class Tok:
        def __init__(self, ids):
            self.ids = ids

        def encode(self, text):
            assert text == "check \n text"
            return self.ids

    ours = hashlib.sha256(str([9, 9]).encode()).hexdigest()
    llamacpp_convert.install({ours: "gpt-2"})
    assert TextModel().get_vocab_base_pre(Tok([9, 9])) == "gpt-2"
    assert TextModel().get_vocab_base_pre(Tok([1, 2, 3])) == "known"
    with pytest.raises(NotImplementedError):
        TextModel().get_vocab_base_pre(Tok([4]))


def test_bad_input_stops_before_any_work_with_status_2(tmp_path):
    import subprocess
    from pathlib import Path

    from dflash.config import ConfigError
    from experiments.serve_check import main
    with pytest.raises(ConfigError, match="--max-new-tokens must be >= 2"):
        main([str(tmp_path), "--max-new-tokens", "1"])
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "experiments.serve_check", str(tmp_path / "nope")], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: ") and "nope" in p.stderr
