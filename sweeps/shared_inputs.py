"""What the runs of one campaign or sweep launch share (docs/sweeps.md): the ground truth they evaluate on, pinned
in the store, and the inputs made once before the runs start.

- `with_truth_pin(overrides, folder)`: `eval.truth_dir=<folder>` unless the overrides set it. GPU greedy decoding
  differs across machines (a few tokens of the held-out suite, 2026-12-01/02), and the folder travels with the
  committed store, so runs of later launches evaluate on the same tokens and pair, prompt for prompt, with earlier
  ones.
- `make_shared_inputs(cfg, more_cfgs, record)`: `dflash.app.write_ahead` (the prompt pool, the online shards every
  run reads, the ground truth of every suite) once, here, recorded as JSON. Runs that start together on one GPU
  would otherwise each build the same ground truth at their first eval, at once.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from dflash.atomic import atomic_write_text
from dflash.overrides import split_override

log = logging.getLogger(__name__)


def sets_truth_dir(overrides: Sequence[str]) -> bool:
    return any(split_override(a)[0].lstrip("+") == "eval.truth_dir" for a in overrides if "=" in a)


def with_truth_pin(overrides: Sequence[str], folder: Path) -> list[str]:
    """`overrides` with `eval.truth_dir=<folder>` unless they set eval.truth_dir themselves (the user's wins, e.g.
    another campaign's pins, to pair with its runs)."""
    if sets_truth_dir(overrides):
        return list(overrides)
    return [*overrides, f"eval.truth_dir={folder}"]


def make_shared_inputs(cfg, more_cfgs: Sequence = (), record: Path | None = None) -> dict[str, float]:
    """The shared inputs of runs like `cfg` and `more_cfgs` (`write_ahead`: the deepest buffer among them decides
    how far to write), with what it did written to `record`."""
    from dflash.app.write_ahead import write_ahead
    stats = write_ahead(cfg, more_cfgs=list(more_cfgs))
    if record is not None:
        atomic_write_text(record, json.dumps(stats, indent=2))
    log.info("shared inputs made in %.0f s: %s", stats["sys/write_ahead_s"], stats)
    return stats

