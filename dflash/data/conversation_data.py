"""`data.source=conversations`: a conversation dataset → the trainer's sequences, loss masks and eval suites.

Steps (each a `datasets` map, memory-mapped, run with `num_proc` workers and cached by fingerprint):
1. read and normalize every file of `data.path` (`dflash.data.conversations`);
2. split by a salted hash of each conversation: `heldout_per_10k` of every 10,000 go to the held-out split, which
   is never trained on and gives the `chat_heldout` eval suite (its first `eval_prompts` conversations, each
   cut before its last assistant turn, continued by the target for `eval_tokens` tokens);
3. (`responses=dataset`) render the TRAIN split through the target's chat template (`dflash.data.chat`): token
   ids and the assistant mask. A conversation with no assistant turn is skipped (`data/skipped`); one longer than `data.max_len` is cut
   (`overflow=truncate`) or split into `max_len` windows (`overflow=split`), counted in `data/truncated`;
   sequences shorter than `data.min_len`, or with no assistant token a block can be anchored on, are skipped.

Where the responses come from (`responses`, `RESPONSES`): `dataset` trains on them as given (data an engine
already wrote with this target); `target` has the target rewrite them, turn by turn: every trained assistant turn of
a TRAIN conversation becomes a prompt (the conversation before it, its earlier assistant turns the target's own
answers, with the generation prompt) that the online writer (`dflash.data.turn_writer`) continues to
`data.online.seq_len` tokens, and the drafter trains on the written tokens up to and including the first end-of-turn
token. `turn_prompts` renders them with the dataset's earlier turns up front (bad input stops the run before any
work; the eval's training examples). `python -m experiments.regen` writes the same shards ahead.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from dflash.data.chat import (
    ChatConfig,
    TemplateError,
    prepare_tokenizer,
    render,
    render_prompt,
    template_name,
    template_text,
)
from dflash.data.conversations import message, read_conversations
from dflash.registry import Registry

log = logging.getLogger(__name__)
FORMAT_VERSION = 3


@dataclass
class ConversationsConfig:
    responses: str = "dataset"  # dataset: train on the dataset's responses | target: the target rewrites them
    overflow: str = "truncate"  # a conversation longer than data.max_len: truncate | split (max_len windows)
    heldout_per_10k: int = 500  # conversations of every 10,000 held out by hash (never trained on)
    salt: str = "dflash-conversations-v1"  # the split's hash salt
    limit: int = 0  # train on the first N training sequences only (0: all)
    num_proc: int = 0  # tokenizing workers; 0 = auto (the machine's cores, 1 below AUTO_PARALLEL_ROWS rows)
    cache_dir: str = ".cache/dflash/conversations"  # `datasets`' Arrow caches; empty: its own default
    eval_prompts: int = 16  # the chat_heldout suite: its first N held-out conversations ...
    eval_tokens: int = 128  # ... each continued for M tokens by the target
    coding10_chat: bool = True  # also evaluate coding10's prompts as user messages through the chat template
    # false: a record the chat template refuses stops the run (exit 2), and one empty assistant turn skips its whole
    # record; true: the refused record is skipped and counted (data/skipped_template_error), an empty assistant turn
    # becomes context (data/untrained_empty_turns) and the record's other turns still train
    skip_bad: bool = False


# data.conversations.overflow -> (ids, mask, max_len) -> windows of at most max_len tokens
def _truncate(ids: list[int], mask: list[int], n: int) -> list[tuple[list[int], list[int]]]:
    """The first n tokens; when the trained tokens lie past them (a late assistant turn's own row), the window
    that starts a quarter of n before the first of them (the turn and the context just before it)."""
    trained = [i for i, m in enumerate(mask) if m]
    if len(ids) <= n or not trained or trained[-1] < n:
        return [(ids[:n], mask[:n])]
    start = min(len(ids) - n, max(0, trained[0] - n // 4))
    return [(ids[start:start + n], mask[start:start + n])]


OVERFLOW: Registry = Registry("data.conversations.overflow", {
    "truncate": _truncate,
    "split": lambda ids, mask, n: [(ids[i:i + n], mask[i:i + n]) for i in range(0, len(ids), n)],
})
RESPONSES = Registry("data.conversations.responses", {"dataset": "dataset", "target": "target"})
AUTO_PARALLEL_ROWS = 20_000  # below this, worker processes cost more than they save


def validate_conversations_config(cfg: ConversationsConfig) -> None:
    RESPONSES.check(cfg.responses)
    OVERFLOW.check(cfg.overflow)
    if not 0 <= cfg.heldout_per_10k < 10_000:
        raise ValueError(f"data.conversations.heldout_per_10k must be in [0, 10000), got {cfg.heldout_per_10k}")
    for key in ("limit", "num_proc"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"data.conversations.{key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.eval_prompts < 0 or cfg.eval_tokens < 2:
        raise ValueError(f"data.conversations.eval_prompts must be >= 0 and eval_tokens >= 2, got "
                         f"{cfg.eval_prompts} / {cfg.eval_tokens}")


def heldout_bucket(prompt_hash: str, salt: str) -> int:
    return int(hashlib.sha256(f"{salt}:{prompt_hash}".encode()).hexdigest()[:8], 16) % 10_000


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256((body + (tokenizer.chat_template or "")).encode()).hexdigest()


def anchorable(mask: list[int]) -> bool:
    """Some anchor a in [1, len - 2] has an assistant token at a + 1 (dflash.training.batching.draw_anchors)."""
    return any(mask[2:])


def _split(record: dict, *, salt: str, per_10k: int) -> dict:
    """Which assistant turns are held out (their prompt's hash), and the record's training messages: held-out
    turns are context there, never trained on."""
    held = [i for i, h in enumerate(record["prompt_hashes"]) if h and heldout_bucket(h, salt) < per_10k]
    messages = [{**m, "train": m["train"] and i not in held} for i, m in enumerate(record["messages"])]
    in_train = not record["skip"] and any(m["role"] == "assistant" and m["train"] for m in messages)
    skip = record["skip"] or ("" if in_train or held else "no_assistant_turn" if not any(
        m["role"] == "assistant" for m in messages) else "no_trained_turn")
    return {"messages": messages, "heldout_turns": held, "in_train": in_train, "skip": skip}


def _tokenize(batch: dict, *, tokenizer, chat: ChatConfig, max_len: int, min_len: int, overflow: str) -> dict:
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "length": [], "truncated": [], "status": [],
                            "source": []}

    def row(ids, mask, truncated, status, source):
        out["input_ids"].append(ids), out["loss_mask"].append(mask), out["length"].append(len(ids))
        out["truncated"].append(truncated), out["status"].append(status), out["source"].append(source)
    for messages, tools, source in zip(batch["messages"], batch["tools"], batch["source"]):
        if not any(m["role"] == "assistant" for m in messages):
            row([], [], False, "no_assistant_turn", source)
            continue
        try:
            rows = render(tokenizer, messages, chat, where=f"record {source}", tools=tools)
        except TemplateError as e:
            row([], [], False, f"{TEMPLATE_ERROR}{e}", source)
            continue
        for ids, mask in rows:  # one row, or one per trained assistant turn (dflash.data.chat.render)
            kept = 0
            for piece_ids, piece_mask in OVERFLOW[overflow](ids, mask, max_len):
                if len(piece_ids) >= min_len and anchorable(piece_mask):
                    row(piece_ids, piece_mask, len(ids) > max_len and kept == 0, "ok", source)
                    kept += 1
            if not kept:  # counted per row: a conversation's other turns may still train
                row([], [], False, "no_trainable_tokens", source)
    return out


@dataclass
class ConversationSet:
    train: object  # datasets.Dataset: input_ids, loss_mask, length, source (TRAIN rows, status ok); None: target
    heldout: object  # datasets.Dataset: normalized conversations with held-out turns (`heldout_turns`)
    normalized: object  # datasets.Dataset: the TRAIN split, normalized (held-out turns: train false)
    stats: dict[str, float]
    formats: dict[str, str]
    fingerprint: str  # the split and rendering; with responses=dataset also the cut (max_len, overflow, limit)
    everything: object = None  # datasets.Dataset: every record, normalized (data statistics)


def _num_proc(cfg: ConversationsConfig, rows: int) -> int | None:
    n = cfg.num_proc or (min(os.cpu_count() or 1, 16) if rows >= AUTO_PARALLEL_ROWS else 1)
    return n if n > 1 and rows >= 4 * n else None


_WARNED: set[tuple[str, str]] = set()  # (data fingerprint, what): a warning given once per process


def _warn_once(data: str, what: str, msg: str, *args) -> None:
    """A warning about the data, given once per process however often the set is loaded (a regen's writer per
    training rank, a campaign's write-ahead and then its runs)."""
    if (data, what) not in _WARNED:
        _WARNED.add((data, what))
        log.warning(msg, *args)


def _count_skips(normalized, stats: dict) -> None:
    """data/skipped_<reason> of the records nobody trains on, data/untrained_empty_turns, and a warning naming the
    first record of each."""
    skips, data = Counter(normalized["skip"]), normalized._fingerprint
    for reason, n in sorted(skips.items()):
        if not reason:
            continue
        first = normalized[normalized["skip"].index(reason)]["source"]
        stats[f"data/skipped_{reason}"] = float(n)
        _warn_once(data, reason, "conversations: %d record(s) skipped (%s), the first %s", n,
                   SKIP_REASONS.get(reason, reason), first)
    empty = normalized["empty_turns"]
    if any(empty):
        first = normalized[next(i for i, n in enumerate(empty) if n)]["source"]
        stats["data/untrained_empty_turns"] = float(sum(empty))
        _warn_once(data, "empty_turns", "conversations: %d empty assistant turn(s) kept as context, not trained on "
                   "(data.conversations.skip_bad=true), the first in %s", sum(empty), first)


TEMPLATE_ERROR = "template_error: "  # the status prefix of a record the chat template refuses


def _refused(status: Counter, skip_bad: bool, stats: dict, data: str) -> None:
    """Records the chat template refused (status `template_error: <why>`): TemplateError naming the first, or
    with `skip_bad` counted as data/skipped_template_error with one warning naming the first."""
    refused = [s for s in status if s.startswith(TEMPLATE_ERROR)]  # in the records' order
    if not refused:
        return
    if not skip_bad:
        raise TemplateError(refused[0].removeprefix(TEMPLATE_ERROR) + " (data.conversations.skip_bad=true skips "
                            "and counts such records)")
    n = sum(status[s] for s in refused)
    stats["data/skipped_template_error"] = float(n)
    _warn_once(data, "template_error", "conversations: %d record(s) skipped (the chat template refuses them), the "
               "first: %s", n, refused[0].removeprefix(TEMPLATE_ERROR))


SKIP_REASONS = {"image_parts": "content with image parts: a text drafter cannot train on it",
                "non_text_parts": "content with audio or file parts", "no_assistant_turn": "no assistant turn",
                "no_trained_turn": "every assistant turn has weight 0",
                "empty_assistant_turn": "an assistant turn with no content, reasoning or tool call"}


def load_conversation_set(data_cfg, tokenizer) -> ConversationSet:
    """Steps 1-3 of the module doc (step 3 only for responses=dataset: with responses=target the target writes
    the training tokens, `turn_prompts`); ConversationInputError / TemplateError on bad input."""
    c, chat = data_cfg.conversations, data_cfg.chat
    tokenizer = prepare_tokenizer(tokenizer, chat)
    normalized, formats = read_conversations(data_cfg.path, c.cache_dir, _num_proc(c, 0) or 1, c.skip_bad)
    procs = _num_proc(c, len(normalized))
    split = normalized.map(_split, fn_kwargs={"salt": c.salt, "per_10k": c.heldout_per_10k}, num_proc=procs,
                           desc="conversations: split")
    train_norm = split.filter(lambda t: t, input_columns="in_train", num_proc=procs)
    heldout = split.filter(lambda h, s: bool(h) and not s, input_columns=["heldout_turns", "skip"], num_proc=procs)
    settings = {"format": FORMAT_VERSION, "data": normalized._fingerprint, "tokenizer": tokenizer_fingerprint(tokenizer),
                "chat": asdict(chat), "template": template_text(chat),
                "heldout": [c.heldout_per_10k, c.salt]}  # what decides the split and the rendering
    base = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    cut = {"max_len": data_cfg.max_len, "min_len": data_cfg.min_len, "overflow": c.overflow, "limit": c.limit}
    fingerprint = base if c.responses == "target" else \
        hashlib.sha256(json.dumps({"base": base, **cut}, sort_keys=True).encode()).hexdigest()
    stats = {"data/conversations": float(len(normalized)), "data/heldout_conversations": float(len(heldout)),
             "data/heldout_prompts": float(sum(len(h) for h in heldout["heldout_turns"]))}
    _count_skips(split, stats)
    cs = ConversationSet(None, heldout, train_norm, stats, formats, fingerprint, split)
    if c.responses == "dataset":
        _tokenize_train(cs, data_cfg, tokenizer, procs)
    log.info("conversations: %d read (%s), %d with held-out turns; %s", len(normalized),
             ", ".join(sorted(set(formats.values()))), len(heldout),
             ", ".join(f"{k.removeprefix('data/')} {v:g}" for k, v in cs.stats.items()))
    return cs


def _tokenize_train(cs: ConversationSet, data_cfg, tokenizer, procs) -> None:
    """Step 3: cs.train (status ok rows) and the data/ counts of what was skipped or cut."""
    c, train_norm = data_cfg.conversations, cs.normalized
    tokenized = train_norm.map(_tokenize, batched=True, batch_size=64, remove_columns=train_norm.column_names,
                               fn_kwargs={"tokenizer": tokenizer, "chat": data_cfg.chat, "max_len": data_cfg.max_len,
                                          "min_len": data_cfg.min_len, "overflow": c.overflow},
                               num_proc=procs, new_fingerprint=cs.fingerprint[:32], desc="conversations: tokenize")
    status = Counter(tokenized["status"])
    _refused(status, c.skip_bad, cs.stats, cs.fingerprint)
    ok = tokenized.filter(lambda s: s == "ok", input_columns="status", num_proc=procs)
    if c.limit:
        ok = ok.select(range(min(c.limit, len(ok))))
    if not len(ok):
        raise ValueError(f"data.path={data_cfg.path!r}: no training conversation has an assistant token to train on "
                         f"(statuses: {dict(status)}; data.min_len={data_cfg.min_len}, data.max_len={data_cfg.max_len})")
    cs.train = ok.remove_columns(["status", "truncated"])
    skipped = {s: n for s, n in status.items() if s != "ok" and not s.startswith(TEMPLATE_ERROR)}
    cs.stats.update({"data/skipped": float(sum(skipped.values()) + sum(
        v for k, v in cs.stats.items() if k.startswith("data/skipped_"))),
        "data/truncated": float(sum(tokenized["truncated"])), "data/train_sequences": float(len(ok))})
    for reason, n in skipped.items():
        cs.stats[f"data/skipped_{reason}"] = float(n)


class ArrowColumn:
    """One list column of a dataset as a read-only sequence of tensors (rows read when asked: memory-mapped)."""

    def __init__(self, ds, column: str, dtype: torch.dtype | None):
        self.ds, self.column, self.dtype = ds, column, dtype

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        """Row i as a tensor of `dtype` (None: the plain list)."""
        value = self.ds[int(i)][self.column]
        return value if self.dtype is None else torch.tensor(value, dtype=self.dtype)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def spread(seq, count: int) -> list:
    """`count` rows spread over `seq` (deterministic), for eval/tau_train without reading everything."""
    step = max(1, len(seq) // max(count, 1))
    return [seq[i] for i in range(0, len(seq), step)[:count]]


# -- responses=target: one prompt per assistant turn --------------------------------------------------------
class PromptLimitError(ValueError):
    """A prompt whose system prompt and tool schemas alone take `data.pool.max_prompt_len` tokens or more."""


def _kept_text(tokenizer, messages: list[dict], chat: ChatConfig, tools: str, text: str) -> str:
    """The start of a prompt's rendering `text` that a cut never touches: the system prompt and the tool schemas
    the template writes there (up to the first character that depends on the turns after the system prompt:
    what `text` has in common with the rendering of the system prompt and a one-character user turn)."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    probe = render_prompt(tokenizer, head + [message("user", "\x00")], chat, tools)
    return text[:len(os.path.commonprefix([text, probe]))]


def prompt_tokens(tokenizer, messages: list[dict], chat: ChatConfig, tools: str, max_len: int,
                  where: str = "a record") -> tuple[list[int], bool]:
    """Assistant turn len(messages)'s prompt as tokens (with the generation prompt), at most `max_len`, and
    whether it was cut. The system prompt and the tool schemas (the template's start of the prompt) are kept
    whole; a long history is cut after them, the oldest turns first, whole, from a user turn on (a template may
    need one); a last user turn still too long keeps its first and last tokens around the cut. PromptLimitError
    (naming `where` and data.pool.max_prompt_len) when the system prompt and tools alone do not fit."""
    text = render_prompt(tokenizer, messages, chat, tools)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_len:
        return ids, False
    kept_text = _kept_text(tokenizer, messages, chat, tools, text)
    kept = tokenizer.encode(kept_text, add_special_tokens=False)
    if len(kept) >= max_len:
        raise PromptLimitError(
            f"data.pool.max_prompt_len={max_len}: the system prompt and tool schemas of {where} alone take "
            f"{len(kept)} tokens, and a prompt is never cut inside them; raise data.pool.max_prompt_len above "
            f"{len(kept)}")
    head = [m for m in messages[:1] if m["role"] == "system"]
    for k in range(len(head) + 1, len(messages)):
        if messages[k]["role"] != "user":
            continue
        text = render_prompt(tokenizer, head + messages[k:], chat, tools)
        cut = tokenizer.encode(text, add_special_tokens=False)
        if len(cut) <= max_len:
            return cut, True
    rest = tokenizer.encode(text[len(kept_text):], add_special_tokens=False)
    room = max_len - len(kept)
    first = room // 2
    return kept + rest[:first] + rest[len(rest) - (room - first):], True


def _turn_prompts(batch: dict, indices: list[int], *, tokenizer, chat: ChatConfig, max_prompt_len: int) -> dict:
    """Each trained assistant turn's prompt with the dataset's earlier turns (`prompt_tokens`; the target writes
    the rest of the sequence), its conversation (the record's index in the TRAIN split) and its place among that
    conversation's trained turns. A conversation with no trained turn gives one empty row (status
    no_assistant_turn); one the template cannot render, or whose system prompt and tools alone exceed the limit,
    one error row (template_error / prompt_limit) and no prompt."""
    out: dict[str, list] = {"prompt_ids": [], "prompt_len": [], "truncated": [], "status": [], "conversation": [],
                            "turn": []}

    def row(ids, truncated, status, conversation, turn):
        out["prompt_ids"].append(ids), out["prompt_len"].append(len(ids))
        out["truncated"].append(truncated), out["status"].append(status)
        out["conversation"].append(conversation), out["turn"].append(turn)
    for messages, tools, source, index in zip(batch["messages"], batch["tools"], batch["source"], indices):
        if not any(m["role"] == "assistant" and m["train"] for m in messages):
            row([], False, "no_assistant_turn", index, -1)
        prompts, status = record_prompts(tokenizer, messages, tools, source, chat, max_prompt_len)
        if status:
            row([], False, status, index, -1)
        for k, (ids, cut) in enumerate(prompts):
            row(ids, cut, "ok", index, k)
    return out


PROMPT_LIMIT = "prompt_limit: "  # the status prefix of a record whose system prompt and tools exceed the limit


def record_prompts(tokenizer, messages: list[dict], tools: str, source: str, chat: ChatConfig,
                   max_prompt_len: int) -> tuple[list[tuple[list[int], bool]], str]:
    """(each trained assistant turn's prompt with the dataset's earlier turns and whether it was cut, ''), or
    ([], why none): `prompt_limit: …` (the system prompt and tools alone exceed the limit) or `template_error: …`
    (the template refuses the record). `check_prompt_statuses` turns the statuses into errors or counts."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["train"]]
    try:
        return [prompt_tokens(tokenizer, messages[:i], chat, tools, max_prompt_len, where=f"record {source}")
                for i in turns], ""
    except PromptLimitError as e:
        return [], f"{PROMPT_LIMIT}{e}"
    except Exception as e:  # noqa: BLE001 - jinja raises many types
        return [], f"{TEMPLATE_ERROR}{template_name(chat)} does not render record {source}: {type(e).__name__}: {e}"


def check_prompt_statuses(status: Counter, skip_bad: bool, stats: dict, data: str) -> None:
    """PromptLimitError for a record whose system prompt and tools exceed the limit (a setting to raise, never
    skipped); records the template refuses as `_refused` says."""
    over = next((s for s in status if s.startswith(PROMPT_LIMIT)), None)
    if over:
        raise PromptLimitError(over.removeprefix(PROMPT_LIMIT))
    _refused(status, skip_bad, stats, data)


def turn_prompts(cs: ConversationSet, tokenizer, data_cfg) -> tuple[ArrowColumn, dict[str, float], str]:
    """(prompts as token lists, data/ figures, fingerprint) of every assistant turn of the TRAIN split."""
    c, chat, n = data_cfg.conversations, data_cfg.chat, data_cfg.pool.max_prompt_len
    fingerprint = hashlib.sha256(f"{cs.fingerprint}:turn-prompts-v5:{n}:{c.limit}:{c.skip_bad}".encode()).hexdigest()
    ds = cs.normalized.map(_turn_prompts, batched=True, batch_size=64, with_indices=True,
                           remove_columns=cs.normalized.column_names,
                           fn_kwargs={"tokenizer": prepare_tokenizer(tokenizer, chat), "chat": chat,
                                      "max_prompt_len": n},
                           num_proc=_num_proc(c, len(cs.normalized)), new_fingerprint=fingerprint[:32],
                           desc="conversations: turn prompts")
    status = Counter(ds["status"])
    stats: dict[str, float] = {}
    check_prompt_statuses(status, c.skip_bad, stats, cs.fingerprint)
    ok = ds.filter(lambda s: s == "ok", input_columns="status")
    if c.limit:
        ok = ok.select(range(min(c.limit, len(ok))))
    if not len(ok):
        raise ValueError(f"data.path={data_cfg.path!r}: no training conversation has an assistant turn to rewrite")
    stats.update({"data/prompts": float(len(ok)), "data/truncated": float(sum(ok["truncated"])),
                  "data/skipped": float(status.get("no_assistant_turn", 0) + stats.get("data/skipped_template_error",
                                                                                      0))})
    return ArrowColumn(ok, "prompt_ids", None), stats, fingerprint


def response_mask(tokens_T: torch.Tensor, prompt_len: int, end) -> torch.Tensor:
    """The tokens the target wrote after its prompt, up to and including its first end token (what follows is
    the target talking past its turn: never trained on). `end`: the end-of-turn id, several stop ids, or None."""
    from dflash.data.writing import ends_at_stop
    stops = () if end is None else (end,) if isinstance(end, int) else tuple(end)
    mask = torch.zeros(tokens_T.numel(), dtype=torch.bool)
    mask[prompt_len:ends_at_stop(tokens_T.tolist(), prompt_len, stops)] = True
    return mask


def end_of_turn_id(tokenizer) -> int | None:
    """The token a chat model ends its turn with: <|im_end|> where the vocabulary has it, else its eos token."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "<|im_end|>" in vocab:
        return int(vocab["<|im_end|>"])
    return getattr(tokenizer, "eos_token_id", None)
