"""Eval suites: a list of named prompts, each the start of a Python source file (a `def` line and its
docstring, after any imports it needs) so that a code model continues it as code.

A suite is a built-in name (a JSON file shipped in `dflash/evaluation/suites/`, e.g. `coding10`), a
generated suite (`heldout`: the shipped frozen file by default, or rebuilt from the corpus's held-out files,
`dflash.evaluation.heldout`) or a path
to a JSON file holding `[{"name": ..., "prompt": ...}, ...]`. `resolve_suite(name, eval_cfg)` gives any of
them as a `Suite` (its label for metric keys, its tasks and the continuation length it is evaluated at).
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from dflash.data.stops import CodeStop


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    # what followed the prompt in its source file (suites cut from files: the held-out suite); "" = unknown. The
    # evaluation measures its degeneracy and prompt lookup's τ on it beside the target's ground truth.
    reference: str = field(default="", compare=False)


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def builtin_suites() -> list[str]:
    root = resources.files("dflash.evaluation") / "suites"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def _read_suite_text(suite: str) -> tuple[str, str]:
    root = resources.files("dflash.evaluation") / "suites"
    if _NAME.match(suite) and not suite.endswith(".json"):
        f = root / f"{suite}.json"
        if f.is_file():
            return f.read_text(encoding="utf-8"), f"built-in suite {suite!r}"
    path = Path(suite).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    raise FileNotFoundError(f"eval.suite={suite!r} is neither a built-in suite ({', '.join(builtin_suites())}) "
                            f"nor a JSON file")


def parse_suite(data, where: str = "suite") -> list[Task]:
    if isinstance(data, dict) and "tasks" in data:
        data = data["tasks"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: expected a non-empty JSON list of {{name, prompt}} objects")
    tasks, seen = [], set()
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{where}: item {i} must be an object with string 'name' and 'prompt'")
        name, prompt = item["name"], item["prompt"]
        if not _NAME.match(name):
            raise ValueError(f"{where}: task name {name!r} may only use letters, digits, '_', '-', '.'")
        if name in seen:
            raise ValueError(f"{where}: duplicate task name {name!r}")
        if not prompt.strip():
            raise ValueError(f"{where}: task {name!r} has an empty prompt")
        seen.add(name)
        ref = item.get("reference", "")
        tasks.append(Task(name, prompt, ref if isinstance(ref, str) else ""))
    return tasks


def load_suite(suite: str) -> list[Task]:
    text, where = _read_suite_text(suite)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
    return parse_suite(data, where)


@dataclass(frozen=True)
class Suite:
    name: str  # label in metric keys (eval/suite/<name>/...): a built-in or generated name, a file's stem
    tasks: list[Task]
    max_new_tokens: int  # length of the target's greedy continuation for this suite
    stop: CodeStop | None = None  # where a continuation ends besides EOS (`eval.stop`, `suite_stop`)


def suite_stop(cfg, name: str) -> CodeStop | None:
    """Suite `name`'s code stop rule from `eval.stop` (`cfg`: the EvalConfig); None without one, or when
    `eval.stop_at_eos` is off (fixed-length ground truth: no end at all)."""
    if not getattr(cfg, "stop_at_eos", True):
        return None
    rule = CodeStop(tuple(cfg.stop.sequences.get(name, ())), name in cfg.stop.dedent)
    return rule or None


# Generated suites by name: (eval config) -> Suite; `dflash.evaluation.heldout` registers `heldout`.
GENERATED: dict[str, Callable[[Any], Suite]] = {}


# Suites the run's data builds (a chat dataset's held-out split: dflash/app/chat_data.py); as eval.suite the
# evaluator holds an empty placeholder until the data hands the suite over (SuiteEvaluator.add_suites).
DATA_SUITES = {"chat_heldout": "data.source=conversations (its held-out split)",
               "coding10_chat": "data.source=conversations (coding10 through the chat template)"}


def generated_suites() -> dict[str, Callable[[Any], Suite]]:
    import dflash.evaluation.heldout  # noqa: F401 - registers itself
    return GENERATED


def suite_label(suite: str) -> str:
    if suite in generated_suites() or suite in DATA_SUITES or (_NAME.match(suite) and not suite.endswith(".json")):
        return suite
    return Path(suite).stem


def resolve_suite(suite: str, cfg) -> Suite:
    """Any suite name or path of `eval.suite` / `eval.extra_suites` as a Suite (`cfg`: the EvalConfig)."""
    gen = generated_suites()
    if suite in gen:
        s = gen[suite](cfg)
        return dataclasses.replace(s, stop=suite_stop(cfg, s.name))
    if suite in DATA_SUITES:
        return Suite(suite, [], int(cfg.max_new_tokens))  # the data fills it in
    label = suite_label(suite)
    return Suite(label, load_suite(suite), int(cfg.max_new_tokens), suite_stop(cfg, label))


def objective_suite(cfg, tasks=None) -> Suite:
    """`eval.suite` as a Suite (`cfg`: the EvalConfig); `tasks` (a list of Task) replaces its tasks, under its
    label and with its code stop rule."""
    if tasks is None:
        return resolve_suite(cfg.suite, cfg)
    label = suite_label(cfg.suite)
    return Suite(label, list(tasks), int(cfg.max_new_tokens), suite_stop(cfg, label))
