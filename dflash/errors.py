"""The library's one bad-input exception, at the bottom of the package so every layer can raise it (the
config schema in dflash/config.py re-exports it; the CLIs turn it into `error: …` and exit status 2)."""
from __future__ import annotations


class ConfigError(ValueError):
    """Bad input, found before any work starts."""
