"""What a conversation dataset trains on, for a person to read: `python -m experiments.data inspect` and the
`data/conversations.md` artifact of every run that trains on conversations.

- `marked_text`: a training row's text with the trained tokens (the loss mask) between `TRAINED_OPEN` and
  `TRAINED_CLOSE`; everything outside them is context;
- `statistics`: formats, turns, lengths, the trained-token share, skips by reason, truncations, the share of
  assistant turns that call tools and that carry reasoning;
- `report`: both as markdown (statistics, then the first `n` training records row by row).
"""
from __future__ import annotations

import json
from collections import Counter

from dflash.data.chat import render

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"
STAT_RECORDS = 100_000  # the statistics read at most this many records (a million-record set: a sample)


def marked_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    """The row's text, each run of trained tokens wrapped in ⟦…⟧."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tokenizer.decode(ids[i:j])
        out.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if mask[i] else text)
        i = j
    return "".join(out)


def _share(a: float, b: float) -> float:
    return a / b if b else 0.0


def statistics(cs) -> dict:
    """Figures of the whole set (its first STAT_RECORDS records) and of the training rows."""
    records = cs.everything.select(range(min(len(cs.everything), STAT_RECORDS)))
    formats, skips = Counter(records["format"]), Counter(s for s in records["skip"] if s)
    turns = assistant = calls = reasoning = weight0 = 0
    for messages in records["messages"]:
        turns += len(messages)
        for m in messages:
            if m["role"] != "assistant":
                continue
            assistant += 1
            calls += bool(m["tool_calls"])
            reasoning += bool(m["reasoning"]) or "<think>" in m["content"]
            weight0 += not m["train"]
    out = {"records": len(cs.everything), "records_read": len(records), "formats": dict(formats),
           "messages_per_record": _share(turns, len(records)),
           "assistant_turns_per_record": _share(assistant, len(records)),
           "tool_call_share": _share(calls, assistant), "reasoning_share": _share(reasoning, assistant),
           "untrained_turn_share": _share(weight0, assistant),
           "skipped": {k.removeprefix("data/skipped_"): int(v) for k, v in cs.stats.items()
                       if k.startswith("data/skipped_")},
           "truncated": int(cs.stats.get("data/truncated", 0)),
           "heldout_prompts": int(cs.stats.get("data/heldout_prompts", 0))}
    out["skipped"].update({k: v for k, v in skips.items() if k not in out["skipped"]})
    if cs.train is not None:
        lengths = sorted(cs.train["length"])  # one int a row: all of them
        sample = cs.train.select(range(min(len(cs.train), STAT_RECORDS)))  # the masks: the first rows'
        trained = sum(sum(m) for m in sample["loss_mask"])
        out.update({"train_rows": len(lengths), "row_tokens_mean": _share(sum(lengths), len(lengths)),
                    "row_tokens_p50": lengths[len(lengths) // 2], "row_tokens_p95": lengths[int(len(lengths) * .95)],
                    "row_tokens_max": lengths[-1],
                    "trained_token_share": _share(trained, sum(sample["length"]))})
    return out


def report(cs, tokenizer, chat, n: int = 3) -> str:
    """Markdown: the statistics, then the first `n` training records, each row with its trained tokens marked."""
    stats = statistics(cs)
    lines = ["# Conversation data", "", f"Trained tokens are marked {TRAINED_OPEN}like this{TRAINED_CLOSE}; the "
             "rest is context (read by the target, never trained on).", "", "## Statistics", "", "| figure | value |",
             "| --- | --- |"]
    for k, v in stats.items():
        value = json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else f"{v:.3f}" if isinstance(v, float) \
            else str(v)
        lines.append(f"| {k} | {value} |")
    for record in cs.normalized.select(range(min(n, len(cs.normalized)))):
        rows = render(tokenizer, record["messages"], chat, where=f"record {record['source']}", tools=record["tools"])
        lines += ["", f"## {record['source']} ({record['format']}, {len(rows)} row(s))"]
        for k, (ids, mask) in enumerate(rows):
            lines += ["", f"### row {k}: {len(ids)} tokens, {sum(mask)} trained", "", "```",
                      marked_text(tokenizer, ids, mask), "```"]
    return "\n".join(lines) + "\n"
