"""A written assistant turn's raw text split into the fields of an OpenAI message, as the serving engines' parsers
split it for the template the model was trained with: `reasoning_content` (the `<think>…</think>` block, vLLM's
and SGLang's `qwen3` reasoning parser) and `tool_calls` (the `<tool_call>…</tool_call>` blocks), the rest the
`content`.

The call's form is the one the template writes (`parser_for`): `hermes` (Qwen3's template: a JSON object
`{"name": …, "arguments": {…}}` in each block) or `qwen3_coder` (Qwen3.6's: `<function=NAME>` with one
`<parameter=KEY>VALUE</parameter>` per argument; a value is a string unless the tool's schema types that
parameter otherwise, then it is read as JSON). A block that does not parse as the template's form stays in the
content, as the engines leave it. A generation prompt that opens the think block (Qwen3.6's `<think>\\n`) makes
the turn's text start inside it; a turn cut at the length limit inside its reasoning has no content.
"""
from __future__ import annotations

import json
import re

from dflash.registry import Registry

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FUNCTION = re.compile(r"^<function=([^>\n]+)>\s*(.*?)\s*</function>$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _hermes(body: str, schemas: dict) -> dict | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"name": call["name"], "arguments": call.get("arguments", {})}


def _value(raw: str, kind) -> object:
    """A qwen3_coder parameter value: a string, unless the schema types it otherwise (then JSON where it parses)."""
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _qwen3_coder(body: str, schemas: dict) -> dict | None:
    m = FUNCTION.match(body)
    if not m:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    props = ((schemas.get(name) or {}).get("parameters") or {}).get("properties") or {}
    args = {key.strip(): _value(value, (props.get(key.strip()) or {}).get("type"))
            for key, value in PARAMETER.findall(inner)}
    return {"name": name, "arguments": args}


# the tool-call forms the shipped templates write, by the engines' parser names
PARSERS: Registry = Registry("tool call parser", {"hermes": _hermes, "qwen3_coder": _qwen3_coder})


def parser_for(template_text: str) -> str:
    """The tool-call form a chat template writes: Qwen3.6's `<function=…>` XML, else Qwen3's JSON."""
    return "qwen3_coder" if "<function=" in template_text else "hermes"


def _reasoning(text: str, prompt_text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a turn's text; the prompt may have opened the think block already."""
    if prompt_text.rstrip().endswith(THINK_OPEN) and THINK_OPEN not in text.split(THINK_CLOSE, 1)[0]:
        text = THINK_OPEN + "\n" + text
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return "", text
    inner, closed, rest = stripped[len(THINK_OPEN):].partition(THINK_CLOSE)
    return inner.strip("\n"), rest.lstrip("\n") if closed else ""


def parse_turn(text: str, prompt_text: str, parser: str, tools: str = "") -> dict:
    """A turn's raw text (its end-of-turn token dropped) → {"content", "reasoning", "tool_calls"} (tool_calls as
    the normalized JSON text of the OpenAI list, '' when none). `tools`: the record's schemas as JSON text."""
    schemas = {(t.get("function") or t).get("name"): (t.get("function") or t) for t in json.loads(tools)} \
        if tools else {}
    reasoning, rest = _reasoning(text, prompt_text)
    calls, kept, at = [], [], 0
    for m in CALL_BLOCK.finditer(rest):
        call = PARSERS[parser](m.group(1), schemas)
        if call is None:
            continue  # not the template's form: it stays in the content
        kept.append(rest[at:m.start()])
        at = m.end()
        calls.append({"type": "function", "function": call})
    content = ("".join(kept) + rest[at:]).strip()
    return {"content": content, "reasoning": reasoning,
            "tool_calls": json.dumps(calls, ensure_ascii=False) if calls else ""}
