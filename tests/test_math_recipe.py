"""The math target's recipe end to end at toy scale on the CPU (issue 75): `experiments.pretrain_target data=math`
with a tiny shape writes a target folder and its quality bar, and `experiments.run +target=reference_math` trains a
drafter on that folder with the problem generator's sequences and the frozen held-out suite."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data=math", "hidden_size=32", "num_layers=4", "intermediate_size=64", "num_heads=2", "num_kv_heads=1",
        "head_dim=16", "linear_num_key_heads=2", "linear_num_value_heads=2", "linear_head_dim=16", "vocab_size=384",
        "math_problems=1500", "math_eval_problems=20", "corpus.limit_files=10", "seq_len=64", "batch_size=6",
        "max_steps=24", "warmup_steps=4", "eval_every=12", "eval_tokens=1024", "final_eval_tokens=2048",
        "bar_problems=4", "bar_oracle_prompts=1", "bar_rollouts=4", "bar_max_new_tokens=24", "max_new_tokens=4",
        "device=cpu", "token_cache_dir=", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def tiny_math_target(tmp_path_factory):
    from experiments.pretrain_target import main
    d = tmp_path_factory.mktemp("math")
    m = main(TINY + [f"run_dir={d / 'run'}", f"out_dir={d / 'target'}", f"results_path={d / 'results.md'}"])
    return d, m


@pytest.mark.slow
def test_the_tiny_pretrain_writes_the_folder_and_its_quality_bar(tiny_math_target):
    d, m = tiny_math_target
    folder = d / "target"
    meta = json.loads((folder / "dflash_target.json").read_text())
    assert meta["name"] == "reference_math_target" and meta["recipe"]["data"] == "math"
    assert meta["corpus"]["scope"].endswith("+math")
    gc = json.loads((folder / "generation_config.json").read_text())
    assert (gc["do_sample"], gc["temperature"], gc["top_p"], gc["top_k"]) == (True, 1.0, 0.95, 20)
    q = meta["quality_bar"]
    assert q == json.loads(json.dumps(m["quality_bar"], default=str))
    assert q["problems"] == 4 and 0 <= q["accuracy"] <= 1 and q["entropy"]["tokens"] > 0
    assert q["oracle"]["block_size"] == 16 and 1 <= q["oracle"]["tau"] <= 16
    assert set(q["met"]) == {"accuracy", "share_below_0.1", "mean_entropy", "in_repeat16", "cycle_share",
                             "eos_after_answer", "oracle_tau"}
    assert "## Quality bar" in (d / "results.md").read_text()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("= 128").tokens[-3:] == ["1", "2", "8"]  # a token per digit


@pytest.mark.slow
def test_a_drafter_trains_on_the_tiny_math_target(tiny_math_target, tmp_path):
    d, _ = tiny_math_target
    out = subprocess.run([sys.executable, "-m", "experiments.run", "+target=reference_math", f"target.path={d / 'target'}",
                          "target.layer_ids=[0,1,2]",
                          "trainer.max_steps=3", "trainer.num_anchors=4", "trainer.eval_every=0",
                          "data.num_sequences=16", "data.min_len=24", "data.max_len=64", "drafter.num_layers=1",
                          "eval.max_new_tokens=24", "eval.samples=1", "eval.tree_budgets=[16]", "eval.bootstrap=100",
                          f"eval.cache_dir={tmp_path / 'eval'}", f"run_dir={tmp_path / 'run'}",
                          "tracking.enabled=false"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = (tmp_path / "run" / "config.yaml").read_text()
    assert "source: math" in cfg and "suite: math10" in cfg
    assert "tau_served" in out.stdout + out.stderr


def test_a_wrong_data_kind_exits_2_naming_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.pretrain_target", "data=maths", "tracking.enabled=false",
                          f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "pretrain.data='maths'" in out.stderr
    assert not (tmp_path / "run").exists()
