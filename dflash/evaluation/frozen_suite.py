"""The held-out suite as a shipped file (`eval.heldout.source=frozen`, the default; docs/evaluation.md).

Why: the suite used to be rebuilt from the local standard library, and standard libraries differ between Python
versions (under 3.11.7 only 112 of the 128 prompts the served campaign pinned on Python 3.12 rebuild), so two
machines evaluated on different prompts. `dflash/evaluation/suites/heldout.json` holds the 128 prompts once:
each task's name, prompt, human continuation (`reference`) and source file (its path under the standard library,
the path the corpus splits by), with the standard library's version, its licence (CPython's `Lib/` is under the
PSF License Version 2, whose text the file carries, as the licence asks of a derivative work), the selection
settings it was made with, the command that made it and a sha256 over its tasks. Reading it needs no corpus.

The corpus split is unchanged: a file is held out by the hash of its relative path (`dflash.data.corpus.split_of`),
so training never reads these files on any Python version (tested). Ground-truth caches and pins are keyed by the
prompts themselves, so the pins written on the 128 pinned prompts stay readable (tested against the committed
campaign's pin).

Made by `python -m experiments.freeze_heldout` (its module doc has the command that made the shipped file).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash.evaluation.prompts import Task, parse_suite
from dflash.evaluation.truth_pin import read_checked_tasks, tasks_digest

KIND = "dflash-frozen-suite"
FORMAT = 1
# the settings that decided which prompts were picked; under source=frozen they must keep the frozen values
SELECTION_KEYS = ("split", "min_prompt_chars", "max_prompt_chars", "max_per_file", "corpus_root")


def frozen_path() -> Path:
    return Path(str(resources.files("dflash.evaluation") / "suites" / "heldout.json"))


@dataclass(frozen=True)
class FrozenSuite:
    head: dict  # everything but the tasks: source, licence, selection, command, sha256
    tasks: list[Task]
    sources: list[str]  # each task's source file, relative to the standard library's root


def read_frozen(path: Path | None = None) -> FrozenSuite:
    """The frozen suite at `path` (default: the shipped one); ValueError naming the file on anything but a whole,
    unedited file of this format."""
    path = path or frozen_path()
    where = f"frozen held-out suite {path}"

    def bad(why: str) -> ValueError:
        return ValueError(f"{where}: {why}; make it again with python -m experiments.freeze_heldout")
    data, items = read_checked_tasks(path, KIND, FORMAT, bad)
    tasks = parse_suite(items, where)
    head = {k: v for k, v in data.items() if k != "tasks"}
    return FrozenSuite(head, tasks, [str(t.get("source", "")) for t in items])


def check_selection(cfg) -> None:
    """ValueError naming the `eval.heldout` key whose value the frozen file was not made with (`cfg`: the
    HeldoutSuiteConfig); the frozen suite cannot honour it, the corpus can."""
    frozen = read_frozen()
    picked = frozen.head.get("selection", {})
    for key in SELECTION_KEYS:
        if getattr(cfg, key) != picked.get(key):
            raise ValueError(f"eval.heldout.{key}={getattr(cfg, key)!r}, but the frozen held-out suite "
                             f"({frozen_path().name}) was selected with {picked.get(key)!r}; keep it, or set "
                             f"eval.heldout.source=corpus to rebuild the suite from the local corpus")
    if cfg.num_prompts > len(frozen.tasks):
        raise ValueError(f"eval.heldout.num_prompts={cfg.num_prompts}: the frozen held-out suite holds "
                         f"{len(frozen.tasks)} prompts (eval.heldout.source=corpus rebuilds a larger one)")


def frozen_heldout_tasks(cfg) -> list[Task]:
    """The first `cfg.num_prompts` of the frozen suite by the corpus selection's own order (`heldout.select`),
    so a smaller frozen suite is the same prompts the corpus selection picks."""
    from dflash.evaluation.heldout import select
    check_selection(cfg)
    return select(read_frozen().tasks, cfg.num_prompts)


def frozen_text(tasks: list[Task], sources: list[str], head: dict, pythons: list[str]) -> str:
    """The frozen file's text: `head` (source, licence, selection, command), the sha256 over the tasks, then the
    tasks one per line (each with its source file and the CPython version it was cut from), so the file reads and
    diffs well."""
    items = [{"name": t.name, "source": s, "python": v, "prompt": t.prompt, "reference": t.reference}
             for t, s, v in zip(tasks, sources, pythons)]
    head = {"kind": KIND, "format": FORMAT, **head, "sha256": tasks_digest(items)}
    return json.dumps(head, indent=1, ensure_ascii=False)[:-2] + ',\n "tasks": [\n  ' \
        + ",\n  ".join(json.dumps(t, ensure_ascii=False) for t in items) + "\n ]\n}\n"
