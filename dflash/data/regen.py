"""Drafter training data written by the target itself (`+data=target_regen`).

The drafter learns to predict the target, so its training sequences should look like what the target
writes: each corpus sequence keeps its first `prompt_len` tokens (the prompt) and the rest is replaced by
the target's greedy continuation. `regenerate_sequences` does this in batches on the target's device and
stores the result in `cache_dir` under a fingerprint of everything that decides it (target identity,
dtype, device type, the input tokens, the settings, the caller's corpus fingerprint); a later call with
the same fingerprint reads the file back instead of generating. Files are written atomically and carry a
checksum: a torn or corrupt file is rebuilt, never trusted.

Batching needs no padding: sequences are grouped by prompt length (all equal when every sequence is at
least `prompt_len + 1` tokens long), and a batch generates its longest continuation, each row cropped to
its own length (greedy decoding is causal, so cropping is exact). Generation runs the decoder with a
Hugging Face cache (prefill, then one token per forward; `DynamicCache(config=...)`, a long-standing API)
and the target's chunked LM head; `use_cache=False` recomputes the whole prefix at every step (slow; a
reference for tests).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from dflash.target.sampling import Sampling

from dflash.atomic import load_checked, save_checked
from dflash.target.cache import cache_kwarg, new_hf_cache

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"DFLASH-REGEN\n"


# -- greedy generation ------------------------------------------------------------------------------
def _next_tokens(target, last_hidden_BTH: torch.Tensor) -> torch.Tensor:
    labels, _, _ = target.labels_from_hidden(last_hidden_BTH[:, -1:], 0)
    return labels[:, -1]


@torch.no_grad()
def greedy_generate(target, prompt_ids_BP: torch.Tensor, max_new_tokens: int,
                    use_cache: bool = True) -> torch.Tensor:
    """The target's greedy continuation of each row of an equal-length prompt batch: LongTensor [B, N]
    on the CPU. Never stops early (an end-of-text token is just another token)."""
    ids = torch.as_tensor(prompt_ids_BP, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    B, P = ids.shape
    if P < 1 or max_new_tokens < 1:
        raise ValueError(f"greedy_generate needs a non-empty prompt and max_new_tokens >= 1 (got {P}, "
                         f"{max_new_tokens})")
    dev = target.device
    ids = ids.to(dev)
    decoder = target.decoder
    out_tokens = []
    if not use_cache:
        seq = ids
        for _ in range(max_new_tokens):
            h = decoder(input_ids=seq, use_cache=False).last_hidden_state
            tok = _next_tokens(target, h)
            out_tokens.append(tok)
            seq = torch.cat([seq, tok[:, None]], dim=1)
        return torch.stack(out_tokens, 1).cpu()
    cache, kw = new_hf_cache(decoder), cache_kwarg(decoder)
    pos = torch.arange(P, device=dev)[None].expand(B, -1)
    h = decoder(input_ids=ids, position_ids=pos, use_cache=True, **{kw: cache}).last_hidden_state
    tok = _next_tokens(target, h)
    out_tokens.append(tok)
    for i in range(max_new_tokens - 1):
        pos = torch.full((B, 1), P + i, device=dev, dtype=torch.long)
        h = decoder(input_ids=tok[:, None], position_ids=pos, use_cache=True, **{kw: cache}).last_hidden_state
        tok = _next_tokens(target, h)
        out_tokens.append(tok)
    return torch.stack(out_tokens, 1).cpu()


# -- conversations, turn by turn ----------------------------------------------------------------------------
def _stop_ids(end) -> tuple[int, ...]:
    """`end` (the end-of-turn id, several stop ids, or None) as a tuple of ids."""
    return () if end is None else (end,) if isinstance(end, int) else tuple(end)


def until_end(tokens: list[int], end) -> list[int]:
    """A response up to and including its first end token (the whole of it when there is none): the one cut of
    every writer (`dflash.data.writing.ends_at_stop`). `end`: the end-of-turn id, several stop ids, or None."""
    from dflash.data.writing import ends_at_stop
    return tokens[:ends_at_stop(tokens, 0, _stop_ids(end))]


def turn_text(tokenizer, tokens: list[int], end) -> str:
    """A written turn's content: its tokens up to its first end token (`until_end`), that token dropped
    (reasoning and calls as the model wrote them, in the text)."""
    turn = until_end(list(tokens), end)
    return tokenizer.decode(turn[:-1] if turn and turn[-1] in _stop_ids(end) else turn)


def target_responder(target, end_id: int | None, max_new_tokens: int, batch_size: int = 16,
                     sampling: "float | Sampling" = 0.0, seed: int = 0, decode: str = "auto"):
    """`respond(prompts) -> responses` (token lists) of the target, each ending at its first end-of-turn token
    (at most `max_new_tokens`): greedy, or sampled at `sampling` (a `Sampling` or a bare temperature; seeded by
    `seed` and the batch's prompts). Prompts of any
    lengths are written together, `batch_size` at a time (`dflash.data.writing.write_continuations`: no
    padding, each row sees exactly its own tokens)."""
    from dflash.data.writing import write_continuations
    sampled = not sampling.greedy if isinstance(sampling, Sampling) else sampling > 0

    def respond(prompts: list[list[int]]) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        for b in range(0, len(order), batch_size):
            batch = order[b:b + batch_size]
            # seeded by the prompts themselves: a resumed regen draws what the first one would have
            gen = torch.Generator().manual_seed(hash((seed, *(tuple(prompts[j]) for j in batch))) & 0x7FFFFFFF) \
                if sampled else None
            rows = write_continuations(target, [prompts[j] for j in batch],
                                       max(len(prompts[j]) for j in batch) + max_new_tokens, sampling, gen, decode)
            for r, j in enumerate(batch):
                p = len(prompts[j])
                out[j] = until_end(rows[r, p:p + max_new_tokens].tolist(), end_id)
        return out  # type: ignore[return-value]
    return respond


def regenerate_turns(conversations: list[list[dict]], respond, prompt_ids, written_turn,
                     start: tuple[int, list[list[dict]]] | None = None, on_round=None,
                     on_turn=None) -> list[list[dict]]:
    """Every conversation's trained assistant turns rewritten, in rounds: round k writes the k-th trained turn of
    every conversation that has one, all of them in one `respond` call (the one step that produces responses: the
    target here, an inference server elsewhere). A turn's prompt (`prompt_ids(conversation index, messages before
    it)`) holds the responses of the earlier rounds, so each later turn is prompted with the target's own earlier
    answers; user turns, tool results and untrained turns stay as the dataset has them.
    `written_turn(conversation index, prompt, tokens)`: the turn's message fields (`content`, and where the caller
    splits them out, `reasoning` and `tool_calls`; those not given are emptied).
    `start` = (rounds done, the conversations after them) resumes; `on_round(rounds done, conversations)` is
    called after each round (to save them); `on_turn(conversation, message index, prompt, response)` after each
    written turn (the in-training writer keeps its rows, `dflash.data.turn_writer`)."""
    convs = [[dict(m) for m in c] for c in conversations]
    turns = [[i for i, m in enumerate(c) if m["role"] == "assistant" and m.get("train", True)] for c in convs]
    first = 0
    if start is not None:
        first, convs = start[0], [[dict(m) for m in c] for c in start[1]]
    for k in range(first, max((len(t) for t in turns), default=0)):
        todo = [(c, t[k]) for c, t in enumerate(turns) if k < len(t)]
        prompts = [prompt_ids(c, convs[c][:i]) for c, i in todo]
        for (c, i), prompt, tokens in zip(todo, prompts, respond(prompts)):
            convs[c][i] = {**convs[c][i], "reasoning": "", "tool_calls": "", **written_turn(c, prompt, tokens)}
            if on_turn is not None:
                on_turn(c, i, prompt, tokens)
        if on_round is not None:
            on_round(k + 1, convs)
    return convs


# -- fingerprint and cache file ---------------------------------------------------------------------
def _as_token_lists(target, sequences: Sequence) -> list[list[int]]:
    out = []
    for s in sequences:
        if isinstance(s, str):
            out.append(list(target.tokenizer.encode(s)))
        elif isinstance(s, torch.Tensor):
            out.append([int(x) for x in s.reshape(-1).tolist()])
        else:
            out.append([int(x) for x in s])
    return out


def regen_key(target, seqs: list[list[int]], prompt_len: int, gen_len: int | None,
              corpus_fingerprint: str = "") -> str:
    h = hashlib.sha256()
    for s in seqs:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int64).numpy().tobytes())
    dev = getattr(target, "device", None)
    payload = {"format": FORMAT_VERSION, "target": str(target.identity),
               "dtype": str(getattr(target, "dtype", "")), "device_type": getattr(dev, "type", str(dev)),
               "prompt_len": int(prompt_len), "gen_len": None if gen_len is None else int(gen_len),
               "corpus": corpus_fingerprint, "inputs": h.hexdigest(), "n": len(seqs)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def regen_cache_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"regen-{key[:32]}.pt"


def save_regen(path: str | os.PathLike, key: str, seqs: list[torch.Tensor], meta: dict) -> None:
    lengths = [int(s.numel()) for s in seqs]
    flat = torch.cat([s.reshape(-1).to(torch.int64) for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
    save_checked(path, _MAGIC, FORMAT_VERSION, key, {"lengths": lengths, "tokens": flat, "meta": meta})


def load_regen(path: str | os.PathLike, key: str) -> list[torch.Tensor]:
    """Raises (ValueError, OSError, …) on anything not exactly as written for `key`."""
    data = load_checked(path, _MAGIC, FORMAT_VERSION, key)
    lengths, flat = [int(n) for n in data["lengths"]], data["tokens"]
    if flat.dtype != torch.int64 or flat.numel() != sum(lengths):
        raise ValueError("token count mismatch")
    return [t.clone() for t in torch.split(flat, lengths)] if lengths else []


# -- regeneration ---------------------------------------------------------------------------------------
def _plan(lengths: list[int], prompt_len: int, gen_len: int | None) -> list[tuple[int, int]]:
    """(prompt tokens kept, tokens to generate) for each sequence."""
    plan = []
    for n in lengths:
        if n < 1:
            raise ValueError("regenerate_sequences: an input sequence is empty")
        if gen_len is None:  # keep the sequence's length: prompt + (n - prompt) generated tokens
            p = min(prompt_len, n - 1) if n > 1 else 1
            plan.append((p, max(n - p, 1)))
        else:
            plan.append((min(prompt_len, n), gen_len))
    return plan


@torch.no_grad()
def build_regen(target, seqs: list[list[int]], prompt_len: int, gen_len: int | None,
                batch_size: int) -> list[torch.Tensor]:
    plan = _plan([len(s) for s in seqs], prompt_len, gen_len)
    order = sorted(range(len(seqs)), key=lambda i: (plan[i][0], -plan[i][1], i))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    t0, done_tok, last_log = time.perf_counter(), 0, time.perf_counter()
    i = 0
    while i < len(order):
        p = plan[order[i]][0]
        batch = [order[i]]
        while i + len(batch) < len(order) and len(batch) < batch_size and plan[order[i + len(batch)]][0] == p:
            batch.append(order[i + len(batch)])
        i += len(batch)
        n_max = max(plan[j][1] for j in batch)
        prompts = torch.tensor([seqs[j][:p] for j in batch], dtype=torch.long)
        gen = greedy_generate(target, prompts, n_max)
        for r, j in enumerate(batch):
            out[j] = torch.cat([prompts[r], gen[r, :plan[j][1]]])
        done_tok += len(batch) * n_max
        if time.perf_counter() - last_log > 30:
            last_log = time.perf_counter()
            log.info("regen: %d/%d sequences, %.0f generated tok/s", i, len(order),
                     done_tok / (last_log - t0))
    return out  # type: ignore[return-value]


def regenerate_sequences(target, sequences: Sequence, prompt_len: int = 32, gen_len: int | None = None,
                         batch_size: int = 64, cache_dir: str | os.PathLike | None = ".cache/dflash/regen",
                         corpus_fingerprint: str = "", stats: dict | None = None) -> list[torch.Tensor]:
    """Each sequence's first `prompt_len` tokens followed by the target's greedy continuation.

    `sequences`: token sequences (LongTensors or int lists) or texts (encoded with `target.tokenizer`).
    `gen_len`: tokens generated per sequence; None keeps every sequence's own length (at least one
    generated token). Returns 1-D LongTensors on the CPU, in input order. `cache_dir` empty/None: no
    disk cache. `stats`, when given, receives {hit, path, key, seconds, generated_tokens}."""
    if prompt_len < 1:
        raise ValueError(f"regen prompt_len must be >= 1, got {prompt_len}")
    if gen_len is not None and gen_len < 1:
        raise ValueError(f"regen gen_len must be >= 1 or None, got {gen_len}")
    if batch_size < 1:
        raise ValueError(f"regen batch_size must be >= 1, got {batch_size}")
    seqs = _as_token_lists(target, sequences)
    key = regen_key(target, seqs, prompt_len, gen_len, corpus_fingerprint)
    info = {"hit": False, "path": None, "key": key, "seconds": 0.0, "generated_tokens": 0}
    path = regen_cache_path(cache_dir, key) if cache_dir else None
    if path is not None and path.is_file():
        try:
            result = load_regen(path, key)
            if len(result) != len(seqs):
                raise ValueError("sequence count mismatch")
            info.update(hit=True, path=str(path))
            if stats is not None:
                stats.update(info)
            log.info("regen: reusing %s (%d sequences)", path, len(result))
            return result
        except Exception as e:  # torn, corrupt or foreign file: rebuild
            log.warning("regen: cache file %s unusable (%s); regenerating", path, e)
    t0 = time.perf_counter()
    result = build_regen(target, seqs, prompt_len, gen_len, batch_size)
    info["seconds"] = time.perf_counter() - t0
    info["generated_tokens"] = sum(g for _, g in _plan([len(s) for s in seqs], prompt_len, gen_len))
    if path is not None:
        save_regen(path, key, result, {"target": str(target.identity), "prompt_len": prompt_len,
                                       "gen_len": gen_len, "corpus": corpus_fingerprint})
        info["path"] = str(path)
    log.info("regen: %d sequences, %d generated tokens in %.1f s", len(result), info["generated_tokens"],
             info["seconds"])
    if stats is not None:
        stats.update(info)
    return result
