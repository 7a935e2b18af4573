"""The held-out suite as a shipped file (`eval.heldout.source=frozen`, dflash/evaluation/frozen_suite.py): the same
prompts on every machine, read without the corpus, its checksum checked, its files never trained on, and the
pins written on its prompts before it was frozen still read by their key."""
from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from dflash.data.corpus import split_of
from dflash.evaluation import EvalConfig, HeldoutSuiteConfig, validate_eval_config
from dflash.evaluation.frozen_suite import frozen_path, read_frozen
from dflash.evaluation.heldout import heldout_tasks, select
from dflash.evaluation.prompts import resolve_suite
from dflash.evaluation.truth_pin import PinnedSuite, tasks_digest

REPO = Path(__file__).resolve().parent.parent
# the shipped file's sha256 over its tasks: a change to the suite is a change to this line too
FROZEN_SHA256 = "618270b05406cc4987e907e4acb56aaae2e1e4a65532ab098770ebc3b7da87bb"
STORE = REPO / "benchmarks" / "ablations" / "campaign_out.tar.xz"
SERVED_PINS = ["aff4e25cfb9ca40a86f666ef", "c92562484e665f29e90820a1"]  # the served campaign's held-out pins: T=0, T=1


def test_the_frozen_suite_loads_identically_without_the_corpus(monkeypatch):
    frozen = read_frozen()
    assert frozen.head["sha256"] == FROZEN_SHA256 == tasks_digest(json.loads(frozen_path().read_text())["tasks"])
    assert len(frozen.tasks) == 128 and all(t.reference and t.prompt.strip() for t in frozen.tasks[:3])
    assert "PSF" in frozen.head["licence"] and "PYTHON SOFTWARE FOUNDATION LICENSE" in frozen.head["licence_text"]

    def no_corpus(*a, **k):
        raise AssertionError("the frozen suite read the corpus")
    monkeypatch.setattr("dflash.evaluation.heldout.load_corpus", no_corpus)
    full = resolve_suite("heldout", EvalConfig(heldout=HeldoutSuiteConfig())).tasks
    assert [(t.name, t.prompt, t.reference) for t in full] == \
        [(t.name, t.prompt, t.reference) for t in sorted(frozen.tasks, key=lambda t: t.name)]
    small = heldout_tasks(HeldoutSuiteConfig(num_prompts=8))
    assert small == select(frozen.tasks, 8) and set(small) <= set(full)  # the corpus selection's first 8


def test_an_edited_frozen_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "heldout.json"
    bad.write_text(frozen_path().read_text().replace("def ", "def  ", 1))
    with pytest.raises(ValueError, match=f"{bad}.*checksum mismatch"):
        read_frozen(bad)


def test_the_frozen_files_are_held_out_of_training():
    frozen = read_frozen()
    corpus = frozen.head["corpus"]
    for task, source in zip(frozen.tasks, frozen.sources):
        assert split_of(source, corpus["heldout_per_10k"], corpus["salt"]) in ("val", "test"), source
        assert task.name.startswith(source.removesuffix(".py").replace("/", ".") + ".")


def test_a_selection_the_frozen_file_was_not_made_with_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="eval.heldout.max_prompt_chars=200.*source=corpus"):
        validate_eval_config(EvalConfig(heldout=HeldoutSuiteConfig(max_prompt_chars=200)))
    with pytest.raises(ValueError, match="eval.heldout.num_prompts=129"):
        validate_eval_config(EvalConfig(heldout=HeldoutSuiteConfig(num_prompts=129)))
    with pytest.raises(ValueError, match="eval.heldout.source='disk'"):
        validate_eval_config(EvalConfig(heldout=HeldoutSuiteConfig(source="disk")))
    validate_eval_config(EvalConfig(heldout=HeldoutSuiteConfig(max_prompt_chars=200, source="corpus")))


@pytest.mark.parametrize("pin_name", SERVED_PINS)
def test_the_pins_written_before_the_freeze_are_read_by_their_key(pin_name, tmp_path):
    """The served campaign pinned its held-out ground truth on the GPU machine's standard library; the frozen
    prompts tokenize to the pinned prompts, so the pin's file name is still their key and it reads."""
    from transformers import AutoTokenizer
    member = f"campaign_out/served/truth/{pin_name}.json"
    with tarfile.open(STORE) as tar:
        with tar.extractfile(member) as src, open(tmp_path / f"{pin_name}.json", "wb") as dst:
            shutil.copyfileobj(src, dst)
    pin = json.loads((tmp_path / f"{pin_name}.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(REPO / "dflash" / "assets" / "reference_target"), local_files_only=True)
    tasks = heldout_tasks(HeldoutSuiteConfig())
    per = pin["protocol"]["samples"] if pin["protocol"]["sampling"]["temperature"] > 0 else 1
    names = [t.name if per == 1 else f"{t.name}#s{i}" for t in tasks for i in range(per)]
    prompts = [tuple(tok.encode(t.prompt)) for t in tasks for _ in range(per)]
    pinned = PinnedSuite(pin["target"], tuple(names), tuple(prompts), 256, 0, pin["protocol"])
    assert pinned.path(tmp_path).name == f"{pin_name}.json"
    assert len(pinned.read(pinned.path(tmp_path)).continuations) == 128 * per


def test_the_freeze_command_refuses_a_folder_that_is_no_standard_library(tmp_path, capsys):
    from experiments.freeze_heldout import main
    with pytest.raises(SystemExit) as e:
        main(["--stdlib", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "no LICENSE.txt" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
