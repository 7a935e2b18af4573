"""A written turn's raw text split into content, reasoning_content and tool_calls by the template's parser: each
shipped template's own rendering of a turn parses back into the message it rendered."""
import json

import pytest

from dflash.data.chat import ChatConfig, prepare_tokenizer, template_messages, template_text
from dflash.data.conversations import message
from dflash.data.turn_parser import parse_turn, parser_for
from tests.test_conversations import tok  # noqa: F401 - the fixture

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "42", "days": 1}}}]


@pytest.mark.parametrize("template, parser", [("qwen3", "hermes"), ("qwen3_6", "qwen3_coder")])
@pytest.mark.parametrize("turn", [
    message("assistant", "Let me look.", reasoning="The user wants Paris.", tool_calls=json.dumps(CALLS)),
    message("assistant", "", reasoning="Just call it.", tool_calls=json.dumps(CALLS[:1])),
    message("assistant", "It is 21 °C.\n\nEnjoy <b>Paris</b>.", reasoning="The tool said 21."),
])
def test_a_rendered_turn_parses_back_into_its_fields(tok, template, parser, turn):
    chat = ChatConfig(template=template)
    prepare_tokenizer(tok, chat)
    assert parser_for(template_text(chat)) == parser
    msgs = [message("user", "Weather in Paris?"), turn]
    head = tok.apply_chat_template(template_messages(msgs[:1], chat), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    full = tok.apply_chat_template(template_messages(msgs, chat), tools=TOOLS, tokenize=False)
    assert full.startswith(head)
    raw = full[len(head):].rstrip()
    assert raw.endswith("<|im_end|>")
    got = parse_turn(raw[:-len("<|im_end|>")], head, parser, json.dumps(TOOLS))
    assert got["content"] == turn["content"].strip() and got["reasoning"] == turn["reasoning"]
    want = json.loads(turn["tool_calls"]) if turn["tool_calls"] else []
    assert (json.loads(got["tool_calls"]) if got["tool_calls"] else []) == want  # "42" stays a string: its schema


def test_what_does_not_parse_stays_in_the_content_and_an_unclosed_think_is_reasoning():
    broken = "Here <tool_call>\n{not json}\n</tool_call> done"
    assert parse_turn(broken, "", "hermes") == {"content": broken, "reasoning": "", "tool_calls": ""}
    # a prompt that opened the think block (Qwen3.6's generation prompt), the turn cut at the limit inside it
    assert parse_turn("still thinking about", "<|im_start|>assistant\n<think>\n", "qwen3_coder") == \
        {"content": "", "reasoning": "still thinking about", "tool_calls": ""}
    assert parse_turn("plain answer", "<|im_start|>assistant\n", "hermes")["content"] == "plain answer"
