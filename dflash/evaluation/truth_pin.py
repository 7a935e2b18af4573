"""Pinned ground-truth tokens (`eval.truth_dir`, docs/evaluation.md): a suite's continuations written once
to a small JSON file, then used by every later evaluation with the same pin folder.

Why: GPU greedy decoding is not bit-reproducible across machines and processes (autotuned kernels differ), so
two machines that each regenerate the ground truth get a few different continuations, a different
`ground_truth_key`, and evaluations that no longer pair. A campaign that spans machines commits its pins and
evaluates every cell on the same tokens; only the target features are recomputed (one forward per prompt).

A pin file is `<truth_dir>/<key[:24]>.json`, key = sha256 of what decides the ground truth apart from numerics:
pin format, target identity, task names with their prompt tokens, max_new_tokens, and the protocol the tokens were
written under (sampling setting, samples, seed, stop tokens, a code suite's stop sequences / dedent; absent for
the legacy greedy fixed-length pins, whose keys are unchanged), not the feature layers: a pin holds tokens only.
It records, per task, its name, the sha256 of its prompt tokens and its continuation,
and a sha256 over the task list, so a hand edit or a torn file is caught. A pin that cannot be read, fails its
checksum or disagrees with the suite is an error naming the file, never silently replaced: its tokens are
what the user asked the evaluation to run on.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash.atomic import atomic_create_text

PIN_FORMAT = 1
_KIND = "dflash-eval-truth-pin"


class PinError(ValueError):
    """A pin file that cannot be used: unreadable, failed checksum, or made for another suite."""


@dataclass(frozen=True)
class Pin:
    path: Path
    continuations: list[list[int]]
    digest: str  # the sha256 over the pinned tasks: names, prompt hashes and continuation tokens


def prompt_sha(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()


def tasks_digest(tasks: list[dict]) -> str:
    return hashlib.sha256(json.dumps(tasks, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_checked_tasks(path, kind: str, fmt: int, bad) -> tuple[dict, list[dict]]:
    """(the JSON object at `path`, its task list) when it is a `kind` file of format `fmt` whose `sha256` is its
    tasks' digest; else raises `bad(why)` (pins and the frozen held-out suite share this shape)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or data.get("kind") != kind or data.get("format") != fmt:
        raise bad(f"not a {kind} file of format {fmt}")
    tasks = data.get("tasks")
    if not isinstance(tasks, list) or not all(isinstance(t, dict) for t in tasks):
        raise bad("no task list")
    if data.get("sha256") != tasks_digest(tasks):
        raise bad("checksum mismatch (edited by hand, or torn)")
    return data, tasks


@dataclass(frozen=True)
class PinnedSuite:
    """What decides a suite's ground truth apart from numerics; finds, reads and writes its pin."""
    target: str  # target identity, as the ground-truth cache key has it
    names: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]  # each task's prompt tokens
    max_new_tokens: int
    vocab_size: int = 0  # pinned tokens must lie below it (0: unchecked); not part of the key
    # how the tokens were written (`ground_truth.TruthSpec.key()`: sampling setting, samples, seed, stop tokens,
    # the suite's code stop rule);
    # None = the legacy greedy fixed-length protocol, whose pins keep their old keys (and are never read for
    # any other protocol: the key differs)
    protocol: dict | None = None

    @property
    def ends(self) -> bool:
        """Continuations end at a stop token or a code suite's stop rule: any length 1..max_new_tokens."""
        return bool(self.protocol and (self.protocol.get("stop_ids") or self.protocol.get("code_stop")))

    def key(self) -> str:
        payload = {"format": PIN_FORMAT, "target": self.target, "max_new_tokens": int(self.max_new_tokens),
                   "prompts": [[n, prompt_sha(p)] for n, p in zip(self.names, self.prompts)]}
        if self.protocol is not None:
            payload["protocol"] = self.protocol
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def path(self, truth_dir: str | Path) -> Path:
        return Path(truth_dir) / f"{self.key()[:24]}.json"

    def write(self, path: Path, suite: str, continuations: Sequence[Sequence[int]]) -> Pin:
        """Pins `continuations` at `path` (whole or not at all; one task per line, so a pin reads and diffs well)
        unless a pin is there already, e.g. written meanwhile by a run that built the same suite at the same
        time: then that one stands and is returned, so racing evaluations still end on one set of tokens."""
        tasks = [{"name": n, "prompt_sha256": prompt_sha(p), "continuation": [int(t) for t in c]}
                 for n, p, c in zip(self.names, self.prompts, continuations)]
        head = {"kind": _KIND, "format": PIN_FORMAT, "target": self.target, "suite": suite,
                "max_new_tokens": int(self.max_new_tokens), "sha256": tasks_digest(tasks)}
        if self.protocol is not None:
            head["protocol"] = self.protocol
        text = json.dumps(head, indent=1)[:-2] + ',\n "tasks": [\n  ' \
            + ",\n  ".join(json.dumps(t) for t in tasks) + "\n ]\n}\n"
        if not atomic_create_text(path, text):
            return self.read(path)
        return Pin(path, [t["continuation"] for t in tasks], head["sha256"])

    def read(self, path: Path) -> Pin:
        """The pin at `path`; PinError naming the file and what disagrees, on anything but an exact match."""
        def bad(why: str) -> PinError:
            return PinError(f"eval.truth_dir: pinned ground truth {path}: {why}; it is not used silently: fix or "
                            f"delete the file (a new pin is then written), or set another eval.truth_dir")
        data, tasks = read_checked_tasks(path, _KIND, PIN_FORMAT, bad)
        self._match(data, tasks, bad)
        return Pin(Path(path), [list(t["continuation"]) for t in tasks], data["sha256"])

    def _match(self, data: dict[str, Any], tasks: list[dict], bad) -> None:
        if data.get("target") != self.target:
            raise bad(f"pinned for target {str(data.get('target'))[:120]!r}, not {self.target[:120]!r}")
        if data.get("protocol") != self.protocol:
            raise bad(f"written under protocol {data.get('protocol')!r} (None: greedy, fixed length), the "
                      f"evaluation asks for {self.protocol!r}")
        if data.get("max_new_tokens") != self.max_new_tokens:
            raise bad(f"max_new_tokens {data.get('max_new_tokens')!r}, the suite has {self.max_new_tokens}")
        names = [t.get("name") for t in tasks]
        if names != list(self.names):
            raise bad(f"tasks {names[:6]}{'…' if len(names) > 6 else ''}, the suite has "
                      f"{list(self.names)[:6]}{'…' if len(self.names) > 6 else ''}")
        for t, ids in zip(tasks, self.prompts):
            if t.get("prompt_sha256") != prompt_sha(ids):
                raise bad(f"task {t['name']!r}: its prompt tokens differ from the suite's")
            cont = t.get("continuation")
            if not isinstance(cont, list) or not (len(cont) == self.max_new_tokens
                                                  or (self.ends and 1 <= len(cont) <= self.max_new_tokens)):
                raise bad(f"task {t['name']!r}: continuation of {len(cont) if isinstance(cont, list) else cont!r} "
                          f"tokens, expected {self.max_new_tokens}")
            top = self.vocab_size or float("inf")
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < top for x in cont):
                raise bad(f"task {t['name']!r}: continuation holds something other than token ids")
