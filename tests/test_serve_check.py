"""`python -m experiments.serve_check` end to end (docs/engines.md): llama.cpp built from the pinned sdist (cached
under ~/.cache/dflash/llamacpp between runs; from an empty cache the build is bounded by BUILD_TIMEOUT_S here), a
drafter trained for a few steps on the shipped reference target, converted by llama.cpp's converter and served by
llama-server at T=0 and T=1, its rounds against the evaluator's on the engine's tokens."""
from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.slow

BUILD_TIMEOUT_S = 1800.0  # 6 min on 2 idle cores (docs/engines.md); CI's whole budget is 90 min


@pytest.fixture(scope="module")
def llama():
    from dflash.serving.llamacpp import ensure_llamacpp
    return ensure_llamacpp(timeout_s=BUILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A one-layer drafter after 30 CPU steps on the shipped reference target: it accepts a few tokens a round."""
    from dflash.app.run import train
    from experiments.config import compose_config
    tmp = tmp_path_factory.mktemp("serve_check")
    cfg = compose_config(["+eval=off", "drafter.num_layers=1", "trainer.max_steps=30", "trainer.checkpoint_every=30",
                          f"run_dir={tmp / 'run'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                          "tracking.console=false", "tracking.system_metrics=false"])
    train(cfg)
    return tmp / "run"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The check's folder: its GGUF files serve the tokenizer test too."""
    return tmp_path_factory.mktemp("serve_check_work")


def test_llama_server_rounds_are_the_evaluators_on_its_tokens(llama, trained_run, work):
    from dflash.target.sampling import GREEDY, Sampling
    from experiments.serve_check import main
    results = main([str(trained_run), "--max-new-tokens", "32", "--work", str(work)])
    assert [r.setting for r in results] == [GREEDY, Sampling(1.0, 1.0, 0)]  # the target's generation_config: T=1
    for r in results:
        assert len(r.requests) == 10 and r.rounds >= 100
        assert r.agrees, [(q.name, q.engine, q.simulated) for q in r.requests if q.mismatched]
        assert r.tau_engine > 1.0  # the drafter gets tokens accepted: the rounds compared are not all trivial
        assert abs(r.tau_engine - r.tau_simulated) < 0.02
    # the engine's T=1 tokens are sampled, not its argmax: the two settings served different streams
    assert [q.engine for q in results[0].requests] != [q.engine for q in results[1].requests]


def test_the_gpt2_rule_splits_the_reference_tokenizers_text_as_it_does(llama, trained_run, work, tmp_path):
    """The pre-tokenizer mapping (PRE_TOKENIZERS) is right: llama.cpp's tokens are the tokenizer's own."""
    from dflash.evaluation.prompts import load_suite
    from dflash.serving.llamacpp import LlamaServer, convert_to_gguf
    from dflash.target.assets import shipped_folder
    from transformers import AutoTokenizer
    target_dir = shipped_folder("reference_target")  # llama.cpp's converter reads the weights unpacked
    tok = AutoTokenizer.from_pretrained(target_dir)
    gguf_t, gguf_d = work / "target.gguf", work / "drafter.gguf"  # the check's, when it ran first
    if not gguf_t.is_file():
        convert_to_gguf(llama, target_dir, gguf_t)
    if not gguf_d.is_file():
        convert_to_gguf(llama, trained_run / "final", gguf_d, target_dir=target_dir)
    texts = [t.prompt for t in load_suite("coding10")] + [
        "\n\n\tx = 1\n\n\n    if a  and  b:\r\n        pass  \n", "s = 'café ✓ 🦙'  # ünïcode\n",
        "3.14e-10, 1_000_000, 0x1F;; ...;;;", "def   f( *args,**kw ) ->None :\n\t\treturn\t\n"]
    with LlamaServer(llama, gguf_t, gguf_d, draft_max=15, log=tmp_path / "server.log") as server:
        for text in texts:
            assert server.tokenize(text) == tok.encode(text), text


def test_a_folder_llama_cpp_cannot_convert_fails_the_check_with_its_message(llama, trained_run, tmp_path):
    from dflash.serving.llamacpp import ConversionError, convert_to_gguf
    from dflash.target.assets import shipped_folder
    bad = tmp_path / "bad"
    shutil.copytree(trained_run / "final", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchDraftModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"(?s)cannot convert it.*NoSuchDraftModel"):
        convert_to_gguf(llama, bad, tmp_path / "bad.gguf", target_dir=shipped_folder("reference_target"))
    assert not list(tmp_path.glob("*.gguf*")), "no GGUF, whole or partial, is left"
