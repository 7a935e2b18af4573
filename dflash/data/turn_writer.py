"""`data.conversations.responses=target` in the loop, turn by turn: every later assistant turn is prompted with
the target's OWN earlier answers (what it sees when it serves the conversation), not the dataset's.

The stream's items are trained assistant turns, taken conversation by conversation (`TurnStream`): epoch e's seeded
order of the conversations (`stream_seed`), rank r's share every `world`-th of them, each conversation's trained
turns in order. A written batch is `write_batch` consecutive items of the rank's stream; writing it is the
offline regen's own loop (`dflash.data.regen.regenerate_turns`, `python -m experiments.regen regen.turns_out=`):
in rounds, round k writes the k-th trained turn of every conversation of the batch in one go, its prompt
(`dflash.data.conversation_data.prompt_tokens`: the conversation before the turn, cut from the middle past
`data.pool.max_prompt_len`) holding the answers of the earlier rounds, each answer ending at its first end token
(the template's end of turn or the target's EOS). Each round is one `write_continuations` call at
`data.online.sampling` (or the inference server's `continue_prompts`), every row to exactly `seq_len` tokens as
the online writer's rows are, so the row of an item is its prompt and the target's continuation, trained up to and
including the end of the turn (`loss_mask`). A conversation that a batch begins in the middle of has its earlier
turns written again as context (at most one per batch). A batch is a pure function of its keys (exact resume,
shards keyed by a fingerprint), as for every online writer (`dflash.data.online`).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

import numpy as np
import torch

from dflash.data.conversation_data import prompt_tokens
from dflash.data.online import OnlineWriter, Written
from dflash.data.regen import regenerate_turns, turn_text
from dflash.data.sources import epoch_order
from dflash.data.writing import ends_at_stop, write_continuations

TURN_FORMAT = 1  # in the shard fingerprint: how a batch of turns is written


class TurnStream:
    """Rank `rank`'s n-th item → (epoch, conversation, turn): the conversations in epoch e's seeded order, every
    `world`-th from `rank`, each expanded into its `turns[c]` trained turns."""

    def __init__(self, turns: list[int], seed: int, rank: int, world: int):
        if len(turns) < world:
            raise ValueError(f"data.path: {len(turns)} training conversation(s) with a turn to rewrite, fewer than "
                             f"the {world} data-parallel ranks")
        self.turns, self.seed, self.rank, self.world = np.asarray(turns, dtype=np.int64), seed, rank, world
        self._starts = [0]  # the rank's first item of each epoch seen so far
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(the rank's conversations of epoch e, cumulative turns after each)."""
        if e not in self._epochs:
            order = np.asarray(epoch_order(len(self.turns), self.seed, e), dtype=np.int64)[self.rank::self.world]
            self._epochs[e] = (order, np.cumsum(self.turns[order]))
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[e]

    def locate(self, n: int) -> tuple[int, int, int]:
        e = 0
        while True:
            if e + 1 == len(self._starts):
                self._starts.append(self._starts[e] + int(self._epoch(e)[1][-1]))
            if n < self._starts[e + 1]:
                break
            e += 1
        order, cum = self._epoch(e)
        pos = n - self._starts[e]
        j = int(np.searchsorted(cum, pos, side="right"))
        return e, int(order[j]), pos - (int(cum[j - 1]) if j else 0)


class TurnWriter(OnlineWriter):
    """The online writer of `responses=target` (module doc). `pool`: the turns' prompts with the dataset's
    earlier turns (pool row `offsets[c] + k` is conversation c's k-th trained turn; read for the eval's training
    examples and the regen's plan, never written from); `conversations`: the TRAIN split's normalized records;
    `records[c]`: conversation c's index there."""

    def __init__(self, target, pool, cfg, seq_len: int, rank: int = 0, world: int = 1, *, conversations,
                 records: list[int], turns: list[int], tokenizer, chat, max_prompt_len: int, end_id: int | None):
        self.conversations, self.records, self.tokenizer, self.chat = conversations, records, tokenizer, chat
        self.max_prompt_len, self.end_id = max_prompt_len, end_id
        self.offsets = np.concatenate([[0], np.cumsum(turns)[:-1]]).astype(np.int64)
        super().__init__(target, pool, cfg, seq_len, rank, world)
        # a turn ends at the template's end of turn or the target's EOS, whichever comes first
        self.stop_ids = tuple(sorted({*self.stop_ids, *(() if end_id is None else (end_id,))}))
        self.stream = TurnStream(turns, cfg.stream_seed, rank, world)
        self.cut_prompts = 0  # written prompts cut from the middle (their history past max_prompt_len)

    def _fingerprint(self) -> str:
        extra = f"turns-v{TURN_FORMAT}:{self.max_prompt_len}:{self.end_id}"
        return hashlib.sha256(f"{super()._fingerprint()}:{extra}".encode()).hexdigest()

    def _items(self, b: int) -> list[tuple[int, int, int]]:
        W = self.cfg.write_batch
        with self._lock:  # the stream's epoch caches; a server-backed regen writes several batches at once
            return [self.stream.locate(n) for n in range(b * W, (b + 1) * W)]

    def prompt_of(self, g: int) -> int:
        """The pool row of item g's turn (its prompt there has the dataset's earlier turns, not the target's)."""
        with self._lock:
            _, c, k = self.stream.locate(g // self.world)
        return int(self.offsets[c]) + k

    def _prompt_lens(self, b: int) -> list[int]:
        raise ValueError("a turn's prompt holds the target's earlier answers: its length is known once written")

    def planned_tokens(self, b: int) -> int:
        """An estimate: the prompts with the dataset's earlier turns (the target's answers differ in length)."""
        return sum(self.seq_len - len(self.pool.prompts[int(self.offsets[c]) + k]) for _, c, k in self._items(b))

    def loss_mask(self, g: int) -> torch.Tensor:
        """Item g's trained tokens: the target's turn after its prompt, up to and including its first end token
        (what it writes past its turn never trains; the prompt, user and system turns included, is context)."""
        seq, start = self.sequence(g), self.prompt_len(g)
        mask = torch.zeros(seq.numel(), dtype=torch.bool)
        mask[start:ends_at_stop(seq.tolist(), start, self.stop_ids)] = True
        return mask

    def _respond(self, seed: int):
        """`respond(prompts) -> continuations` of one written batch: each prompt continued to `seq_len` tokens,
        a round at a time, seeded by the batch and the round."""
        rounds = iter(range(1 << 30))

        def respond(prompts: list[list[int]]) -> list[list[int]]:
            round_seed = (seed * 131 + next(rounds)) % (1 << 63)
            sp = self.sampling
            if self.responder is not None:
                return self.responder.continue_prompts(prompts, [self.seq_len - len(p) for p in prompts],
                                                       0.0 if sp.greedy else sp.temperature, round_seed,
                                                       sp.top_p, sp.top_k)
            # the static decoder keeps one captured shape: every round written write_batch rows wide
            pad = self.cfg.write_batch - len(prompts) if self.decode != "cache" else 0
            gen = None
            if not sp.greedy:
                gen = torch.Generator(device=self.target.device)
                gen.manual_seed(round_seed)
            rows = write_continuations(self.target, prompts + prompts[-1:] * pad, self.seq_len, sp, gen, self.decode)
            return [rows[i, len(p):].tolist() for i, p in enumerate(prompts)]
        return respond

    def _write(self, b: int) -> Written:
        items = self._items(b)
        # the batch's conversations (one copy per epoch they appear in), each up to its last turn in the batch
        local: dict[tuple[int, int], int] = {}
        for e, c, _ in items:
            local.setdefault((e, c), len(local))
        last = {key: max(k for e, c, k in items if (e, c) == key) for key in local}
        convs, tools = [], []
        for (e, c), idx in local.items():
            rec = self.conversations[self.records[c]]
            trained = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant" and m["train"]]
            convs.append(rec["messages"][:trained[last[(e, c)]] + 1])
            tools.append(rec["tools"])
        rows: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (local conversation, turn) → row

        def prompt(j: int, messages: list[dict]) -> list[int]:
            ids, cut = prompt_tokens(self.tokenizer, messages, self.chat, tools[j], self.max_prompt_len)
            self.cut_prompts += cut
            return ids
        turn_of = {}  # (local conversation, message index) → trained-turn ordinal
        for j, msgs in enumerate(convs):
            ks = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and m["train"]]
            turn_of.update({(j, i): k for k, i in enumerate(ks)})
        seed = ((self.cfg.stream_seed * 1_000_003 + self.world) * 1_000_033 + self.rank) * 7_919 + b
        t0 = time.perf_counter()
        regenerate_turns(convs, self._respond(seed), prompt,
                         lambda j, p, ids: {"content": turn_text(self.tokenizer, ids, self.stop_ids)},
                         on_turn=lambda j, i, p, cont: rows.__setitem__((j, turn_of[(j, i)]), (p, cont)))
        dt = time.perf_counter() - t0
        picked = [rows[(local[(e, c)], k)] for e, c, k in items]
        tokens = torch.tensor([[*p, *cont][:self.seq_len] for p, cont in picked], dtype=torch.long)
        self._count(b, len(picked), sum(self.seq_len - len(r[0]) for r in rows.values()), dt)
        return Written(tokens, [len(p) for p, _ in picked])

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "data/cut_prompts": float(self.cut_prompts)}
