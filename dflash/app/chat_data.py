"""The run's data for `data.source=conversations` (dflash/data/conversation_data.py says what is read and how).

`build_conversation_data` gives a `TrainingData` whose items carry a loss mask (only assistant tokens are
trained on) and the eval suites of the user's own distribution: `chat_heldout` (the held-out split's first
`data.conversations.eval_prompts` conversations with a held-out turn, each cut before its first held-out turn,
`eval_tokens` tokens each)
and `coding10_chat` (the coding10 prompts as user messages through the target's chat template).

- `responses=dataset`: the tokenized TRAIN split, memory-mapped; the run is tagged `data.responses=dataset` and
  the eval summary says no response was written by the target in this run.
- `responses=target`: the online writer rewrites every trained assistant turn, turn by turn, each later turn
  prompted with the target's own earlier answers (`dflash.data.turn_writer`: shards, fingerprints, exact resume);
  `conversation_writer` builds it, and `python -m experiments.regen` writes the same shards ahead of a run.
"""
from __future__ import annotations

import logging
import shutil

import torch

from dflash.config import ConfigError
from dflash.data.chat import prepare_tokenizer, render_prompt
from dflash.data.conversation_data import (
    ArrowColumn,
    ConversationSet,
    end_of_turn_id,
    load_conversation_set,
    spread,
    turn_prompts,
)
from dflash.data.conversation_report import report
from dflash.data.pool import PromptPool
from dflash.data.turn_writer import TurnWriter
from dflash.evaluation.prompts import Suite, Task, load_suite, suite_stop
from dflash.training.datastream import TrainingData, build_training_data

log = logging.getLogger(__name__)
SAMPLE_ROWS = 64  # training rows kept in memory for eval/tau_train
REPORT_RECORDS = 3  # records shown with their trained tokens marked in the run's data/conversations.md


def check_chat_records(cfg) -> None:
    """data.source=conversations: every record of data.path read and normalized now, before the store, the run
    folder or the target exist (minutes at 27B): a bad record is a ConfigError naming the file, line and field. The
    datasets cache the check made is removed when it fails, and kept when it passes (the load reads it again)."""
    if cfg.data.source != "conversations":
        return
    from dflash.data.conversations import read_conversations
    from dflash.run_dir import missing_folders, remove_empty_folders
    cache = cfg.data.conversations.cache_dir
    made = missing_folders(cache) if cache else []
    try:
        read_conversations(cfg.data.path, cache, 1)  # as load_conversation_set reads it: the same cache entries
    except (ValueError, FileNotFoundError) as e:
        if made:
            shutil.rmtree(made[0], ignore_errors=True)
            remove_empty_folders(made[1:])
        raise ConfigError(str(e)) from e


def load_set(cfg, tokenizer) -> ConversationSet:
    """The conversation set, bad input as ConfigError (exit 2), naming the file, line and field."""
    try:
        return load_conversation_set(cfg.data, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def chat_suites(cs: ConversationSet, tokenizer, cfg) -> list[Suite]:
    d, c = cfg.data, cfg.data.conversations
    tokenizer = prepare_tokenizer(tokenizer, d.chat)
    tasks = []
    for row in cs.heldout:  # each conversation's first held-out turn: its prompt, never trained on
        if len(tasks) >= c.eval_prompts:
            break
        i = row["heldout_turns"][0]
        tasks.append(Task(f"chat{len(tasks):04d}", render_prompt(tokenizer, row["messages"][:i], d.chat, row["tools"])))
    # each ends where eval.stop names it to (by default neither: a chat answer is prose and fenced code)
    suites = [Suite("chat_heldout", tasks, c.eval_tokens, suite_stop(cfg.eval, "chat_heldout"))] if tasks else []
    if not tasks and c.eval_prompts:
        log.warning("data.conversations: the held-out split has no conversation with an assistant turn; no "
                    "chat_heldout suite (raise data.conversations.heldout_per_10k)")
    if c.coding10_chat:
        coding = [Task(t.name, render_prompt(tokenizer, [{"role": "user", "content": t.prompt}], d.chat))
                  for t in load_suite("coding10")]
        suites.append(Suite("coding10_chat", coding, int(cfg.eval.max_new_tokens),
                            suite_stop(cfg.eval, "coding10_chat")))
    return suites


def conversation_writer(cfg, target, cs: ConversationSet, rank: int = 0, world: int = 1) -> tuple[TurnWriter, dict]:
    """The online writer of `responses=target` (every trained assistant turn, turn by turn) and its data/
    figures. The turns' prompts with the dataset's history are rendered up front: a template that cannot render
    a record stops the run before any work, and they are the run's training examples for eval/tau_train."""
    d = cfg.data
    try:  # a record the template refuses, or whose system prompt and tools exceed the prompt limit: exit 2
        prompts, stats, fingerprint = turn_prompts(cs, target.tokenizer, d)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    pool = PromptPool(prompts, [], fingerprint, cs.fingerprint, stats)  # type: ignore[arg-type] - read by index
    records, turns = [], []  # per conversation with a turn to rewrite: its TRAIN-split index, its turns kept
    for conv in prompts.ds["conversation"]:
        if not records or records[-1] != conv:
            records.append(conv)
            turns.append(0)
        turns[-1] += 1
    writer = TurnWriter(target, pool, d.online, d.online_seq_len(), rank, world, conversations=cs.normalized,
                        records=records, turns=turns, tokenizer=prepare_tokenizer(target.tokenizer, d.chat),
                        chat=d.chat, max_prompt_len=d.pool.max_prompt_len, end_id=end_of_turn_id(target.tokenizer))
    return writer, stats


def build_conversation_data(cfg, target, dist_info) -> TrainingData:
    d, c = cfg.data, cfg.data.conversations
    cs = load_set(cfg, target.tokenizer)
    suites = chat_suites(cs, target.tokenizer, cfg)
    text = report(cs, target.tokenizer, d.chat, REPORT_RECORDS) if dist_info.rank == 0 else ""
    tags = {"data.responses": c.responses, "data.formats": ",".join(sorted(set(cs.formats.values()))),
            "data.conversations": cs.fingerprint[:16]}
    if c.responses == "dataset":
        seqs = ArrowColumn(cs.train, "input_ids", torch.long)
        masks = ArrowColumn(cs.train, "loss_mask", torch.bool)
        mean_len = sum(cs.train["length"]) / len(cs.train)
        note = ("training responses: the dataset's own (data.conversations.responses=dataset), not written by "
                "the target in this run")
        return TrainingData("conversations", seqs, None, len(seqs), mean_len, cs.fingerprint, cs.fingerprint,
                            cfg.seed, loss_masks=masks, stats=cs.stats, tags=tags, eval_suites=suites,
                            eval_note=note, sample=spread(seqs, SAMPLE_ROWS), report=text)
    writer, stats = conversation_writer(cfg, target, cs, dist_info.rank, dist_info.world)
    prompts = writer.pool.prompts

    def masks(claims):
        return [writer.loss_mask(g) for g, _, _ in claims]
    unique = 0 if not writer.sampling.greedy else len(writer.pool)
    note = (f"training responses: written by the target in this run (data.conversations.responses=target, "
            f"{writer.sampling.describe()})")
    return TrainingData("conversations_online", None, writer, unique, float(d.online_seq_len()), writer.fingerprint,
                        cs.fingerprint, d.online.stream_seed, writer.cfg.reuse, mask_source=masks,
                        stats={**cs.stats, **stats}, tags=tags, eval_suites=suites, eval_note=note,
                        sample=spread(prompts, SAMPLE_ROWS), report=text)


def build_run_data(cfg, target, dist_info) -> TrainingData:
    """A run's data: a chat dataset (`data.source=conversations`, assistant tokens only) here, every other
    source through `dflash.training.datastream.build_training_data`."""
    if cfg.data.source == "conversations":
        return build_conversation_data(cfg, target, dist_info)
    return build_training_data(cfg, target, dist_info)
