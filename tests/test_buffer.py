"""Tests for dflash.training.buffer (pure Python, CPU, fast; every thread is joined with a timeout)."""

from __future__ import annotations

import collections
import random
import threading
import time

import pytest

from dflash.training.buffer import (
    POLICIES,
    BucketedBuffer,
    BufferClosed,
    BufferConfig,
    BufferExhausted,
    BufferFailed,
    PullPolicy,
    build_policy,
    register_policy,
    validate_buffer_config,
)

JOIN_S = 3.0
# edges [10, 20] -> buckets: len<=10 -> 0, len<=20 -> 1, longer -> 2
LEN = {0: 5, 1: 15, 2: 30}


def make_cfg(**kw) -> BufferConfig:
    base = dict(min_ready=1, max_depth=4, bucket_edges=[10, 20], timeout_s=2.0)
    base.update(kw)
    return BufferConfig(**base)


class Worker(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn = fn
        self.result = None
        self.exc: BaseException | None = None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - captured for the assertion
            self.exc = e

    def finish(self, timeout=JOIN_S):
        self.join(timeout)
        assert not self.is_alive(), "thread hung"
        return self


def start(fn) -> Worker:
    w = Worker(fn)
    w.start()
    return w


def drain(buf: BucketedBuffer) -> list:
    out = []
    while True:
        try:
            out.append(buf.get_entry())
        except BufferExhausted:
            return out


# ----------------------------------------------------------------------- config


def test_defaults_and_bucketing():
    cfg = BufferConfig()
    assert (cfg.name, cfg.min_ready, cfg.max_depth, cfg.policy) == ("r10_20", 10, 20, "round_robin")
    assert cfg.bucket_edges == [64, 128, 256, 512, 1024]
    assert cfg.deterministic is False and cfg.timeout_s == 600.0
    validate_buffer_config(cfg)
    buf = BucketedBuffer(cfg)
    assert buf.num_buckets == 6
    assert [buf.bucket_of(n) for n in (0, 64, 65, 128, 1024, 1025, 10**6)] == [0, 0, 1, 1, 4, 5, 5]
    assert buf.depths() == [0] * 6


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(min_ready=0), "buffer.min_ready"),
        (dict(min_ready=5, max_depth=4), "buffer.min_ready"),
        (dict(max_depth=0), "buffer.max_depth"),
        (dict(policy="lifo"), "buffer.policy"),
        (dict(bucket_edges=[10, 10]), "buffer.bucket_edges"),
        (dict(bucket_edges=[20, 10]), "buffer.bucket_edges"),
        (dict(bucket_edges=[0, 10]), "buffer.bucket_edges"),
        (dict(bucket_edges=[1.5, 10]), "buffer.bucket_edges"),
        (dict(timeout_s=0), "buffer.timeout_s"),
        (dict(timeout_s=-1.0), "buffer.timeout_s"),
        (dict(timeout_s=float("inf")), "buffer.timeout_s"),
    ],
)
def test_config_validation_names_key(kw, key):
    cfg = make_cfg(**kw)
    with pytest.raises(ValueError, match=key):
        validate_buffer_config(cfg)
    with pytest.raises(ValueError, match=key):
        BucketedBuffer(cfg)


def test_policy_registry():
    assert {"round_robin", "proportional", "fifo"} <= set(POLICIES)
    for name in ("round_robin", "proportional", "fifo"):
        assert isinstance(build_policy(name, seed=1), PullPolicy)
    with pytest.raises(ValueError, match="buffer.policy"):
        build_policy("nope")

    @register_policy("_test_last_nonempty")
    class LastNonEmpty(PullPolicy):
        def choose(self, depths, oldest_seq):
            return max(i for i, d in enumerate(depths) if d)

    try:
        buf = BucketedBuffer(make_cfg(policy="_test_last_nonempty", max_depth=3))
        for b in (0, 2, 1):
            buf.put(b, LEN[b])
        assert buf.get() == 2
    finally:
        POLICIES.pop("_test_last_nonempty")


# ------------------------------------------------------------- backpressure


def test_backpressure_blocks_producer_at_max_depth():
    buf = BucketedBuffer(make_cfg(max_depth=3))
    for i in range(3):
        buf.put(i, LEN[0])
    w = start(lambda: buf.put(3, LEN[1]))
    time.sleep(0.1)
    assert w.is_alive(), "put should block at max_depth"
    assert len(buf) == 3
    assert buf.get() == 0
    w.finish()
    assert w.exc is None
    assert len(buf) == 3 and buf.depths() == [2, 1, 0]


def test_min_ready_then_drain_after_close():
    buf = BucketedBuffer(make_cfg(min_ready=3, max_depth=5))
    w = start(buf.get)
    buf.put("a", LEN[0])
    buf.put("b", LEN[1])
    time.sleep(0.1)
    assert w.is_alive(), "get must wait for min_ready items"
    buf.put("c", LEN[2])
    w.finish()
    assert w.exc is None and w.result in {"a", "b", "c"}
    # 2 left < min_ready: a get would wait; after close they drain.
    w2 = start(buf.get)
    time.sleep(0.05)
    assert w2.is_alive()
    buf.close()
    w2.finish()
    assert w2.exc is None
    rest = [w2.result] + [e.item for e in drain(buf)]
    assert sorted([w.result] + rest) == ["a", "b", "c"]
    with pytest.raises(BufferExhausted):
        buf.get()
    with pytest.raises(BufferClosed):
        buf.put("d", 1)


def test_close_wakes_blocked_consumer_and_producer():
    buf = BucketedBuffer(make_cfg(min_ready=2, max_depth=2))
    c = start(buf.get)  # empty -> blocks
    time.sleep(0.05)
    buf.close()
    c.finish()
    assert isinstance(c.exc, BufferExhausted)

    buf = BucketedBuffer(make_cfg(min_ready=2, max_depth=2))
    buf.put(0, 1)
    buf.put(1, 1)
    p = start(lambda: buf.put(2, 1))  # full -> blocks
    time.sleep(0.05)
    buf.close()
    p.finish()
    assert isinstance(p.exc, BufferClosed)
    assert [e.item for e in drain(buf)] == [0, 1]


# ----------------------------------------------------------------- policies


def dominant_stream(n: int, seed: int = 0) -> list[int]:
    """Bucket ids with ~80% in bucket 0."""
    rng = random.Random(seed)
    return [0 if rng.random() < 0.8 else rng.choice([1, 2]) for _ in range(n)]


def test_round_robin_rotates_nonempty_buckets_with_dominant_bucket():
    buf = BucketedBuffer(make_cfg(policy="round_robin", min_ready=10, max_depth=10))
    for b in [0] * 8 + [1, 2]:
        buf.put(b, LEN[b])
    buf.close()
    assert [e.bucket for e in drain(buf)] == [0, 1, 2] + [0] * 7

    # streaming: whenever >1 bucket is non-empty, the same bucket is never pulled twice
    # in a row, and minority buckets get served far above their 20% share.
    buf = BucketedBuffer(make_cfg(policy="round_robin", min_ready=10, max_depth=20))
    stream = dominant_stream(300)
    pulled, multi = [], []
    it = iter(stream)
    for b in it:
        buf.put(b, LEN[b])
        if len(buf) == 20:
            break
    for b in it:
        depths = buf.depths()
        e = buf.get_entry()
        multi.append(sum(d > 0 for d in depths) > 1)
        pulled.append(e.bucket)
        buf.put(b, LEN[b])
    for i in range(1, len(pulled)):
        if multi[i]:
            assert pulled[i] != pulled[i - 1]
    # pointer semantic: after bucket k, next is the first non-empty bucket after k.
    rr = build_policy("round_robin")
    assert [rr.choose([3, 0, 2], [0, None, 1]) for _ in range(4)] == [0, 2, 0, 2]
    assert rr.choose([1, 1, 1], [0, 1, 2]) == 0  # pointer wrapped to 0 after bucket 2
    sd = rr.state_dict()
    rr2 = build_policy("round_robin")
    rr2.load_state_dict(sd)
    assert rr2.choose([1, 1, 1], [0, 1, 2]) == rr.choose([1, 1, 1], [0, 1, 2]) == 1


def test_proportional_tracks_depth_and_is_reproducible():
    p = build_policy("proportional", seed=123)
    depths = [80, 10, 10]
    n = 20000
    counts = collections.Counter(p.choose(depths, [0, 1, 2]) for _ in range(n))
    assert abs(counts[0] / n - 0.8) < 0.02
    assert abs(counts[1] / n - 0.1) < 0.02 and abs(counts[2] / n - 0.1) < 0.02
    assert p.choose([0, 5, 0], [None, 3, None]) == 1  # never an empty bucket

    a, b = build_policy("proportional", seed=7), build_policy("proportional", seed=7)
    seq_a = [a.choose([5, 3, 2], [0, 1, 2]) for _ in range(200)]
    assert seq_a == [b.choose([5, 3, 2], [0, 1, 2]) for _ in range(200)]
    c = build_policy("proportional", seed=8)
    assert seq_a != [c.choose([5, 3, 2], [0, 1, 2]) for _ in range(200)]

    # state_dict round-trip reproduces the continuation
    sd = a.state_dict()
    cont = [a.choose([5, 3, 2], [0, 1, 2]) for _ in range(200)]
    r = build_policy("proportional", seed=999)
    r.load_state_dict(sd)
    assert [r.choose([5, 3, 2], [0, 1, 2]) for _ in range(200)] == cont


def test_proportional_buffer_with_dominant_bucket():
    buf = BucketedBuffer(make_cfg(policy="proportional", min_ready=20, max_depth=20), seed=3)
    stream = dominant_stream(2000, seed=1)
    got = []
    for b in stream:
        if len(buf) == 20:
            got.append(buf.get_entry().bucket)
        buf.put(b, LEN[b])
    frac0 = got.count(0) / len(got)
    assert 0.7 < frac0 < 0.9  # tracks the ~80% depth share


def test_fifo_returns_arrival_order():
    buf = BucketedBuffer(make_cfg(policy="fifo", min_ready=10, max_depth=10))
    order = dominant_stream(10, seed=5)
    for i, b in enumerate(order):
        buf.put(i, LEN[b])
    buf.close()
    assert [e.item for e in drain(buf)] == list(range(10))


def test_buffer_state_dict_and_pending_keys_resume_exactly():
    def feed(buf, items):
        for i, b in items:
            buf.put(i, LEN[b], key=(i, b))

    stream = list(enumerate(dominant_stream(60, seed=2)))
    cfg = make_cfg(policy="proportional", min_ready=6, max_depth=8)

    ref = BucketedBuffer(cfg, seed=11)
    out_ref = []
    for i, b in stream:
        if len(ref) == 8:
            out_ref.append(ref.get())
        ref.put(i, LEN[b], key=(i, b))

    buf = BucketedBuffer(cfg, seed=11)
    out, pos = [], 0
    for i, b in stream[:30]:
        if len(buf) == 8:
            out.append(buf.get())
        buf.put(i, LEN[b], key=(i, b))
        pos += 1
    sd, pending = buf.snapshot()
    assert len(pending) == len(buf)
    assert [k[0] for _, k in pending] == sorted(k[0] for _, k in pending)  # arrival order
    assert all(bk == k[1] for bk, k in pending)
    stats_before = buf.stats()

    res = BucketedBuffer(cfg, seed=0)  # different seed: state must come from sd
    res.load_state_dict(sd)
    feed(res, [k for _, k in pending])
    st = res.stats()
    for i in range(3):
        assert st[f"buffer/puts_b{i}"] == stats_before[f"buffer/puts_b{i}"]
        assert st[f"buffer/gets_b{i}"] == stats_before[f"buffer/gets_b{i}"]
    for i, b in stream[pos:]:
        if len(res) == 8:
            out.append(res.get())
        res.put(i, LEN[b], key=(i, b))
    assert out == out_ref

    with pytest.raises(RuntimeError):
        res.load_state_dict(sd)  # not empty
    with pytest.raises(ValueError, match="buffer.bucket_edges"):
        BucketedBuffer(make_cfg(policy="proportional", bucket_edges=[10]), seed=0).load_state_dict(sd)


def test_stats_and_counters():
    buf = BucketedBuffer(make_cfg(max_depth=6))
    for b in (0, 0, 1, 2):
        buf.put(b, LEN[b])
    buf.get()
    st = buf.stats()
    assert st["buffer/total"] == 3
    assert [st[f"buffer/depth_b{i}"] for i in range(3)] == buf.depths()
    assert [st[f"buffer/puts_b{i}"] for i in range(3)] == [2, 1, 1]
    assert st["buffer/puts"] == 4 and st["buffer/gets"] == 1


# ------------------------------------------------------------ deterministic


class Recording(PullPolicy):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen: list[list[int]] = []

    def choose(self, depths, oldest_seq):
        self.seen.append(list(depths))
        return self.inner.choose(depths, oldest_seq)


def run_deterministic(producer_sleep, consumer_sleep, policy="proportional"):
    cfg = make_cfg(policy=policy, min_ready=2, max_depth=5, deterministic=True)
    buf = BucketedBuffer(cfg, seed=4)
    rec = Recording(buf.policy)
    buf.policy = rec
    stream = dominant_stream(40, seed=9)
    rng_p, rng_c = random.Random(1), random.Random(2)

    def produce():
        with buf.guard("producer"):
            for i, b in enumerate(stream):
                buf.put(i, LEN[b])
                if producer_sleep:
                    time.sleep(rng_p.random() * producer_sleep)
            buf.close()

    def consume():
        out = []
        with buf.guard("consumer"):
            while True:
                try:
                    out.append(buf.get())
                except BufferExhausted:
                    return out
                if consumer_sleep:
                    time.sleep(rng_c.random() * consumer_sleep)

    p, c = start(produce), start(consume)
    p.finish()
    c.finish()
    assert p.exc is None and c.exc is None
    return c.result, rec.seen


def test_deterministic_mode_pulls_at_full_depth_and_is_timing_independent():
    out1, seen1 = run_deterministic(producer_sleep=0.002, consumer_sleep=0.0)
    out2, seen2 = run_deterministic(producer_sleep=0.0, consumer_sleep=0.002)
    assert sorted(out1) == list(range(40))
    # before close: every pull at full depth; after close: drain 4, 3, 2, 1
    totals = [sum(d) for d in seen1]
    assert totals == [5] * 36 + [4, 3, 2, 1]
    assert out1 == out2 and seen1 == seen2
    out3, _ = run_deterministic(0.001, 0.001, policy="round_robin")
    out4, _ = run_deterministic(0.0, 0.002, policy="round_robin")
    assert out3 == out4


def test_deterministic_waits_for_full_depth():
    buf = BucketedBuffer(make_cfg(min_ready=1, max_depth=3, deterministic=True, timeout_s=0.15))
    buf.put(0, 1)
    buf.put(1, 1)
    with pytest.raises(TimeoutError, match=r"depths=\[2, 0, 0\]"):
        buf.get()
    buf.put(2, 1)
    assert buf.get() == 0


# ------------------------------------------------------------------ errors


def test_producer_failure_unblocks_consumer_with_cause():
    buf = BucketedBuffer(make_cfg(min_ready=3, max_depth=5, timeout_s=5.0))
    buf.put("x", 1)
    c = start(buf.get)
    time.sleep(0.05)
    boom = ValueError("target OOM")

    def producer():
        with buf.guard("producer 0"):
            raise boom

    t0 = time.monotonic()
    p = start(producer)
    p.finish()
    c.finish()
    assert time.monotonic() - t0 < 1.0
    assert p.exc is boom
    assert isinstance(c.exc, BufferFailed)
    assert c.exc.__cause__ is boom
    assert "producer 0" in str(c.exc) and "target OOM" in str(c.exc)
    # every later call fails too, even though an item is still buffered
    with pytest.raises(BufferFailed) as ei:
        buf.get()
    assert ei.value.__cause__ is boom
    with pytest.raises(BufferFailed):
        buf.put("y", 1)
    assert buf.error is boom


def test_consumer_failure_unblocks_blocked_producer():
    buf = BucketedBuffer(make_cfg(max_depth=2, timeout_s=5.0))
    buf.put(0, 1)
    buf.put(1, 1)
    p = start(lambda: buf.put(2, 1))
    time.sleep(0.05)
    assert p.is_alive()
    err = RuntimeError("drafter step crashed")
    t0 = time.monotonic()
    buf.fail(err, source="consumer")
    p.finish()
    assert time.monotonic() - t0 < 1.0
    assert isinstance(p.exc, BufferFailed) and p.exc.__cause__ is err
    assert "consumer" in str(p.exc)
    buf.fail(ValueError("later"))  # first error wins
    assert buf.error is err


def test_timeouts_name_depths():
    buf = BucketedBuffer(make_cfg(min_ready=3, max_depth=3, timeout_s=0.1))
    buf.put(0, LEN[1])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"depths=\[0, 1, 0\]"):
        buf.get()
    assert time.monotonic() - t0 < 1.0
    buf.put(1, LEN[2])
    buf.put(2, LEN[2])
    with pytest.raises(TimeoutError, match=r"depths=\[0, 1, 2\]"):
        buf.put(3, 1)
    assert len(buf) == 3  # nothing lost or added


# ------------------------------------------------------------ no silent loss


def test_no_loss_two_producers():
    buf = BucketedBuffer(make_cfg(policy="round_robin", min_ready=3, max_depth=7))
    n_each = 300
    expected = collections.Counter()

    def producer(pid):
        rng = random.Random(pid)
        items = [(pid, i, rng.randrange(1, 40)) for i in range(n_each)]
        expected.update(items)  # built before the producer threads start
        return items

    batches = [producer(0), producer(1)]

    def run(items, name):
        with buf.guard(name):
            for it in items:
                buf.put(it, it[2], key=it[:2])

    ps = [start(lambda b=b, k=k: run(b, f"producer {k}")) for k, b in enumerate(batches)]

    def closer():
        for p in ps:
            p.finish()
        buf.close()

    cl = start(closer)
    got = drain(buf)
    cl.finish()
    assert all(p.exc is None for p in ps) and cl.exc is None
    assert collections.Counter(e.item for e in got) == expected
    assert all(e.bucket == buf.bucket_of(e.item[2]) for e in got)
    st = buf.stats()
    assert st["buffer/puts"] == st["buffer/gets"] == 2 * n_each
    assert st["buffer/total"] == 0 and buf.snapshot()[1] == []
