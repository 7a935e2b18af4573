"""Agentic datasets as users hold them: OpenAI's `developer` role, records a template refuses or that hold an empty
turn (skipped and counted with data.conversations.skip_bad, their valid turns kept), and prompts whose tool schemas
are longer than data.pool.max_prompt_len (kept whole: the history is cut, never the schema)."""
import json
import logging

import pytest

from dflash.data.chat import ChatConfig, TemplateError, prepare_tokenizer
from dflash.data.conversation_data import PromptLimitError, load_conversation_set, prompt_tokens, turn_prompts
from dflash.data.conversations import message, read_conversations
from dflash.data.sources import DataConfig
from tests.test_conversations import _write_jsonl, tok  # noqa: F401 - the fixture

CALC = [{"type": "function", "function": {"name": f"tool_{k}", "description": f"Tool number {k} does {k}.",
                                          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for k in range(6)]


def _data(path, tmp_path, **conv) -> DataConfig:
    d = DataConfig(source="conversations", path=str(path), min_len=8, max_len=1024)
    d.conversations.cache_dir, d.conversations.heldout_per_10k = str(tmp_path / "hf"), 0
    d.chat.template = "qwen3_6"
    for k, v in conv.items():
        setattr(d.conversations, k, v)
    return d


def test_the_developer_role_is_a_system_message(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut."}]}])
    ds, _ = read_conversations(str(path), str(tmp_path / "hf"))
    assert [m["role"] for m in ds[0]["messages"]] == ["system", "user", "assistant"]


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
EMPTY_THEN_VALID = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                                 {"role": "user", "content": "Still there?"}, {"role": "assistant", "content": "Yes."}]}
# Qwen3.6's template refuses a system message after the first one ("System message must be at the beginning.")
REFUSED = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                        {"role": "developer", "content": "Now be rude."}, {"role": "user", "content": "Bye"},
                        {"role": "assistant", "content": "Go away."}]}


def test_by_default_a_refused_record_stops_and_an_empty_turn_drops_its_record(tok, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [GOOD, EMPTY_THEN_VALID])
    cs = load_conversation_set(_data(path, tmp_path), tok)
    assert cs.stats["data/skipped_empty_assistant_turn"] == 1 and cs.stats["data/train_sequences"] == 1
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD, REFUSED])
    with pytest.raises(TemplateError, match=r"qwen3_6 does not render record .*d\.jsonl#1.*skip_bad=true"):
        load_conversation_set(_data(path, tmp_path), tok)


@pytest.mark.parametrize("responses", ["dataset", "target"])
def test_skip_bad_counts_refused_records_and_keeps_the_valid_turns_warning_once(tok, tmp_path, caplog, responses):
    path = _write_jsonl(tmp_path / "c.jsonl", [GOOD, EMPTY_THEN_VALID, REFUSED, REFUSED])
    d = _data(path, tmp_path, skip_bad=True, responses=responses)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # loaded twice in one process (a regen's writer per rank): each warning once
            cs = load_conversation_set(d, tok)
            stats = cs.stats if responses == "dataset" else {**cs.stats, **turn_prompts(cs, tok, d)[1]}
    assert stats["data/untrained_empty_turns"] == 1 and "data/skipped_empty_assistant_turn" not in stats
    assert stats["data/skipped_template_error"] == 2
    empty = [r for r in cs.normalized if r["source"].endswith("#1")][0]["messages"]
    assert [m["train"] for m in empty if m["role"] == "assistant"] == [False, True]  # the empty one is context
    if responses == "dataset":  # GOOD's turn and the valid turn after the empty one
        texts = [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in
                 zip(cs.train["input_ids"], cs.train["loss_mask"])]
        assert len(texts) == 2 and any("Yes." in t for t in texts) and not any("Go away" in t for t in texts)
    else:
        assert stats["data/prompts"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("chat template refuses" in w and "c.jsonl#2" in w for w in warnings) == 1, warnings
    assert sum("empty assistant turn(s) kept as context" in w and "c.jsonl#1" in w for w in warnings) == 1


def _agent(n_turns: int) -> list[dict]:
    msgs = [message("system", "You are an agent. Use the tools.")]
    for i in range(n_turns):
        msgs += [message("user", f"step {i}: " + "please do the thing " * 4), message("assistant", f"done {i} " * 6)]
    return msgs + [message("user", "last question")]


def test_a_prompt_is_cut_in_its_history_never_inside_the_system_prompt_or_the_tools(tok):
    chat = ChatConfig(template="qwen3")
    prepare_tokenizer(tok, chat)
    tools = json.dumps(CALC)
    schema = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": "You are an agent. Use the tools."}],
                                                    tools=CALC, tokenize=False)))
    full, cut = prompt_tokens(tok, _agent(8), chat, tools, 10_000)
    assert not cut and len(full) > schema + 100
    ids, cut = prompt_tokens(tok, _agent(8), chat, tools, schema + 100)
    text = tok.decode(ids)
    assert cut and len(ids) <= schema + 100
    assert all(f'"tool_{k}"' in text for k in range(6)) and "You are an agent. Use the tools." in text
    assert text.endswith("last question<|im_end|>\n<|im_start|>assistant\n") and "step 0:" not in text
    # a last user turn longer than the room left: the schema whole, the turn cut around its middle
    long = _agent(0)[:-1] + [message("user", "word " * 400 + "the end")]
    ids, cut = prompt_tokens(tok, long, chat, tools, schema + 40)
    text = tok.decode(ids)
    assert cut and len(ids) <= schema + 40 and all(f'"tool_{k}"' in text for k in range(6))
    assert text.endswith("the end<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(PromptLimitError, match=rf"data\.pool\.max_prompt_len=100: the system prompt and tool schemas "
                                               rf"of record x#3 alone take \d+ tokens"):
        prompt_tokens(tok, _agent(8), chat, tools, 100, where="record x#3")


def test_a_schema_over_the_prompt_limit_exits_2_naming_the_key(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    path = _write_jsonl(tmp_path / "c.jsonl", [{"tools": CALC, **GOOD}] * 3)
    proc = subprocess.run([sys.executable, "-m", "experiments.regen", "+target=tiny_random_chat", "+data=conversations",
                           f"data.path={path}", "data.chat.template=qwen3", "data.conversations.responses=target",
                           f"data.conversations.cache_dir={tmp_path / 'hf'}", "data.pool.max_prompt_len=64",
                           f"data.online.shard_dir={tmp_path / 'shards'}", "regen.batches=1"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.pool.max_prompt_len=64: the system prompt and tool schemas of record" in proc.stderr
    assert not (tmp_path / "shards").exists()
