r"""Look at a conversation dataset the way a run will train on it:

    python -m experiments.data inspect data.path=chats.jsonl [n=3] [+target=qwen3_6_27b target.path=...] \
        [data.chat.template=qwen3] [data.chat.think=drop] [data.max_len=2048] [out=report.md]

Prints (or writes to `out`) the dataset's statistics (formats, turns, lengths, the trained-token share, skips by
reason, truncations, the share of assistant turns that call tools and that reason) and the first `n` training
records rendered through the target's chat template, each row with its trained tokens marked ⟦like this⟧. Only
the target's tokenizer is read (no weights); the default target is the tiny chat test target. Every run that
trains on conversations logs the same report as its MLflow artifact `data/conversations.md`. Bad input exits 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dflash.config import ConfigError
from experiments.config import compose_config, exit_on_help, run_cli

DEFAULTS = ["+target=tiny_random_chat", "+data=conversations"]


def target_tokenizer(tcfg):
    """The target's tokenizer alone (its folder's, or `target.tokenizer`'s), no weights."""
    from transformers import AutoTokenizer

    from dflash.target.model import checkpoint_path, tokenizer_path
    where = tokenizer_path(tcfg) if tcfg.tokenizer not in ("auto", "bytes") else checkpoint_path(tcfg)
    if not where:
        raise ConfigError("target: no tokenizer to render chat with (give target.path=<checkpoint folder> or "
                          "target.tokenizer=<folder>)")
    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"target tokenizer {where!r} cannot be read ({e})") from e


def inspect(argv: list[str]) -> str:
    from dflash.app.chat_data import load_set
    from dflash.data.conversation_report import report
    ours = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in ("n", "out")}
    rest = [a for a in argv if a.split("=", 1)[0] not in ("n", "out")]
    try:
        n = int(ours.get("n", 3))
    except ValueError as e:
        raise ConfigError(f"n={ours['n']!r}: expected a number of records") from e
    groups = {a.split("=", 1)[0] for a in rest if a.startswith("+")}
    cfg = compose_config([d for d in DEFAULTS if d.split("=", 1)[0] not in groups] + rest)
    if cfg.data.source != "conversations":
        raise ConfigError("experiments.data inspect reads conversation data: give +data=conversations data.path=...")
    cfg.data.conversations.responses = "dataset"  # what the records train on as given
    tokenizer = target_tokenizer(cfg.target)
    cs = load_set(cfg, tokenizer)
    text = report(cs, tokenizer, cfg.data.chat, n)
    if "out" in ours:
        Path(ours["out"]).write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(argv, __doc__, extra={"": {"n": 3, "out": ""}})
    if not argv or argv[0] != "inspect":
        raise ConfigError("usage: python -m experiments.data inspect data.path=... [n=3] (see --help)")
    text = inspect(argv[1:])
    print(text, flush=True)
    return text


if __name__ == "__main__":
    run_cli(main)
