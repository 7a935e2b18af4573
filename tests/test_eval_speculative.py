"""Real speculative decoding (dflash.evaluation.speculative) on a tiny hybrid qwen3_5 target: lossless
with rejections (Gated-DeltaNet state rolled back), and real τ == simulated τ round for round."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation.acceptance import DrafterProposer, simulate_task
from dflash.evaluation.ground_truth import build_ground_truth
from dflash.evaluation.prompts import Task
from dflash.evaluation.speculative import (
    TargetSession,
    greedy_decode,
    speculative_decode,
)
from tests.conftest import LenCache

N = 24
TASKS = [Task("fib", 'def fib(n):\n    """Fibonacci."""\n'), Task("rev", "def rev(s):\n    return")]



@pytest.fixture(scope="module")
def target(reference_target):
    t = reference_target
    assert t.info.model_type == "qwen3_5" and "linear_attention" in t.model.config.layer_types
    return t


@pytest.fixture(scope="module")
def truths(target):
    return build_ground_truth(target, TASKS, N)


def _random_drafter(target, bs=4, seed=0):
    torch.manual_seed(seed)
    d = build_drafter(DrafterConfig(block_size=bs), target.hidden_size, target.info.num_layers,
                      target.mask_token_id, target.layer_ids)
    d.attach_target_head(target.embed_weight(), target.lm_head_weight())
    return d.eval()


class PatternDrafter(nn.Module):
    """Knows the target's tokens; proposes them except at random positions (1 in `period`), where it
    proposes a wrong token — rounds then accept 0..bs-1 drafts, exercising every rollback length."""

    def __init__(self, tokens: list[int], vocab: int, bs: int, period: int, seed: int = 0):
        super().__init__()
        import random
        rng = random.Random(seed)
        self.w = nn.Parameter(torch.zeros(1))
        self.tokens, self.vocab, self.block_size = tokens, vocab, bs
        self.wrong = {q for q in range(len(tokens) + bs) if rng.randrange(period) == 0}
        self.target_layer_ids, self.hidden_size = None, None

    def new_cache(self):
        return LenCache()

    def extend_context(self, cache, features_BTLH, start):
        assert start <= cache.length or cache.length == start
        cache.length = start + features_BTLH.shape[1]

    def draft_hidden(self, cache, anchor_B):
        p = cache.length
        assert int(anchor_B[0]) == self.tokens[p], "anchor must be the committed token at position p"
        return torch.full((1, self.block_size - 1, 1), float(p))

    def logits(self, hidden):
        p = int(hidden[0, 0, 0])
        out = torch.zeros(1, self.block_size - 1, self.vocab)
        for k in range(1, self.block_size):
            want = self.tokens[p + k] if p + k < len(self.tokens) else 0
            out[0, k - 1, (want + 1) % self.vocab if p + k in self.wrong else want] = 1.0
        return out


def test_rollback_restores_the_exact_recurrent_and_kv_state(target):
    """Verify a block, keep a prefix, continue: identical to a session that only ever saw the prefix."""
    prompt = torch.tensor(target.tokenizer.encode("def f(x):\n    return x"))
    block = torch.tensor([10, 20, 30, 40, 50])
    nxt = torch.tensor([7, 8])
    for keep in (1, 3, 5):
        a = TargetSession(target)
        a.forward(prompt)
        snap = a.snapshot()
        a.forward(block)
        a.commit(snap, block, keep)
        b = TargetSession(target)
        b.forward(prompt)
        b.forward(block[:keep])
        assert a.length == b.length == prompt.numel() + keep
        fa, la = a.forward(nxt)
        fb, lb = b.forward(nxt)
        assert torch.equal(la, lb)
        torch.testing.assert_close(fa, fb, rtol=1e-5, atol=1e-5)


def test_without_rollback_the_hybrid_state_drifts(target):
    """Cropping only the attention KV is not enough on a Gated-DeltaNet target (why the snapshot exists)."""
    prompt = torch.tensor(target.tokenizer.encode("def f(x):\n    return x"))
    block = torch.tensor([10, 20, 30, 40, 50])
    a = TargetSession(target)
    a.forward(prompt)
    a.forward(block)
    a._crop_attention(prompt.numel() + 1)  # attention cropped, recurrent state left as after 5 tokens
    a.length = prompt.numel() + 1
    b = TargetSession(target)
    b.forward(prompt)
    b.forward(block[:1])
    fa, _ = a.forward(torch.tensor([7]))
    fb, _ = b.forward(torch.tensor([7]))
    assert not torch.allclose(fa, fb, atol=1e-4)


def test_random_drafter_is_lossless_and_matches_simulation(target, truths):
    drafter = _random_drafter(target)
    for truth in truths:
        greedy = greedy_decode(target, truth.prompt_ids, N)
        assert greedy.tokens == truth.continuation.tolist()
        spec = speculative_decode(drafter, target, truth.prompt_ids, N)
        assert spec.tokens == greedy.tokens  # lossless, token for token
        assert any(t < drafter.block_size for t in spec.taus)  # there were rejections
        sim = simulate_task(truth, DrafterProposer(drafter), drafter.block_size)
        assert spec.taus == sim.taus_vanilla
        assert sum(spec.taus) >= N - 1 and spec.target_forwards > len(spec.taus)  # re-advances happened


def test_hf_generate_agrees_with_greedy(target, truths):
    ids = truths[0].prompt_ids[None]
    out = target.model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == truths[0].continuation.tolist()


@pytest.mark.parametrize("bs,period", [(4, 3), (6, 4), (5, 7)])
def test_partial_acceptance_lossless_and_tau_equal(target, truths, bs, period):
    for truth in truths:
        drafter = PatternDrafter(truth.tokens.tolist(), target.vocab_size, bs, period)
        spec = speculative_decode(drafter, target, truth.prompt_ids, N)
        assert spec.tokens == truth.continuation.tolist()
        sim = simulate_task(truth, DrafterProposer(drafter), bs, budgets=[])
        assert spec.taus == sim.taus_vanilla
        assert len(set(spec.taus)) > 1 and max(spec.taus) > 1  # several acceptance lengths exercised
