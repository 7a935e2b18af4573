"""`key=value` overrides on a config dataclass: the one parser of every entry point.

`experiments.run`, `eval`, `bench`, `promote`, `pretrain_target` and `sweeps.launch` / `sweeps.campaign` hand
their `key=value` tokens here (the run config's `+group=option` selections go to Hydra first, in
experiments/config.py; this module never imports Hydra). A token sets one field of a (nested) dataclass,
dotted: `trainer.max_steps=2000`, `corpus.heldout_per_10k=500`. The value is parsed as the field's declared
type: `int`, `float`, `bool` (true/false, yes/no, on/off, 1/0), `str` (one pair of surrounding quotes
dropped), `list[...]` (`[1,2,3]` or `1,2,3`), `dict[...]` (`{a: b}`) and `X | None` (`null`).

Errors are `OverrideError` (a `ConfigError`, so every entry point prints `error: …` and exits 2) and always
quote the token:
- `override 'trainer.max_steps': expected key=value` (malformed token);
- `override 'trainer.max_stpes=3': unknown key 'max_stpes' in trainer (known: ...)`;
- `override 'trainer.max_steps=many': expected int, got 'many'`;
- `override 'trainer=3': 'trainer' is a config section; set its keys (trainer.<key>=value)`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import yaml

from dflash.errors import ConfigError

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class OverrideError(ConfigError):
    """A bad `key=value` override: malformed, an unknown key or a value of the wrong type."""


def split_override(token: str, what: str = "override") -> tuple[str, str]:
    """'a.b=3' -> ('a.b', '3'); a token without `=` or with an empty key is malformed."""
    key, sep, raw = token.partition("=")
    key = key.strip()
    if not sep or not key:
        raise OverrideError(f"{what} {token!r}: expected key=value")
    return key, raw.strip()


def apply_overrides(cfg: Any, tokens: typing.Iterable[str], what: str = "override", prefix: str = "") -> Any:
    """`cfg` (a dataclass, not changed) with every `key=value` token applied in order. `prefix` is the name the
    tokens carry for `cfg` on the command line (`bench.` for `BenchConfig`): stripped, and kept in messages."""
    for token in tokens:
        key, raw = split_override(token, what)
        if prefix:
            if not key.startswith(prefix):
                raise OverrideError(f"{what} {token!r}: expected a key under {prefix.rstrip('.')}")
            key = key[len(prefix):]
        cfg = _set_path(cfg, key.split("."), raw, f"{what} {token!r}", prefix.rstrip("."))
    return cfg


def _set_path(obj: Any, path: list[str], raw: str, where: str, section: str) -> Any:
    head = path[0]
    names = [f.name for f in dataclasses.fields(obj)]
    if head not in names:
        raise OverrideError(f"{where}: unknown key {head!r} in {section or 'the config'} "
                            f"(known: {', '.join(sorted(names))})")
    current = getattr(obj, head)
    name = f"{section}.{head}" if section else head
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise OverrideError(f"{where}: {name!r} is a value, not a config section")
        return dataclasses.replace(obj, **{head: _set_path(current, path[1:], raw, where, name)})
    if dataclasses.is_dataclass(current):
        raise OverrideError(f"{where}: {name!r} is a config section; set its keys ({name}.<key>=value)")
    declared = typing.get_type_hints(type(obj)).get(head, type(current))
    return dataclasses.replace(obj, **{head: parse_value(raw, declared, where)})


def parse_value(raw: str, declared: Any, where: str = "value") -> Any:
    """`raw` (command-line text) as a value of the type `declared`; OverrideError naming `where` otherwise."""
    args = [a for a in typing.get_args(declared) if a is not type(None)]
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        if raw.lower() in ("null", "none", "~"):
            return None
        return parse_value(raw, args[0] if len(args) == 1 else Any, where)
    origin = typing.get_origin(declared) or declared
    try:
        if origin is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError(raw)
        if origin is int:
            return int(raw)
        if origin is float:
            return float(raw)
        if origin is str:
            return _unquote(raw)
        if origin in (list, tuple):
            items = _yaml(raw) if raw.startswith("[") else [s for s in raw.split(",") if s.strip()]
            if not isinstance(items, list):
                raise ValueError(raw)
            elem = args[0] if args else Any
            return origin(_parsed(x, elem, where) for x in items)
        if origin is dict:
            value = _yaml(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            kt, vt = args if len(args) == 2 else (Any, Any)
            return {_parsed(k, kt, where): _parsed(v, vt, where) for k, v in value.items()}
    except OverrideError:  # an element of a list or mapping: its own message
        raise
    except ValueError:
        raise OverrideError(f"{where}: expected {_type_name(declared)}, got {raw!r}") from None
    return _yaml(raw)


def _parsed(x: Any, declared: Any, where: str) -> Any:
    """An element YAML already parsed, as `declared`: a string or scalar through `parse_value`, a list element by
    element (so a string inside keeps what YAML made of it: '\\n' in double quotes is a newline)."""
    origin = typing.get_origin(declared)
    if isinstance(x, list) and origin in (list, tuple):
        args = typing.get_args(declared)
        return origin(_parsed(e, args[0] if args else Any, where) for e in x)
    return parse_value(x if isinstance(x, str) else str(x), declared, where)


def _yaml(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(raw) from e


def _unquote(raw: str) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def _type_name(t: Any) -> str:
    origin, args = typing.get_origin(t), [_type_name(a) for a in typing.get_args(t)]
    if origin in (list, tuple):
        return f"a list of {args[0]} ([a,b] or a,b)" if args else "a list ([a,b] or a,b)"
    if origin is dict:
        return f"a mapping ({{key: value}}, {' → '.join(args)})" if args else "a mapping ({key: value})"
    if t is bool:
        return "bool (true/false)"
    return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")
