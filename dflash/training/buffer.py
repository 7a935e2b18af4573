"""Bounded, length-bucketed hand-off buffer between target producers and the drafter.

Target-model producer threads :meth:`~BucketedBuffer.put` one item per sequence
(features + labels; the buffer treats items as opaque objects) and the drafter
consumer :meth:`~BucketedBuffer.get`\\ s them back.  Items are grouped into length
buckets and a :class:`PullPolicy` decides from which bucket the next item comes.

Knobs (``BufferConfig``)
------------------------
``bucket_edges``
    Upper bounds of the length buckets: a sequence of length ``L`` goes to the first
    bucket ``i`` with ``L <= bucket_edges[i]``; longer sequences go to the last bucket,
    so there are ``len(bucket_edges) + 1`` buckets.
``min_ready``
    ``get`` waits until at least ``min_ready`` items are buffered.  Pulling from a pool
    rather than from whatever arrived last lets the policy mix lengths inside each
    optimizer step instead of training on runs of same-length sequences.
``max_depth``
    Hard bound on the number of buffered items (bounded memory: items hold target
    hidden states).  ``put`` blocks while the buffer is full (backpressure).
    ``max_depth`` must be comfortably larger than ``min_ready`` when one bucket
    dominates the data, otherwise the pool is nearly all that bucket and there is
    nothing for the policy to rotate through.
``policy``
    ``round_robin``  cycles over the non-empty buckets (remembers its pointer);
    ``proportional`` picks a bucket with probability proportional to its depth, from a
    seeded ``random.Random`` whose state is checkpointed;
    ``fifo``         returns the oldest item overall (plain queue, no mixing).
    New policies register with :func:`register_policy`.
``deterministic``
    Pull only when the buffer is exactly full (``total == max_depth``).  Producers
    then always refill to the same depth before each pull, so the buffer content seen
    by the policy at every pull depends only on the *arrival order* of items, not on
    thread timing.  (The arrival order itself must be deterministic, e.g. one producer
    or producers that put in a fixed interleaving.)
``timeout_s``
    Neither ``put`` nor ``get`` waits longer than this; they raise ``TimeoutError``
    with the bucket depths instead of hanging.

Shutdown and errors
-------------------
* ``close()``: no more puts.  Remaining items drain regardless of ``min_ready`` (and of
  the deterministic full-depth rule); then ``get`` raises :class:`BufferExhausted`.
* ``fail(exc)``: stores the first error and wakes everybody; every blocked or later
  ``put``/``get`` raises :class:`BufferFailed` chained (``__cause__``) from ``exc``.
  Use ``with buffer.guard("producer 0"): ...`` around a producer/consumer loop to fail
  the buffer on any exception.
* Items are never dropped silently: ``snapshot()`` gives what is still buffered (for exact
  resume) with the per-bucket put/get counters.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import operator
import random
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

from dflash.registry import Registry

__all__ = [
    "BufferConfig",
    "validate_buffer_config",
    "PullPolicy",
    "POLICIES",
    "register_policy",
    "build_policy",
    "RoundRobinPolicy",
    "ProportionalPolicy",
    "FifoPolicy",
    "BucketedBuffer",
    "BufferEntry",
    "BufferExhausted",
    "BufferFailed",
    "BufferClosed",
]


# --------------------------------------------------------------------------- config


@dataclass
class BufferConfig:
    name: str = "r10_20"
    min_ready: int = 10
    max_depth: int = 20
    policy: str = "round_robin"
    bucket_edges: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    deterministic: bool = False
    timeout_s: float = 600.0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_buffer_config(cfg: BufferConfig) -> None:
    """Raise ``ValueError`` naming the offending ``buffer.*`` key."""
    if not _is_int(cfg.max_depth) or cfg.max_depth < 1:
        raise ValueError(f"buffer.max_depth must be an int >= 1, got {cfg.max_depth!r}")
    if not _is_int(cfg.min_ready) or cfg.min_ready < 1:
        raise ValueError(f"buffer.min_ready must be an int >= 1, got {cfg.min_ready!r}")
    if cfg.min_ready > cfg.max_depth:
        raise ValueError(
            f"buffer.min_ready ({cfg.min_ready}) must be <= buffer.max_depth ({cfg.max_depth})"
        )
    POLICIES.check(cfg.policy)
    try:
        edges = list(cfg.bucket_edges)
    except TypeError:
        raise ValueError(
            f"buffer.bucket_edges must be a list of ints, got {cfg.bucket_edges!r}"
        ) from None
    for i, e in enumerate(edges):
        if not _is_int(e) or e <= 0:
            raise ValueError(
                f"buffer.bucket_edges must be positive ints, got {e!r} at index {i}"
            )
        if i > 0 and e <= edges[i - 1]:
            raise ValueError(
                f"buffer.bucket_edges must be strictly increasing, got {edges!r}"
            )
    if not isinstance(cfg.timeout_s, (int, float)) or isinstance(cfg.timeout_s, bool) \
            or not math.isfinite(cfg.timeout_s) or cfg.timeout_s <= 0:
        raise ValueError(f"buffer.timeout_s must be a finite number > 0, got {cfg.timeout_s!r}")
    if not isinstance(cfg.deterministic, bool):
        raise ValueError(f"buffer.deterministic must be a bool, got {cfg.deterministic!r}")


# ------------------------------------------------------------------------- policies


class PullPolicy(ABC):
    """Chooses the bucket of the next pulled item.

    ``choose`` is only called when at least one bucket is non-empty and must return
    the index of a non-empty bucket.  ``oldest_seq[i]`` is the arrival sequence number
    of bucket ``i``'s oldest item (``None`` for an empty bucket).
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def choose(self, depths: list[int], oldest_seq: list[int | None]) -> int: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


POLICIES: Registry[type[PullPolicy]] = Registry("buffer.policy")


def register_policy(name: str) -> Callable[[type[PullPolicy]], type[PullPolicy]]:
    def deco(cls: type[PullPolicy]) -> type[PullPolicy]:
        POLICIES.register(name, cls)
        cls.policy_name = name
        return cls

    return deco


def build_policy(name: str, seed: int = 0) -> PullPolicy:
    return POLICIES.build(name, seed=seed)


@register_policy("round_robin")
class RoundRobinPolicy(PullPolicy):
    """Cycle over the non-empty buckets; the pointer survives empty buckets."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.next = 0

    def choose(self, depths: list[int], oldest_seq: list[int | None]) -> int:
        n = len(depths)
        for k in range(n):
            i = (self.next + k) % n
            if depths[i] > 0:
                self.next = (i + 1) % n
                return i
        raise ValueError("round_robin: all buckets are empty")

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])


@register_policy("proportional")
class ProportionalPolicy(PullPolicy):
    """Bucket chosen with probability proportional to its depth (seeded RNG)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.rng = random.Random(seed)

    def choose(self, depths: list[int], oldest_seq: list[int | None]) -> int:
        total = sum(depths)
        if total <= 0:
            raise ValueError("proportional: all buckets are empty")
        r = self.rng.randrange(total)
        for i, d in enumerate(depths):
            if r < d:
                return i
            r -= d
        raise AssertionError("unreachable")

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng_state": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng_state"]
        self.rng.setstate((version, tuple(internal), gauss))


@register_policy("fifo")
class FifoPolicy(PullPolicy):
    """The oldest buffered item overall."""

    def choose(self, depths: list[int], oldest_seq: list[int | None]) -> int:
        best, best_seq = -1, None
        for i, s in enumerate(oldest_seq):
            if s is not None and (best_seq is None or s < best_seq):
                best, best_seq = i, s
        if best < 0:
            raise ValueError("fifo: all buckets are empty")
        return best


# --------------------------------------------------------------------------- buffer


class BufferExhausted(Exception):
    """``get`` on a closed buffer with nothing left."""


class BufferClosed(RuntimeError):
    """``put`` after ``close()``."""


class BufferFailed(RuntimeError):
    """The run failed; ``__cause__`` is the original error passed to ``fail``."""


class BufferEntry(NamedTuple):
    item: Any
    key: Any
    bucket: int
    length: int
    seq: int


class BucketedBuffer:
    """Thread-safe bounded buffer with length buckets and a pluggable pull policy.

    See the module docstring for the meaning of the config fields.
    """

    def __init__(self, cfg: BufferConfig, seed: int = 0) -> None:
        validate_buffer_config(cfg)
        self.cfg = cfg
        self.edges: list[int] = [int(e) for e in cfg.bucket_edges]
        self.num_buckets = len(self.edges) + 1
        self.policy = build_policy(cfg.policy, seed)
        self._cond = threading.Condition(threading.Lock())
        self._buckets: list[deque[BufferEntry]] = [deque() for _ in range(self.num_buckets)]
        self._total = 0
        self._seq = 0
        self._puts = [0] * self.num_buckets
        self._gets = [0] * self.num_buckets
        self._closed = False
        self._error: BaseException | None = None
        self._error_source: str | None = None
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0

    # ---------------------------------------------------------------- helpers
    def bucket_of(self, length: int) -> int:
        """Index of the bucket for a sequence of ``length`` tokens."""
        return bisect.bisect_left(self.edges, length)

    def _depths(self) -> list[int]:
        return [len(b) for b in self._buckets]

    def _describe(self) -> str:
        return (
            f"buffer {self.cfg.name!r}: depths={self._depths()} total={self._total} "
            f"min_ready={self.cfg.min_ready} max_depth={self.cfg.max_depth} "
            f"deterministic={self.cfg.deterministic} closed={self._closed}"
        )

    def _raise_failed(self, op: str) -> None:
        src = f" in {self._error_source}" if self._error_source else ""
        exc = self._error
        raise BufferFailed(
            f"{op} aborted: buffer {self.cfg.name!r} failed{src}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc

    def _ready(self) -> bool:
        if self._total == 0:
            return False
        if self._closed:
            return True  # drain regardless of min_ready / full-depth rule
        if self.cfg.deterministic:
            return self._total == self.cfg.max_depth
        return self._total >= self.cfg.min_ready

    def ready(self) -> bool:
        """Whether a `get` would return now without waiting (an inline producer tops up until it is)."""
        with self._cond:
            return self._error is not None or self._ready()

    def space(self) -> int:
        """Items a `put` can still add without blocking."""
        with self._cond:
            return max(self.cfg.max_depth - self._total, 0)

    # -------------------------------------------------------------- producer
    def put(self, item: Any, length: int, key: Any = None) -> None:
        """Add ``item`` (a sequence of ``length`` tokens); blocks while full."""
        length = operator.index(length)
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        b = self.bucket_of(length)
        with self._cond:
            t0 = time.monotonic()
            ok = self._cond.wait_for(
                lambda: self._error is not None
                or self._closed
                or self._total < self.cfg.max_depth,
                timeout=self.cfg.timeout_s,
            )
            self._put_wait_s += time.monotonic() - t0
            if self._error is not None:
                self._raise_failed("put")
            if self._closed:
                raise BufferClosed(f"put on closed buffer {self.cfg.name!r}")
            if not ok:
                raise TimeoutError(
                    f"put waited {self.cfg.timeout_s}s for space (consumer stalled?); "
                    + self._describe()
                )
            self._buckets[b].append(BufferEntry(item, key, b, length, self._seq))
            self._seq += 1
            self._total += 1
            self._puts[b] += 1
            self._cond.notify_all()

    def close(self) -> None:
        """No more puts; wakes everyone.  Remaining items can still be drained."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fail(self, exc: BaseException, source: str | None = None) -> None:
        """Store ``exc`` (the first one wins) and wake everyone.

        Every blocked or later ``put``/``get`` raises :class:`BufferFailed` from it.
        """
        with self._cond:
            if self._error is None:
                self._error = exc
                self._error_source = source
            self._cond.notify_all()

    @contextlib.contextmanager
    def guard(self, source: str) -> Iterator["BucketedBuffer"]:
        """``with buf.guard("producer 0"):`` -- fail the buffer on any exception."""
        try:
            yield self
        except BaseException as e:
            self.fail(e, source)
            raise

    # -------------------------------------------------------------- consumer
    def get_entry(self) -> BufferEntry:
        """Like :meth:`get` but returns the :class:`BufferEntry` (item, key, bucket...)."""
        with self._cond:
            t0 = time.monotonic()
            ok = self._cond.wait_for(
                lambda: self._error is not None
                or self._ready()
                or (self._closed and self._total == 0),
                timeout=self.cfg.timeout_s,
            )
            self._get_wait_s += time.monotonic() - t0
            if self._error is not None:
                self._raise_failed("get")
            if not ok:
                raise TimeoutError(
                    f"get waited {self.cfg.timeout_s}s for the buffer to become ready "
                    "(producers stalled?); " + self._describe()
                )
            if self._total == 0:
                raise BufferExhausted(f"buffer {self.cfg.name!r} is closed and empty")
            depths = self._depths()
            oldest = [b[0].seq if b else None for b in self._buckets]
            i = self.policy.choose(depths, oldest)
            if not (0 <= i < self.num_buckets) or depths[i] == 0:
                raise RuntimeError(
                    f"pull policy {self.cfg.policy!r} chose bucket {i} with depths {depths}"
                )
            entry = self._buckets[i].popleft()
            self._total -= 1
            self._gets[i] += 1
            self._cond.notify_all()
            return entry

    def get(self) -> Any:
        """Pop one item; blocks until ready.  Raises ``BufferExhausted`` when closed
        and empty, ``BufferFailed`` after ``fail``, ``TimeoutError`` after ``timeout_s``."""
        return self.get_entry().item

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.get()
            except BufferExhausted:
                return

    # ------------------------------------------------------------ inspection
    @property
    def error(self) -> BaseException | None:
        return self._error

    def depths(self) -> list[int]:
        with self._cond:
            return self._depths()

    def __len__(self) -> int:
        """Items buffered now, all buckets together."""
        with self._cond:
            return self._total

    def stats(self) -> dict[str, float]:
        with self._cond:
            out: dict[str, float] = {}
            for i, b in enumerate(self._buckets):
                out[f"buffer/depth_b{i}"] = len(b)
            for i in range(self.num_buckets):
                out[f"buffer/puts_b{i}"] = self._puts[i]
                out[f"buffer/gets_b{i}"] = self._gets[i]
            out["buffer/total"] = self._total
            out["buffer/puts"] = sum(self._puts)
            out["buffer/gets"] = sum(self._gets)
            out["buffer/put_wait_s"] = self._put_wait_s
            out["buffer/get_wait_s"] = self._get_wait_s
            return out

    # ------------------------------------------------------------ checkpoint
    def snapshot(self) -> tuple[dict, list[tuple[int, Any]]]:
        """``(state, pending)`` taken under one lock, so a concurrent put cannot slip between them (a checkpoint
        needs both to agree): the policy state and per-bucket counters, and the ``(bucket, key)`` of every
        buffered item in arrival order. ``load_state_dict(state)`` into an empty buffer, then re-putting the
        pending items in this order, restores the buffer exactly (same within-bucket and fifo order, same
        counters)."""
        with self._cond:
            entries = sorted((e for b in self._buckets for e in b), key=lambda e: e.seq)
            return self._state_unlocked(), [(e.bucket, e.key) for e in entries]

    def _state_unlocked(self) -> dict:
        return {
            "num_buckets": self.num_buckets,
            "bucket_edges": list(self.edges),
            "policy_name": self.cfg.policy,
            "policy": self.policy.state_dict(),
            "puts": list(self._puts),
            "gets": list(self._gets),
            "pending": self._depths(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore policy state and counters into an empty buffer.

        The put counters are restored *minus* the items that were pending at save
        time, so re-putting the pending items of ``snapshot`` yields the saved counters.
        """
        with self._cond:
            if self._total:
                raise RuntimeError("load_state_dict needs an empty buffer")
            if state["num_buckets"] != self.num_buckets or list(state["bucket_edges"]) != self.edges:
                raise ValueError(
                    f"buffer.bucket_edges mismatch: checkpoint {state['bucket_edges']} "
                    f"vs config {self.edges}"
                )
            if state["policy_name"] != self.cfg.policy:
                raise ValueError(
                    f"buffer.policy mismatch: checkpoint {state['policy_name']!r} "
                    f"vs config {self.cfg.policy!r}"
                )
            self.policy.load_state_dict(state["policy"])
            pending = list(state.get("pending", [0] * self.num_buckets))
            self._puts = [int(p) - int(q) for p, q in zip(state["puts"], pending)]
            self._gets = [int(g) for g in state["gets"]]
