"""The shipped math reference target (dflash/assets/reference_math_target/, issue 75): the quality bar its pretraining
recorded, and the cheap figures recomputed here on the CPU from the shipped weights."""
import json

import pytest

from dflash.pretrain.math_quality import BAR, check_bar, load_target, quality_bar, suite_tasks
from dflash.target.assets import asset_folder, packed_files, shipped_folder
from dflash.target.sampling import read_generation_config

ASSET = asset_folder("reference_math_target")  # tokenizer, config and records; the weights packed (.xz)
pytestmark = pytest.mark.skipif(
    not (packed_files(ASSET) or any(ASSET.glob("*.safetensors"))),
    reason="dflash/assets/reference_math_target/ has no weights: its GPU pretraining "
           "(benchmarks/leased_gpu/pretrain_math_target.sh) writes them")


def _meta() -> dict:
    return json.loads((ASSET / "dflash_target.json").read_text())


def test_the_recorded_quality_bar_is_met():
    meta = _meta()
    q = meta["quality_bar"]
    assert check_bar(q) == {k: True for k in check_bar(q)}, q["met"]
    assert len(check_bar(q)) == len(BAR)  # the oracle's line included
    assert q["problems"] >= 128 and q["sampling"] == read_generation_config(ASSET).as_dict()
    assert meta["model"]["bf16_bytes"] < 40_000_000 and meta["recipe"]["data"] == "math"


def test_it_is_served_at_t1():
    s = read_generation_config(ASSET)
    assert s.temperature == 1.0 and 0 < s.top_p <= 1 and s.top_k >= 0


@pytest.mark.slow
def test_the_cheap_figures_hold_on_the_cpu():
    """Accuracy, entropy profile and degeneracy on 24 held-out problems at the served setting (the oracle is the GPU's
    figure). 24 problems: the bar's accuracy less a margin for the small sample."""
    target = load_target(str(shipped_folder("reference_math_target")), "cpu")  # the shipped weights, unpacked
    q = quality_bar(target, suite_tasks(24), read_generation_config(ASSET), oracle_prompts=0, batch_size=24)
    assert q["accuracy"] >= BAR["accuracy"] - 0.15
    assert q["entropy"]["share_below_0.1"] > BAR["share_below_0.1"]
    assert q["degeneracy"]["in_repeat16"] <= BAR["in_repeat16"] and q["degeneracy"]["cycle_share"] <= 0.05
    assert q["degeneracy"]["eos_after_answer"] >= 0.9
