"""The tokenizer of `+target=tiny_random_chat` (shipped as dflash/assets/tiny_chat/), built offline.

It is the shipped reference target's byte-level BPE (dflash/assets/reference_target, 4,096 tokens, <|mask|> = 2)
plus Qwen-style chat tokens (<|im_start|> 4096, <|im_end|> 4097, <think> 4098, </think> 4099) and a ChatML chat
template whose assistant turns sit inside `{% generation %}` markers, so that `apply_chat_template(...,
return_assistant_tokens_mask=True)` gives the assistant mask. Rebuild the shipped files with

    python -m dflash.target.chat_tokenizer
"""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
OUT = ASSETS / "tiny_chat"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")

# ChatML as Qwen3 writes it; the assistant's content and its <|im_end|> are what the model generates, so they
# sit inside the generation markers (the newline after <|im_end|> is the template's, not the model's).
CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def build_tiny_chat_tokenizer(out: Path = OUT) -> int:
    """Writes the tokenizer files into `out`; returns the vocabulary size."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "reference_target"), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    tok.add_tokens(list(THINK_TOKENS))
    tok.chat_template = CHAT_TEMPLATE
    tok.eos_token = "<|im_end|>"  # a chat model stops at the end of its turn
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return len(tok)


if __name__ == "__main__":
    print(f"wrote {OUT} ({build_tiny_chat_tokenizer()} tokens)")
