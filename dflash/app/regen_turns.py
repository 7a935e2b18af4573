"""`python -m experiments.regen ... out=chats_regen.jsonl` (`regen.turns_out`): a conversation dataset with every
trained assistant turn rewritten by the target, turn by turn, written as a new conversation file (OpenAI JSONL:
one record per conversation) that a run trains on with `+data=conversations data.path=...`.

Each turn's prompt is the conversation before it through the chat template, its earlier assistant turns the ones
just written (`dflash.data.conversation_data.prompt_tokens`: at most `data.pool.max_prompt_len` tokens, the system
prompt and tool schemas kept whole). User turns, tool results and untrained turns (`weight: 0`, held out) stay as
the dataset has them. Every prompt is rendered once with the dataset's turns before any is written, so a record the
template refuses, or whose system prompt and tools exceed the limit, stops the regen first (exit 2; with
`data.conversations.skip_bad` a refused record is left out and counted). A written turn's raw text is split into
`content`, `reasoning_content` and `tool_calls` as the engines' parsers split it for the template
(`dflash.data.turn_parser`).

Who writes the turns:
- `backend=target`: this process's target, in rounds (`dflash.data.regen.regenerate_turns`: round k writes the
  k-th turn of every conversation in one batched call), each turn ending at its first end-of-turn token (at most
  `regen.turn_tokens`); a killed regen resumes after its last finished round (`.FILE.rounds`).
- `backend=openai`: an OpenAI-compatible server (vLLM, SGLang, `transformers serve`) serving the target, one
  `/v1/completions` request per turn (the prompt as text, the data's sampling settings, a seed per turn), ended
  where the server stops: its end of turn, or `regen.turn_tokens` (no fixed-length generation). Conversations
  run at once up to `server.concurrency`, each turn after the one before it. Every written turn is appended to a
  journal beside the output (`.FILE.turns`, one flushed line per turn): killed, even with kill -9, the regen
  resumes with the turns it had, when the data and settings are the same.
The file is written atomically when every turn is done; the journal or rounds file is then removed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash.config import ConfigError

log = logging.getLogger(__name__)
TURNS_VERSION = 2  # what regen.turns_out writes (its rounds file or journal is read back only at the same version)


def openai_record(messages: list[dict], tools: str) -> dict:
    """A normalized conversation as an OpenAI record our reader reads back. Untrained turns get weight 0, and so
    does a turn the target ended at once (nothing but its end-of-turn token to train on: context, as the reader
    takes an empty weight-0 turn, so its record's other turns still train)."""
    out = []
    for m in messages:
        empty = not (m["content"].strip() or m.get("reasoning", "").strip() or m.get("tool_calls"))
        msg = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning"):
            msg["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            msg["tool_calls"] = json.loads(m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        if m["role"] == "assistant" and (not m["train"] or empty):
            msg["weight"] = 0
        out.append(msg)
    return {"messages": out, **({"tools": json.loads(tools)} if tools else {})}


def _trained(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["train"]]


def _renderable(kept, tokenizer, cfg) -> tuple[list[int], dict[str, float]]:
    """The indices of `kept` whose every prompt renders and fits, and data/ figures; ConfigError (exit 2) before
    any turn is written for a record whose system prompt and tools exceed the limit, or one the template refuses
    (without data.conversations.skip_bad)."""
    from collections import Counter

    from dflash.data.conversation_data import check_prompt_statuses, record_prompts
    d = cfg.data
    statuses = [record_prompts(tokenizer, r["messages"], r["tools"], r["source"], d.chat, d.pool.max_prompt_len)[1]
                for r in kept]
    stats: dict[str, float] = {}
    try:
        check_prompt_statuses(Counter(s for s in statuses if s), d.conversations.skip_bad, stats, kept._fingerprint)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return [c for c, s in enumerate(statuses) if not s], stats


def _write_file(out: Path, conversations: list[list[dict]], tools: list[str]) -> None:
    from dflash.atomic import atomic_write_text
    atomic_write_text(out, "".join(json.dumps(openai_record(m, t), ensure_ascii=False) + "\n"
                                   for m, t in zip(conversations, tools)))


def run_regen_turns(cfg, regen) -> dict[str, float]:
    """The module doc's file: returns data/ and perf/ figures of the regen."""
    from dflash.app.chat_data import load_set
    from dflash.app.regen_shards import validate_regen
    from dflash.config import validate
    from dflash.data.chat import prepare_tokenizer
    from dflash.data.conversation_data import end_of_turn_id
    from dflash.data.online import resolve_online_config
    from dflash.target.model import Target
    from dflash.target.sampling import Sampling
    validate(cfg)
    validate_regen(cfg, regen)
    target = Target(cfg.target)
    cs = load_set(cfg, target.tokenizer)
    kept = cs.everything.filter(lambda s: not s, input_columns="skip")
    tok = prepare_tokenizer(target.tokenizer, cfg.data.chat)
    ok, stats = _renderable(kept, tok, cfg)
    kept = kept.select(ok)
    # the data's sampling setting made what runs (-1 fields: the target's generation_config.json)
    online = resolve_online_config(cfg.data.online, target, cfg.data.max_len)
    sampling = Sampling(online.sampling.temperature, online.sampling.top_p, online.sampling.top_k)
    job = TurnJob(cfg, regen, tok, kept["messages"], kept["tools"], end_of_turn_id(tok), sampling,
                  online.stream_seed)
    # a killed regen resumes when nothing that decides the answers changed
    job.key = hashlib.sha256(json.dumps([cs.fingerprint, str(target.identity), str(target.dtype), job.max_new,
                                         cfg.data.pool.max_prompt_len, job.end_id, sampling.label,
                                         online.stream_seed, regen.backend, TURNS_VERSION]).encode()).hexdigest()
    t0 = time.perf_counter()
    written = job.through_server() if regen.backend == "openai" else job.through_target(target, online)
    turns = sum(len(_trained(c)) for c in kept["messages"])
    log.info("regen: %d conversations, %d assistant turns rewritten turn by turn, in %s", len(written), turns,
             job.out)
    wall = time.perf_counter() - t0
    return {**stats, "data/regen_conversations": float(len(written)), "data/regen_turns": float(turns),
            **job.stats(wall), "sys/regen_s": wall}


class TurnJob:
    """The conversations to rewrite and how (module doc); `through_target` / `through_server` write the file."""

    def __init__(self, cfg, regen, tokenizer, conversations, tools, end_id, sampling, seed: int):
        from dflash.data.chat import template_text
        from dflash.data.turn_parser import parser_for
        self.cfg, self.regen, self.tok, self.end_id = cfg, regen, tokenizer, end_id
        self.conversations, self.tools, self.sampling, self.seed = conversations, tools, sampling, seed
        self.max_new = regen.turn_tokens or cfg.data.max_len
        self.parser = parser_for(template_text(cfg.data.chat) or tokenizer.chat_template)
        self.out = Path(regen.turns_out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.key = ""
        self.tokens = self.stopped = self.at_limit = self.requests = self.cut_prompts = 0
        self._lock = threading.Lock()

    def prompt_ids(self, c: int, messages: list[dict]) -> list[int]:
        from dflash.data.conversation_data import prompt_tokens
        d = self.cfg.data
        ids, cut = prompt_tokens(self.tok, messages, d.chat, self.tools[c], d.pool.max_prompt_len)
        if cut:
            with self._lock:
                self.cut_prompts += 1
        return ids

    def fields(self, c: int, text: str, prompt_text: str) -> dict:
        from dflash.data.turn_parser import parse_turn
        return parse_turn(text, prompt_text, self.parser, self.tools[c])

    def stats(self, wall: float) -> dict[str, float]:
        return {"data/written_tokens": float(self.tokens), "perf/write_tok_s": self.tokens / wall if wall else 0.0,
                "data/regen_turns_stopped": float(self.stopped), "data/regen_turns_at_limit": float(self.at_limit),
                "data/regen_requests": float(self.requests), "data/cut_prompts": float(self.cut_prompts)}

    # -- this process's target, in rounds --------------------------------------------------------------------
    def through_target(self, target, online) -> list[list[dict]]:
        from dflash.data.regen import regenerate_turns, target_responder, until_end
        respond = target_responder(target, self.end_id, self.max_new, online.write_batch or 16, self.sampling,
                                   self.seed, online.decode)
        rounds = self.out.with_name(f".{self.out.name}.rounds")

        def fields(c: int, prompt: list[int], tokens: list[int]) -> dict:
            turn = until_end(list(tokens), self.end_id)
            ended = bool(turn) and turn[-1] == self.end_id
            self.count(ended, len(turn))
            return self.fields(c, self.tok.decode(turn[:-1] if ended else turn), self.tok.decode(prompt))
        written = regenerate_turns(self.conversations, respond, self.prompt_ids, fields,
                                   start=self._read_rounds(rounds), on_round=lambda k, convs: _save_rounds(
                                       rounds, self.key, k, convs))
        _write_file(self.out, written, self.tools)
        rounds.unlink(missing_ok=True)
        return written

    def _read_rounds(self, path: Path) -> tuple[int, list] | None:
        """(rounds done, conversations) of an earlier regen of the same data and settings, or None."""
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if saved.get("key") != self.key:
            return None
        log.info("regen: resuming after round %d (%s)", saved["rounds"], path)
        return int(saved["rounds"]), saved["conversations"]

    # -- an OpenAI-compatible server, a request per turn -------------------------------------------------------
    def through_server(self) -> list[list[dict]]:
        from dflash.data.responders import ServerResponder
        responder = ServerResponder(self.regen.server, self.tok)
        journal = Journal(self.out.with_name(f".{self.out.name}.turns"), self.key)
        try:
            with ThreadPoolExecutor(max_workers=self.regen.server.concurrency,
                                    thread_name_prefix="dflash-regen-turns") as pool:
                written = list(pool.map(lambda c: self._conversation(c, responder, journal),
                                        range(len(self.conversations))))
        finally:
            responder.close()
            journal.close()
        self.requests = responder.requests
        _write_file(self.out, written, self.tools)
        journal.path.unlink(missing_ok=True)
        log.info("regen: %d requests to %s (%d retried), %d turns from the journal", responder.requests,
                 self.regen.server.url, responder.retried, len(journal.done))
        return written

    def _conversation(self, c: int, responder, journal: "Journal") -> list[dict]:
        """Conversation c with its trained turns written one after the other (each prompted with the ones before)."""
        sp = self.sampling
        msgs = [dict(m) for m in self.conversations[c]]
        for i in _trained(msgs):
            fields = journal.done.get((c, i))
            if fields is None:
                prompt = self.tok.decode(self.prompt_ids(c, msgs[:i]), skip_special_tokens=False)
                seed = int(hashlib.sha256(f"{self.seed}:{c}:{i}".encode()).hexdigest()[:8], 16)
                text, finish = responder.complete_turn(prompt, self.max_new, 0.0 if sp.greedy else sp.temperature,
                                                       seed, sp.top_p, sp.top_k)
                text, ended = self._cut_at_end(text, finish)
                fields = self.fields(c, text, prompt)
                tokens = len(self.tok.encode(text, add_special_tokens=False))
                journal.append(c, i, fields, ended, tokens)
                self.count(ended, tokens)
            msgs[i] = {**msgs[i], **fields}
        return msgs

    def _cut_at_end(self, text: str, finish: str) -> tuple[str, bool]:
        """The turn's text up to its end-of-turn token (a server that writes it out, or past it) and whether the
        server ended the turn itself (finish_reason stop, or the token in the text)."""
        end = self.tok.convert_ids_to_tokens(self.end_id) if self.end_id is not None else None
        if end and end in text:
            return text[:text.index(end)], True
        return text, finish == "stop"

    def count(self, ended: bool, tokens: int) -> None:
        """A turn written in this process: its tokens, and whether it ended at the end of turn or at the limit."""
        with self._lock:  # the server's turns come back on several threads
            self.tokens += tokens
            self.stopped += ended
            self.at_limit += not ended


def _save_rounds(path: Path, key: str, rounds: int, conversations) -> None:
    from dflash.atomic import atomic_write_text
    atomic_write_text(path, json.dumps({"key": key, "rounds": rounds, "conversations": conversations}))


class Journal:
    """The written turns of a server regen, one JSON line each (the key on the first line), appended and flushed as
    each turn comes back: what reached the file survives a kill -9. `done`: (conversation, message) → fields of an
    earlier regen with the same key (a torn last line is dropped)."""

    def __init__(self, path: Path, key: str):
        self.path, self.done = path, {}
        lines = path.read_text(encoding="utf-8").split("\n") if path.is_file() else []
        if lines and _json_line(lines[0]).get("key") == key:
            for line in lines[1:]:
                row = _json_line(line)
                if "c" in row:
                    self.done[(row["c"], row["i"])] = row["fields"]
            log.info("regen: resuming with %d written turns (%s)", len(self.done), path)
            self._file = path.open("a", encoding="utf-8")
            if lines[-1]:  # a torn last line: end it so the next one starts on its own line
                self._file.write("\n")
        else:
            self._file = path.open("w", encoding="utf-8")
            self._file.write(json.dumps({"key": key}) + "\n")
        self._file.flush()
        self._lock = threading.Lock()

    def append(self, c: int, i: int, fields: dict, ended: bool, tokens: int) -> None:
        with self._lock:
            self._file.write(json.dumps({"c": c, "i": i, "fields": fields, "ended": ended, "tokens": tokens},
                                        ensure_ascii=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_line(line: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError:
        return {}
    return row if isinstance(row, dict) else {}
