"""dflash.registry: one helper behind every name -> variant table."""
import pytest

from dflash.config import ConfigError, RunConfig, validate
from dflash.registry import Registry, UnknownName


def test_register_build_check_and_names():
    reg = Registry("thing.kind")

    @reg.register("b")
    def make_b(x):
        return ("b", x)

    reg.register("a", lambda x: ("a", x))
    assert reg.names() == ["a", "b"] and "a" in reg and reg["b"] is make_b
    assert reg.build("b", 3) == ("b", 3)
    reg.check("a")
    assert reg.register("b", make_b) is make_b  # the same object again: a no-op
    with pytest.raises(ValueError, match=r"thing\.kind: 'b' is already registered"):
        reg.register("b", lambda x: x)
    with pytest.raises(UnknownName, match=r"thing\.kind='c' is unknown; known: a, b"):
        reg.check("c")
    with pytest.raises(UnknownName, match=r"thing\.kind='c'"):
        reg.build("c")
    assert reg.get("c") is None and isinstance(UnknownName("x"), ValueError)


def test_entries_at_construction_and_pop():
    reg = Registry("k", {"x": 1, "y": 2})
    assert dict(reg) == {"x": 1, "y": 2} and reg.pop("x") == 1 and reg.names() == ["y"]


@pytest.mark.parametrize("section,key,value", [
    ("loss", "lm_head_grad", "nope"), ("loss", "name", "nope"), ("trainer", "producer_mode", "nope"),
    ("drafter", "attn_kernel", "nope"), ("noise", "name", "nope"), ("buffer", "policy", "nope"),
    ("data", "source", "nope"), ("eval", "proposer", "nope"), ("loss", "lm_head_kernel", "nope"),
    ("target", "fused_ops", "nope"),
])
def test_validate_names_the_key_and_the_known_names(section, key, value):
    import dataclasses
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    with pytest.raises(ConfigError, match=rf"{section}\.{key}='nope' is unknown; known: "):
        validate(cfg)


def test_tiny_target_type_is_checked_before_building():
    import dataclasses
    cfg = RunConfig()
    random = dataclasses.replace(cfg.target.random, model_type="llama")
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, path="", random=random))
    with pytest.raises(ConfigError, match=r"target\.random\.model_type='llama' is unknown; known: qwen3_5, qwen3_next"):
        validate(cfg)
