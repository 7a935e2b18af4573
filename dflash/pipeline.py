"""Target producers → bounded, length-bucketed buffer → drafter consumer, running concurrently.

Each producer thread claims the next global item index g (epoch = g // N, position g % N in that
epoch's seeded order), runs the frozen target on that sequence and puts the features + labels into
the buffer. The global index is the item's key: a checkpoint stores the buffer's pending keys and
the number of items put, and a resumed run replays exactly those items before going on.

Any exception in a producer fails the buffer (the consumer's next `get` raises it, chained); the
consumer failing fails the buffer too, which unblocks producers. Nothing hangs: the buffer's waits
have a timeout.

Both sides use the thread's default CUDA stream, so no cross-stream race can hand the consumer a
half-written tensor (the original pipeline's NaNs came from packing on a second stream unsynced).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from dflash.buffer import BucketedBuffer
from dflash.data import epoch_order
from dflash.target import Target


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


class ItemSource:
    """Maps global item indices to (epoch, sequence index); hands out fresh indices thread-safely.

    With `world` data-parallel ranks, rank r takes g = n·world + r for its n-th item: the ranks together
    walk each epoch's order once, each its own share."""

    def __init__(self, sequences: list[torch.Tensor], seed: int, next_index: int = 0,
                 replay: list[int] | None = None, rank: int = 0, world: int = 1):
        self.sequences = sequences
        self.seed = seed
        self.rank, self.world = rank, world
        self._next = next_index
        self._replay = list(replay or [])
        self._orders: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def locate(self, g: int) -> tuple[int, int]:
        n = len(self.sequences)
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


class ProducerPool:
    """`n` producer threads feeding one buffer."""

    def __init__(self, target: Target, buffer: BucketedBuffer, source: ItemSource, n: int,
                 soft_top_k: int):
        self.target, self.buffer, self.source = target, buffer, source
        self.soft_top_k = soft_top_k
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, name=f"producer-{i}", daemon=True)
                        for i in range(n)]

    def start(self) -> "ProducerPool":
        for t in self.threads:
            t.start()
        return self

    def produce(self, g: int, epoch: int, idx: int) -> Item:
        tokens = self.source.sequences[idx]
        out = self.target.forward_features(tokens[None], self.soft_top_k)
        soft = (out.soft_vals_BTk[0], out.soft_idx_BTk[0]) if out.soft_vals_BTk is not None else (None, None)
        return Item(g, epoch, idx, tokens.to(self.target.device), out.features_BTLH[0], out.labels_BT[0], *soft)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                g, epoch, idx = self.source.claim()
                item = self.produce(g, epoch, idx)
                self.buffer.put(item, item.tokens_T.numel(), key=g)
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
        return self.target.tokens_done, self.target.busy_s
