"""Batched producer forwards: length grouping, and right-padded batches give each sequence's own features."""
import threading

import pytest
import torch

from dflash.training.buffer import BucketedBuffer, BufferConfig
from dflash.training.pipeline import ItemSource, ProducerPool, length_groups
from dflash.target.model import Target, TargetConfig, TinyTargetSpec


def test_length_groups_bound_the_padding():
    lengths = [300, 64, 310, 70, 128, 305, 66, 120]
    groups = length_groups(lengths, max_waste=0.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert lengths[g[0]] == max(lengths[i] for i in g)
        assert len(g) * lengths[g[0]] <= 1.25 * real
    assert len(groups) == 3  # ~300, ~125, ~66
    assert length_groups([50] * 5) == [[0, 1, 2, 3, 4]]
    assert length_groups([]) == []


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_batched_forward_equals_one_at_a_time(model_type):
    spec = TinyTargetSpec(model_type=model_type, hidden_size=64, num_layers=4, intermediate_size=128,
                          head_dim=16, linear_head_dim=16)
    target = Target(TargetConfig(random=spec, layer_ids=[0, 1, 2], dtype="float32"))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (40, 33, 37, 90, 81)]
    pool = ProducerPool(target, BucketedBuffer(BufferConfig()), ItemSource(seqs, seed=0), n=1, soft_top_k=8,
                        batch=5)
    claims = [(10 + i, 0, i) for i in range(len(seqs))]
    batched = pool.produce(claims)
    assert [it.key for it in batched] == [10, 11, 12, 13, 14]  # claim order, not length order
    for it, seq in zip(batched, seqs):
        single = target.forward_features(seq[None], 8)
        assert it.features_TLH.shape[0] == seq.numel()
        torch.testing.assert_close(it.features_TLH, single.features_BTLH[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(it.labels_T, single.labels_BT[0])
        torch.testing.assert_close(it.soft_vals_Tk, single.soft_vals_BTk[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(it.tokens_T, seq)


def test_batched_producer_puts_every_claimed_key_in_order():
    spec = TinyTargetSpec(hidden_size=64, num_layers=4, intermediate_size=128, head_dim=16, linear_head_dim=16)
    target = Target(TargetConfig(random=spec, layer_ids=[0, 1]))
    seqs = [torch.randint(0, 256, (24 + 3 * i,)) for i in range(6)]
    keys, done = [], threading.Event()

    class Sink:
        def put(self, item, n, key):
            keys.append(key)
            if len(keys) >= 8:
                done.set()
                pool.stop.set()

        def fail(self, e, source):
            raise AssertionError(e)

        def close(self):
            pass

    pool = ProducerPool(target, Sink(), ItemSource(seqs, seed=0), n=1, soft_top_k=0, batch=4).start()
    assert done.wait(60)
    pool.shutdown()
    assert keys[:8] == list(range(8))
