"""benchmarks/eval_cost.py on the CPU: every part of an evaluation timed in a cold and a warm pass, on the shipped
reference target with a random drafter."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_eval_cost_benchmark_times_every_part_twice(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("eval_cost", ROOT / "benchmarks" / "eval_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--tasks", "2", "--tokens", "12", "--json", str(tmp_path / "e.json"), "target.device=cpu",
                      "eval.tree_budgets=[16]"])
    assert out["device"] == "cpu" and out["tasks"] == 2 and out["proposer"] == "sequential"
    parts = ["ground truth", "vanilla rounds", "vanilla + trees [16]", "prompt lookup rounds", "greedy decoding",
             "speculative decoding"]
    assert list(out["seconds"]) == parts and all(len(s) == 2 and min(s) >= 0 for s in out["seconds"].values())
    # each round commits τ tokens after the prompt's first, which the target's prefill gives
    assert out["real_rounds"] * out["real_tau"] == pytest.approx(2 * (12 - 1))
    printed = capsys.readouterr().out
    assert "| part | cold pass s | warm pass s |" in printed and all(f"| {p} | " in printed for p in parts)
    assert json.loads((tmp_path / "e.json").read_text())["seconds"].keys() == set(parts)
