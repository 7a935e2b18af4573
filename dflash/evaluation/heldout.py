"""The `heldout` suite (docs/evaluation.md): prompts from the corpus's held-out files, of the kind the training
prompt pool uses — a function or class header with its docstring (`dflash.data.prompts.header_prompts`) —
continued for `max_new_tokens` (default 256) tokens, long enough for a drafter to show long streaks.

Where its prompts come from (`eval.heldout.source`):
- `frozen` (default): the shipped file `dflash/evaluation/suites/heldout.json` (`dflash.evaluation.frozen_suite`),
  128 prompts with their human continuations, source files and licence, read the same on every machine, with
  or without the corpus; `num_prompts` takes the first n of them in the selection's own order (below), so a
  smaller suite is the one the corpus would pick too;
- `corpus`: rebuilt from the local corpus as below (other standard libraries give other prompts: under Python
  3.11.7 only 112 of the frozen 128 rebuild).

Files: whatever `dflash.data.corpus.load_corpus(CorpusConfig(...))` — the corpus's own defaults, its root
replaced by `corpus_root` when set — puts in `cfg.split` (`val`, `test`, or `heldout` = both); the split is a
hash of each file's path, so the target never trained on these files. Prompts: every header prompt of
those files whose length lies in [min_prompt_chars, max_prompt_chars], at most `max_per_file` per file
(the first ones in source order), then `num_prompts` of them chosen by sha256 of their name — a fixed,
seed-free sample that does not move when other files are added.

Built once and cached as JSON (`<eval.cache_dir>/suites/heldout-<key>.json`, atomic write), key = sha256
of the settings, the corpus root and the Python version; the expensive part, the target's continuations,
is cached by `ground_truth` under the prompts themselves. Standard library only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

from dflash.data.corpus import CorpusConfig, corpus_root, load_corpus
from dflash.data.prompts import header_prompts
from dflash.evaluation.prompts import GENERATED, Suite, Task, parse_suite

log = logging.getLogger(__name__)

SPLITS = ("val", "test", "heldout")
SOURCES = ("frozen", "corpus")


@dataclass
class HeldoutSuiteConfig:
    num_prompts: int = 128
    max_new_tokens: int = 256  # the target's greedy continuation per prompt
    split: str = "heldout"  # corpus split the files come from: val, test or heldout (val + test)
    min_prompt_chars: int = 40
    max_prompt_chars: int = 1000  # longer headers cost target features (prompt + continuation are cached)
    max_per_file: int = 8  # spread the suite over many files
    corpus_root: str = ""  # empty: the corpus's default root (dflash.data.corpus.CorpusConfig)
    # frozen: the shipped file (dflash/evaluation/suites/heldout.json), the same on every machine; corpus: rebuilt
    # from the local corpus with the settings above
    source: str = "frozen"


def corpus_config(cfg: HeldoutSuiteConfig) -> CorpusConfig:
    return CorpusConfig(root=cfg.corpus_root) if cfg.corpus_root else CorpusConfig()


def validate_heldout(cfg: HeldoutSuiteConfig) -> None:
    if cfg.source not in SOURCES:
        raise ValueError(f"eval.heldout.source={cfg.source!r}; expected one of {', '.join(SOURCES)}")
    if cfg.split not in SPLITS:
        raise ValueError(f"eval.heldout.split={cfg.split!r}; expected one of {', '.join(SPLITS)}")
    for k in ("num_prompts", "max_per_file"):
        if getattr(cfg, k) < 1:
            raise ValueError(f"eval.heldout.{k} must be >= 1, got {getattr(cfg, k)}")
    if cfg.max_new_tokens < 2:
        raise ValueError(f"eval.heldout.max_new_tokens must be >= 2, got {cfg.max_new_tokens}")
    if not 1 <= cfg.min_prompt_chars <= cfg.max_prompt_chars:
        raise ValueError(f"eval.heldout.min_prompt_chars/max_prompt_chars must satisfy 1 <= min <= max, got "
                         f"{cfg.min_prompt_chars}/{cfg.max_prompt_chars}")
    if cfg.source == "frozen":
        from dflash.evaluation.frozen_suite import check_selection
        check_selection(cfg)


def build_heldout_tasks(cfg: HeldoutSuiteConfig) -> list[Task]:
    """The suite's tasks from the corpus (no cache); raises ValueError when the split yields no prompt at all."""
    return select([t for t, _ in heldout_pool(cfg)], cfg.num_prompts)


def heldout_pool(cfg: HeldoutSuiteConfig) -> list[tuple[Task, str]]:
    """Every candidate prompt of the corpus's held-out split with its source file (the path the corpus splits
    by), before the selection; raises ValueError when there is none."""
    validate_heldout(dataclasses.replace(cfg, source="corpus"))
    corpus = load_corpus(corpus_config(cfg))
    docs = corpus.heldout if cfg.split == "heldout" else getattr(corpus, cfg.split)
    pool: list[tuple[Task, str]] = []
    for doc in docs:
        prefix = doc.path.removesuffix(".py").replace("/", ".") + "."
        kept = 0
        refs = human_continuations(doc.text, prefix)
        for name, prompt in header_prompts(doc.text, prefix):
            if cfg.min_prompt_chars <= len(prompt) <= cfg.max_prompt_chars and prompt.strip():
                pool.append((Task(name, prompt, refs.get(name, "")), doc.path))
                kept += 1
                if kept >= cfg.max_per_file:
                    break
    if not pool:
        raise ValueError(f"eval.heldout: the corpus's {cfg.split!r} split ({len(docs)} files under "
                         f"{corpus.root}) has no function or class with a docstring")
    if len(pool) < cfg.num_prompts:
        log.warning("eval.heldout: %d prompts available in split %r, fewer than num_prompts=%d",
                    len(pool), cfg.split, cfg.num_prompts)
    return pool


def select(pool: list[Task], n: int) -> list[Task]:
    """`n` tasks of `pool` chosen by sha256 of their name (seed-free; the first n of a larger pool are the first n
    of any pool that holds them), in name order."""
    pick = sorted(pool, key=lambda t: hashlib.sha256(t.name.encode()).hexdigest())[:n]
    return sorted(pick, key=lambda t: t.name)


def human_continuations(source: str, prefix: str = "") -> dict[str, str]:
    """{header prompt name: the text that follows the prompt in the file}: the rest of the definition's body, dedented
    as the prompt is (`header_prompts` names; the human continuation the target's ground truth is compared with)."""
    from dflash.data.prompts import _dedent, documented_definitions
    out = {}
    for name, node, lines, start, end in documented_definitions(source, prefix):
        prompt = _dedent(lines[start - 1:end], node.col_offset)
        whole = _dedent(lines[start - 1:node.end_lineno], node.col_offset)
        if whole.startswith(prompt):
            out[name] = whole[len(prompt):]
    return out


def suite_key(cfg: HeldoutSuiteConfig) -> str:
    corpus = corpus_config(cfg)
    payload = {"cfg": dataclasses.asdict(cfg), "corpus": dataclasses.asdict(corpus), "root": str(corpus_root(corpus)),
               "python": platform.python_version(), "format": 2}  # 2: tasks carry their human continuation
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def heldout_tasks(cfg: HeldoutSuiteConfig, cache_dir: str = "") -> list[Task]:
    """The frozen file's tasks (`source=frozen`), or the cached `build_heldout_tasks`; a cache file that does not
    parse as a suite is rebuilt."""
    if cfg.source == "frozen":
        from dflash.evaluation.frozen_suite import frozen_heldout_tasks
        return frozen_heldout_tasks(cfg)
    if not cache_dir:
        return build_heldout_tasks(cfg)
    path = Path(cache_dir) / "suites" / f"heldout-{suite_key(cfg)}.json"
    if path.is_file():
        try:
            return parse_suite(json.loads(path.read_text(encoding="utf-8")), str(path))
        except (OSError, ValueError) as e:
            log.warning("eval.heldout: cache %s is unreadable (%s); rebuilding it", path, e)
    tasks = build_heldout_tasks(cfg)
    from dflash.atomic import atomic_write_text
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps([{"name": t.name, "prompt": t.prompt, "reference": t.reference}
                                        for t in tasks], indent=1))
    return tasks


def _heldout_suite(eval_cfg) -> Suite:
    h = eval_cfg.heldout
    return Suite("heldout", heldout_tasks(h, eval_cfg.cache_dir), int(h.max_new_tokens))


GENERATED["heldout"] = _heldout_suite
