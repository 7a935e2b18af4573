"""Ground truth for the eval suite: the target's continuation of each prompt at a sampling setting, and its features.

`TruthSpec` says how the target continues (docs/evaluation.md, "τ at temperature"):
- greedy (T = 0): each prompt's greedy output (prompts continued together, `greedy_continuations`; the same
  tokens as `greedy_decode` of each alone);
- sampled (T > 0): `samples` continuations per prompt, drawn at the setting (seeded; the target's own sampling
  law, `dflash.target.sampling.warp`); each is a task of its own (`<name>#s<i>`), grouped by prompt for the CIs;
- ends: with `stop_ids` a continuation ends after its first stop token (EOS / end of turn), and with `code_stop`
  (a code suite's `eval.stop`: `dflash.data.stops`) at a stop sequence or the dedent below the prompt's body,
  whichever comes first (`dflash.data.writing.first_end`, the one cut of every writer), capped at
  `max_new_tokens`; without either (the legacy protocol, pins and caches made before sampling existed) it is
  exactly `max_new_tokens` long whatever the target writes. `end_reasons` says which rule ended each.
Then ONE `target.forward_features` over prompt + continuation for the features the drafter conditions on, and at
T > 0 the target's warped probability of each continuation token (`TaskTruth.path_p`: the p of the rejection rule).

With `truth_dir` (`eval.truth_dir`) the continuation tokens are pinned (`dflash.evaluation.truth_pin`): a pin
there is used instead of the greedy decode (the features still come from the one forward, and the one-shot
argmax's agreement with the pinned tokens is still `consistency`, so numerical drift stays visible); without one,
the ground truth is built and its tokens pinned.

Cached on disk under `cache_dir/<key>.gt`, key = sha256 of (format version, target identity, layer ids,
target dtype and device type, suite prompts, max_new_tokens, the TruthSpec unless legacy, and the pin's digest when pinned): changing any
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash.atomic import load_checked, save_checked
from dflash.data.stops import CodeStop, TextEnd
from dflash.data.writing import first_end
from dflash.evaluation.prompts import Task
from dflash.evaluation.truth_pin import PinnedSuite
from dflash.target.sampling import GREEDY, Sampling, warp

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"DFLASH-EVAL-GT\n"


@dataclass(frozen=True)
class TruthSpec:
    """How the ground truth is written (module doc). The default is the legacy protocol: greedy, fixed length."""
    sampling: Sampling = GREEDY
    samples: int = 1  # continuations per prompt (greedy: always 1)
    seed: int = 0  # the sampled continuations' generator
    stop_ids: tuple[int, ...] = ()  # empty: no natural end (legacy)
    code_stop: CodeStop | None = None  # the suite's stop sequences / dedent (`for_suite`); None: none

    @property
    def legacy(self) -> bool:
        return self.sampling.greedy and not self.ends

    @property
    def ends(self) -> bool:
        """Continuations end before the cap where a rule fires (any length 1..max_new_tokens)."""
        return bool(self.stop_ids) or bool(self.code_stop)

    def for_suite(self, suite) -> "TruthSpec":
        """This setting with `suite`'s own code stop rule (`Suite.stop`, from `eval.stop`)."""
        return self if suite.stop == self.code_stop else replace(self, code_stop=suite.stop or None)

    def text_end(self, prompt: str, decode) -> TextEnd | None:
        return self.code_stop.for_prompt(prompt, decode) if self.code_stop else None

    @property
    def per_prompt(self) -> int:
        return 1 if self.sampling.greedy else max(1, int(self.samples))

    def key(self) -> dict | None:
        """What enters cache and pin keys (None for the legacy protocol: its old keys stay valid)."""
        if self.legacy:
            return None
        out = {"sampling": self.sampling.as_dict(), "samples": self.per_prompt,
               "seed": int(self.seed) if not self.sampling.greedy else 0, "stop_ids": sorted(self.stop_ids)}
        if self.code_stop:  # only then: ground truth that ends at EOS alone keeps the key it was written under
            out["code_stop"] = self.code_stop.key()
        return out


@dataclass
class TaskTruth:
    name: str
    prompt_ids: torch.Tensor  # [P] long
    continuation: torch.Tensor  # [N] long: the target's tokens at positions P..P+N-1 (N <= max_new_tokens)
    features: torch.Tensor  # [P+N, L, H] target features of prompt + continuation (CPU, target dtype)
    consistency: float = 1.0  # fraction of continuation tokens the one-shot forward's argmax agrees with
    prompt_name: str = ""  # the suite task it continues (sampled truths: several per task); "" = name
    path_p: torch.Tensor | None = None  # [N] float: the target's warped probability of each token (T > 0)

    @property
    def group(self) -> str:
        return self.prompt_name or self.name

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def n_new(self) -> int:
        return int(self.continuation.numel())

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.continuation])


def cache_key(target, tasks: list[Task], max_new_tokens: int, pinned: str = "",
              spec: TruthSpec | None = None) -> str:
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
    if spec is not None and spec.key() is not None:  # likewise: legacy ground truth keeps its old key
        payload["protocol"] = spec.key()
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"{key}.gt"


# Rows continued together. One prompt at a time, the held-out suite (128 prompts x 256 tokens) took over seven
# minutes of an H200 (32 K host-bound decode steps); batched, it is one decode of max prompt + N steps per group.
GT_BATCH_ROWS = 128


def greedy_continuations(target, prompts: list[list[int]], max_new_tokens: int,
                         rows: int = GT_BATCH_ROWS, sampling: Sampling = GREEDY,
                         generator: torch.Generator | None = None) -> list[list[int]]:
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
        seq = write_continuations(target, group, max(map(len, group)) + max_new_tokens, sampling, generator,
                                  decode="cache")
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


def expand_tasks(tasks: list[Task], spec: TruthSpec) -> list[Task]:
    """The truths' tasks: each task once (greedy), or `samples` times as `<name>#s<i>` (sampled)."""
    n = spec.per_prompt
    return list(tasks) if n == 1 else [Task(f"{t.name}#s{i}", t.prompt) for t in tasks for i in range(n)]


def _group_of(name: str) -> str:
    return name.rsplit("#s", 1)[0] if "#s" in name else ""


@torch.no_grad()
def path_probs(target, full_T: torch.Tensor, prompt_len: int, sampling: Sampling) -> torch.Tensor:
    """The target's warped probability [N] of each continuation token of `full_T` (prompt + continuation)."""
    logits = target.logits(full_T[None])[0, prompt_len - 1:-1]
    cont = full_T[prompt_len:].to(logits.device)
    return warp(logits, sampling).gather(-1, cont[:, None])[:, 0].cpu()


@torch.no_grad()
def truths_from_tokens(target, tasks: list[Task], prompts: list[list[int]], continuations: list[list[int]],
                       source: str = "greedy", sampling: Sampling = GREEDY) -> list[TaskTruth]:
    """The ground truth of known tokens: ONE `target.forward_features` over prompt + continuation per task for
    the features; `consistency` = how often that forward's argmax agrees with the continuation (`source`
    names where the tokens came from, for the warning; a sampled continuation is not expected to agree).
    At a sampled setting also the path's probabilities (`path_probs`)."""
    out, t0, first_s = [], time.perf_counter(), 0.0
    for t, ids, cont in zip(tasks, prompts, continuations):
        full = torch.tensor(ids + list(cont), dtype=torch.long)
        batch = target.forward_features(full[None], 0)
        labels = batch.labels_BT[0, len(ids) - 1:-1].cpu()
        agree = float((labels == torch.tensor(cont)).float().mean())
        if agree < 1.0 and sampling.greedy:
            log.warning("eval task %s: the one-shot forward's argmax agrees with the %s continuation on "
                        "%.1f%% of tokens (numerics of cached vs. full-sequence forward)", t.name, source, 100 * agree)
        pp = None if sampling.greedy else path_probs(target, full, len(ids), sampling)
        out.append(TaskTruth(t.name, torch.tensor(ids, dtype=torch.long), torch.tensor(cont, dtype=torch.long),
                             batch.features_BTLH[0].detach().cpu().contiguous(), agree, _group_of(t.name), pp))
        first_s = first_s or time.perf_counter() - t0  # timed through the .cpu() copies: no extra sync
    # the first forward apart: a fresh H200 spent 73 s on the held-out suite's 128; another read
    # 62.8 s, 49.3 s of it the first (the chunked kernels' first compile and autotune in this machine's life: the
    # write-ahead before it decodes only), the other 127 in 13.5 s (RESULTS.md, 2026-12-02)
    log.info("eval ground truth: %d one-shot forwards in %.1f s (the first %.1f s)", len(out),
             time.perf_counter() - t0, first_s)
    return out


def decoder(target):
    """Token ids -> text, as the code stop rules read a continuation."""
    return lambda ids: target.tokenizer.decode([int(i) for i in ids])


def write_truth_tokens(target, prompts: list[list[int]], max_new_tokens: int, spec: TruthSpec,
                       texts: list[str] | None = None) -> list[list[int]]:
    """The continuations of `prompts` (already expanded per sample; `texts`: their prompt strings, which the
    code stop rules read) under `spec`, each cut at its end (`first_end`)."""
    gen = None
    if not spec.sampling.greedy:
        gen = torch.Generator(device=target.device).manual_seed(int(spec.seed))
    conts = greedy_continuations(target, prompts, max_new_tokens, sampling=spec.sampling, generator=gen)
    if spec.ends:
        ends = _text_ends(target, spec, prompts, texts)
        conts = [c[:first_end(c, 0, spec.stop_ids, e)[0]] for c, e in zip(conts, ends)]
    return conts


def _text_ends(target, spec: TruthSpec, prompts: list[list[int]], texts: list[str] | None) -> list[TextEnd | None]:
    if not spec.code_stop:
        return [None] * len(prompts)
    dec = decoder(target)
    return [spec.text_end(text, dec) for text in (texts or [dec(p) for p in prompts])]


def end_reasons(target, truths: list[TaskTruth], spec: TruthSpec, texts: list[str] | None = None) -> list[str]:
    """Which rule ended each continuation (`dflash.data.stops.END_REASONS`: eos, stop, dedent, length = the cap
    or no rule), read again from its tokens with the cut that wrote it. `texts`: each truth's prompt string."""
    ends = _text_ends(target, spec, [t.prompt_ids.tolist() for t in truths], texts)
    return [first_end(t.continuation.tolist(), 0, spec.stop_ids, e)[1] if spec.ends else "length"
            for t, e in zip(truths, ends)]


@torch.no_grad()
def build_ground_truth(target, tasks: list[Task], max_new_tokens: int,
                       spec: TruthSpec = TruthSpec()) -> list[TaskTruth]:
    tasks = expand_tasks(tasks, spec)
    prompts = prompt_token_ids(target, tasks)
    conts = write_truth_tokens(target, prompts, max_new_tokens, spec, [t.prompt for t in tasks])
    return truths_from_tokens(target, tasks, prompts, conts,
                              "greedy" if spec.sampling.greedy else "sampled", spec.sampling)


# -- cache file ---------------------------------------------------------------------------------
def save_ground_truth(path: str | os.PathLike, key: str, truths: list[TaskTruth]) -> None:
    tasks = [{"name": t.name, "prompt_ids": t.prompt_ids, "continuation": t.continuation,
              "features": t.features, "consistency": t.consistency, "path_p": t.path_p} for t in truths]
    save_checked(path, _MAGIC, FORMAT_VERSION, key, {"tasks": tasks})


def load_ground_truth(path: str | os.PathLike, key: str) -> list[TaskTruth]:
    """Raises ValueError (or an I/O error) on anything not exactly as written for `key`."""
    data = load_checked(path, _MAGIC, FORMAT_VERSION, key)
    return [TaskTruth(d["name"], d["prompt_ids"], d["continuation"], d["features"],
                      float(d.get("consistency", 1.0)), _group_of(d["name"]), d.get("path_p"))
            for d in data["tasks"]]


def _validate(truths: list[TaskTruth], target, tasks: list[Task], max_new_tokens: int,
              spec: TruthSpec = TruthSpec()) -> None:
    if [t.name for t in truths] != [t.name for t in tasks]:
        raise ValueError("task names differ")
    L, H = len(target.layer_ids), int(target.hidden_size)
    for tr, task in zip(truths, tasks):
        ids = list(target.tokenizer.encode(task.prompt))
        if tr.prompt_ids.dtype != torch.long or tr.prompt_ids.tolist() != ids:
            raise ValueError(f"{tr.name}: prompt tokens differ")
        n = int(tr.continuation.numel())
        if tr.continuation.dtype != torch.long or tr.continuation.dim() != 1 \
                or not (n == max_new_tokens or (spec.ends and 1 <= n <= max_new_tokens)):
            raise ValueError(f"{tr.name}: continuation shape {tuple(tr.continuation.shape)}")
        if tr.features.shape != (len(ids) + n, L, H):
            raise ValueError(f"{tr.name}: features shape {tuple(tr.features.shape)}")
        if not spec.sampling.greedy and (tr.path_p is None or tr.path_p.shape != (n,)):
            raise ValueError(f"{tr.name}: no path probabilities of a sampled ground truth")
        if not bool(torch.isfinite(tr.features).all()):
            raise ValueError(f"{tr.name}: non-finite features")


def load_or_build_ground_truth(target, tasks: list[Task], max_new_tokens: int,
                               cache_dir: str | os.PathLike | None, truth_dir: str | os.PathLike | None = None,
                               suite: str = "", spec: TruthSpec = TruthSpec()) -> tuple[list[TaskTruth], bool]:
    """(truths, hit). `cache_dir` None or empty: no disk cache. `truth_dir`: the pin folder (module doc; `suite`
    is the name a new pin records); a pin there that cannot be used raises `truth_pin.PinError`. A pin is keyed by
    `spec` too (unless legacy), so a greedy pin is never read for a sampled ground truth, nor the reverse."""
    if not truth_dir:
        return _through_cache(target, tasks, max_new_tokens, cache_dir, "",
                              lambda: build_ground_truth(target, tasks, max_new_tokens, spec), spec)
    truth_tasks = expand_tasks(tasks, spec)
    prompts = prompt_token_ids(target, truth_tasks)
    pinned = PinnedSuite(str(target.identity), tuple(t.name for t in truth_tasks), tuple(map(tuple, prompts)),
                         int(max_new_tokens), int(getattr(target, "vocab_size", 0) or 0), spec.key())
    path = pinned.path(truth_dir)
    source = "greedy" if spec.sampling.greedy else "sampled"
    if path.exists():
        pin = pinned.read(path)
        log.info("eval ground truth: pinned tokens from %s", path)
        return _through_cache(target, tasks, max_new_tokens, cache_dir, pin.digest,
                              lambda: truths_from_tokens(target, truth_tasks, prompts, pin.continuations, "pinned",
                                                         spec.sampling), spec)
    # No pin yet: this evaluation's tokens become it. Built afresh (an unpinned cache file is not read):
    # the feature cache is then written once, under the pinned key every later evaluation looks up.
    truths = build_ground_truth(target, tasks, max_new_tokens, spec)
    pin = pinned.write(path, suite, [t.continuation.tolist() for t in truths])
    if pin.continuations != [t.continuation.tolist() for t in truths]:  # another run pinned its tokens first
        truths = truths_from_tokens(target, truth_tasks, prompts, pin.continuations, "pinned", spec.sampling)
    log.info("eval ground truth: built (%s) and pinned its tokens in %s", source, path)
    if cache_dir:
        key = cache_key(target, tasks, max_new_tokens, pin.digest, spec)
        save_ground_truth(cache_path(cache_dir, key), key, truths)
    return truths, False


def _through_cache(target, tasks: list[Task], max_new_tokens: int, cache_dir: str | os.PathLike | None,
                   pinned: str, build, spec: TruthSpec = TruthSpec()) -> tuple[list[TaskTruth], bool]:
    """`build()`'s ground truth through the disk cache under `cache_key(..., pinned, spec)`: (truths, hit)."""
    if not cache_dir:
        return build(), False
    key = cache_key(target, tasks, max_new_tokens, pinned, spec)
    path = cache_path(cache_dir, key)
    if path.exists():
        try:
            truths = load_ground_truth(path, key)
            _validate(truths, target, expand_tasks(tasks, spec), max_new_tokens, spec)
            log.info("eval ground truth: cache hit %s", path)
            return truths, True
        except Exception as e:  # noqa: BLE001 - any failure means: do not trust, rebuild
            warnings.warn(f"eval ground-truth cache {path} is unreadable or invalid ({type(e).__name__}: {e}); "
                          f"rebuilding it", RuntimeWarning, stacklevel=3)
    truths = build()
    save_ground_truth(path, key, truths)
    log.info("eval ground truth: built and cached %s", path)
    return truths, False
