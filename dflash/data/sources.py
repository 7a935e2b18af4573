"""Training sequences: an offline corpus cut into variable-length token sequences.

Sources (`data.source`):
- `stdlib`: the running Python's standard-library sources (sorted file order, deterministic) — a real
  code corpus available on every machine with no download.
- `text_files`: a file or a directory of text files (`data.path`, files matched by `data.glob`).
- `math`: seeded word problems with worked solutions (`dflash.data.math_problems`, never a held-out one), each
  ending at the target's EOS: the math target's task (`+target=reference_math` selects it).
- `synthetic`: seeded random tokens (throughput and shape tests; acceptance on it means nothing).
- `target_regen`: sequences of `regen_base` whose continuations the target itself regenerates (greedy,
  batched, cached by fingerprint): the drafter learns the target's behaviour on text that looks like what
  the target writes (`dflash.data.regen`).

Lengths are drawn uniformly in [min_len, max_len] so the buffer's length buckets see a real mix.
The epoch order is a seeded permutation of (seed, epoch): resuming at (epoch, cursor) replays it exactly.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dflash.data.chat import ChatConfig, validate_chat_config
from dflash.data.conversation_data import ConversationsConfig, validate_conversations_config
from dflash.data.corpus import CorpusConfig, validate_corpus_config
from dflash.data.online import OnlineConfig, validate_online_config
from dflash.data.pool import PoolConfig, validate_pool_config
from dflash.registry import Registry


@dataclass
class DataConfig:
    source: str = "stdlib"
    path: str = ""
    glob: str = "**/*.py"
    num_sequences: int = 256
    min_len: int = 64
    max_len: int = 320
    holdout_files_every: int = 10  # every n-th corpus file is held out (never trained on)
    regen_base: str = "stdlib"  # target_regen: the corpus whose prefixes prompt the target
    regen_prompt_len: int = 32  # target_regen: tokens kept from the corpus; the rest is the target's
    regen_batch_size: int = 64
    regen_cache_dir: str = ".cache/dflash/regen"
    # memorization guard: a run planned to see its average sequence more often than this warns at start and is
    # tagged data.over_epoch_limit=true (sweeps and the promotion gate can refuse it); 0: no limit
    max_epochs: float = 4.0
    # online: the target writes the training data (dflash.data.online) from prompts of the corpus's TRAIN split
    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(scope="installed"))  # all the machine's Python
    pool: PoolConfig = field(default_factory=PoolConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    # conversations: a chat dataset at data.path rendered through the target's chat template (dflash.data.chat,
    # dflash.data.conversation_data); only assistant tokens are trained on
    chat: ChatConfig = field(default_factory=ChatConfig)
    conversations: ConversationsConfig = field(default_factory=ConversationsConfig)

    def online_seq_len(self) -> int:
        return self.online.seq_len or self.max_len


def _stdlib_files(cfg: DataConfig) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def _text_files(cfg: DataConfig) -> list[Path]:
    if not cfg.path:
        raise ValueError("data.path is empty; data.source=text_files needs a file or directory")
    root = Path(cfg.path)
    if not root.exists():
        raise FileNotFoundError(f"data.path={cfg.path!r} does not exist")
    return [root] if root.is_file() else sorted(p for p in root.glob(cfg.glob) if p.is_file())


# data.source -> the files of a corpus source (its text is tokenized and cut into sequences)
CORPORA: Registry[Callable[[DataConfig], list[Path]]] = Registry("data.source", {
    "stdlib": _stdlib_files,
    "text_files": _text_files,
})


def _corpus_files(cfg: DataConfig) -> list[Path]:
    files = CORPORA[cfg.source](cfg)
    train = [f for i, f in enumerate(files) if cfg.holdout_files_every <= 0
             or i % cfg.holdout_files_every != cfg.holdout_files_every - 1]
    if not train:
        raise ValueError(f"data: no training files found (source={cfg.source!r}, path={cfg.path!r}, "
                         f"glob={cfg.glob!r})")
    return train


def _lengths(cfg: DataConfig, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(cfg.min_len, cfg.max_len) for _ in range(cfg.num_sequences)]


def _synthetic_sequences(cfg: DataConfig, target, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, target.vocab_size, (n,), generator=g) for n in _lengths(cfg, seed)]


def _corpus_sequences(cfg: DataConfig, target, seed: int) -> list[torch.Tensor]:
    encode = target.tokenizer.encode
    lengths = _lengths(cfg, seed)
    need = sum(lengths)
    tokens: list[int] = []
    for f in _corpus_files(cfg):
        tokens.extend(encode(f.read_text(encoding="utf-8", errors="replace")))
        if len(tokens) >= need:
            break
    return _cut(cfg, tokens, lengths)


def _cut(cfg: DataConfig, tokens: list[int], lengths: list[int]) -> list[torch.Tensor]:
    """`tokens` (one stream) cut into sequences of `lengths`, wrapping round a stream shorter than their sum."""
    if len(tokens) < cfg.min_len:
        raise ValueError(f"data: the corpus holds {len(tokens)} tokens, fewer than data.min_len="
                         f"{cfg.min_len} (source={cfg.source!r}, path={cfg.path!r})")
    flat = torch.tensor(tokens, dtype=torch.long)
    out, pos = [], 0
    for n in lengths:
        if pos + n > len(flat):
            pos = 0  # wrap: a small corpus is reused rather than silently giving fewer sequences
        out.append(flat[pos:pos + n].clone())
        pos += n
    return out


def _math_sequences(cfg: DataConfig, target, seed: int) -> list[torch.Tensor]:
    """Word problems with worked solutions (`dflash.data.math_problems`, training split only), each followed by the
    target's end-of-text token, as one stream cut like a corpus: what the math target writes, EOS after the answer."""
    from dflash.data.math_problems import training_problems
    encode, eos = target.tokenizer.encode, target.tokenizer.eos_token_id
    lengths = _lengths(cfg, seed)
    need = sum(lengths)
    tokens: list[int] = []
    for problem in training_problems(seed):
        tokens.extend(list(encode(problem.text)) + [eos])
        if len(tokens) >= need:
            break
    return _cut(cfg, tokens, lengths)


def _regenerated_sequences(cfg: DataConfig, target, seed: int) -> list[torch.Tensor]:
    base = dataclasses.replace(cfg, source=cfg.regen_base)
    sequences = SOURCES.build(base.source, base, target, seed)
    from dflash.data.regen import regenerate_sequences
    fingerprint = json.dumps(dataclasses.asdict(base), sort_keys=True) + f":seed={seed}"
    return regenerate_sequences(target, sequences, cfg.regen_prompt_len, None, cfg.regen_batch_size,
                                cfg.regen_cache_dir or None, corpus_fingerprint=fingerprint)


# data.source -> its sequences from (cfg, target, seed): a corpus (CORPORA) tokenized and cut, seeded random
# tokens, or a base source (data.regen_base) whose continuations the target regenerates.
SOURCES: Registry[Callable[..., list[torch.Tensor]]] = Registry("data.source", {
    "stdlib": _corpus_sequences,
    "text_files": _corpus_sequences,
    "synthetic": _synthetic_sequences,
    "math": _math_sequences,
    "target_regen": _regenerated_sequences,
})
REGEN_SOURCES = ("target_regen",)  # sources that need a base source (data.regen_base) of their own
# sources the trainer's producers write while the run trains (dflash.training.datastream): no list to build
ONLINE_SOURCES = ("online",)
# chat datasets with loss masks, read by dflash/app/chat_data.py (not a list of plain sequences)
CONVERSATION_SOURCES = ("conversations",)


def inactive_data_keys(cfg: DataConfig, online: bool) -> list[str]:
    """Dotted `data.` keys a run with this source never reads (its MLflow params leave them out): the online
    writer's corpus / pool / online settings unless the target writes the data, the regeneration settings unless
    the source regenerates."""
    out = [] if online or cfg.source in ONLINE_SOURCES else ["data.corpus", "data.pool", "data.online"]
    if cfg.source not in REGEN_SOURCES:
        out += ["data.regen_base", "data.regen_prompt_len", "data.regen_batch_size", "data.regen_cache_dir"]
    return out


def build_training_sequences(cfg: DataConfig, target, seed: int) -> list[torch.Tensor]:
    """The trainer's sequences (a deterministic list of 1-D LongTensors): `data.source`'s entry in SOURCES."""
    validate_data_config(cfg)
    if cfg.source in ONLINE_SOURCES + CONVERSATION_SOURCES:
        raise ValueError(f"data.source={cfg.source!r} is read or written while the run trains "
                         f"(dflash.training.datastream.build_training_data; a chat dataset: dflash/app/chat_data.py), "
                         f"not built up front")
    return SOURCES.build(cfg.source, cfg, target, seed)


def validate_online_data(cfg: DataConfig) -> None:
    """The online writer's settings (also checked when `trainer.online_data` turns it on)."""
    validate_pool_config(cfg.pool)
    if cfg.source == "math" and cfg.pool.source != "math":
        # the math target's runs with online data (+trainer=gpu) would otherwise write continuations of Python code
        raise ValueError(f"data.source=math with online data (trainer.online_data): the target writes from "
                          f"data.pool, whose source is {cfg.pool.source!r} (code prompts); set data.pool.source=math "
                          f"(conf/data/math.yaml does) to train on its answers to math problems, or "
                          f"data.source=online to mean code prompts")
    validate_online_config(cfg.online, cfg.online_seq_len(), cfg.pool.max_prompt_len)
    try:
        validate_corpus_config(cfg.corpus)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"data.{e}") from e  # names the key as data.corpus.*


def epoch_order(num: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num, generator=g).tolist()


def validate_data_config(cfg: DataConfig) -> None:
    if cfg.max_epochs < 0:
        raise ValueError(f"data.max_epochs must be >= 0 (0: no limit), got {cfg.max_epochs}")
    if cfg.source in ONLINE_SOURCES:
        validate_online_data(cfg)
        return
    if cfg.source in CONVERSATION_SOURCES:
        _validate_conversation_data(cfg)
        return
    SOURCES.check(cfg.source)
    if cfg.source in REGEN_SOURCES:
        if cfg.regen_base in REGEN_SOURCES or cfg.regen_base not in SOURCES:
            bases = ", ".join(n for n in SOURCES.names() if n not in REGEN_SOURCES)
            raise ValueError(f"data.regen_base={cfg.regen_base!r}; expected one of {bases}")
        if not 1 <= cfg.regen_prompt_len < cfg.min_len:
            raise ValueError(f"data.regen_prompt_len={cfg.regen_prompt_len} must be in [1, data.min_len)")
        if cfg.regen_batch_size < 1:
            raise ValueError("data.regen_batch_size must be >= 1")
        validate_data_config(dataclasses.replace(cfg, source=cfg.regen_base))
        return
    if cfg.num_sequences < 1:
        raise ValueError(f"data.num_sequences must be >= 1 (empty data), got {cfg.num_sequences}")
    if not 2 <= cfg.min_len <= cfg.max_len:
        raise ValueError(f"data.min_len/max_len must satisfy 2 <= min_len <= max_len, got "
                         f"{cfg.min_len}/{cfg.max_len}")
    if cfg.source in CORPORA:
        _corpus_files(cfg)  # raises, naming data.path, when there is nothing to read


def _validate_conversation_data(cfg: DataConfig) -> None:
    from dflash.data.conversations import resolve_files
    validate_chat_config(cfg.chat)
    validate_conversations_config(cfg.conversations)
    if not 2 <= cfg.min_len <= cfg.max_len:
        raise ValueError(f"data.min_len/max_len must satisfy 2 <= min_len <= max_len, got "
                         f"{cfg.min_len}/{cfg.max_len}")
    if cfg.conversations.responses == "target":
        validate_online_config(cfg.online, cfg.online_seq_len(), cfg.pool.max_prompt_len)
    resolve_files(cfg.path)  # raises, naming data.path, when it matches no file
