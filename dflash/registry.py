"""Name → variant tables: every choice a config makes by name goes through one `Registry`.

Losses, their terms and weightings (`dflash.training.losses`), the LM-head gradient paths, noise schedules,
pull policies, attention kernels, data sources, producer modes, tiny target types, and the sweeps' samplers
and pruners all use it the same way::

    KERNELS = Registry("drafter.attn_kernel")        # the config key that names the choice

    @KERNELS.register("sdpa")                        # a class or a function, as a decorator ...
    class SdpaKernel: ...
    KERNELS.register("flex", FlexKernel())           # ... or any object, directly

    KERNELS["sdpa"]                                  # the entry; an unknown name raises UnknownName
    KERNELS.build("sdpa", *args)                     # the entry called with args (a class: an instance)
    KERNELS.check(cfg.drafter.attn_kernel)           # the config check, before any work
    KERNELS.names()                                  # sorted names, for messages and choices

An unknown name raises `UnknownName` (a `ValueError`, which `dflash.config.validate` reports as a
`ConfigError`) naming the key, the bad value and the known names. A registry is a `dict`, so `in`,
iteration, `sorted(...)` and `pop` work as on one.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")
_DECORATE = object()


class UnknownName(ValueError):
    """A name no entry of a registry has; the message names the config key and the known names."""


class Registry(dict[str, T]):
    def __init__(self, key: str, entries: dict[str, T] | None = None):
        super().__init__()
        self.key = key  # the config key whose value is looked up here (e.g. "loss.name")
        for name, obj in (entries or {}).items():
            self.register(name, obj)

    def register(self, name: str, obj: Any = _DECORATE) -> Any:
        """Add `obj` as `name` (without `obj`: a decorator that adds what it decorates). Registering the
        same object twice is a no-op; another object under a taken name is an error."""
        if obj is _DECORATE:
            return lambda o: self.register(name, o)
        if dict.get(self, name, obj) is not obj:
            raise ValueError(f"{self.key}: {name!r} is already registered")
        self[name] = obj
        return obj

    def __missing__(self, name: str) -> T:
        raise UnknownName(f"{self.key}={name!r} is unknown; known: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return sorted(self)

    def check(self, name: str) -> None:
        """Raises `UnknownName` unless `name` is registered."""
        self[name]  # noqa: B018 - __missing__ raises

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        entry: Callable[..., Any] = self[name]  # type: ignore[assignment]
        return entry(*args, **kwargs)
