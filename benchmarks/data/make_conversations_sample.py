"""Writes benchmarks/data/conversations_sample.jsonl: 200 conversations written by this script (no third-party text).

Half are OpenAI `messages` records, half ShareGPT `conversations` records (system / human / gpt); some carry a
system prompt, a third are multi-turn, some assistant turns open with a Qwen3-style `<think>` block. Topics are
small programming and arithmetic tasks whose answers the script computes, so every response is correct.
Deterministic: `python benchmarks/data/make_conversations_sample.py` rewrites the same file.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("conversations_sample.jsonl")
SYSTEMS = ["You are a concise coding assistant.", "You answer in short, correct steps.",
           "You are a helpful assistant for Python programmers."]
NUMERIC = ["numbers", "prices", "temperatures", "scores"]
THINGS = ["numbers", "words", "file names", "prices", "temperatures", "scores", "user ids", "timestamps"]


def _func(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["sum", "max", "unique", "sorted", "count", "reverse"])
    thing = rng.choice(NUMERIC if kind in ("sum", "max") else THINGS)  # a sum of words is no answer
    name = {"sum": "total", "max": "largest", "unique": "deduplicate", "sorted": "in_order", "count": "count_items",
            "reverse": "backwards"}[kind] + "_" + thing.replace(" ", "_")
    body = {"sum": "    return sum(items)", "max": "    return max(items) if items else None",
            "unique": "    seen = set()\n    out = []\n    for x in items:\n        if x not in seen:\n"
                      "            seen.add(x)\n            out.append(x)\n    return out",
            "sorted": "    return sorted(items)", "count": "    counts = {}\n    for x in items:\n"
                      "        counts[x] = counts.get(x, 0) + 1\n    return counts",
            "reverse": "    return list(reversed(items))"}[kind]
    ask = {"sum": "adds up", "max": "returns the largest of", "unique": "removes duplicates from",
           "sorted": "sorts", "count": "counts how often each value occurs in", "reverse": "reverses"}[kind]
    question = f"Write a Python function that {ask} a list of {thing}."
    answer = (f"Here is a function that {ask} a list of {thing}:\n\n```python\ndef {name}(items):\n"
              f"    \"\"\"{ask.capitalize()} `items`.\"\"\"\n{body}\n```\n\nIt runs in linear time"
              f"{' plus the sort' if kind == 'sorted' else ''} and leaves the input list unchanged.")
    return question, answer


def _arith(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(12, 999), rng.randint(3, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "sum", "-": "difference", "*": "product"}[op]
    return (f"What is {a} {op} {b}?", f"The {word} of {a} and {b} is {value}. In Python you can check it with "
                                      f"`print({a} {op} {b})`, which prints {value}.")


def _convert(rng: random.Random) -> tuple[str, str]:
    c = rng.randint(-20, 40)
    f = c * 9 / 5 + 32
    return (f"Convert {c} degrees Celsius to Fahrenheit.",
            f"Multiply by 9/5 and add 32: {c} * 9/5 + 32 = {f:g}. So {c} °C is {f:g} °F.")


def _followup(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(3, 9)
    return (f"Can you add a test for it with {n} items?",
            f"Sure. A test with {n} items:\n\n```python\ndef test_it():\n    items = list(range({n}))\n"
            f"    result = solve(items)\n    assert result is not None\n```\n\nRun it with `pytest -q`.")


TOPICS = [_func, _func, _arith, _convert]


def _turns(rng: random.Random) -> list[tuple[str, str]]:
    first = rng.choice(TOPICS)(rng)
    turns = [first]
    if rng.random() < 0.35:
        turns.append(_followup(rng) if first[1].startswith("Here is") else rng.choice(TOPICS)(rng))
        if rng.random() < 0.4:
            turns.append(rng.choice(TOPICS)(rng))
    if rng.random() < 0.25:  # a Qwen3-style reasoning block before the first answer
        q, a = turns[0]
        turns[0] = (q, f"<think>\nThe user asks: {q} I will answer directly.\n</think>\n\n{a}")
    return turns


def record(i: int, rng: random.Random) -> dict:
    turns = _turns(rng)
    system = rng.choice(SYSTEMS) if rng.random() < 0.4 else None
    if i % 2 == 0:
        msgs = [{"role": "system", "content": system}] if system else []
        for q, a in turns:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return {"id": f"sample-{i:03d}", "messages": msgs}
    conv = [{"from": "system", "value": system}] if system else []
    for q, a in turns:
        conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return {"id": f"sample-{i:03d}", "conversations": conv}


def main(n: int = 200) -> None:
    rng = random.Random(29)
    lines = [json.dumps(record(i, rng), ensure_ascii=False) for i in range(n)]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({n} conversations)")


if __name__ == "__main__":
    main()
