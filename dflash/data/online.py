"""Online target-written training data (docs/data.md): the target writes every training sequence while the run
trains, so a run never needs to see a sequence twice.

The stream: item key g (the trainer's global item index; rank r of `world` takes g = n·world + r) names
prompt `order(epoch)[g mod P]` of the prompt pool (P prompts, `dflash.data.pool`; epoch = g div P, a seeded
permutation per epoch, `stream_seed`). The target continues the prompt to exactly `seq_len` tokens at
`sampling` (default the target's recommended setting: T=1 for the shipped reference target; greedy when
temperature is 0), seeded per written batch. A sequence's natural end is its first stop token after the prompt
(EOS / end of turn): `loss_mask` masks what follows out of the loss (`stop_at_eos`), and `stats` logs the
data's degeneracy (`dflash.data.degeneracy`) beside data/epochs. Every sequence has the same length, so the
target's feature forward and the drafter step see one static shape.

Writing is batched wide: a rank's items n = b·W .. (b+1)·W − 1 (`write_batch` W) are one written batch,
generated together (`dflash.data.writing.write_continuations`); with `reuse` R a written batch serves R·W items,
each row R times. On a GPU the next `ahead` batches are written in the background while the run trains on this
one. A batch is a pure function of its keys: an exact resume writes the same tokens again, or reads them back.
With `shard_dir` set each written batch is saved as a shard keyed by a fingerprint of everything that decides
it (target, dtype, pool, length, sampling, stream seed, world, rank, decode path), atomically and checksummed; later runs and every sweep trial with the same data settings read the shards
instead of writing (no trial regenerates what another wrote).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from dflash.atomic import load_checked, save_checked
from dflash.data.pool import PromptPool
from dflash.data.degeneracy import summarize
from dflash.data.writing import (DECODE_MODES, auto_write_batch, check_write_batch, ends_at_stop, resolve_decode,
                                 write_continuations)
from dflash.target.sampling import (FROM_TARGET, GREEDY, Sampling, SamplingConfig, resolve_sampling, target_folder,
                                    validate_sampling_config)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"DFLASH-ONLINE\n"


@dataclass
class OnlineConfig:
    seq_len: int = 0  # tokens per written sequence (prompt + continuation); 0: data.max_len
    # sequences the target writes together (one generation batch, one shard); 0 = auto (`auto_write_batch`)
    write_batch: int = 0
    # the setting the target writes at (docs/data.md, "Sampling"): -1 fields come from the target's
    # generation_config.json (the shipped reference target: T=1, so training data does not loop); temperature 0:
    # greedy. Labels stay the target's argmax either way.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # the legacy key (configs written before data.online.sampling): >= 0 sets the temperature; -1: sampling's.
    # `resolve_online_config` writes the resolved temperature here, so readers see what runs.
    temperature: float = -1.0
    # a written sequence ends after its first stop token (the target's EOS / end of turn) past the prompt: what
    # follows is masked out of the loss (`OnlineWriter.loss_mask`); false: every token is trained on
    stop_at_eos: bool = True
    stream_seed: int = 0  # prompt order and sampling; not the run seed, so trials of a sweep share shards
    shard_dir: str = ".cache/dflash/online"  # written batches saved here and reused; empty: none
    keep_batches: int = 4  # written batches kept in memory (a resume's replay reaches back into the last ones)
    # how the target decodes (DECODE_MODES): auto = graph on a GPU for a model type with a static decoder, else cache
    decode: str = "auto"
    ahead: int = 1  # on a GPU, batches written in the background ahead of the consumer (0: write when asked)
    # views of each written sequence: written batch b serves items b·R·W … (b+1)·R·W − 1, each row R times in a
    # seeded order. Writing and training share one GPU; R > 1 lets training run at its own speed
    reuse: int = 0  # 0 = auto: AUTO_GPU_REUSE on a GPU, 1 on the CPU


def validate_online_config(cfg: OnlineConfig, seq_len: int, max_prompt_len: int) -> None:
    if cfg.write_batch < 0:
        raise ValueError(f"data.online.write_batch must be >= 1, or 0 for auto; got {cfg.write_batch}")
    if cfg.temperature < 0 and cfg.temperature != FROM_TARGET:
        raise ValueError(f"data.online.temperature must be >= 0 (0: greedy), or -1 for data.online.sampling's; "
                         f"got {cfg.temperature}")
    validate_sampling_config(cfg.sampling, "data.online.sampling")
    if cfg.keep_batches < 1:
        raise ValueError(f"data.online.keep_batches must be >= 1, got {cfg.keep_batches}")
    if cfg.decode not in DECODE_MODES:
        raise ValueError(f"data.online.decode must be one of {', '.join(DECODE_MODES)}; got {cfg.decode!r}")
    if cfg.reuse < 0:
        raise ValueError(f"data.online.reuse must be >= 1 (views of each written sequence), or 0 for auto; "
                         f"got {cfg.reuse}")
    if cfg.ahead < 0:
        raise ValueError(f"data.online.ahead must be >= 0 (0: write when asked), got {cfg.ahead}")
    if seq_len <= max_prompt_len:
        raise ValueError(f"data.online.seq_len ({seq_len}; 0 means data.max_len) must exceed "
                         f"data.pool.max_prompt_len ({max_prompt_len}): the target must write something")


# auto reuse on a GPU. At the reference shapes (+trainer=gpu, 5-layer drafter) training takes ~0.54 ms of the
# H200 per sequence (59% busy at 350 K consumed tok/s) and the graph decode ~0.71 ms per written sequence: one
# view each needs more than the GPU; two views halve the writing (benchmarks/RESULTS.md, 2026-12-01).
AUTO_GPU_REUSE = 2


def resolve_online_config(cfg: OnlineConfig, target, seq_len: int) -> OnlineConfig:
    """`cfg` with its "auto" values made what runs: the sampling setting (-1 fields: the target's
    generation_config.json; the resolved temperature also in `temperature`), `write_batch` (0: `auto_write_batch`
    for this target and length) and `reuse` (0: AUTO_GPU_REUSE on a GPU, 1 on the CPU). Resolved values pass through unchanged, so the
    composing layer resolves once and every reader (the writer, the data's epoch count, write-ahead) sees it."""
    if cfg.temperature == FROM_TARGET or cfg.sampling.temperature == FROM_TARGET or -1 in (cfg.sampling.top_p,
                                                                                          cfg.sampling.top_k):
        s = resolve_sampling(cfg.sampling if cfg.temperature == FROM_TARGET
                             else dataclasses.replace(cfg.sampling, temperature=cfg.temperature), target_folder(target))
        cfg = dataclasses.replace(cfg, temperature=s.temperature, sampling=SamplingConfig(s.temperature, s.top_p, s.top_k))
    if cfg.write_batch == 0:
        cfg = dataclasses.replace(cfg, write_batch=auto_write_batch(target, seq_len))
    if cfg.reuse == 0:
        cfg = dataclasses.replace(cfg, reuse=AUTO_GPU_REUSE if target.device.type == "cuda" else 1)
    return cfg


# -- the stream -----------------------------------------------------------------------------------------
class Written(NamedTuple):
    """A written batch: its rows (prompt + continuation, each `seq_len` tokens) and each row's prompt length."""
    tokens: torch.Tensor  # [write_batch, seq_len], long, on the CPU
    prompt_lens: list[int]


def _tokens_digest(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class OnlineWriter:
    """Key → written sequence, by written batches (memory → shard → the target writes it). Thread-safe."""

    def __init__(self, target, pool: PromptPool, cfg: OnlineConfig, seq_len: int, rank: int = 0, world: int = 1):
        self.target, self.pool, self.cfg, self.seq_len = target, pool, cfg, seq_len
        self.rank, self.world = rank, world
        # "auto" values: resolved by the composing layer already (a no-op then), and before the fingerprint, so
        # shards name the real width
        self.cfg = cfg = resolve_online_config(cfg, target, seq_len)
        check_write_batch(target, cfg.write_batch)
        self.decode = resolve_decode(target, cfg.decode)
        self.fingerprint = self._fingerprint()
        self._batches: OrderedDict[int, Written] = OrderedDict()
        self._orders: OrderedDict[int, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # the maps above and `_pending`
        self._write_lock = threading.Lock()  # one batch written at a time
        self._pending: dict[int, Future] = {}
        self._reuse_orders: OrderedDict[int, torch.Tensor] = OrderedDict()
        # batches written ahead in the background: on a GPU (the static decoder's replays leave the host free);
        # on the CPU a second writer would only compete with training for the cores
        self.ahead = cfg.ahead if target.device.type == "cuda" else 0
        # what the engine did, for data/ and perf/ metrics
        self.written_batches = self.shard_reads = self.written_tokens = 0
        self.write_s = 0.0
        self.stop_ids = stop_token_ids(target)
        self._degeneracy: dict[str, float] = {}  # sums over the rows measured (`_measure`)
        self.batch_digests: dict[int, str] = {}  # written batch -> sha256 of its tokens (read or written: `digest`)
        # an inference server that writes the responses instead of this process's target
        # (`dflash.data.responders.ServerResponder`; `python -m experiments.regen backend=openai`); the shards are
        # the same, keyed alike, since the server serves this target with the same sampling settings
        self.responder = None

    @property
    def size(self) -> int:
        return len(self.pool)

    def _fingerprint(self) -> str:
        t = self.target
        payload = {"format": FORMAT_VERSION, "target": str(t.identity), "dtype": str(t.dtype),
                   "device_type": t.device.type, "pool": self.pool.fingerprint, "seq_len": self.seq_len,
                   "temperature": float(self.cfg.temperature), "stream_seed": self.cfg.stream_seed,
                   "write_batch": self.cfg.write_batch, "world": self.world, "rank": self.rank,
                   "decode": "cache" if self.decode == "cache" else "static"}  # graph and static: the same kernels
        if self.sampling.top_p < 1.0 or self.sampling.top_k > 0:  # only then: shards of T-only settings keep their keys
            payload.update(top_p=self.sampling.top_p, top_k=self.sampling.top_k)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    @property
    def sampling(self) -> Sampling:
        t = max(0.0, float(self.cfg.temperature))
        return Sampling(t, float(self.cfg.sampling.top_p), int(self.cfg.sampling.top_k)) if t > 0 else GREEDY

    def loss_mask(self, g: int) -> torch.Tensor | None:
        """Item g's tokens to train on: everything up to and including the first stop token the target wrote
        after the prompt (its natural end); None when it wrote none (every token) or `stop_at_eos` is off."""
        if not self.cfg.stop_at_eos or not self.stop_ids:
            return None
        seq = self.sequence(g)
        start = self.prompt_len(g)
        end = ends_at_stop(seq.tolist(), start, self.stop_ids)
        if end >= seq.numel():
            return None
        mask = torch.zeros(seq.numel(), dtype=torch.bool)
        mask[:end] = True
        return mask

    def shard_path(self, b: int) -> Path | None:
        d = self.cfg.shard_dir
        return Path(d) / self.fingerprint[:24] / f"batch-{b:08d}.pt" if d else None

    def prompt_index(self, g: int) -> int:
        from dflash.data.sources import epoch_order  # (sources holds this module's config: import here)
        epoch, pos = divmod(g, self.size)
        if epoch not in self._orders:
            self._orders[epoch] = epoch_order(self.size, self.cfg.stream_seed, epoch)
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch][pos]

    def batch_keys(self, b: int) -> list[int]:
        W = self.cfg.write_batch
        return [(b * W + j) * self.world + self.rank for j in range(W)]

    def _row(self, g: int) -> tuple[int, int]:
        """(written batch, row) that item g reads."""
        n = g // self.world
        if g % self.world != self.rank:
            raise ValueError(f"item {g} belongs to rank {g % self.world}, not {self.rank}")
        W, R = self.cfg.write_batch, self.cfg.reuse
        if R == 1:
            return divmod(n, W)
        b, j = divmod(n, R * W)
        return b, int(self._reuse_order(b)[j]) % W

    def sequence(self, g: int) -> torch.Tensor:
        b, row = self._row(g)
        return self._batch(b).tokens[row]

    def prompt_len(self, g: int) -> int:
        """How many of item g's first tokens are its prompt (the rest the target wrote)."""
        b, row = self._row(g)
        return self._batch(b).prompt_lens[row]

    def prompt_of(self, g: int) -> int:
        """The pool index of the prompt item g's sequence continues (its first tokens are that prompt)."""
        b, row = self._row(g)
        return self.prompt_index(self.batch_keys(b)[row])

    def _reuse_order(self, b: int) -> torch.Tensor:
        """Written batch b's R·W views in a seeded order (each row R times, spread over the window)."""
        with self._lock:
            order = self._reuse_orders.get(b)
            if order is None:
                gen = torch.Generator().manual_seed((self.cfg.stream_seed * 1_000_003 + self.rank) * 7_919 + b)
                order = self._reuse_orders[b] = torch.randperm(self.cfg.reuse * self.cfg.write_batch, generator=gen)
                while len(self._reuse_orders) > 2:
                    self._reuse_orders.popitem(last=False)
            return order

    # A batch is claimed once (a Future in `_pending`) and filled by one writer at a time (`_write_lock`): in the
    # caller, or with `ahead` > 0 (a GPU) in a background thread, which also writes the next `ahead` batches
    # while the run trains on this one. Batches are pure functions of their keys, so who writes them and when
    # changes no token (an exact resume reads or writes the same batches).
    def _batch(self, b: int) -> Written:
        with self._lock:
            written, fut, mine = self._batches.get(b), None, False
            if written is None:
                fut = self._pending.get(b)
                if fut is None:
                    fut, mine = self._claim(b), True
        if written is None:
            if mine and not self.ahead:
                self._fill(b, fut)
            written = fut.result()
        for nxt in range(b + 1, b + 1 + self.ahead):
            with self._lock:
                if nxt not in self._batches and nxt not in self._pending:
                    self._claim(nxt)
        return written

    def _claim(self, b: int) -> Future:  # (under self._lock)
        fut = self._pending[b] = Future()
        if self.ahead:
            threading.Thread(target=self._fill, args=(b, fut), name=f"dflash-online-{b}", daemon=True).start()
        return fut

    def _fill(self, b: int, fut: Future) -> None:
        try:
            with self._write_lock:
                written = self._load_or_write(b)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for this batch
            log.warning("online data: writing batch %d failed (%s: %s)", b, type(e).__name__, e)
            with self._lock:
                self._pending.pop(b, None)
            fut.set_exception(e)
            return
        with self._lock:
            self._pending.pop(b, None)
            self._batches[b] = written
            while len(self._batches) > self.cfg.keep_batches:
                self._batches.popitem(last=False)
        fut.set_result(written)

    def close(self, wait: bool = True) -> None:
        """Wait for the batches being written ahead (a shard half written at exit is a wasted batch). `wait=False`
        (a run stopping on a signal): do not; their daemon threads end with the process, and a shard is written
        atomically, so none is left torn."""
        if not wait:
            return
        with self._lock:
            pending = list(self._pending.values())
        for fut in pending:
            fut.exception()

    def ensure_shard(self, b: int) -> int:
        """Written batch b on disk (`python -m experiments.regen`): the tokens the target wrote for it now, 0 when
        its shard was already there (a resumed regen skips it without reading it)."""
        path = self.shard_path(b)
        if path is None:
            raise ValueError("data.online.shard_dir is empty: there is nowhere to write shards")
        if path.is_file():
            return 0
        before = self.written_tokens
        self._load_or_write(b)
        return self.written_tokens - before

    def _load_or_write(self, b: int) -> Written:
        path = self.shard_path(b)
        key = f"{self.fingerprint}:{b}"
        if path is not None and path.is_file():
            try:
                data = load_checked(path, _MAGIC, FORMAT_VERSION, key)
                tokens = data["tokens"]
                if tokens.shape != (self.cfg.write_batch, self.seq_len) or tokens.dtype != torch.long:
                    raise ValueError(f"shape {tuple(tokens.shape)}")
                lens = data.get("prompt_lens") or self._prompt_lens(b)  # (shards written before they were kept)
                self.shard_reads += 1
                self.batch_digests[b] = _tokens_digest(tokens)
                return Written(tokens, [int(n) for n in lens])
            except Exception as e:  # noqa: BLE001 - torn, corrupt or foreign: write it again
                log.warning("online data: shard %s unusable (%s); writing it again", path, e)
        written = self._write(b)
        if path is not None:
            save_checked(path, _MAGIC, FORMAT_VERSION, key, written._asdict())
        self.batch_digests[b] = _tokens_digest(written.tokens)
        self._measure(written)
        return written

    def digest(self, batches: int) -> str | None:
        """One digest of written batches 0 … batches−1, as read or written here; None when one of them was not.
        Runs whose digests differ trained on different text under the same settings: sampled data (T > 0) written
        again on another machine need not repeat bit for bit, unlike the key of its shards."""
        parts = [self.batch_digests.get(b) for b in range(batches)]
        if batches < 1 or None in parts:
            return None
        return hashlib.sha256(":".join(parts).encode()).hexdigest()[:16]

    def _prompt_lens(self, b: int) -> list[int]:
        return [len(self.pool.prompts[self.prompt_index(g)]) for g in self.batch_keys(b)]

    def planned_tokens(self, b: int) -> int:
        """The tokens writing batch b takes (the regen's progress bar)."""
        return sum(self.seq_len - n for n in self._prompt_lens(b))

    def _measure(self, written: Written) -> None:
        """Degeneracy of the batch's continuations (up to MEASURED_ROWS rows of each written batch, each cut at its
        end): summed here, logged by `stats` beside data/epochs."""
        tokens = written.tokens
        rows = range(0, len(tokens), max(1, len(tokens) // MEASURED_ROWS))
        conts, ended = [], 0
        for r in rows:
            seq = tokens[r].tolist()
            start = written.prompt_lens[r]
            end = ends_at_stop(seq, start, self.stop_ids) if self.stop_ids else len(seq)
            ended += end < len(seq)
            conts.append(seq[start:end])
        d = summarize(conts)
        acc = self._degeneracy
        n = d["count"]
        for k in ("repeat4", "in_repeat16", "cycle_share"):
            if d[k] == d[k]:
                acc[k] = acc.get(k, 0.0) + d[k] * n
        acc["ended"] = acc.get("ended", 0.0) + ended
        acc["rows"] = acc.get("rows", 0.0) + n

    def _write(self, b: int) -> Written:
        with self._lock:  # prompt_index's order cache; a server-backed regen writes several batches at once
            prompts = [self.pool.prompts[self.prompt_index(g)] for g in self.batch_keys(b)]
        seed = ((self.cfg.stream_seed * 1_000_003 + self.world) * 1_000_033 + self.rank) * 7_919 + b
        t0 = time.perf_counter()
        if self.responder is not None:
            sp = self.sampling
            rows = self.responder.continue_prompts([list(map(int, p)) for p in prompts],
                                                   [self.seq_len - len(p) for p in prompts],
                                                   0.0 if sp.greedy else sp.temperature, seed, sp.top_p, sp.top_k)
            tokens = torch.tensor([[*map(int, p), *r] for p, r in zip(prompts, rows)], dtype=torch.long)
        else:
            gen = None
            if not self.sampling.greedy:
                gen = torch.Generator(device=self.target.device)
                gen.manual_seed(seed)
            tokens = write_continuations(self.target, prompts, self.seq_len, self.sampling, gen, self.decode)
        dt = time.perf_counter() - t0
        self._count(b, len(prompts), sum(self.seq_len - len(p) for p in prompts), dt)
        return Written(tokens, [len(p) for p in prompts])

    def _count(self, b: int, rows: int, written: int, dt: float) -> None:
        self.write_s += dt
        self.written_batches += 1
        self.written_tokens += written
        # one line a written batch: the only trace of a writer in the loop (the trainer logs every N steps, and
        # logs nothing while it waits for the first batch: a 27B run of 2026-12-02 showed no line in 280 s)
        log.info("online data: wrote batch %d, %d rows, %d tokens in %.1f s (%.0f written tok/s, decode %s)", b,
                 rows, written, dt, written / max(dt, 1e-9), self.decode)

    def stats(self) -> dict[str, float]:
        out = {"data/written_batches": self.written_batches, "data/shard_reads": self.shard_reads,
               "data/written_tokens": self.written_tokens,
               "perf/write_tok_s": self.written_tokens / self.write_s if self.write_s else 0.0}
        n = self._degeneracy.get("rows", 0.0)
        if n:  # the data's degeneracy (dflash.data.degeneracy), over the rows measured so far
            d = self._degeneracy
            out.update({"data/repeat4": d.get("repeat4", 0.0) / n, "data/in_repeat16": d.get("in_repeat16", 0.0) / n,
                        "data/cycle_share": d.get("cycle_share", 0.0) / n, "data/ended_share": d["ended"] / n,
                        "data/temperature": float(self.sampling.temperature)})
        return out


# rows of each written batch whose degeneracy is measured (the measure is Python, ~1 ms a row)
MEASURED_ROWS = 64


def stop_token_ids(target) -> tuple[int, ...]:
    """The target's end tokens (its configs' and tokenizer's eos_token_id), as the evaluation's ground truth ends."""
    ids: set[int] = set()
    model = getattr(target, "model", None)
    for src in (getattr(model, "config", None), getattr(model, "generation_config", None),
                getattr(target, "tokenizer", None)):
        v = getattr(src, "eos_token_id", None)
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                ids.add(x)
    vocab = int(getattr(target, "vocab_size", 0) or 0)
    return tuple(sorted(i for i in ids if not vocab or i < vocab))
