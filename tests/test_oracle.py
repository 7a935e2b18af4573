"""The oracle drafter (dflash.evaluation.oracle) in the real decoding loop on a tiny random hybrid qwen3_5 target
(CPU), and the benchmark that times it against greedy decoding on the shipped reference target
(benchmarks/decode_ceiling.py)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dflash.evaluation.ground_truth import build_ground_truth
from dflash.evaluation.oracle import OracleDrafter
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
    assert json.loads((tmp_path / "c.json").read_text())["dtypes"]["float32"]["identical"] == 2
