"""Every option of every group composes and builds; bad input fails before any work, naming the key."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.training.buffer import BucketedBuffer
from dflash.config import ConfigError, RunConfig, validate
from dflash.drafter.model import build_drafter
from dflash.training.losses import build_loss
from dflash.training.noise import build_noise
from dflash.target.model import read_target_info, resolve_layer_ids
from experiments.config import CONF_DIR, compose_config, group_options

GROUPS = ["target", "drafter", "loss", "noise", "buffer", "data", "trainer", "tracking", "eval", "promote"]
ROOT = Path(__file__).resolve().parent.parent


def _schema(group):
    return type(getattr(RunConfig(), group))


def _keys(cls, prefix=""):
    out = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            out |= _keys(type(default), f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def _flat(d, prefix=""):
    out = set()
    for k, v in d.items():
        # an empty mapping is a value (eval.stop.sequences: {}), not a group without keys
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k}
    return out


@pytest.mark.parametrize("group", GROUPS)
def test_each_option_file_sets_all_of_its_keys(group):
    for opt in group_options(group):
        data = yaml.safe_load((CONF_DIR / group / f"{opt}.yaml").read_text())
        data.pop("defaults", None)  # an option that selects others too (target/reference_math: its data and eval)
        assert _flat(data) == _keys(_schema(group)), f"conf/{group}/{opt}.yaml"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_option_composes_and_builds(group, option, tmp_path):
    overrides = [f"+{group}={option}"]
    if group == "data" and option == "text_files":
        overrides.append(f"data.path={ROOT / 'dflash'}")
    if group == "data" and option == "conversations":
        overrides.append(f"data.path={ROOT / 'benchmarks' / 'data' / 'conversations_sample.jsonl'}")
    cfg = compose_config(overrides)
    assert getattr(cfg, group) == _option_as_dataclass(group, option, cfg)
    if group == "target" and cfg.target.path:  # a real checkpoint: check the layer ids and token, not the weights
        assert cfg.target.layer_ids and cfg.target.mask_token_id >= 0
        return
    validate(cfg)
    info = read_target_info(cfg.target)
    build_loss(cfg.loss), build_noise(cfg.noise, 10), BucketedBuffer(cfg.buffer)
    build_drafter(cfg.drafter, info.hidden_size, info.num_layers, 0, resolve_layer_ids(cfg.target, info),
                  info.vocab_size)


def _option_as_dataclass(group, option, cfg):
    from dflash.config import _build
    data = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text())
    data.pop("defaults", None)
    if group == "data" and option in ("text_files", "conversations"):
        data["path"] = cfg.data.path
    return _build(_schema(group), data, f"{group}.")


def test_plus_loss_switches_loss_exactly_as_typed():
    assert compose_config([]).loss.name == "hard_ce"
    cfg = compose_config(["+loss=soft_kl", "+noise=cosine", "+buffer=r30_90"])
    assert (cfg.loss.name, cfg.noise.name, cfg.buffer.name) == ("soft_kl", "cosine", "r30_90")
    assert (cfg.buffer.min_ready, cfg.buffer.max_depth) == (30, 90)


@pytest.mark.parametrize("overrides,match", [
    (["loss.tempurature=2"], "tempurature"),
    (["+loss.bogus=1"], "loss.bogus"),
    (["trainer.max_steps=many"], "trainer.max_steps"),
    (["+loss=nonexistent"], "nonexistent"),
])
def test_compose_rejects_unknown_keys_and_wrong_types(overrides, match):
    with pytest.raises(ConfigError, match=match):
        compose_config(overrides)


@pytest.mark.parametrize("overrides,match", [
    (["target.layer_ids=[1,99]"], "target.layer_ids"),
    (["drafter.block_size=1"], "drafter.block_size"),
    (["target.path=/nonexistent/model"], "target.path"),
    (["target.mask_token_id=5000"], "target.mask_token_id"),
    (["data.num_sequences=0"], "data.num_sequences"),
    (["+data=text_files"], "data.path"),
    (["+loss=soft_kl", "loss.name=nope"], "loss.name"),
    (["buffer.min_ready=50"], "buffer.min_ready"),
])
def test_validate_names_the_bad_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_config(overrides))


def test_empty_data_dir_is_rejected(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = compose_config(["+data=text_files", f"data.path={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="no training files"):
        validate(cfg)


def test_cli_bad_input_exits_nonzero_before_any_work(tmp_path):
    run_dir = tmp_path / "never"
    p = subprocess.run([sys.executable, "-m", "experiments.run", "target.layer_ids=[1,99]", f"run_dir={run_dir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "target.layer_ids" in p.stderr
    assert not run_dir.exists(), "nothing may be written before validation passes"
