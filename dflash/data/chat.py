"""Conversations → token ids and the mask of tokens a drafter is trained on, through the target's chat template.

A conversation is a list of normalized messages (`dflash.data.conversations`): `role` (system, user, assistant,
tool), `content`, and where the data has them `reasoning` (an assistant's `reasoning_content`), `tool_calls` (JSON
text of the OpenAI list), `tool_call_id`, `name`, and `train` (false: a ShareGPT `weight: 0` turn, or a turn whose
prompt is held out — context, never loss); a record may carry `tools` (JSON text of the OpenAI schemas). They are
rendered with the target tokenizer's own `apply_chat_template` (tools, tool calls and reasoning passed as the
template expects them) — the exact text the serving engine feeds the target — and the trained tokens are the
assistant's: what the target itself generates at serving time (its reasoning, its text, its tool calls) and the
end-of-turn token its template closes the turn with. System, user and tool tokens and the template's framing
(`<|im_start|>assistant\\n`, a generation prompt's `<think>\\n`) are context only.

Where the assistant turns are (`render`):
- a template with `{% generation %}` markers: `return_assistant_tokens_mask`, one row per conversation;
- otherwise by rendering: assistant turn i is the text between the render of messages[:i] with the generation
  prompt (`head`) and the render of messages[:i+1] (`upto`), trailing whitespace dropped (the template's, not the
  model's). Context and turns are tokenized piece by piece, as the target reads its prompt and then writes its
  turn, so no token straddles a boundary. When every turn's `upto` is a prefix of the whole conversation's render,
  the conversation is one row; when the template rewrites earlier turns (Qwen3 strips their reasoning), each
  trained assistant turn becomes its own row over its own rendering (`head` + the turn): what the target reads
  when it writes that turn. (SpecForge's parser renders the conversation once and masks every assistant span in
  it, so with such a template its earlier turns train as the template rewrote them.)

`data.chat.template`: a .jinja file, or a shipped template by name (`TEMPLATES`: qwen3, qwen3_6, the official
templates as the models ship them) replacing or supplying the tokenizer's. `data.chat.think`: keep or drop
reasoning (drop: removed from assistant turns and rendered with `enable_thinking=False`, as a non-thinking
server renders it).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dflash.registry import Registry

ROLES = ("system", "user", "assistant", "tool")
THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"
# data.chat.template names -> the official chat templates as the models ship them (dflash/assets/chat_templates)
TEMPLATES = {"qwen3": ASSETS / "qwen3.jinja", "qwen3_6": ASSETS / "qwen3_6.jinja"}


@dataclass
class ChatConfig:
    template: str = ""  # a .jinja file or a shipped template (qwen3, qwen3_6); empty: the target tokenizer's own
    # reasoning in assistant turns (`reasoning_content` or <think>…</think>): keep (trained on, as the target
    # writes it) or drop (removed; rendered with enable_thinking=False)
    think: str = "keep"


THINK_MODES: Registry = Registry("data.chat.think", {"keep": "keep", "drop": "drop"})


class TemplateError(ValueError):
    """A chat template that does not render a record (names the template and the record)."""


def template_path(template: str) -> Path:
    return TEMPLATES.get(template) or Path(template)


def validate_chat_config(cfg: ChatConfig) -> None:
    THINK_MODES.check(cfg.think)
    if cfg.template and not template_path(cfg.template).is_file():
        raise FileNotFoundError(f"data.chat.template={cfg.template!r}: no such file (expected a .jinja chat template "
                                f"or one of {', '.join(TEMPLATES)})")


def template_text(cfg: ChatConfig) -> str:
    return template_path(cfg.template).read_text(encoding="utf-8") if cfg.template else ""


def prepare_tokenizer(tokenizer, cfg: ChatConfig):
    """The tokenizer with `data.chat.template` set; raises ValueError when it cannot render chat."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"data.source=conversations: the target's tokenizer ({type(tokenizer).__name__}) cannot "
                         f"render chat; use a target with a Hugging Face tokenizer (e.g. target.tokenizer=builtin:"
                         f"tiny_chat or a checkpoint folder)")
    if cfg.template:
        tokenizer.chat_template = template_text(cfg)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.source=conversations: the target's tokenizer has no chat template; set "
                         f"data.chat.template=<file.jinja> or one of {', '.join(TEMPLATES)}")
    return tokenizer


def template_name(cfg: ChatConfig) -> str:
    return cfg.template or "the target tokenizer's chat template"


def has_generation_markers(tokenizer) -> bool:
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template or ""))


# -- messages as the template reads them ------------------------------------------------------------------
def _arguments(raw):
    """A call's arguments as the templates read them: a JSON object text becomes the object (Qwen3.6's template
    iterates its items; Qwen3's writes it back with tojson)."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return raw


def template_messages(messages: list[dict], cfg: ChatConfig) -> list[dict]:
    """Normalized messages → the dicts `apply_chat_template` reads (OpenAI fields; reasoning as
    `reasoning_content`, dropped with think=drop)."""
    out = []
    for m in messages:
        content = m["content"]
        msg = {"role": m["role"], "content": content}
        if m["role"] == "assistant":
            if cfg.think == "drop":
                msg["content"] = THINK_BLOCK.sub("", content)
            elif m.get("reasoning"):
                msg["reasoning_content"] = m["reasoning"]
            if m.get("tool_calls"):
                calls = json.loads(m["tool_calls"])
                msg["tool_calls"] = [{**c, "function": {**c["function"],
                                                       "arguments": _arguments(c["function"].get("arguments"))}}
                                     for c in calls]
        for key in ("tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        out.append(msg)
    return out


def _apply(tokenizer, messages: list[dict], tools, cfg: ChatConfig, **kw):
    extra = {"enable_thinking": False} if cfg.think == "drop" else {}
    return tokenizer.apply_chat_template(messages, tools=tools or None, **extra, **kw)


def _check_tools(text: str, messages: list[dict], tools) -> None:
    """A template that ignores tools or tool calls would train the call's turn as an empty one: refuse it."""
    for t in tools or []:
        name = (t.get("function") or t).get("name", "")
        if name and name not in text:
            raise TemplateError(f"it does not render tools (the schema of {name!r} is missing from the rendering); "
                                f"use a template that renders tools (e.g. data.chat.template=qwen3)")
    for m in messages:
        for c in m.get("tool_calls") or []:
            name = c["function"]["name"]
            if name not in text:
                raise TemplateError(f"it does not render tool calls (the call to {name!r} is missing from the "
                                    f"rendering); use a template that renders tool_calls (e.g. "
                                    f"data.chat.template=qwen3)")


# -- rows ----------------------------------------------------------------------------------------------------
def render(tokenizer, messages: list[dict], cfg: ChatConfig, where: str = "",
           tools: str = "") -> list[tuple[list[int], list[int]]]:
    """The training rows (token ids, assistant mask 0/1) of one conversation (module doc): one row, or one per
    trained assistant turn. `tools`: the record's tool schemas as JSON text. TemplateError names the template
    and `where`."""
    train = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True)]
    msgs, schemas = template_messages(messages, cfg), (json.loads(tools) if tools else None)
    try:
        if not train:
            return []
        if has_generation_markers(tokenizer) and all(m.get("train", True) for m in messages
                                                     if m["role"] == "assistant"):
            out = _apply(tokenizer, msgs, schemas, cfg, tokenize=True, return_dict=True,
                         return_assistant_tokens_mask=True)
            _check_tools(tokenizer.decode(out["input_ids"]), msgs, schemas)
            return [(list(out["input_ids"]), [int(x) for x in out["assistant_masks"]])]
        return _render_by_prefixes(tokenizer, msgs, schemas, train, cfg)
    except TemplateError as e:
        raise TemplateError(f"{template_name(cfg)} does not render {where or 'a record'}: {e}") from e
    except Exception as e:  # noqa: BLE001 - jinja raises many types; all mean the template fails this record
        raise TemplateError(f"{template_name(cfg)} does not render {where or 'a record'}: "
                            f"{type(e).__name__}: {e}") from e


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _render_by_prefixes(tokenizer, msgs: list[dict], tools, train: list[int], cfg: ChatConfig):
    full = _apply(tokenizer, msgs, tools, cfg, tokenize=False)
    _check_tools(full, msgs, tools)
    turns, whole = [], True  # (head, upto) of each trained turn; whole: one row serves them all
    for i in train:
        head = _apply(tokenizer, msgs[:i], tools, cfg, tokenize=False, add_generation_prompt=True) if i else ""
        upto = _apply(tokenizer, msgs[: i + 1], tools, cfg, tokenize=False)
        if not upto.startswith(head):
            raise TemplateError(f"its generation prompt is not a prefix of assistant message {i}'s rendering")
        turns.append((head, upto))
        whole = whole and full.startswith(upto)
    if not whole:  # the template rewrites earlier turns: each trained turn its own row
        rows = []
        for head, upto in turns:
            ids, turn = _encode(tokenizer, head), _encode(tokenizer, upto[len(head):].rstrip())
            rows.append((ids + turn, [0] * len(ids) + [1] * len(turn)))
        return rows
    ids, mask, at = [], [], 0
    for head, upto in turns:
        end = len(upto.rstrip())
        for text, m in ((full[at:len(head)], 0), (full[len(head):end], 1)):
            piece = _encode(tokenizer, text)
            ids += piece
            mask += [m] * len(piece)
        at = end
    tail = _encode(tokenizer, full[at:])
    return [(ids + tail, mask + [0] * len(tail))]


def render_prompt(tokenizer, messages: list[dict], cfg: ChatConfig, tools: str = "") -> str:
    """The text the target continues for its next assistant turn (the generation prompt appended)."""
    return _apply(tokenizer, template_messages(messages, cfg), json.loads(tools) if tools else None, cfg,
                  tokenize=False, add_generation_prompt=True)
