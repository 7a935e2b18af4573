"""Conversations → token ids and the mask of tokens a drafter is trained on, through the target's chat template.

A conversation is a list of `{"role", "content"}` messages (roles: system, user, assistant, tool). It is rendered
with the target tokenizer's own `apply_chat_template` — the exact text the serving engine feeds the target — and
the trained tokens are the assistant's: what the target itself generates at serving time, including the end-of-turn
token its template closes an assistant turn with. System, user and tool tokens and the template's own framing
(`<|im_start|>assistant\\n`) are context only.

The assistant mask comes from the template's `{% generation %}` markers where it has them
(`return_assistant_tokens_mask`), else from rendering: assistant turn i spans the characters between the render of
messages[:i] with the generation prompt and the render of messages[:i+1] (trailing whitespace dropped: the
template's, not the model's), mapped to tokens by their offsets.

`data.chat.template` (a .jinja file) replaces or supplies the template of a tokenizer that has none;
`data.chat.think` keeps or drops Qwen3-style `<think>…</think>` blocks in assistant turns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dflash.registry import Registry

ROLES = ("system", "user", "assistant", "tool")
THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass
class ChatConfig:
    template: str = ""  # a .jinja chat template file; empty: the target tokenizer's own
    # Qwen3-style reasoning in assistant turns: keep (trained on, as the target writes it) or drop (removed
    # before rendering, as a chat template drops the reasoning of earlier turns)
    think: str = "keep"


# data.chat.think -> the assistant content as rendered
THINK_MODES: Registry = Registry("data.chat.think", {
    "keep": lambda text: text,
    "drop": lambda text: THINK_BLOCK.sub("", text),
})


class TemplateError(ValueError):
    """A chat template that does not render a record (names the template and the record)."""


def validate_chat_config(cfg: ChatConfig) -> None:
    THINK_MODES.check(cfg.think)
    if cfg.template and not Path(cfg.template).is_file():
        raise FileNotFoundError(f"data.chat.template={cfg.template!r}: no such file (expected a .jinja chat template)")


def prepare_tokenizer(tokenizer, cfg: ChatConfig):
    """The tokenizer with `data.chat.template` set; raises ValueError when it cannot render chat."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"data.source=conversations: the target's tokenizer ({type(tokenizer).__name__}) cannot "
                         f"render chat; use a target with a Hugging Face tokenizer (e.g. target.tokenizer=builtin:"
                         f"tiny_chat or a checkpoint folder)")
    if cfg.template:
        tokenizer.chat_template = Path(cfg.template).read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.source=conversations: the target's tokenizer has no chat template; set "
                         "data.chat.template=<file.jinja>")
    return tokenizer


def template_name(cfg: ChatConfig) -> str:
    return cfg.template or "the target tokenizer's chat template"


def has_generation_markers(tokenizer) -> bool:
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template or ""))


def clean_messages(messages: list[dict], cfg: ChatConfig) -> list[dict]:
    strip = THINK_MODES[cfg.think]
    return [{"role": m["role"], "content": strip(m["content"]) if m["role"] == "assistant" else m["content"]}
            for m in messages]


def render(tokenizer, messages: list[dict], cfg: ChatConfig, where: str = "") -> tuple[list[int], list[int]]:
    """(token ids, assistant mask 0/1) of one conversation; TemplateError names the template and `where`."""
    messages = clean_messages(messages, cfg)
    try:
        if has_generation_markers(tokenizer):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        return _render_by_prefixes(tokenizer, messages)
    except TemplateError as e:
        raise TemplateError(f"{template_name(cfg)} does not render {where or 'a record'}: {e}") from e
    except Exception as e:  # noqa: BLE001 - jinja raises many types; all mean the template fails this record
        raise TemplateError(f"{template_name(cfg)} does not render {where or 'a record'}: "
                            f"{type(e).__name__}: {e}") from e


def _render_by_prefixes(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The assistant mask of a template without generation markers (module doc)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(upto) and upto.startswith(head)):
            raise TemplateError(f"rendering message {i} is not a prefix of the whole conversation's rendering "
                                f"(the template rewrites earlier turns); give it {{% generation %}} markers")
        spans.append((len(head), len(upto.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo <= s < hi for lo, hi in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def render_prompt(tokenizer, messages: list[dict], cfg: ChatConfig) -> str:
    """The text the target continues for its next assistant turn (the generation prompt appended)."""
    return tokenizer.apply_chat_template(clean_messages(messages, cfg), tokenize=False, add_generation_prompt=True)
