"""DFlash 2 through the evaluation: the draft is the selector walk's greedy path, the same from the batched and the
sequential proposer and from the real decoding loop (lossless, τ round for round as simulated); the walk's q over
the whole vocabulary (what sampled verification compares with p)."""
from __future__ import annotations

import pytest
import torch

from dflash.drafter.model import DFlashDrafter, DrafterConfig, build_drafter
from dflash.evaluation.acceptance import BatchedDrafterProposer, DrafterProposer, simulate_task
from dflash.evaluation.ground_truth import TaskTruth, build_ground_truth
from dflash.evaluation.prompts import Task
from dflash.evaluation.speculative import greedy_decode, speculative_decode

HIDDEN, L, V, BS = 32, 3, 50, 4


def _strong_selector(d):
    with torch.no_grad():  # pair scores as large as the unary ones: the walk departs from the argmax
        for p in d.candidate_selector.parameters():
            p.normal_(std=1.0)
    return d


def _drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64, block_size=BS,
                        attn_group=3, architecture="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=5,
                        layer_types=["sliding_attention"] * 2, sliding_window=9, sliding_causal=False)
    d = DFlashDrafter(cfg, HIDDEN, num_target_layers=8, mask_token_id=V - 1, target_layer_ids=list(range(L)),
                      vocab_size=V)
    torch.manual_seed(1)
    d.attach_target_head(torch.randn(V, HIDDEN), torch.randn(V, HIDDEN))
    return _strong_selector(d).eval()


def test_batched_and_sequential_proposers_give_the_walks_path():
    d = _drafter()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V - 1, (37,), generator=g)
    truth = TaskTruth("t", ids[:6], ids[6:], torch.randn(37, L, HIDDEN, generator=g))
    batched, seq = BatchedDrafterProposer(d), DrafterProposer(d)
    departs = False
    for p in range(6, 36):
        a, b = batched(truth, p), seq(truth, p)
        assert a.tokens == b.tokens, p
        with torch.no_grad():
            cache = d.new_cache()
            d.extend_context(cache, truth.features[None, :p], 0)
            hidden = d.draft_hidden(cache, truth.tokens[p:p + 1])
        assert b.tokens == d.draft(hidden, truth.tokens[p:p + 1]).tokens[0].tolist()
        departs |= b.tokens != d.logits(hidden)[0].argmax(-1).tolist()
    assert departs  # the walk is not the argmax here: the test tells the two apart


def test_dense_q_is_the_candidates_softmax_and_zero_elsewhere():
    d = _drafter()
    walk = d.draft(torch.randn(2, BS - 1, HIDDEN), torch.tensor([3, 4]), temperature=0.7,
                   generator=torch.Generator().manual_seed(0))
    q = walk.dense_q(V, 0.7)
    assert torch.allclose(q.sum(-1), torch.ones(2, BS - 1))
    assert torch.allclose(q.gather(-1, walk.candidates), torch.softmax(walk.scores / 0.7, -1))
    assert (q > 0).sum(-1).max() <= d.cfg.selector_top_k
    assert (q.gather(-1, walk.tokens[..., None]) > 0).all()  # the sampled draft is one of its candidates


@pytest.mark.slow
def test_dflash2_decoding_is_lossless_and_matches_the_simulation(reference_target):
    t = reference_target
    torch.manual_seed(0)
    cfg = DrafterConfig(block_size=BS, architecture="dflash2", selector_rank=8, selector_top_k=4,
                        layer_types=["sliding_attention"] * 2, sliding_window=16, sliding_causal=False)
    d = build_drafter(cfg, t.hidden_size, t.info.num_layers, t.mask_token_id, t.layer_ids, t.info.vocab_size)
    d.attach_target_head(t.embed_weight(), t.lm_head_weight())
    d = _strong_selector(d).eval()
    truths = build_ground_truth(t, [Task("fib", 'def fib(n):\n    """Fibonacci."""\n')], 20)
    for truth in truths:
        spec = speculative_decode(d, t, truth.prompt_ids, 20)
        assert spec.tokens == greedy_decode(t, truth.prompt_ids, 20).tokens  # lossless
        assert spec.taus == simulate_task(truth, DrafterProposer(d), BS).taus_vanilla
        assert spec.taus == simulate_task(truth, BatchedDrafterProposer(d), BS).taus_vanilla

    from dflash.evaluation import EvalConfig
    from dflash.evaluation.report import evaluate
    rep = evaluate(d, t, EvalConfig(tree_budgets=[4, 16]), truths=truths)  # DDTree: DFlash 1 only, said so
    assert rep.budgets == [] and "DFlash 1 only" in rep.info["ddtree"]
    assert rep.metrics["eval/tau_vanilla"] == pytest.approx(sum(spec.taus) / len(spec.taus))


# ------------------------------------------------------------------ sampled (T > 0): the walk's q, exact rejection
from tests.test_eval_sampling import ALPHA, _exact_law, _pvalue  # noqa: E402


def _sampled_truth(d):
    from dflash.target.sampling import Sampling
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V - 1, (30,), generator=g)
    truth = TaskTruth("s", ids[:6], ids[6:], torch.randn(30, L, HIDDEN, generator=g))
    return truth, Sampling(0.9, 1.0, 0)


def test_sampled_proposals_carry_the_walks_q_along_the_path_in_both_proposers():
    d = _drafter()
    truth, s = _sampled_truth(d)
    batched, seq = BatchedDrafterProposer(d, sampling=s), DrafterProposer(d, sampling=s)
    for p in range(6, 29):
        a, b = batched(truth, p), seq(truth, p)
        assert a.path_q is not None and torch.allclose(torch.tensor(a.path_q), torch.tensor(b.path_q), atol=1e-5)
        with torch.no_grad():  # the reference: q of each path token after the path's previous token
            cache = d.new_cache()
            d.extend_context(cache, truth.features[None, :p], 0)
            hidden = d.draft_hidden(cache, truth.tokens[p:p + 1])
        path = truth.tokens[p + 1:p + BS]
        want = []
        for k, y in enumerate(path.tolist()):
            prev = int(truth.tokens[p + k])
            unary, cand = d.logits(hidden)[0, k].topk(d.cfg.selector_top_k)
            scores = unary + d.candidate_selector.pair_scores(hidden[0, k], torch.tensor(prev), cand)
            q = torch.softmax(scores / 0.9, -1)
            want.append(float(q[cand == y].sum()))
        want += [0.0] * (BS - 1 - len(want))  # past the path's end
        assert torch.allclose(torch.tensor(b.path_q), torch.tensor(want), atol=1e-5), p


def _dflash2_on(target, bs=4):
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=1, head_dim=16, intermediate_size=64, block_size=bs, architecture="dflash2",
                        selector_rank=8, selector_top_k=3, layer_types=["sliding_attention"], sliding_window=64,
                        sliding_causal=False)
    d = build_drafter(cfg, target.hidden_size, target.info.num_layers, target.mask_token_id, target.layer_ids,
                      target.info.vocab_size)
    d.attach_target_head(target.embed_weight(), target.lm_head_weight())
    return _strong_selector(d).eval()


def test_dflash2_speculative_sampling_is_lossless_on_a_tiny_target(byte_target):
    """The real loop with the selector's sampled walk as the draft and its q in the rejection rule: the first 3
    committed tokens against the target's exact law at T=1, top_k=2, over 250 seeds (~25 s)."""
    from dflash.evaluation.sampled_decode import sampled_speculative_decode
    from dflash.target.sampling import Sampling
    s, prompt, n = Sampling(1.0, 1.0, 2), [5, 17, 33, 2, 9], 3
    law = _exact_law(byte_target, prompt, s, n)
    d = _dflash2_on(byte_target)
    with torch.no_grad():  # pair scores of order 1: q spread over the candidates, not one of them
        for p in d.candidate_selector.parameters():
            p.normal_(std=0.5)
    # unary logits that leave exactly three candidates: the two tokens the target samples at the first drafted
    # position and one it never samples; drafts are accepted, rejected for a residual draw, and rejected outright
    second = sorted({seq[1] for seq in law})
    row = torch.full((byte_target.vocab_size,), -1e4)
    row[second + [200]] = 0.0
    d.logits = lambda hidden: row.expand(*hidden.shape[:-1], row.numel()).clone()
    counts, taus = dict.fromkeys(law, 0), []
    for seed in range(250):
        r = sampled_speculative_decode(d, byte_target, prompt, n, s, torch.Generator().manual_seed(seed))
        counts[tuple(r.tokens)] += 1
        taus += r.taus
    keys = sorted(law)
    assert _pvalue([counts[k] for k in keys], [law[k] for k in keys]) > ALPHA
    assert 1 < sum(taus) / len(taus) < n  # drafts were both accepted and rejected: both paths were seen
