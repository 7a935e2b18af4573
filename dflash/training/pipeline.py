"""Target producers → bounded, length-bucketed buffer → drafter consumer, running concurrently.

Each producer thread claims the next global item index g (epoch = g // N, position g % N in that
epoch's seeded order), runs the frozen target on that sequence and puts the features + labels into
the buffer. The global index is the item's key: a checkpoint stores the buffer's pending keys and
the number of items put, and a resumed run replays exactly those items before going on.

Any exception in a producer fails the buffer (the consumer's next `get` raises it, chained); the
consumer failing fails the buffer too, which unblocks producers. Nothing hangs: the buffer's waits
have a timeout.

By default both sides use the thread's default CUDA stream, so no cross-stream race can hand the consumer a
half-written tensor (the original pipeline's NaNs came from packing on a second stream unsynced).
`trainer.producer_stream=side` runs the target's forwards on their own stream so that the drafter work the
consumer has queued runs beside the forward on the GPU; `SideStream` says how that stays exact.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from dflash.registry import Registry
from dflash.training.buffer import BucketedBuffer
from dflash.data.sources import epoch_order
from dflash.target.model import Target

# trainer.producer_mode -> whether the consumer runs the target itself, given (drafter device, target device).
# thread: producer threads run the target beside the drafter; inline: the consumer runs it whenever the buffer
# runs short; auto: inline when both sides share one GPU (they take turns on it anyway).
PRODUCER_MODES: Registry = Registry("trainer.producer_mode", {
    "thread": lambda drafter_device, target_device: False,
    "inline": lambda drafter_device, target_device: True,
    "auto": lambda drafter_device, target_device: drafter_device.type == "cuda" and drafter_device == target_device,
})


@dataclass
class Item:
    key: int  # global item index
    epoch: int
    index: int  # index into the sequence list
    tokens_T: torch.Tensor  # on the target device
    features_TLH: torch.Tensor
    labels_T: torch.Tensor
    soft_vals_Tk: torch.Tensor | None
    soft_idx_Tk: torch.Tensor | None
    # True on the tokens the drafter is trained to predict (a conversation's assistant tokens, on the host);
    # None: every token (dflash.training.batching draws anchors and labels from it)
    loss_mask_T: torch.Tensor | None = None


class ItemSource:
    """Maps global item indices to (epoch, sequence index); hands out fresh indices thread-safely.

    With `world` data-parallel ranks, rank r takes g = n·world + r for its n-th item: the ranks together
    walk each epoch's order once, each its own share."""

    def __init__(self, sequences: list[torch.Tensor], seed: int, next_index: int = 0,
                 replay: list[int] | None = None, rank: int = 0, world: int = 1, masks=None):
        self.sequences = sequences
        self.masks = masks  # per sequence, the tokens a drafter trains on (None: all)
        self.size = len(sequences)  # items per epoch
        self.seed = seed
        self.rank, self.world = rank, world
        self._next = next_index
        self._replay = list(replay or [])
        self._orders: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def locate(self, g: int) -> tuple[int, int]:
        n = self.size
        epoch = g // n
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(n, self.seed, epoch)}
        return epoch, self._orders[epoch][g % n]

    def claim(self) -> tuple[int, int, int]:
        with self._lock:
            if self._replay:
                g = self._replay.pop(0)
            else:
                g, self._next = self._next * self.world + self.rank, self._next + 1
            return (g, *self.locate(g))

    def sequences_for(self, claims: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The token sequences of claimed (key, epoch, index) triples (an online source writes them)."""
        return [self.sequences[idx] for _, _, idx in claims]

    def masks_for(self, claims: list[tuple[int, int, int]]) -> list[torch.Tensor | None]:
        """The loss masks of claimed triples (None for data trained on every token)."""
        return [None if self.masks is None else self.masks[idx] for _, _, idx in claims]


def length_groups(lengths: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Indices grouped for batched forwards, longest first: a group grows while right-padding every member
    to its longest adds at most `max_waste` of its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * lengths[g[0]] <= (1 + max_waste) * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


class SameStream:
    """The target's forwards on the stream of the thread that runs them (the default)."""

    def __init__(self, device: torch.device):
        pass

    def produce(self, fn):
        return fn()


class SideStream:
    """The target's forwards on their own CUDA stream (one per producer thread), beside the consumer's: the
    drafter work the consumer has queued keeps running while the target computes — with an inline producer the
    step queued just before the forward; with producer threads (`trainer.producer_mode=thread`) every step the
    consumer launches meanwhile. docs/DESIGN.md, "The buffer": an unsynchronised second stream once handed the
    consumer NaNs. Exact because (1) the consumer's stream waits for the side stream's work before it touches an item
    (`wait_stream`: a device-side wait, no host sync; the target also synchronises its own stream to time its
    forward), and (2) every tensor of an item is recorded as used by the consumer's stream, so the caching
    allocator cannot hand its memory to the next forward on the side stream while the drafter's queued
    kernels still read it. The forward reads nothing the consumer writes (its own inputs, the frozen
    weights). Off CUDA there are no streams: the same as `SameStream`."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            self.consumer = torch.cuda.current_stream(device)  # built on the consumer's thread
        self.local = threading.local()  # a stream per producer thread: a wait never covers another's forward

    def produce(self, fn):
        if not self.cuda:
            return fn()
        if not hasattr(self.local, "stream"):
            self.local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.local.stream):
            items = fn()
        self.consumer.wait_stream(self.local.stream)
        for item in items:
            for t in (item.tokens_T, item.features_TLH, item.labels_T, item.soft_vals_Tk, item.soft_idx_Tk):
                if t is not None:
                    t.record_stream(self.consumer)
        return items


# trainer.producer_stream → how the target's forwards are placed on the device
PRODUCER_STREAMS: Registry = Registry("trainer.producer_stream", {"default": SameStream, "side": SideStream})


class ProducerPool:
    """`n` producer threads feeding one buffer; each claims `batch` items per round and runs the target
    on them in length groups (one forward per group). Items are put in claim order, so a single producer
    puts keys in order and a checkpoint's item count stays an exact resume point.

    `inline`: no threads; the consumer tops the buffer up itself (`next_item`) whenever a get would wait.
    On one GPU shared by target and drafter the two sides serialise on the device anyway, and a second
    Python thread only adds contention for the GIL and the allocator (measured in benchmarks/RESULTS.md).
    An inline producer runs `batch` sequences per forward even when the buffer has less room: the rest wait in
    `staged` (claimed, in claim order, not yet put). A checkpoint counts only what was put, so a resume claims
    the staged keys again and produces exactly the same items."""

    def __init__(self, target: Target, buffer: BucketedBuffer, source: ItemSource, n: int,
                 soft_top_k: int, batch: int = 1, inline: bool = False, stream: str = "default"):
        self.target, self.buffer, self.source = target, buffer, source
        self.streams = PRODUCER_STREAMS.build(stream, target.device)
        self.soft_top_k, self.batch, self.inline = soft_top_k, batch, inline
        self.inline_s = 0.0  # consumer time spent producing (inline mode): counted as its wait
        self.staged: deque[Item] = deque()  # inline mode: produced, not yet put (the buffer was full)
        self.stop = threading.Event()
        self.threads = [] if inline else [threading.Thread(target=self._run, name=f"producer-{i}", daemon=True)
                                          for i in range(n)]

    def start(self) -> "ProducerPool":
        for t in self.threads:
            t.start()
        return self

    def produce(self, claims: list[tuple[int, int, int]]) -> list[Item]:
        """Target features for claimed (key, epoch, index) triples, in claim order.

        Right-padding is exact for a causal model: attention, the Gated-DeltaNet recurrence and its short
        convolution only look back, so positions < len never see the pad tokens."""
        seqs = self.source.sequences_for(claims)
        masks = self.source.masks_for(claims)
        items: list[Item | None] = [None] * len(claims)
        for group in length_groups([s.numel() for s in seqs]):
            T = seqs[group[0]].numel()
            ids = torch.zeros(len(group), T, dtype=seqs[group[0]].dtype)
            for row, i in enumerate(group):
                ids[row, : seqs[i].numel()] = seqs[i]
            # one host → device copy per group, from pinned memory: a per-item `.to(device)` from pageable
            # memory blocks the host until the stream drains (a sync per item)
            ids = ids.pin_memory().to(self.target.device, non_blocking=True) if self.target.device.type == "cuda" \
                else ids.to(self.target.device)
            out = self.target.forward_features(ids, self.soft_top_k)
            for row, i in enumerate(group):
                L, (g, epoch, idx) = seqs[i].numel(), claims[i]
                soft = (None, None) if out.soft_vals_BTk is None else \
                    (out.soft_vals_BTk[row, :L], out.soft_idx_BTk[row, :L])
                items[i] = Item(g, epoch, idx, ids[row, :L], out.features_BTLH[row, :L],
                                out.labels_BT[row, :L], *soft, masks[i])
        return items

    def next_item(self) -> Item:
        """The consumer's get; in inline mode it first runs the target until the buffer is ready."""
        if self.inline:
            t0 = time.perf_counter()
            while not self.buffer.ready():
                if not self.staged:  # a whole producer batch per target forward, whatever the buffer's depth
                    claims = [self.source.claim() for _ in range(self.batch)]
                    self.staged.extend(self.streams.produce(lambda claims=claims: self.produce(claims)))
                while self.staged and self.buffer.space():
                    item = self.staged.popleft()
                    self.buffer.put(item, item.tokens_T.numel(), key=item.key)
            self.inline_s += time.perf_counter() - t0
        return self.buffer.get()

    def _put(self, items: list[Item]) -> None:
        for item in items:
            self.buffer.put(item, item.tokens_T.numel(), key=item.key)

    def _run(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.set_device(self.target.device)  # Triton kernels launch on the thread's current GPU
        try:
            while not self.stop.is_set():
                claims = [self.source.claim() for _ in range(self.batch)]
                self._put(self.streams.produce(lambda claims=claims: self.produce(claims)))
        except Exception as e:  # noqa: BLE001 - handed to the consumer through the buffer
            if not self.stop.is_set():
                self.buffer.fail(e, source=threading.current_thread().name)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop.set()
        self.buffer.close()
        for t in self.threads:
            t.join(timeout)

    def perf(self) -> tuple[int, float]:
        """(tokens, seconds) the target spent in forward, summed over producers (measured in Target)."""
        return self.target.forward_stats()
