"""The oracle drafter (dflash.evaluation.oracle) in the real decoding loop on a tiny random hybrid qwen3_5 target
(CPU), and the benchmark that times it against greedy decoding on the shipped reference target
(benchmarks/decode_ceiling.py)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from dflash.evaluation.ground_truth import build_ground_truth
from dflash.evaluation.oracle import OracleDrafter, loop_tokens, oracle_ceiling
from dflash.evaluation.prompts import Task
from dflash.evaluation.speculative import greedy_decode, speculative_decode

ROOT = Path(__file__).resolve().parents[1]
N = 40
TASKS = [Task("fib", 'def fib(n):\n    """Fibonacci."""\n'), Task("rev", "def rev(s):\n    return")]


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_oracle_accepts_every_block_and_writes_the_greedy_tokens(reference_target, block_size):
    for tr in build_ground_truth(reference_target, TASKS, N):
        o = OracleDrafter(tr.tokens.tolist(), reference_target.vocab_size, block_size)
        s = speculative_decode(o, reference_target, tr.prompt_ids, N)
        assert s.tokens == greedy_decode(reference_target, tr.prompt_ids, N).tokens == tr.continuation.tolist()
        # every round commits a whole block (its drafts and the bonus token), the last one clipped to N
        assert s.taus[:-1] == [block_size] * (len(s.taus) - 1) and 1 <= s.taus[-1] <= block_size
        assert sum(s.taus) == N
        # the prefill, one verify forward per round, and a replay of the kept part of a clipped last block: the
        # hybrid target's recurrent state cannot be cut, so a partial commit re-advances it (TargetSession.commit)
        assert s.target_forwards == 1 + len(s.taus) + (s.taus[-1] < block_size)


def test_the_oracle_follows_the_loop_off_a_wrong_truth(reference_target):
    """bfloat16's block verify can pick another token than greedy decoding at a near-tie; from there the greedy
    tokens continue another prefix. Stood in for on CPU by a truth with one token changed: the loop diverges there,
    and `loop_tokens` makes the oracle propose what the loop commits, so the timed pass accepts every block."""
    B = 8
    good = build_ground_truth(reference_target, TASKS, N)
    bad = []
    for tr in good:
        c = tr.continuation.clone()
        c[5] = (c[5] + 1) % reference_target.vocab_size
        bad.append(dataclasses.replace(tr, continuation=c))
    wrong = speculative_decode(OracleDrafter(bad[0].tokens.tolist(), reference_target.vocab_size, B),
                               reference_target, bad[0].prompt_ids, N)
    assert any(t < B for t in wrong.taus[:-1])  # the stand-in diverges as bfloat16 did
    tokens, diverged = loop_tokens(reference_target, bad[0], B, N)
    assert diverged == 1 and tokens == good[0].tokens.tolist()  # float32: the loop's own tokens are greedy's
    assert loop_tokens(reference_target, good[0], B, N) == (good[0].tokens.tolist(), 0)
    r = oracle_ceiling(reference_target, bad, B, N)
    assert r["resynced"] == len(bad) and r["identical"] == r["runs"] == len(bad)
    assert all(all(t == B for t in taus[:-1]) for taus in r["taus"])


def test_the_ceiling_benchmark_prints_both_loops_side_by_side(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("decode_ceiling", ROOT / "benchmarks" / "decode_ceiling.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--tasks", "2", "--tokens", "24", "--repeats", "1", "--json", str(tmp_path / "c.json"),
                      "target.device=cpu"])
    r = out["dtypes"]["float32"]
    assert out["device"] == "cpu" and list(out["dtypes"]) == ["float32"]
    assert r["tau"] > 1 and r["identical"] == r["runs"] == 2
    assert r["target_forwards_greedy"] == 2 * 24 and r["target_forwards_speculative"] < r["target_forwards_greedy"]
    assert r["speed_up"] == pytest.approx(r["speculative_tok_s"] / r["greedy_tok_s"])
    printed = capsys.readouterr().out
    assert "| float32 | " in printed and f"**{r['speed_up']:.2f}×**" in printed
    assert r["resynced"] == 0 and printed.rstrip().count("| 0/2 |") == 1  # float32's oracle is greedy's tokens
    assert json.loads((tmp_path / "c.json").read_text())["dtypes"]["float32"]["identical"] == 2
