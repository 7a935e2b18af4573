"""Hydra composition against the typed schema; the only place (with the entry points) that knows Hydra.

`compose_config(overrides)` returns a plain `dflash.config.RunConfig`: Hydra composes the group selections
(`+loss=soft_kl`) against the structured schema registered here (unknown keys and wrong types in a YAML group
fail, naming the key); the `key=value` overrides then go through `dflash.overrides`, the one override parser
of every entry point, so a bad one reads the same everywhere and exits 2 (`run_cli`).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dflash.config import ConfigError, RunConfig, from_dict
from dflash.overrides import apply_overrides, split_override

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
ConfigStore.instance().store(name="schema", node=RunConfig)


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra's tokens, key=value tokens): `+group=option` / `group=option` selections and `~` deletions are
    Hydra's; every other token is a `key=value` override for `dflash.overrides` (a leading `+` dropped)."""
    hydra, values = [], []
    for o in overrides:
        key = o.partition("=")[0].lstrip("+")
        if o.startswith("~") or ("=" in o and key in GROUPS):
            hydra.append(o)
        else:
            values.append(o.lstrip("+") if "=" in o else o)
    return hydra, values


def compose_config(overrides: list[str] | None = None, config_name: str = "config") -> RunConfig:
    """Compose conf/config.yaml with its group selections (e.g. ['+loss=soft_kl']), then the `key=value`
    overrides on top (e.g. ['seed=3']) through the one override parser, `dflash.overrides`."""
    group_tokens, values = split_overrides(list(overrides or []))
    for token in values:  # a malformed token fails before Hydra runs
        split_override(token)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=group_tokens)
        # `+key=value` force-adds keys even into a structured node: the strict rebuild rejects them.
        composed = from_dict(OmegaConf.to_container(cfg, resolve=True))
    except (HydraException, OmegaConfBaseException) as e:
        cause = f" ({e.__cause__})" if e.__cause__ else ""
        raise ConfigError(f"config: {e}{cause}".strip()) from e
    return apply_overrides(composed, values)


def resume_config(run_dir: str, overrides: list[str]) -> RunConfig:
    """The saved config of `run_dir` with `key=value` overrides on top (e.g. trainer.max_steps=2000 to extend a
    run). Group options cannot change on resume: that would be another run."""
    from dflash.run_dir import RunDir
    try:
        saved_cfg = RunDir(run_dir).read_config()
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume={run_dir!r}: {e}") from e
    groups = [o for o in overrides if o.startswith("+") or o.split("=")[0] in GROUPS]
    if groups:
        raise ConfigError(f"resume: {groups} would change a config group; only key=value overrides apply on resume")
    cfg = apply_overrides(from_dict(saved_cfg), overrides)
    return dataclasses.replace(cfg, run_dir=str(run_dir), resume=str(run_dir))


# Config groups whose option is switched with `+group=option` (the base entry sits in conf/config.yaml):
# every folder of conf/ but sweep/ and campaign/ (sweep and campaign definitions are not part of the run config).
NOT_GROUPS = ("sweep", "campaign")
GROUPS = tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_GROUPS))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def default_group_options() -> dict[str, str]:
    """group -> the option conf/config.yaml picks."""
    import yaml
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text()).get("defaults", [])
    return {e.split("/")[0]: e.split("/")[1].split("@")[0] for e in defaults if isinstance(e, str) and "/" in e}


def _keys_table(d: dict, prefix: str = "") -> list[str]:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            lines += _keys_table(v, f"{prefix}{k}.")
        else:
            lines.append(f"  {prefix}{k}={v!r}" if isinstance(v, str) else f"  {prefix}{k}={v}")
    return lines


def help_text(doc: str, run_keys: bool = True, extra: dict | None = None, groups: bool = True) -> str:
    """`--help` for an entry point: its docstring, the config groups with their options (`+group=option`, the
    default marked *), and every `key=value` key with its default (`extra`: more sections, e.g. bench.*)."""
    from dflash.config import to_dict
    out = [doc.strip(), ""]
    if groups:
        picked = default_group_options()
        out.append("Config groups (switch with +group=option; * = default):")
        for g in GROUPS:
            opts = [f"{o}*" if o == picked.get(g) else o for o in group_options(g)]
            out.append(f"  {g}: {', '.join(opts)}")
        out.append("")
    if run_keys:
        try:
            d = to_dict(compose_config([]))
        except ConfigError:
            d = to_dict(RunConfig())
        out.append("Keys (key=value; defaults as composed from conf/config.yaml):")
        out += _keys_table(d)
    for section, d in (extra or {}).items():
        out += ["", f"{section} keys:" if section else "Keys (key=value, defaults shown):"] + _keys_table(d, f"{section}." if section else "")
    return "\n".join(out)


class ArgParser(argparse.ArgumentParser):
    """argparse for the flag-style entry points (promote, export), whose errors read like every other entry
    point's: `error: …` on stderr, exit status 2."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def exit_on_help(argv: list[str], doc: str, **kw) -> None:
    """Prints `help_text` and exits 0 when argv asks for help (-h / --help)."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(doc, **kw))
        raise SystemExit(0)


def _ignore_late_sigterm() -> None:
    """The stop is done and the process exits: SIGTERM ignored from here. `timeout` and batch schedulers send one
    copy to the child, then one to its process group, and the second may land in Python's finalization, which gives
    every handler Python set back to SIG_DFL (not SIG_IGN): the process then died by the signal instead of exiting
    128 + signal with its run checkpointed and closed (a small run stopped within the 50 ms between two copies did,
    tests/test_run_lifecycle.py). Ctrl-C keeps working on an exit that hangs."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _quiet_stdout() -> None:
    """stdout onto /dev/null: the interpreter's flush at exit would raise BrokenPipeError again (Python's
    documented recipe, library/signal.html "Note on SIGPIPE")."""
    import os
    import sys
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def run_cli(main) -> None:
    """`python -m experiments.X`: logging on, bad input → `error: …` on stderr and exit status 2."""
    import logging
    import os
    import sys
    # Fewer, growable allocator segments: the drafter's variable-length steps otherwise fragment the cache.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # compile and autotune caches under ~/.cache/dflash: a repeated run's first step in seconds (dflash/devices.py)
    from dflash.devices import persist_compile_caches
    persist_compile_caches()
    # DFLASH_LOG_TIME=1 (the GPU job scripts' environment): every line timed, so a job's logs say where its
    # seconds went (cells once sat idle for minutes and their untimed logs did not say so)
    stamp = "%(asctime)s " if os.environ.get("DFLASH_LOG_TIME") == "1" else ""
    logging.basicConfig(level=logging.INFO, format=stamp + "%(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr and the run goes on: where a run that logs nothing
    # is (a 27B run with its writer in the loop once logged no step before it was stopped, and nothing said why)
    import faulthandler
    import signal
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)  # fd 2, whatever wraps stderr
    from dflash.atomic import DiskFullError
    from dflash.safe_load import UnsafeFileError
    from dflash.tracking.store import StoreError
    from dflash.training.health import DeadDrafterError
    from dflash.training.interrupts import RunInterrupted
    try:
        main()
    except (ConfigError, UnsafeFileError, StoreError) as e:  # bad input: a value, a damaged file, a store
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # the reader went away (`... --help | head`): no error of ours, nothing more to write
        _quiet_stdout()
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a writer the pipe's end killed
    except ConnectionError as e:  # a tracking server a command needs, dead or silent (bounded: seconds)
        print(f"error: the tracking store does not answer: {e}", file=sys.stderr)
        sys.exit(1)
    except RunInterrupted as e:  # the trainer checkpointed and closed its run KILLED
        _ignore_late_sigterm()
        print(f"{e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before a run began (while composing the config): nothing to keep
        print("stopped by SIGINT before the run started", file=sys.stderr)
        sys.exit(130)
    except DeadDrafterError as e:  # closed FAILED
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except DiskFullError as e:  # the folder holds only whole files; the run closed FAILED
        print(f"error: {e.strerror}", file=sys.stderr)
        sys.exit(1)
