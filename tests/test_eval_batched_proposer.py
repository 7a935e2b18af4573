"""The batched drafter proposer (all of a task's round positions in chunked training forwards) gives what the
sequential one (one cached drafter call per round) gives: same top-k log-probs, same simulated τ, for full and
windowed drafters and any chunking. CPU, float32, tiny random drafters on random features."""
from __future__ import annotations

import pytest
import torch

from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.evaluation.acceptance import (
    DRAFTER_PROPOSERS,
    BatchedDrafterProposer,
    DrafterProposer,
    Proposal,
    reduce_logits,
    simulate_task,
)
from dflash.evaluation.ground_truth import TaskTruth

HIDDEN, L, V, BS = 32, 3, 50, 4
WINDOW = 9  # below the sequence length: the window hides old context and the sequential cache is trimmed
LAYOUTS = {"full": {}, "windowed": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)}


def _drafter(layout: str, attn_kernel: str = "sdpa", attn_group: int = 16) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                        block_size=BS, attn_group=attn_group, attn_kernel=attn_kernel, **LAYOUTS[layout])
    d = DFlashDrafter(cfg, HIDDEN, num_target_layers=8, mask_token_id=V - 1, target_layer_ids=list(range(L)))
    torch.manual_seed(1)
    d.attach_target_head(torch.randn(V, HIDDEN), torch.randn(V, HIDDEN))
    return d.eval()


def _truth(name="t", P=6, N=31, seed=2) -> TaskTruth:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (P + N,), generator=g)
    return TaskTruth(name, ids[:P], ids[P:], torch.randn(P + N, L, HIDDEN, generator=g))


def _chained_truth(drafter, **kw) -> TaskTruth:
    """A truth whose token after each position is the drafter's own first draft from there: every round
    accepts at least one draft, so τ and the trees vary (a random drafter on random tokens gives τ = 1)."""
    truth = _truth(**kw)
    seq = DrafterProposer(drafter)  # its context cache holds features only: tokens may change under it
    for p in range(truth.prompt_len, truth.prompt_len + truth.n_new - 1):
        truth.continuation[p + 1 - truth.prompt_len] = seq(truth, p)[0].argmax()
    return truth


def _round_starts(truth: TaskTruth) -> range:
    return range(truth.prompt_len, truth.prompt_len + truth.n_new - 1)  # rounds run while p − P < N − 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attn_kernel,attn_group", [("sdpa", 16), ("sdpa", 3), ("flex", 16)])
def test_batched_equals_sequential_at_every_position(layout, attn_kernel, attn_group):
    """k = V: the whole sorted log-softmax, i.e. the logits up to their log-partition. The training forward runs
    the drafter's own kernel (grouped anchors or not); the sequential path is plain SDPA after a cache."""
    d, truth = _drafter(layout, attn_kernel, attn_group), _truth()
    seq, batched = DrafterProposer(d), BatchedDrafterProposer(d, k=V, anchor_chunk=8)
    for p in _round_starts(truth):
        want, got = reduce_logits(seq(truth, p), V), batched(truth, p)
        assert isinstance(got, Proposal) and len(got.tokens) == BS - 1  # near the end too (the rounds clip)
        assert got.tokens == want.tokens and got.topk_idx == want.topk_idx, p
        torch.testing.assert_close(torch.tensor(got.topk_logp), torch.tensor(want.topk_logp), rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_simulated_taus_are_identical(layout):
    d = _drafter(layout)
    truth, budgets = _chained_truth(d), [2, 4, 16]
    want = simulate_task(truth, DrafterProposer(d), BS, budgets)
    got = simulate_task(truth, BatchedDrafterProposer(d, k=max(budgets), anchor_chunk=7), BS, budgets)
    assert min(want.taus_vanilla) >= 2 and len(set(want.taus_vanilla)) > 1  # the chain made rounds accept
    assert got.taus_vanilla == want.taus_vanilla
    assert got.taus_tree == want.taus_tree and got.nodes_tree == want.nodes_tree
    assert got.reached == want.reached and got.accepted == want.accepted


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunking_does_not_change_the_proposals(layout):
    d, truth = _drafter(layout), _truth()
    n = truth.n_new - 1
    tables = [BatchedDrafterProposer(d, k=5, anchor_chunk=c).propose_all(truth) for c in (1, 7, n, 4 * n)]
    for arg, logp, idx in tables[1:]:
        assert torch.equal(arg, tables[0][0]) and torch.equal(idx, tables[0][2])
        torch.testing.assert_close(logp, tables[0][1], rtol=0, atol=1e-5)
    assert tables[0][0].shape == (n, BS - 1) and tables[0][1].shape == (n, BS - 1, 5)


def test_one_forward_per_chunk_and_one_task_at_a_time(monkeypatch):
    d = _drafter("full")
    a, b = _truth("a"), _truth("b", P=4, N=12, seed=3)
    forwards = []
    forward = d.forward
    monkeypatch.setattr(d, "forward", lambda *args: forwards.append(args[1].shape[1]) or forward(*args))
    batched = BatchedDrafterProposer(d, k=4, anchor_chunk=8)
    first = [batched(a, p) for p in _round_starts(a)]
    assert forwards == [8, 8, 8, 6]  # 30 round starts in chunks of 8, computed on the first call only
    batched(b, 4)
    assert forwards[4:] == [8, 3]
    assert [batched(a, p) for p in _round_starts(a)] == first  # task a again: recomputed, same proposals
    assert len(forwards) == 10


def test_positions_outside_the_rounds_are_refused():
    truth = _truth()
    batched = BatchedDrafterProposer(_drafter("full"), k=2)
    for p in (truth.prompt_len - 1, truth.prompt_len + truth.n_new - 1):
        with pytest.raises(ValueError, match="no round starts at position"):
            batched(truth, p)


def test_proposer_registry():
    d = _drafter("full")
    assert isinstance(DRAFTER_PROPOSERS.build("batched", d, 16), BatchedDrafterProposer)
    assert DRAFTER_PROPOSERS.build("batched", d, 16).k == 16
    assert isinstance(DRAFTER_PROPOSERS.build("sequential", d, 16), DrafterProposer)
    with pytest.raises(ValueError, match="eval.proposer='fast' is unknown"):
        DRAFTER_PROPOSERS.check("fast")
    with pytest.raises(ValueError, match="anchor_chunk"):
        BatchedDrafterProposer(d, anchor_chunk=0)
