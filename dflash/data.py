"""Training sequences: an offline corpus cut into variable-length token sequences.

Sources (`data.source`):
- `stdlib`: the running Python's standard-library sources (sorted file order, deterministic) — a real
  code corpus available on every machine with no download.
- `text_files`: a file or a directory of text files (`data.path`, files matched by `data.glob`).
- `synthetic`: seeded random tokens (throughput and shape tests; acceptance on it means nothing).

Lengths are drawn uniformly in [min_len, max_len] so the buffer's length buckets see a real mix.
The epoch order is a seeded permutation of (seed, epoch): resuming at (epoch, cursor) replays it exactly.
"""
from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass
class DataConfig:
    source: str = "stdlib"
    path: str = ""
    glob: str = "**/*.py"
    num_sequences: int = 256
    min_len: int = 64
    max_len: int = 320
    holdout_files_every: int = 10  # every n-th corpus file is held out (never trained on)


def _corpus_files(cfg: DataConfig) -> list[Path]:
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py") if p.is_file())
    else:
        root = Path(cfg.path)
        if not root.exists():
            raise FileNotFoundError(f"data.path={cfg.path!r} does not exist")
        files = [root] if root.is_file() else sorted(p for p in root.glob(cfg.glob) if p.is_file())
    train = [f for i, f in enumerate(files) if cfg.holdout_files_every <= 0
             or i % cfg.holdout_files_every != cfg.holdout_files_every - 1]
    if not train:
        raise ValueError(f"data: no training files found (source={cfg.source!r}, path={cfg.path!r}, "
                         f"glob={cfg.glob!r})")
    return train


def _lengths(cfg: DataConfig, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(cfg.min_len, cfg.max_len) for _ in range(cfg.num_sequences)]


def build_sequences(cfg: DataConfig, encode: Callable[[str], list[int]], vocab_size: int,
                    seed: int) -> list[torch.Tensor]:
    """Deterministic list of 1-D LongTensors."""
    validate_data_config(cfg)
    lengths = _lengths(cfg, seed)
    if cfg.source == "synthetic":
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]
    need = sum(lengths)
    tokens: list[int] = []
    for f in _corpus_files(cfg):
        tokens.extend(encode(f.read_text(encoding="utf-8", errors="replace")))
        if len(tokens) >= need:
            break
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


def epoch_order(num: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num, generator=g).tolist()


def validate_data_config(cfg: DataConfig) -> None:
    if cfg.source not in ("stdlib", "text_files", "synthetic"):
        raise ValueError(f"data.source={cfg.source!r}; expected stdlib, text_files or synthetic")
    if cfg.source == "text_files" and not cfg.path:
        raise ValueError("data.path is empty; data.source=text_files needs a file or directory")
    if cfg.num_sequences < 1:
        raise ValueError(f"data.num_sequences must be >= 1 (empty data), got {cfg.num_sequences}")
    if not 2 <= cfg.min_len <= cfg.max_len:
        raise ValueError(f"data.min_len/max_len must satisfy 2 <= min_len <= max_len, got "
                         f"{cfg.min_len}/{cfg.max_len}")
    if cfg.source != "synthetic":
        _corpus_files(cfg)  # raises, naming data.path, when there is nothing to read
