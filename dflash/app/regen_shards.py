"""The target's responses to a conversation dataset, written offline as the shards a run reads
(`python -m experiments.regen`; `data.conversations.responses=target`).

A training run with `responses=target` asks the online writer (`dflash.data.online`) for written batch b of
training rank r; the batch is a pure function of its keys and is saved under a fingerprint of everything that
decides it (target, pool, length, sampling, stream seed, training world size, rank, write_batch). This writes
exactly those shards ahead, for `regen.train_world` training ranks: the same writers, the same keys, the same
files. Work items are (training rank, batch) pairs, dealt round-robin to the regen's own ranks (torchrun: one per
GPU), so any number of writing GPUs can fill the shards of any number of training ranks. A shard already on disk
is skipped without being read: a killed regen resumes where it was, and a finished one is a no-op.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import ConfigError
from dflash.data.responders import ServerConfig, validate_server

log = logging.getLogger(__name__)


@dataclass
class RegenConfig:
    train_world: int = 1  # data-parallel ranks of the training runs that will read the shards
    epochs: float = 1.0  # written batches per training rank to cover this many passes over the turn prompts
    batches: int = 0  # written batches per training rank (0: from epochs)
    progress: bool = True  # a progress bar on stderr (rank 0): written tok/s and ETA
    # who writes the responses: `target` (this process's target) or `openai` (an OpenAI-compatible inference
    # server serving the same target: vLLM, SGLang, transformers serve; `server.*`, dflash.data.responders)
    backend: str = "target"
    server: ServerConfig = field(default_factory=ServerConfig)
    # turn by turn: the conversations with every trained assistant turn rewritten by the target (each later turn
    # prompted with its own earlier answers, each ending at its end-of-turn token), written to this .jsonl (then
    # train on it with responses=dataset) instead of shards
    turns_out: str = ""
    turn_tokens: int = 0  # longest written turn (0: data.max_len)


def validate_regen(cfg, regen: RegenConfig) -> None:
    d = cfg.data
    if d.source != "conversations" or d.conversations.responses != "target":
        raise ConfigError("experiments.regen writes the target's responses to a conversation dataset: give "
                          "+data=conversations data.path=... data.conversations.responses=target")
    if not d.online.shard_dir:
        raise ConfigError("data.online.shard_dir is empty: experiments.regen has nowhere to write its shards")
    if regen.backend not in ("target", "openai"):
        raise ConfigError(f"backend={regen.backend!r}: expected target (this process writes) or openai (an "
                          f"inference server at url=...)")
    if regen.backend == "openai":
        validate_server(regen.server)
        if regen.turns_out:  # the turn-by-turn writer generates with this process's target only, for now
            raise ConfigError("backend=openai writes shards; regen.turns_out (turn by turn) needs backend=target")
    if regen.turns_out and not regen.turns_out.endswith(".jsonl"):
        raise ConfigError(f"regen.turns_out={regen.turns_out!r}: expected a .jsonl file to write")
    if regen.turn_tokens < 0:
        raise ConfigError(f"regen.turn_tokens must be >= 0 (0: data.max_len), got {regen.turn_tokens}")
    if regen.train_world < 1 or regen.batches < 0 or regen.epochs <= 0:
        raise ConfigError(f"regen.train_world must be >= 1, regen.batches >= 0 and regen.epochs > 0; got "
                          f"{regen.train_world} / {regen.batches} / {regen.epochs}")


def plan(num_prompts: int, write_batch: int, regen: RegenConfig) -> int:
    """Written batches per training rank: `batches`, or enough for `epochs` passes over the prompts."""
    if regen.batches:
        return regen.batches
    return math.ceil(regen.epochs * num_prompts / (write_batch * regen.train_world))


def _openai_record(messages: list[dict], tools: str) -> dict:
    """A normalized conversation as an OpenAI record our reader reads back (untrained turns: weight 0)."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning"):
            msg["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            msg["tool_calls"] = json.loads(m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        if m["role"] == "assistant" and not m["train"]:
            msg["weight"] = 0
        out.append(msg)
    return {"messages": out, **({"tools": json.loads(tools)} if tools else {})}


TURNS_VERSION = 1  # what regen.turns_out writes (its rounds file is read back only at the same version)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _read_rounds(path: Path, key: str) -> tuple[int, list] | None:
    """(rounds done, conversations) of an earlier regen of the same data and settings, or None."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if saved.get("key") != key:
        return None
    log.info("regen: resuming after round %d (%s)", saved["rounds"], path)
    return int(saved["rounds"]), saved["conversations"]


def run_regen_turns(cfg, regen: RegenConfig) -> dict[str, float]:
    """`regen.turns_out`: the dataset's conversations with their trained assistant turns rewritten by the
    target, turn by turn (`dflash.data.regen.regenerate_turns`), written atomically as OpenAI JSONL."""
    from dflash.app.chat_data import load_set
    from dflash.config import validate
    from dflash.data.conversation_data import end_of_turn_id, prompt_tokens
    from dflash.data.online import resolve_online_config
    from dflash.data.regen import regenerate_turns, target_responder, turn_text
    from dflash.target.sampling import Sampling
    from dflash.target.model import Target
    validate(cfg)
    validate_regen(cfg, regen)
    target = Target(cfg.target)
    cs = load_set(cfg, target.tokenizer)
    kept = cs.everything.filter(lambda s: not s, input_columns="skip")
    tok, chat, n = target.tokenizer, cfg.data.chat, cfg.data.pool.max_prompt_len
    tools, end_id = kept["tools"], end_of_turn_id(target.tokenizer)
    max_new = regen.turn_tokens or cfg.data.max_len
    # the data's sampling setting made what runs (-1 fields: the target's generation_config.json)
    online = resolve_online_config(cfg.data.online, target, cfg.data.max_len)
    sampling = Sampling(online.sampling.temperature, online.sampling.top_p, online.sampling.top_k)
    respond = target_responder(target, end_id, max_new, online.write_batch or 16, sampling,
                               online.stream_seed, online.decode)
    out = Path(regen.turns_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a killed regen resumes after its last finished round, when nothing that decides the answers changed
    key = hashlib.sha256(json.dumps([cs.fingerprint, str(target.identity), str(target.dtype), max_new, n, end_id,
                                     sampling.label, online.stream_seed, TURNS_VERSION]).encode()).hexdigest()
    partial = out.with_name(f".{out.name}.rounds")
    start = _read_rounds(partial, key)
    t0 = time.perf_counter()
    written = regenerate_turns(kept["messages"], respond,
                               lambda c, msgs: prompt_tokens(tok, msgs, chat, tools[c], n)[0],
                               lambda ids: turn_text(tok, ids, end_id),
                               start=start, on_round=lambda k, convs: _write_atomic(
                                   partial, json.dumps({"key": key, "rounds": k, "conversations": convs})))
    _write_atomic(out, "".join(json.dumps(_openai_record(m, t), ensure_ascii=False) + "\n"
                               for m, t in zip(written, tools)))
    partial.unlink(missing_ok=True)
    turns = sum(m["role"] == "assistant" and m["train"] for c in written for m in c)
    log.info("regen: %d conversations, %d assistant turns rewritten turn by turn, in %s", len(written), turns, out)
    return {"data/regen_conversations": float(len(written)), "data/regen_turns": float(turns),
            "sys/regen_s": time.perf_counter() - t0}


def run_regen(cfg, regen: RegenConfig) -> dict[str, float]:
    """Writes this process's share of the shards (module doc); returns data/ and perf/ figures of this rank."""
    if regen.turns_out:
        return run_regen_turns(cfg, regen)
    from dflash.target.model import Target
    from dflash.app.chat_data import conversation_writer, load_set
    from dflash.training.distributed import init_distributed
    from dflash.training.distributed import shutdown as shutdown_distributed
    from dflash.config import validate
    validate(cfg)
    validate_regen(cfg, regen)
    dist = init_distributed()
    try:
        target = Target(cfg.target)
        cs = load_set(cfg, target.tokenizer)
        writers = [conversation_writer(cfg, target, cs, r, regen.train_world)[0] for r in range(regen.train_world)]
        n = plan(len(writers[0].pool), writers[0].cfg.write_batch, regen)
        jobs = [(r, b) for b in range(n) for r in range(regen.train_world)][dist.rank::dist.world]
        todo = [(r, b) for r, b in jobs if not writers[r].shard_path(b).is_file()]
        total = sum(writers[r].planned_tokens(b) for r, b in todo)
        log.info("regen rank %d/%d: %d of %d shards to write (%d already there), %d tokens, write_batch %d, "
                 "decode %s, shards under %s", dist.rank, dist.world, len(todo), len(jobs), len(jobs) - len(todo),
                 total, writers[0].cfg.write_batch, writers[0].decode, writers[0].shard_path(0).parent)
        bar = _progress(total, regen.progress and dist.is_main, dist.world)
        t0, written = time.perf_counter(), 0
        if regen.backend == "openai":
            written = _write_through_server(writers, todo, regen, target.tokenizer, bar)
        for r, b in todo if regen.backend == "target" else ():
            tokens = writers[r].ensure_shard(b)
            written += tokens
            bar.update(tokens)
        bar.close()
        wall = time.perf_counter() - t0
        return {"data/regen_shards": float(len(jobs)), "data/regen_written_shards": float(len(todo)),
                "data/written_tokens": float(written), "perf/write_tok_s": written / wall if wall else 0.0,
                "sys/regen_s": wall, "data/regen_batches_per_rank": float(n),
                "data/write_batch": float(writers[0].cfg.write_batch)}
    finally:
        shutdown_distributed(dist)


def _write_through_server(writers, todo, regen: RegenConfig, tokenizer, bar) -> int:
    """The shards of `todo` with an inference server writing the responses: enough shards at once to keep
    `server.concurrency` requests in flight (the responder bounds them); returns the tokens written."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from dflash.data.responders import ServerResponder
    responder = ServerResponder(regen.server, tokenizer)
    for w in writers:
        w.responder = responder
    at_once = max(1, math.ceil(regen.server.concurrency / writers[0].cfg.write_batch))
    written = 0
    try:
        with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="dflash-regen") as pool:
            for fut in as_completed([pool.submit(writers[r].ensure_shard, b) for r, b in todo]):
                tokens = fut.result()
                written += tokens
                bar.update(tokens)
    finally:
        responder.close()
    log.info("regen: %d requests to %s (%d retried)", responder.requests, regen.server.url, responder.retried)
    return written


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, show: bool, world: int):
    if not show:
        return _NoBar()
    from tqdm import tqdm
    # rank 0's own share: its written tok/s and ETA (the ranks' shares are equal to within one batch)
    return tqdm(total=total, unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True, smoothing=0.1,
                desc="regen written" if world == 1 else f"regen written (rank 0 of {world})")


SHORT_KEYS = {"backend=": "regen.backend=", "url=": "regen.server.url=", "server.": "regen.server."}


def regen_config_from(argv: list[str]) -> tuple[RegenConfig, list[str]]:
    """`regen.KEY=VALUE` arguments as a RegenConfig (through the one override parser, dflash/overrides.py); the
    rest are run-config overrides. `backend=`, `url=` and `server.KEY=` are short for regen.backend,
    regen.server.url and regen.server.KEY."""
    from dflash.overrides import apply_overrides
    argv = [next((long + a[len(short):] for short, long in SHORT_KEYS.items() if a.startswith(short)), a)
            for a in argv]
    ours = [a for a in argv if a.startswith("regen.")]
    return apply_overrides(RegenConfig(), ours, prefix="regen."), [a for a in argv if not a.startswith("regen.")]
