"""Ground truth for the eval suite: the target's greedy continuation of each prompt and its features.

For each prompt: the target's own greedy output, `max_new_tokens` long, no stop on EOS (prompts continued
together, `greedy_continuations`; the same tokens as `greedy_decode` of each alone), then ONE
`target.forward_features` over prompt + continuation for the features the drafter conditions on.

With `truth_dir` (`eval.truth_dir`) the continuation tokens are pinned (`dflash.evaluation.truth_pin`): a pin
there is used instead of the greedy decode (the features still come from the one forward, and the one-shot
argmax's agreement with the pinned tokens is still `consistency`, so numerical drift stays visible); without one,
the ground truth is built and its tokens pinned.

Cached on disk under `cache_dir/<key>.gt`, key = sha256 of (format version, target identity, layer ids,
target dtype and device type, suite prompts, max_new_tokens, and the pin's digest when pinned): changing any
of them misses, and a pinned ground truth never reads an unpinned one's file. A cache file is
written atomically (`dflash.atomic.save_checked`) and carries the sha256 of its payload; a file that
cannot be read, fails its checksum, or does not match the expected shapes is rebuilt (with a warning),
never trusted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.atomic import load_checked, save_checked
from dflash.evaluation.prompts import Task
from dflash.evaluation.truth_pin import PinnedSuite

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"DFLASH-EVAL-GT\n"


@dataclass
class TaskTruth:
    name: str
    prompt_ids: torch.Tensor  # [P] long
    continuation: torch.Tensor  # [N] long: the target's greedy tokens at positions P..P+N-1
    features: torch.Tensor  # [P+N, L, H] target features of prompt + continuation (CPU, target dtype)
    consistency: float = 1.0  # fraction of continuation tokens the one-shot forward's argmax agrees with

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def n_new(self) -> int:
        return int(self.continuation.numel())

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.continuation])


def cache_key(target, tasks: list[Task], max_new_tokens: int, pinned: str = "") -> str:
    """`pinned`: the pin's digest (`Pin.digest`) when the continuation tokens come from a pin."""
    dev = getattr(target, "device", None)
    payload = {
        "format": FORMAT_VERSION,
        "target": str(target.identity),
        "layer_ids": [int(i) for i in target.layer_ids],
        "dtype": str(getattr(target, "dtype", "")),
        "device_type": getattr(dev, "type", str(dev)),
        "prompts": [[t.name, t.prompt] for t in tasks],
        "max_new_tokens": int(max_new_tokens),
    }
    if pinned:  # only then: an unpinned ground truth keeps the key its cache files were written under
        payload["pinned"] = pinned
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"{key}.gt"


# Rows continued together. One prompt at a time, the held-out suite (128 prompts x 256 tokens) took over seven
# minutes of an H200 (32 K host-bound decode steps); batched, it is one decode of max prompt + N steps per group.
GT_BATCH_ROWS = 128


def greedy_continuations(target, prompts: list[list[int]], max_new_tokens: int,
                         rows: int = GT_BATCH_ROWS) -> list[list[int]]:
    """Each prompt's first `max_new_tokens` greedy tokens, prompts continued `rows` at a time with the cache
    (`dflash.data.writing.write_continuations`: a row inside its prompt is fed its own tokens, so it gets what
    the target writes for it alone; greedy is causal, so a row's first N tokens do not depend on how far the
    batch goes on)."""
    from dflash.data.writing import write_continuations
    out: list[list[int]] = []
    for s in range(0, len(prompts), rows):
        group = prompts[s:s + rows]
        # transformers' own cached decode, not the online writer's graph: in bf16 the two part at near-ties (88.7%
        # of written tokens agree on an H200, RESULTS.md, 2026-12-01), and the ground truth is what τ is measured on
        seq = write_continuations(target, group, max(map(len, group)) + max_new_tokens, decode="cache")
        out += [seq[r, len(p):len(p) + max_new_tokens].tolist() for r, p in enumerate(group)]
    return out


def prompt_token_ids(target, tasks: list[Task]) -> list[list[int]]:
    prompts = []
    for t in tasks:
        ids = list(target.tokenizer.encode(t.prompt))
        if not ids:
            raise ValueError(f"eval task {t.name!r}: the prompt tokenizes to nothing")
        prompts.append(ids)
    return prompts


@torch.no_grad()
def truths_from_tokens(target, tasks: list[Task], prompts: list[list[int]], continuations: list[list[int]],
                       source: str = "greedy") -> list[TaskTruth]:
    """The ground truth of known tokens: ONE `target.forward_features` over prompt + continuation per task for
    the features; `consistency` = how often that forward's argmax agrees with the continuation (`source`
    names where the tokens came from, for the warning)."""
    out, t0, first_s = [], time.perf_counter(), 0.0
    for t, ids, cont in zip(tasks, prompts, continuations):
        full = torch.tensor(ids + list(cont), dtype=torch.long)
        batch = target.forward_features(full[None], 0)
        labels = batch.labels_BT[0, len(ids) - 1:-1].cpu()
        agree = float((labels == torch.tensor(cont)).float().mean())
        if agree < 1.0:
            log.warning("eval task %s: the one-shot forward's argmax agrees with the %s continuation on "
                        "%.1f%% of tokens (numerics of cached vs. full-sequence forward)", t.name, source, 100 * agree)
        out.append(TaskTruth(t.name, torch.tensor(ids, dtype=torch.long), torch.tensor(cont, dtype=torch.long),
                             batch.features_BTLH[0].detach().cpu().contiguous(), agree))
        first_s = first_s or time.perf_counter() - t0  # timed through the .cpu() copies: no extra sync
    # the first forward apart: a fresh H200 spent 73 s on the held-out suite's 128; another read
    # 62.8 s, 49.3 s of it the first (the chunked kernels' first compile and autotune in this machine's life: the
    # write-ahead before it decodes only), the other 127 in 13.5 s (RESULTS.md, 2026-12-02)
    log.info("eval ground truth: %d one-shot forwards in %.1f s (the first %.1f s)", len(out),
             time.perf_counter() - t0, first_s)
    return out


@torch.no_grad()
def build_ground_truth(target, tasks: list[Task], max_new_tokens: int) -> list[TaskTruth]:
    prompts = prompt_token_ids(target, tasks)
    return truths_from_tokens(target, tasks, prompts, greedy_continuations(target, prompts, max_new_tokens))


# -- cache file ---------------------------------------------------------------------------------
def save_ground_truth(path: str | os.PathLike, key: str, truths: list[TaskTruth]) -> None:
    tasks = [{"name": t.name, "prompt_ids": t.prompt_ids, "continuation": t.continuation,
              "features": t.features, "consistency": t.consistency} for t in truths]
    save_checked(path, _MAGIC, FORMAT_VERSION, key, {"tasks": tasks})


def load_ground_truth(path: str | os.PathLike, key: str) -> list[TaskTruth]:
    """Raises ValueError (or an I/O error) on anything not exactly as written for `key`."""
    data = load_checked(path, _MAGIC, FORMAT_VERSION, key)
    return [TaskTruth(d["name"], d["prompt_ids"], d["continuation"], d["features"],
                      float(d.get("consistency", 1.0))) for d in data["tasks"]]


def _validate(truths: list[TaskTruth], target, tasks: list[Task], max_new_tokens: int) -> None:
    if [t.name for t in truths] != [t.name for t in tasks]:
        raise ValueError("task names differ")
    L, H = len(target.layer_ids), int(target.hidden_size)
    for tr, task in zip(truths, tasks):
        ids = list(target.tokenizer.encode(task.prompt))
        if tr.prompt_ids.dtype != torch.long or tr.prompt_ids.tolist() != ids:
            raise ValueError(f"{tr.name}: prompt tokens differ")
        if tr.continuation.dtype != torch.long or tr.continuation.shape != (max_new_tokens,):
            raise ValueError(f"{tr.name}: continuation shape {tuple(tr.continuation.shape)}")
        if tr.features.shape != (len(ids) + max_new_tokens, L, H):
            raise ValueError(f"{tr.name}: features shape {tuple(tr.features.shape)}")
        if not bool(torch.isfinite(tr.features).all()):
            raise ValueError(f"{tr.name}: non-finite features")


def load_or_build_ground_truth(target, tasks: list[Task], max_new_tokens: int,
                               cache_dir: str | os.PathLike | None, truth_dir: str | os.PathLike | None = None,
                               suite: str = "") -> tuple[list[TaskTruth], bool]:
    """(truths, hit). `cache_dir` None or empty: no disk cache. `truth_dir`: the pin folder (module doc; `suite`
    is the name a new pin records); a pin there that cannot be used raises `truth_pin.PinError`."""
    if not truth_dir:
        return _through_cache(target, tasks, max_new_tokens, cache_dir, "",
                              lambda: build_ground_truth(target, tasks, max_new_tokens))
    prompts = prompt_token_ids(target, tasks)
    spec = PinnedSuite(str(target.identity), tuple(t.name for t in tasks), tuple(map(tuple, prompts)),
                       int(max_new_tokens), int(getattr(target, "vocab_size", 0) or 0))
    path = spec.path(truth_dir)
    if path.exists():
        pin = spec.read(path)
        log.info("eval ground truth: pinned tokens from %s", path)
        return _through_cache(target, tasks, max_new_tokens, cache_dir, pin.digest,
                              lambda: truths_from_tokens(target, tasks, prompts, pin.continuations, "pinned"))
    # No pin yet: this evaluation's greedy tokens become it. Built afresh (an unpinned cache file is not read):
    # the feature cache is then written once, under the pinned key every later evaluation looks up.
    truths = build_ground_truth(target, tasks, max_new_tokens)
    pin = spec.write(path, suite, [t.continuation.tolist() for t in truths])
    if pin.continuations != [t.continuation.tolist() for t in truths]:  # another run pinned its tokens first
        truths = truths_from_tokens(target, tasks, prompts, pin.continuations, "pinned")
    log.info("eval ground truth: built and pinned its tokens in %s", path)
    if cache_dir:
        key = cache_key(target, tasks, max_new_tokens, pin.digest)
        save_ground_truth(cache_path(cache_dir, key), key, truths)
    return truths, False


def _through_cache(target, tasks: list[Task], max_new_tokens: int, cache_dir: str | os.PathLike | None,
                   pinned: str, build) -> tuple[list[TaskTruth], bool]:
    """`build()`'s ground truth through the disk cache under `cache_key(..., pinned)`: (truths, hit)."""
    if not cache_dir:
        return build(), False
    key = cache_key(target, tasks, max_new_tokens, pinned)
    path = cache_path(cache_dir, key)
    if path.exists():
        try:
            truths = load_ground_truth(path, key)
            _validate(truths, target, tasks, max_new_tokens)
            log.info("eval ground truth: cache hit %s", path)
            return truths, True
        except Exception as e:  # noqa: BLE001 - any failure means: do not trust, rebuild
            warnings.warn(f"eval ground-truth cache {path} is unreadable or invalid ({type(e).__name__}: {e}); "
                          f"rebuilding it", RuntimeWarning, stacklevel=3)
    truths = build()
    save_ground_truth(path, key, truths)
    log.info("eval ground truth: built and cached %s", path)
    return truths, False
