"""What a run trains on, and how often it has seen it (docs/data.md).

`build_training_data` gives the run its data before the first step: stored sequences (`data.source`) or the
online stream the target writes (`data.source=online`, or `trainer.online_data`, which `+trainer=gpu` turns
on; `dflash.data.online`). Either way the data's size in distinct sequences is known up front, so the
memorization guard can warn before any work: a run planned to see its average sequence more than
`data.max_epochs` times logs a loud warning and carries the tag `data.over_epoch_limit=true`.

`DataMeter` counts what the consumer trained on (all ranks together) and logs `data/epochs` (how often the
average distinct sequence has been seen), `data/unique_sequences`, `data/consumed_tokens` and the online
writer's own figures; it holds `trainer.token_budget` (stop at the first log interval past that many consumed
tokens). Its counts are part of a checkpoint, so a resumed run goes on counting.
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dflash.data.online import OnlineWriter, resolve_online_config
from dflash.data.sources import build_training_sequences
from dflash.training.distributed import DistInfo, sum_
from dflash.training.pipeline import ItemSource

log = logging.getLogger(__name__)


class OnlineSource(ItemSource):
    """Item keys → sequences the target writes (or wrote into a shard earlier); epochs are prompt-pool epochs."""

    def __init__(self, writer: OnlineWriter, next_index: int = 0, replay: list[int] | None = None,
                 mask_source: Callable | None = None):
        super().__init__([], writer.cfg.stream_seed, next_index, replay, writer.rank, writer.world)
        self.size, self.writer, self.mask_source = writer.size, writer, mask_source

    def sequences_for(self, claims: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        return [self.writer.sequence(g) for g, _, _ in claims]

    def masks_for(self, claims: list[tuple[int, int, int]]) -> list[torch.Tensor | None]:
        return [None] * len(claims) if self.mask_source is None else self.mask_source(claims)


@dataclass
class TrainingData:
    kind: str  # "stored" | "online"
    sequences: list[torch.Tensor] | None  # stored data
    writer: OnlineWriter | None  # online data
    unique: int  # distinct sequences the data holds; 0: unbounded (sampled online writing)
    mean_len: float
    fingerprint: str
    corpus_fingerprint: str
    order_seed: int
    reuse: int = 1  # views of each written sequence (data.online.reuse)
    loss_masks: Sequence | None = None  # stored data: per sequence, the tokens trained on (None: all)
    mask_source: Callable | None = None  # online data: claims -> loss masks (None: every token)
    stats: dict = field(default_factory=dict)  # fixed data/ figures logged beside the counts (data/skipped ...)
    tags: dict = field(default_factory=dict)  # run tags the data adds (data.responses ...)
    eval_suites: list = field(default_factory=list)  # suites of the data's own distribution (chat_heldout ...)
    eval_note: str = ""  # printed under the eval summary (where the training responses came from)
    sample: list | None = None  # what examples() returns when set (a few rows of a large memory-mapped set)
    report: str = ""  # markdown for a person (a chat dataset's statistics and marked records), a run artifact

    def epochs(self, items: int) -> float:
        """data/epochs after `items` views: pool epochs (items over the distinct sequences) for a bounded pool,
        never below the views each written sequence gets (`reuse`); unbounded (sampled) data: `reuse`."""
        if not self.unique:
            return float(self.reuse) if items else 0.0
        return max(items / self.unique, float(self.reuse)) if self.reuse > 1 and items else items / self.unique

    def distinct_seen(self, items: int) -> int:
        seen = math.ceil(items / self.reuse)
        return min(seen, self.unique) if self.unique else seen

    def examples(self) -> list:
        """What the run trains on, for eval/tau_train: the stored sequences, or the online stream's prompts."""
        if self.sample is not None:
            return self.sample
        return self.sequences if self.writer is None else self.writer.pool.prompts

    def source(self, next_index: int, replay: list[int], rank: int, world: int) -> ItemSource:
        if self.writer is not None:
            return OnlineSource(self.writer, next_index, replay, self.mask_source)
        return ItemSource(self.sequences, self.order_seed, next_index, replay, rank, world, self.loss_masks)


def uses_online(cfg) -> bool:
    return cfg.data.source == "online" or cfg.trainer.online_data


def sequences_fingerprint(seqs: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for s in seqs:
        h.update(len(s).to_bytes(4, "little"))
        h.update(s.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def build_training_data(cfg, target, dist_info: DistInfo) -> TrainingData:
    if not uses_online(cfg):
        seqs = build_training_sequences(cfg.data, target, cfg.seed)
        return TrainingData("stored", seqs, None, len(seqs), sum(map(len, seqs)) / len(seqs),
                            sequences_fingerprint(seqs), "", cfg.seed)
    if cfg.data.source == "math" and cfg.data.pool.source == "math":
        log.info("trainer.online_data=true: the target's answers to the math generator's training problems "
                 "(data.pool.source=math), written online")
    elif cfg.data.source not in ("online", "stdlib"):
        log.warning("trainer.online_data=true: training on sequences the target writes online from data.pool "
                    "(source %s); data.source=%s is not used (trainer.online_data=false trains on it)",
                    cfg.data.pool.source, cfg.data.source)
    from dflash.data.pool import pool_for
    from dflash.data.sources import validate_online_data
    d = cfg.data
    validate_online_data(d)
    pool = pool_for(d, target.tokenizer, str(target.identity))
    online = resolve_online_config(d.online, target, d.online_seq_len())  # a no-op on a composed run's config
    writer = OnlineWriter(target, pool, online, d.online_seq_len(), dist_info.rank, dist_info.world)
    unique = 0 if not writer.sampling.greedy else len(pool)  # greedy: one prompt, one sequence
    return TrainingData("online", None, writer, unique, float(d.online_seq_len()), writer.fingerprint,
                        pool.corpus_fingerprint, online.stream_seed, online.reuse,
                        mask_source=lambda claims: [writer.loss_mask(g) for g, _, _ in claims])


def planned_items(cfg, data: TrainingData, world: int) -> int:
    """Items the run will consume at most: its steps, or fewer when the token budget ends it first."""
    t = cfg.trainer
    per_step = t.sequences_per_step * world
    items = t.max_steps * per_step
    if t.token_budget > 0:  # stops at the first log interval past the budget
        steps = math.ceil(t.token_budget / (data.mean_len * per_step))
        steps = math.ceil(steps / cfg.tracking.log_every) * cfg.tracking.log_every
        items = min(items, steps * per_step)
    return items


def epoch_guard(cfg, data: TrainingData, world: int) -> dict[str, str]:
    """Tags of the run's data, and a loud warning when it is planned past `data.max_epochs`."""
    items = planned_items(cfg, data, world)
    epochs = data.epochs(items)
    limit = cfg.data.max_epochs
    over = bool(limit) and epochs > limit
    if over:
        bar = "!" * 100
        log.warning("\n%s\nMEMORIZATION RISK: this run is planned to see its average training sequence %.1f times "
                    "(%d items over %d distinct sequences), past data.max_epochs=%g. The drafter will memorize: "
                    "training accuracy will look excellent while held-out acceptance falls. Use more data "
                    "(data.source=online, a larger data.num_sequences / data.pool) or fewer steps. The run is "
                    "tagged data.over_epoch_limit=true.\n%s", bar, epochs, items, data.unique, limit, bar)
    return {"data.kind": data.kind, "data.fingerprint": data.fingerprint[:16],
            "data.corpus": data.corpus_fingerprint[:16] or "-", "data.planned_epochs": f"{epochs:.3f}",
            "data.max_epochs": f"{limit:g}", "data.over_epoch_limit": str(over).lower(),
            "data.unique_sequences": str(data.unique or "unbounded"), **data.tags}


class DataMeter:
    def __init__(self, data: TrainingData, token_budget: int, dist_info: DistInfo = DistInfo()):
        self.data, self.token_budget, self.dist = data, token_budget, dist_info
        self.items = self.tokens = 0  # this rank's, since the run began (a checkpoint carries them)
        # of those tokens, the ones a loss mask trains on (a conversation's assistant tokens); -1: no mask seen
        self.trained = -1
        self.total_items = self.total_tokens = 0  # all ranks, as of the last read

    def add(self, tokens: int, items: int, trained: int | None = None) -> None:
        """`trained`: the step's tokens inside its loss masks (None: the data has none, every token trains)."""
        self.items += items
        self.tokens += tokens
        if trained is not None:
            self.trained = max(self.trained, 0) + trained

    def read(self) -> dict[str, float]:
        """All ranks' counts (one collective per log interval: every rank calls)."""
        tot = sum_(torch.tensor([self.items, self.tokens, self.trained], dtype=torch.float64), self.dist).tolist()
        self.total_items, self.total_tokens = int(tot[0]), int(tot[1])
        d, items = self.data, self.total_items
        unique = d.distinct_seen(items)
        epochs = d.epochs(items)
        out = {"data/consumed_tokens": float(self.total_tokens), "data/consumed_sequences": float(items),
               "data/unique_sequences": float(unique), "data/epochs": epochs,
               "data/views_per_sequence": items / unique if unique else 0.0}
        if self.trained >= 0:  # masked data: consumed tokens count the user and system turns too
            out["data/trained_tokens"] = max(tot[2], 0.0)
        out.update(d.stats)
        if self.data.writer is not None:
            out.update(self.data.writer.stats())  # this rank's writer
        return out

    def over_budget(self) -> bool:
        """Past `trainer.token_budget` at the last read (the same all-reduced figure on every rank)."""
        return self.token_budget > 0 and self.total_tokens >= self.token_budget

    def state_dict(self) -> dict:
        return {"items": self.items, "tokens": self.tokens, "trained": self.trained}

    def load_state_dict(self, state: dict) -> None:
        self.items, self.tokens = int(state.get("items", 0)), int(state.get("tokens", 0))
        self.trained = int(state.get("trained", -1))  # checkpoints written before the count: none
