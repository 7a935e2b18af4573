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

import logging
import math
import sys
import time
from dataclasses import dataclass, field

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
    # `out=`: the conversations with every trained assistant turn rewritten by the target, turn by turn (each later
    # turn prompted with its own earlier answers, each ending at its end of turn), written to this .jsonl instead of
    # shards (dflash.app.regen_turns; then train on it with responses=dataset)
    turns_out: str = ""
    turn_tokens: int = 0  # longest written turn (0: data.max_len)


def validate_regen(cfg, regen: RegenConfig) -> None:
    d = cfg.data
    if d.source != "conversations":
        raise ConfigError("experiments.regen writes the target's responses to a conversation dataset: give "
                          "+data=conversations data.path=... (and data.conversations.responses=target for shards, "
                          "or out=FILE.jsonl for a conversation file)")
    if not regen.turns_out and d.conversations.responses != "target":
        raise ConfigError("experiments.regen writes the shards of data.conversations.responses=target: give it "
                          "(or out=FILE.jsonl to write a conversation file)")
    if not regen.turns_out and not d.online.shard_dir:
        raise ConfigError("data.online.shard_dir is empty: experiments.regen has nowhere to write its shards")
    if regen.backend not in ("target", "openai"):
        raise ConfigError(f"backend={regen.backend!r}: expected target (this process writes) or openai (an "
                          f"inference server at url=...)")
    if regen.backend == "openai":
        validate_server(regen.server)
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


def run_regen(cfg, regen: RegenConfig) -> dict[str, float]:
    """Writes this process's share of the shards (module doc); returns data/ and perf/ figures of this rank."""
    if regen.turns_out:  # a conversation file instead of shards
        from dflash.app.regen_turns import run_regen_turns
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


SHORT_KEYS = {"backend=": "regen.backend=", "url=": "regen.server.url=", "server.": "regen.server.",
              "out=": "regen.turns_out="}


def regen_config_from(argv: list[str]) -> tuple[RegenConfig, list[str]]:
    """`regen.KEY=VALUE` arguments as a RegenConfig (through the one override parser, dflash/overrides.py); the
    rest are run-config overrides. `backend=`, `url=`, `server.KEY=` and `out=` are short for regen.backend,
    regen.server.url, regen.server.KEY and regen.turns_out."""
    from dflash.overrides import apply_overrides
    argv = [next((long + a[len(short):] for short, long in SHORT_KEYS.items() if a.startswith(short)), a)
            for a in argv]
    ours = [a for a in argv if a.startswith("regen.")]
    return apply_overrides(RegenConfig(), ours, prefix="regen."), [a for a in argv if not a.startswith("regen.")]
