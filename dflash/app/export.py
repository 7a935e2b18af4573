"""Which drafter a path means (a run folder, a serving folder, a checkpoint: dflash/run_dir.py decides),
exported to the serving format (dflash/serving/export.py writes it). `python -m experiments.export` calls this."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from dflash.run_dir import resolve_drafter_source
from dflash.serving.export import (ExportSource, TargetFacts, drafter_from_checkpoint, parse_dtype,
                                   read_target_facts, source_from_serving, write_serving_folder)


def resolve_export_source(source: str | os.PathLike) -> ExportSource:
    """A run dir (its final/ serving folder, else its newest intact checkpoint), a serving folder, or a .pt
    (`dflash.run_dir.resolve_drafter_source` decides which)."""
    src = resolve_drafter_source(source)
    if src.serving is not None:
        return source_from_serving(src.serving)
    return drafter_from_checkpoint(src.checkpoint, src.state, src.run_serving)


def export_drafter(source: str | os.PathLike, out_dir: str | os.PathLike,
                   dtype: str | torch.dtype = "bfloat16",
                   target: TargetFacts | str | os.PathLike | None = None) -> Path:
    """Writes the serving folder (docs/serving.md) for a run dir / serving folder /
    checkpoint, atomically. `target` (its facts, or a local target folder: config.json + tokenizer) replaces
    the facts the source records (needed when the source is a bare folder: no context length or mask string of
    its own)."""
    src = resolve_export_source(source)
    if target is not None and not isinstance(target, TargetFacts):
        from dflash.target.model import TargetConfig
        target = read_target_facts(TargetConfig(name="export", path=str(target),
                                                mask_token_id=src.drafter.mask_token_id))
    target = target or src.target
    vocab = target.vocab_size if target else src.vocab_size
    return write_serving_folder(src.drafter, out_dir, dtype=parse_dtype(dtype), extra=src.extra or None,
                                vocab_size=vocab, target=target)
