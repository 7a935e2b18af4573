"""DFlash 2's selector loss against a plain reference (top-k, gold injection, teacher-forced predecessor, K-way
CE, values and gradients), its metrics, and its composition with every block loss; then `experiments.run
+drafter=dflash2` end to end on the CPU."""
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash.drafter.selector import CandidateSelector
from dflash.training.losses import LOSSES, LossConfig, build_loss
from dflash.training import selector_loss
from dflash.training.selector_loss import SelectorLoss, selector_metrics, selector_terms, unary_topk

ROOT = Path(__file__).resolve().parents[1]


def _problem(N=4, K=5, H=8, V=23, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    logits = hidden @ head.T
    labels = torch.randint(0, V, (N, K), generator=g)
    top = logits.topk(k, dim=-1).indices
    inside = torch.rand(N, K, generator=g) < 0.5  # half the labels among the top-k, half (mostly) not
    labels = torch.where(inside, top[..., 1], labels)
    labels[0, 2] = -100
    labels[1, -2:] = -100
    anchors = torch.randint(0, V, (N,), generator=g)
    sel = CandidateSelector(H, V, rank=3, top_k=k).double()
    with torch.no_grad():
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.normal_(generator=g)
    return hidden.requires_grad_(), head, labels, anchors, sel


def _shape(x):  # an output multiplier of 0.7 and a soft cap of 5, to test that both reach the unary scores
    return 5.0 * torch.tanh(0.7 * x / 5.0)



def test_candidates_of_a_bfloat16_head_are_its_own_top_k_and_differ_from_float32_only_at_near_ties():
    """The top-k runs in the head's dtype (an engine's bfloat16 logits), not as a float32 product (the float32 rate
    and a float32 copy of the head): a candidate the float32 top-k would not have picked is one whose float32 logit
    lies within the bfloat16 rounding of the float32 k-th best."""
    g = torch.Generator().manual_seed(3)
    S, H, V, k = 96, 64, 3000, 16
    hidden = torch.randn(S, H, generator=g).bfloat16()
    head = (torch.randn(V, H, generator=g) / 8).bfloat16()
    got = unary_topk(hidden, head, k, _shape)
    assert torch.equal(got, _shape((hidden @ head.T).float()).topk(k, dim=-1).indices)
    exact = _shape(hidden.float() @ head.float().T)
    kth = exact.topk(k, dim=-1).values[:, -1:]
    picked = exact.gather(-1, got)
    tol = 2 ** -7 * exact.abs().amax(-1, keepdim=True)  # bfloat16 keeps 8 significant bits
    assert (picked >= kth - tol).all()
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, exact.topk(k, dim=-1).indices))
    assert same / (S * k) > 0.95  # near-ties are rare: nearly every candidate is the float32 product's too


def _reference(hidden, head, labels, anchors, sel):
    """Position by position: top-k of the shaped logits, gold in place of the last when missing, predecessor the
    previous gold (the anchor first), CE over the k scores; mean over valid positions."""
    N, K, _ = hidden.shape
    k = sel.top_k
    total, n, hits, correct = 0.0, 0, 0, 0
    for i in range(N):
        for t in range(K):
            gold = int(labels[i, t])
            if gold == -100:
                continue
            cand = _shape(hidden[i, t].detach() @ head.T).topk(k).indices.tolist()
            hit = gold in cand
            if not hit:
                cand[-1] = gold
            prev = int(anchors[i]) if t == 0 else max(int(labels[i, t - 1]), 0)  # after an ignored one: 0
            scores = torch.stack([_shape(hidden[i, t] @ head[b])
                                  + (sel.predecessor_codebook[prev] * (hidden[i, t] @ sel.hidden_projection.weight.T)
                                     * sel.successor_codebook[b]).sum() for b in cand])
            target = cand.index(gold)
            total = total - torch.log_softmax(scores, 0)[target]
            n += 1
            hits += hit
            correct += hit and int(scores.argmax()) == target
    return total / n, hits / n, correct / n


def test_selector_ce_and_gradients_match_the_plain_reference():
    hidden, head, labels, anchors, sel = _problem()
    terms = selector_terms(hidden, head, labels, anchors, sel, _shape)
    m = selector_metrics(terms)
    ref, recall, acc = _reference(hidden, head, labels, anchors, sel)
    assert 0 < recall < 1  # both branches (gold in the top-k, gold injected) are exercised
    torch.testing.assert_close(m["selector_ce"], ref, rtol=1e-10, atol=1e-10)
    assert math.isclose(float(m["candidate_recall"]), recall, rel_tol=1e-6)
    assert math.isclose(float(m["selector_acc"]), acc, rel_tol=1e-6)
    params = [hidden, sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight]
    got = torch.autograd.grad(m["selector_ce"], params)
    want = torch.autograd.grad(ref, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_selector_streak_is_the_self_conditioned_walks_matched_prefix():
    hidden, head, labels, anchors, sel = _problem()
    terms = selector_terms(hidden, head, labels, anchors, sel, _shape)
    walk = sel.walk(hidden.detach(), _shape(hidden.detach() @ head.T), anchors)
    want = []
    for i in range(labels.shape[0]):
        m = 0
        for t in range(labels.shape[1]):
            if labels[i, t] == -100 or int(walk.tokens[i, t]) != int(labels[i, t]):
                break
            m += 1
        want.append(m)
    assert terms["matched"].tolist() == want


def test_selector_streak_follows_at_most_walk_blocks_evenly_strided(monkeypatch):
    hidden, head, labels, anchors, sel = _problem()
    everything = selector_terms(hidden, head, labels, anchors, sel, _shape)
    N = labels.shape[0]
    monkeypatch.setattr(selector_loss, "WALK_BLOCKS", 2)
    sampled = selector_terms(hidden, head, labels, anchors, sel, _shape)
    stride = -(-N // 2)
    assert sampled["matched"].tolist() == everything["matched"][::stride].tolist()
    blocks = (labels != -100).any(1)[::stride]
    want = (everything["matched"][::stride] * blocks).sum() / blocks.sum()
    torch.testing.assert_close(selector_metrics(sampled)["selector_streak"], want.to(torch.float32), check_dtype=False)
    for key in ("ce", "hit", "correct"):  # the walk's sample leaves the loss and the other metrics alone
        torch.testing.assert_close(sampled[key], everything[key])


def _drafter_stub(sel, multiplier=1.0):
    return SimpleNamespace(candidate_selector=sel, cfg=SimpleNamespace(output_multiplier=multiplier),
                           shape_logits=lambda x: x * multiplier)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_selector_loss_composes_with_every_block_loss(name):
    hidden, head, labels, anchors, sel = _problem(V=23)
    B, N = 2, 2
    soft_vals, soft_idx = (hidden.detach() @ head.T + 0.5).topk(6, dim=-1)
    batch = SimpleNamespace(labels_BNK=labels.view(B, N, -1), anchor_tokens_BN=anchors.view(B, N),
                            soft_vals_BNKk=soft_vals.view(B, N, *soft_vals.shape[1:]),
                            soft_idx_BNKk=soft_idx.view(B, N, *soft_idx.shape[1:]))
    cfg = LossConfig(name=name, selector_alpha=0.3, lm_head_kernel="torch")
    block = build_loss(cfg)
    loss_fn = SelectorLoss(block, _drafter_stub(sel, 0.5), cfg.selector_alpha)
    h = hidden.view(B, N, *hidden.shape[1:])
    total, metrics = loss_fn(h, head, batch)
    alone, _ = build_loss(cfg)(h * 0.5, head, batch)
    torch.testing.assert_close(total, alone + 0.3 * metrics["selector_ce"])
    assert {"selector_ce", "candidate_recall", "selector_acc", "selector_streak", "acc", "streak"} <= set(metrics)
    total.backward()
    assert torch.isfinite(hidden.grad).all() and sel.successor_codebook.grad.abs().sum() > 0
    assert "selector_alpha" in loss_fn.config_keys and loss_fn.needs_soft == block.needs_soft


def _batch(labels, anchors, soft, B, N):
    return SimpleNamespace(labels_BNK=labels.view(B, N, -1), anchor_tokens_BN=anchors.view(B, N),
                           soft_vals_BNKk=soft[0].view(B, N, *soft[0].shape[1:]),
                           soft_idx_BNKk=soft[1].view(B, N, *soft[1].shape[1:]))


@pytest.mark.parametrize("grad_path", ["fused", "recompute"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_candidates_from_the_block_loss_pass_give_the_plain_references_losses_and_gradients(name, grad_path):
    """The trainer's selector loss takes its candidates from the block loss's own chunked pass (no second
    full-vocabulary product); the plain reference (`candidates="recompute"`: `unary_topk`, a pass of its own) gives
    the same loss, metrics and gradients, in chunks smaller than the positions so that several chunks' top-k join."""
    hidden, head, labels, anchors, sel = _problem(N=6, K=5, V=41, k=4, seed=2)
    B, N = 2, 3
    soft = (hidden.detach() @ head.T + 0.5).topk(6, dim=-1)
    batch = _batch(labels, anchors, soft, B, N)
    cfg = LossConfig(name=name, selector_alpha=0.3, lm_head_kernel="torch", lm_head_grad=grad_path, chunk_size=7,
                     temperature=1.5)
    params = [hidden, sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight]
    results = {}
    for source in ("block", "recompute"):
        loss_fn = SelectorLoss(build_loss(cfg), _drafter_stub(sel, 0.5), cfg.selector_alpha, candidates=source)
        total, metrics = loss_fn(hidden.view(B, N, *hidden.shape[1:]), head, batch)
        results[source] = total, metrics, torch.autograd.grad(total, params)
    (total, metrics, grads), (ref_total, ref_metrics, ref_grads) = results["block"], results["recompute"]
    assert 0 < float(ref_metrics["candidate_recall"]) < 1  # both branches: gold among the candidates, gold injected
    torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=1e-12)
    assert metrics.keys() == ref_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_trainers_selector_loss_makes_no_second_vocabulary_pass(monkeypatch):
    import dflash.training.selector_loss as selector_loss

    def second_pass(*args):
        raise AssertionError("unary_topk ran: a second full-vocabulary pass")
    monkeypatch.setattr(selector_loss, "unary_topk", second_pass)
    hidden, head, labels, anchors, sel = _problem()
    batch = _batch(labels, anchors, (hidden.detach() @ head.T).topk(3, dim=-1), 2, 2)
    loss_fn = SelectorLoss(build_loss(LossConfig(lm_head_kernel="torch")), _drafter_stub(sel), 1.0)
    total, _ = loss_fn(hidden.view(2, 2, *hidden.shape[1:]), head, batch)
    assert torch.isfinite(total)
    with pytest.raises(AssertionError, match="second full-vocabulary pass"):
        SelectorLoss(loss_fn.block, _drafter_stub(sel), 1.0, candidates="recompute")(
            hidden.view(2, 2, *hidden.shape[1:]), head, batch)


def test_block_pass_candidates_of_a_bfloat16_head_are_unary_topks():
    """In the head's dtype: with a bfloat16 head the block loss's chunks take the top-k of the same bfloat16 product
    `unary_topk` computes, so the candidates are the same ids, chunk size apart."""
    from dflash.training.position_stats import compute_position_stats
    g = torch.Generator().manual_seed(5)
    N, K, H, V, k = 6, 7, 32, 500, 16
    hidden = torch.randn(N, K, H, generator=g).bfloat16()
    head = (torch.randn(V, H, generator=g) / 4).bfloat16()
    labels = torch.randint(0, V, (N, K), generator=g)
    for grad_path in ("fused", "recompute"):
        stats = compute_position_stats(hidden, head, labels, chunk_size=9, lm_head_grad=grad_path,
                                       lm_head_kernel="torch", top_k=k)
        want = unary_topk(hidden.reshape(-1, H), head, k, lambda x: x).view(N, K, k)
        assert torch.equal(stats.top_k_idx, want)


def test_selector_alpha_below_zero_is_refused_by_name():
    from dflash.training.losses import validate_loss_config
    with pytest.raises(ValueError, match="loss.selector_alpha"):
        validate_loss_config(LossConfig(selector_alpha=-1.0))


@pytest.mark.slow
def test_run_trains_a_dflash2_drafter_on_the_cpu(tmp_path):
    """`python -m experiments.run +drafter=dflash2 trainer.max_steps=20` on the tiny target: it trains, logs the
    selector's metrics and writes a DFlash2DraftModel folder that loads back."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.run", "+drafter=dflash2", "trainer.max_steps=20", "+target=tiny_random",
           "drafter.num_layers=1", "drafter.layer_types=[sliding_attention]", "drafter.intermediate_size=128", "trainer.num_anchors=4", "data.max_len=128",
           "tracking.log_every=10", "eval.enabled=false", "+tracking=off", f"run_dir={run}",
           "trainer.tau_probe.sequences=0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "train/selector_ce" in r.get("metrics", r)][-1]
    last = last.get("metrics", last)
    assert math.isfinite(last["train/selector_ce"]) and 0 <= last["train/candidate_recall"] <= 1
    cfg = json.loads((run / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    from dflash.serving.export import load_drafter
    assert load_drafter(run / "final").candidate_selector is not None


@pytest.mark.slow
def test_a_compiled_dflash2_drafter_trains_to_the_eager_losses(fast_cfg):
    """`trainer.compile=true` on a DFlash 2 drafter: inductor (its CPU backend here) compiles the forward, the
    convolutions' block-boundary resets included, in one graph per shape (no graph break), and four steps train to
    the eager run's losses. The served campaign trains DFlash 2 eager (its store's cells); served_compiled
    compiles it."""
    from torch._dynamo.utils import counters

    from dflash.app.run import train
    from dflash.tracking.loggers import read_jsonl_metrics

    def losses(*overrides, run):
        res = train(fast_cfg("+drafter=dflash2", "drafter.num_layers=2", "trainer.max_steps=4", "trainer.pad_multiple=32",
                             "trainer.checkpoint_every=100", "trainer.producer_mode=inline", *overrides, run=run))
        return [r["train/loss"] for r in read_jsonl_metrics(res.run_dir) if "train/loss" in r]
    eager = losses("trainer.compile=false", run="eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = losses("trainer.compile=true", run="compiled")
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()
    assert len(eager) == 4 and compiled == pytest.approx(eager, rel=1e-4)


@pytest.mark.parametrize("gather_bytes", [1 << 25, 700])  # one forward chunk; chunks of 4 rows
def test_pair_scores_gradients_match_indexing_with_frequent_ids(monkeypatch, gather_bytes):
    """`pair_scores` (`GatheredDots`: a chunked gather forward, an embedding-bag backward) in place of
    codebook[ids] (whose index_put_ backward walks each run of one id in one warp): the same scores and gradients,
    here with one id at most positions, as a frequent token is among every position's candidates."""
    import dflash.drafter.selector as selector
    monkeypatch.setattr(selector, "GATHER_BYTES", gather_bytes)
    g = torch.Generator().manual_seed(7)
    S, H, V, k, r = 64, 12, 30, 5, 4
    sel = CandidateSelector(H, V, rank=r, top_k=k).double()
    hidden = torch.randn(S, H, generator=g, dtype=torch.float64, requires_grad=True)
    cand = torch.randint(0, V, (S, k), generator=g)
    cand[:, 0] = 3  # one id among every row's candidates
    pred = torch.where(torch.rand(S, generator=g) < 0.7, 3, torch.randint(0, V, (S,), generator=g))
    w = torch.randn(S, k, generator=g, dtype=torch.float64)
    params = [hidden, sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight]
    got = sel.pair_scores(hidden, pred, cand)
    gate = sel.predecessor_codebook[pred] * sel.hidden_projection(hidden)
    want = (sel.successor_codebook[cand] * gate[:, None, :]).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((got * w).sum(), params), torch.autograd.grad((want * w).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_block_pass_unary_scores_of_a_bfloat16_head_are_its_logits_and_the_gold_ones_too():
    """With a bfloat16 head the trainer's unary scores are the block pass's own logits (the bfloat16 product, as an
    engine's): the top-k values, and for an injected gold token `gold_logits`, which rounds as that pass does. Their
    gradient (`CandidateLogits`' embedding-bag backward) is the float32 gather's within bfloat16 rounding."""
    from dflash.training.lm_head_loss import chunk_logits
    from dflash.training.position_stats import compute_position_stats
    from dflash.training.selector_loss import CandidateLogits, gold_logits
    g = torch.Generator().manual_seed(9)
    S, H, V, k = 40, 32, 300, 8
    hidden = torch.randn(S, H, generator=g)
    head = (torch.randn(V, H, generator=g) / 4).bfloat16()
    gold = torch.randint(0, V, (S,), generator=g)
    logits = chunk_logits(hidden, head)
    assert torch.equal(gold_logits(hidden, head, gold), logits.gather(1, gold[:, None])[:, 0])
    stats = compute_position_stats(hidden.view(S, 1, H), head, gold.view(S, 1), chunk_size=7, lm_head_grad="fused",
                                   lm_head_kernel="torch", top_k=k)
    assert torch.equal(stats.top_k_val.view(S, k), logits.gather(1, stats.top_k_idx.view(S, k)))
    h = hidden.clone().requires_grad_()
    coef = torch.randn(S, k, generator=g)
    idx = stats.top_k_idx.view(S, k)
    (CandidateLogits.apply(h, head, idx, stats.top_k_val.view(S, k)) * coef).sum().backward()
    want = torch.einsum("sk,skh->sh", coef, head[idx].float())
    torch.testing.assert_close(h.grad, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_the_hidden_projection_runs_in_a_bfloat16_heads_dtype(monkeypatch):
    """With a bfloat16 head the selector's projection h · P is a bfloat16 product (as the block loss's logits and an
    engine's bf16 weights), returned in bfloat16 (the pair scores read it as float32); with a float32 head it stays
    float32."""
    g = torch.Generator().manual_seed(3)
    sel = CandidateSelector(32, 500, 24, 16)
    hidden = torch.randn(10, 32, generator=g)
    low = sel.project(hidden, torch.bfloat16)
    want = hidden.bfloat16() @ sel.hidden_projection.weight.bfloat16().T
    assert low.dtype == torch.bfloat16 and torch.equal(low, want)
    assert torch.equal(sel.project(hidden), sel.hidden_projection(hidden))
    seen = []
    real = CandidateSelector.project
    monkeypatch.setattr(CandidateSelector, "project", lambda self, h, dtype=None: seen.append(dtype) or real(self, h, dtype))
    N, K, V = 3, 5, 500
    labels = torch.randint(0, V, (N, K), generator=g)
    for head_dtype, want_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, None)):
        head = (torch.randn(V, 32, generator=g) / 4).to(head_dtype)
        selector_terms(torch.randn(N, K, 32, generator=g), head, labels, labels[:, 0], sel, lambda x: x)
        assert seen[-1] == want_dtype
