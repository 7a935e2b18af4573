"""`python -m experiments.regen backend=openai url=... out=FILE.jsonl`: a conversation file written turn by turn
through a real `transformers serve` started here on 127.0.0.1 (the tiny chat target): the project's sample (its
first 40 records: the server writes a few turns a second on 2 shared CPU cores) plus tool-calling conversations
whose prompts exceed data.pool.max_prompt_len, each turn ending where the server stops, resumed after kill -9, and
the file trains with +data=conversations."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_conversations import SAMPLE, chat_cfg  # noqa: F401 - the fixture
from tests.test_regen_server import save_chat_target, transformers_serve

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {"name": name, "description": what, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
         for name, what in (("get_weather", "The weather in a city"), ("get_time", "The local time in a city"))]
CITIES = ("Paris", "Rome", "Oslo")
SAMPLE_RECORDS = 40
TOOL_RECORDS = 3


def _agent(k: int) -> dict:
    """A tool-calling conversation: three rounds of a long question, a call, its result and an answer (the prompts
    of the later rounds are longer than the limit: the history is cut, the tool schemas kept)."""
    msgs = [{"role": "developer", "content": "You help with cities."}]
    for r, city in enumerate(CITIES):
        msgs += [{"role": "user", "content": f"Question {k}.{r}: tell me, with all the detail you can, about the "
                                             f"weather, the time and the people of {city} today, please."},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{r}", "type": "function", "function": {
                     "name": TOOLS[r % 2]["function"]["name"], "arguments": json.dumps({"city": city})}}]},
                 {"role": "tool", "tool_call_id": f"c{r}", "content": json.dumps({"value": 10 * r + k})},
                 {"role": "assistant", "content": f"In {city} it is {10 * r + k}."}]
    return {"tools": TOOLS, "messages": msgs}


def _ends_turns_early(ckpt: Path, chat_cfg, data: Path) -> None:
    """The served model's generation_config.json: its stop tokens are <|im_end|> and the token the random target
    writes most often early in its first turns (a random model seldom writes <|im_end|>; with this one the server
    ends some turns early, as a chat model ends its turns)."""
    from collections import Counter

    from dflash.data.chat import ChatConfig, prepare_tokenizer, render_prompt
    from dflash.data.conversations import read_conversations
    from dflash.data.regen import greedy_generate
    from dflash.target.model import Target
    target = Target(chat_cfg(f"target.path={ckpt}").target)
    tok = prepare_tokenizer(target.tokenizer, ChatConfig(template="qwen3"))
    ds, _ = read_conversations(str(data / "sample.jsonl"), str(ckpt.parent / "hf_probe"))
    written = Counter()
    for r in list(ds)[:12]:
        i = next(k for k, m in enumerate(r["messages"]) if m["role"] == "assistant")
        prompt = tok.encode(render_prompt(tok, r["messages"][:i], ChatConfig(template="qwen3")),
                            add_special_tokens=False)
        written.update(greedy_generate(target, torch.tensor([prompt]), 6)[0].tolist()[2:])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [im_end, written.most_common(1)[0][0]], "do_sample": False}))


def _journal_turns(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().split("\n")[1:] if line.startswith("{") and line.endswith("}"))


@pytest.mark.slow
def test_a_conversation_file_regenerates_through_transformers_serve_resumes_after_kill_9_and_trains(
        chat_cfg, tmp_path):
    from dflash.app.run import train
    from dflash.data.conversations import read_conversations
    from experiments.regen import main as regen
    data = tmp_path / "data"
    data.mkdir()
    (data / "sample.jsonl").write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:SAMPLE_RECORDS]))
    (data / "tools.jsonl").write_text("".join(json.dumps(_agent(k)) + "\n" for k in range(TOOL_RECORDS)))
    ckpt = save_chat_target(tmp_path, chat_cfg)
    _ends_turns_early(ckpt, chat_cfg, data)
    out = tmp_path / "chats_regen.jsonl"
    journal = out.with_name(f".{out.name}.turns")
    with transformers_serve(ckpt, tmp_path) as url:
        args = ["+target=tiny_random_chat", "+data=conversations", f"data.path={data}", f"target.path={ckpt}",
                "target.layer_ids=[0,1,2]", "data.chat.template=qwen3", "data.pool.max_prompt_len=320",
                "data.max_len=512", "data.online.temperature=0", "data.conversations.heldout_per_10k=0",
                f"data.conversations.cache_dir={tmp_path / 'hf'}", "backend=openai", f"url={url}",
                "server.concurrency=4", "regen.turn_tokens=12", f"out={out}"]
        killed = subprocess.Popen([sys.executable, "-m", "experiments.regen", *args], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while _journal_turns(journal) < 8 and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert killed.poll() is None, killed.stderr.read()[-3000:]
        os.kill(killed.pid, signal.SIGKILL)  # mid-write: no handler runs, a journal line may be torn
        killed.wait()
        assert not out.exists()
        kept = _journal_turns(journal)
        stats = regen(args)  # resumes: only the turns the journal does not have are asked for
    turns = int(stats["data/regen_turns"])
    assert kept >= 8 and stats["data/regen_requests"] == turns - kept, (kept, stats)
    assert stats["data/regen_conversations"] == SAMPLE_RECORDS + TOOL_RECORDS and turns > SAMPLE_RECORDS
    assert stats["data/cut_prompts"] > 0  # the tool conversations' later prompts: history cut, the schema kept
    # each turn ended where the server stopped it or at regen.turn_tokens: none is generated to a fixed length
    assert stats["data/regen_turns_stopped"] + stats["data/regen_turns_at_limit"] == turns - kept
    assert stats["data/regen_turns_stopped"] > 0 and stats["data/written_tokens"] < 12 * (turns - kept)
    assert not journal.exists() and not list(tmp_path.glob(".chats_regen*"))
    ds, _ = read_conversations(str(out), str(tmp_path / "hf2"))  # a turn the server ended at once: weight 0
    rows = list(ds)
    assert len(rows) == SAMPLE_RECORDS + TOOL_RECORDS and all(not r["skip"] for r in rows)
    tool_rows = [r for r in rows if r["tools"]]
    assert len(tool_rows) == TOOL_RECORDS and tool_rows[0]["messages"][0]["role"] == "system"  # developer read as system
    # user turns and tool results are the dataset's; the assistant turns the server's
    src = _agent(0)["messages"]
    assert [m["content"] for m in tool_rows[0]["messages"] if m["role"] in ("user", "tool")] == \
        [m["content"] for m in src if m["role"] in ("user", "tool")]
    assert [m["content"] for m in tool_rows[0]["messages"] if m["role"] == "assistant"] != \
        [m["content"] for m in src if m["role"] == "assistant"]
    # the file trains as a conversation dataset
    run = train(chat_cfg(f"data.path={out}", f"target.path={ckpt}", "data.chat.template=qwen3",
                         "data.max_len=128", run="trains"))
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(x == x and x < 1e4 for x in losses)
    assert [r for r in rows if "data/train_sequences" in r][-1]["data/train_sequences"] >= SAMPLE_RECORDS // 2


def test_the_journal_keeps_whole_lines_drops_a_torn_one_and_starts_over_for_other_settings(tmp_path):
    from dflash.app.regen_turns import Journal
    path = tmp_path / ".out.jsonl.turns"
    fields = {"content": "hi", "reasoning": "", "tool_calls": ""}
    journal = Journal(path, "k1")
    journal.append(0, 1, fields, True, 2)
    journal.append(1, 1, {**fields, "content": "yo"}, False, 12)
    journal.close()
    path.write_text(path.read_text() + '{"c": 2, "i": 1, "fiel')  # killed mid-line
    again = Journal(path, "k1")
    assert again.done == {(0, 1): fields, (1, 1): {**fields, "content": "yo"}}
    again.append(2, 1, fields, True, 2)
    again.close()
    third = Journal(path, "k1")
    third.close()
    assert third.done[(2, 1)] == fields  # the torn line ended, the new one whole after it
    other = Journal(path, "k2")
    other.close()
    assert other.done == {} and path.read_text() == '{"key": "k2"}\n'  # other data or settings: a fresh journal
