"""Tests for dflash.training.losses against slow, per-position Python-loop references."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import pytest
import torch

import dflash.training.losses as losses_module
from dflash.training.losses import (
    LOSSES,
    TERMS,
    WEIGHTINGS,
    Loss,
    LossConfig,
    PositionStats,
    block_metrics,
    build_loss,
    compute_position_stats,
    dpace_weights,
    position_decay,
    register_loss,
    streak_weights,
)

ALL_LOSSES = ["hard_ce", "soft_kl", "streak", "soft_kl_streak", "dpace", "lk"]
# Non-default values so that a swapped or ignored hyper-parameter shows up.
CFG = dict(gamma=3.0, temperature=1.7, kl_weight=0.6, alpha=1.3, dpace_a=0.3, lk_eta=2.0)


# --------------------------------------------------------------------------
# Problem construction
# --------------------------------------------------------------------------


def make_problem(topk: int | None, dtype=torch.float64, N=4, K=5, D=8, V=11, seed=0):
    """Random drafter problem with invalid positions and target top-k soft labels.

    Block 0 has an invalid position in the middle, block 1 trailing padding,
    block 3 is fully padded.  Half the valid labels equal the drafter argmax so
    that label probabilities (and streak / D-PACE weights) are far from 1/V.
    """
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, D, generator=g, dtype=torch.float64)
    lm_head = torch.randn(V, D, generator=g, dtype=torch.float64)
    logits = hidden @ lm_head.T
    labels = torch.randint(0, V, (N, K), generator=g)
    use_argmax = torch.rand(N, K, generator=g) < 0.5
    labels = torch.where(use_argmax, logits.argmax(-1), labels)
    labels[0, 2] = -100
    labels[1, -2:] = -100
    labels[3, :] = -100

    target_logits = logits + 1.5 * torch.randn(N, K, V, generator=g, dtype=torch.float64)
    k = V if topk is None else topk
    if k == V:  # full distribution, indices in a random (unsorted) order
        soft_idx = torch.stack([torch.randperm(V, generator=g) for _ in range(N * K)]).reshape(N, K, V)
        soft_vals = target_logits.gather(-1, soft_idx)
    else:
        soft_vals, soft_idx = target_logits.topk(k, dim=-1)
    soft_vals[2, 1, -1] = -math.inf  # a zero-probability target entry at a valid position
    invalid = labels == -100
    soft_vals[invalid] = -math.inf  # padding garbage must not leak NaNs
    soft_idx[invalid] = -100

    hidden = hidden.to(dtype).requires_grad_()
    lm_head = lm_head.to(dtype).requires_grad_()
    return hidden, lm_head, labels, soft_vals.to(dtype), soft_idx


# --------------------------------------------------------------------------
# Slow reference (explicit loops, full logits, independent of the module)
# --------------------------------------------------------------------------


def reference_position_stats(hidden, lm_head, labels, soft_vals, soft_idx, T):
    """Dict (n, k) -> per-position quantities, only for valid positions."""
    N, K, _ = hidden.shape
    out = {}
    for n in range(N):
        for k in range(K):
            label = int(labels[n, k])
            if label == -100:
                continue
            logits = hidden[n, k].double() @ lm_head.double().T
            ce = -torch.log_softmax(logits, dim=-1)[label]
            entry = {"ce": ce, "p": math.exp(-ce.item()), "correct": int(logits.argmax()) == label}
            if soft_vals is not None:
                q = torch.softmax(logits / T, dim=-1)
                p = torch.softmax(soft_vals[n, k].double() / T, dim=-1)
                kl, overlap = 0.0, 0.0
                for j in range(p.shape[0]):
                    q_j = q[int(soft_idx[n, k, j])]
                    if p[j] > 0:
                        kl = kl + p[j] * (torch.log(p[j]) - torch.log(q_j))
                    overlap = overlap + torch.minimum(p[j], q_j)
                entry.update(kl=kl, tv=1.0 - overlap, overlap=float(overlap.detach()))
            out[(n, k)] = entry
    return out


def reference_weights(name, per, N, K, cfg):
    decay = [math.exp(-k / cfg.gamma) for k in range(K)]
    w = {}
    for n in range(N):
        if name in ("streak", "soft_kl_streak"):
            cum = 1.0
            for k in range(K):
                p = per[(n, k)]["p"] if (n, k) in per else 0.0
                w[(n, k)] = decay[k] * (1.0 + cfg.alpha * cum * (1.0 - p))
                cum *= p
        elif name == "dpace":
            ks = [k for k in range(K) if (n, k) in per]
            q_tilde = {k: (1 - cfg.dpace_a) * per[(n, k)]["p"] + cfg.dpace_a for k in ks}
            for j in ks:
                total = 0.0
                for m in ks:
                    if m >= j:
                        total += math.prod(q_tilde[i] for i in ks if i <= m)
                w[(n, j)] = total
        else:
            for k in range(K):
                w[(n, k)] = decay[k]
    return w


def reference_position_loss(name, e, cfg):
    T = cfg.temperature
    if name in ("hard_ce", "streak", "dpace"):
        return e["ce"]
    if name in ("soft_kl", "soft_kl_streak"):
        return cfg.kl_weight * T * T * e["kl"] + (1 - cfg.kl_weight) * e["ce"]
    if name == "lk":
        lam = math.exp(-cfg.lk_eta * e["overlap"])
        return lam * e["kl"] + (1 - lam) * e["tv"]
    raise AssertionError(name)


def reference_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx):
    N, K, _ = hidden.shape
    per = reference_position_stats(hidden, lm_head, labels, soft_vals, soft_idx, cfg.temperature)
    w = reference_weights(name, per, N, K, cfg)
    num, den = 0.0, 0.0
    for pos, e in per.items():
        num = num + w[pos] * reference_position_loss(name, e, cfg)
        den += w[pos]
    return num / den


def module_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx):
    loss_fn = build_loss(cfg)
    stats = compute_position_stats(
        hidden, lm_head, labels,
        soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
        temperature=cfg.temperature, chunk_size=cfg.chunk_size, need_soft=loss_fn.needs_soft,
    )
    return loss_fn.reduce(stats, labels != -100), stats


# --------------------------------------------------------------------------
# Values and gradients against the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("topk", [4, None], ids=["topk4", "fullV"])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_loss_matches_reference_float64(name, topk):
    cfg = LossConfig(name=name, chunk_size=7, **CFG)
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(topk)

    loss, _ = module_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx)
    grads = torch.autograd.grad(loss, (hidden, lm_head))
    ref = reference_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx)
    ref_grads = torch.autograd.grad(ref, (hidden, lm_head))

    assert loss.dtype == torch.float64 and loss.dim() == 0
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    for g, rg in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-12)
    assert grads[0][labels == -100].abs().max() == 0  # padding gets no gradient


@pytest.mark.parametrize("name", ["soft_kl_streak", "lk", "dpace"])
def test_loss_matches_reference_float32(name):
    cfg = LossConfig(name=name, chunk_size=6, **CFG)
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(5, dtype=torch.float32)
    loss, _ = module_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx)
    grads = torch.autograd.grad(loss, (hidden, lm_head))
    ref = reference_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx)
    ref_grads = torch.autograd.grad(ref, (hidden, lm_head))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("topk", [3, None], ids=["topk3", "fullV"])
def test_position_stats_match_reference(topk):
    T = 1.7
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(topk)
    stats = compute_position_stats(
        hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
        temperature=T, chunk_size=4, need_soft=True,
    )
    per = reference_position_stats(hidden, lm_head, labels, soft_vals, soft_idx, T)
    N, K = labels.shape
    for n in range(N):
        for k in range(K):
            if (n, k) not in per:
                for t in (stats.ce, stats.kl, stats.tv, stats.overlap, stats.p_label):
                    assert t[n, k] == 0
                assert not stats.correct[n, k]
                continue
            e = per[(n, k)]
            for field in ("ce", "kl", "tv"):
                torch.testing.assert_close(getattr(stats, field)[n, k], e[field].detach(), rtol=1e-10, atol=1e-12)
            assert stats.overlap[n, k].item() == pytest.approx(e["overlap"], rel=1e-10, abs=1e-12)
            assert stats.p_label[n, k].item() == pytest.approx(e["p"], rel=1e-10)
            assert bool(stats.correct[n, k]) == e["correct"]
    assert stats.ce.requires_grad and stats.kl.requires_grad and stats.tv.requires_grad
    assert not stats.overlap.requires_grad and not stats.p_label.requires_grad
    assert stats.correct.dtype == torch.bool
    assert stats.correct.any()  # the problem does exercise correct predictions


def test_hard_stats_have_no_soft_fields():
    hidden, lm_head, labels, _, _ = make_problem(3)
    stats = compute_position_stats(hidden, lm_head, labels)
    assert stats.kl is None and stats.tv is None and stats.overlap is None
    with pytest.raises(ValueError, match="need_soft"):
        compute_position_stats(hidden, lm_head, labels, need_soft=True)
    with pytest.raises(ValueError, match="soft"):
        build_loss(LossConfig(name="lk")).reduce(stats, labels != -100)


# --------------------------------------------------------------------------
# Chunking and memory
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["soft_kl_streak", "lk", "dpace"])
def test_chunking_invariance(name):
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(4)
    N, K = labels.shape
    results = []
    for chunk_size in (1, 7, N * K, N * K + 13):
        cfg = LossConfig(name=name, chunk_size=chunk_size, **CFG)
        loss, stats = module_loss(name, cfg, hidden, lm_head, labels, soft_vals, soft_idx)
        results.append((loss, stats, torch.autograd.grad(loss, (hidden, lm_head))))
    loss0, stats0, grads0 = results[0]
    for loss, stats, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-14)
        for field in ("ce", "kl", "tv", "overlap", "p_label"):
            a, b = getattr(stats, field), getattr(stats0, field)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        assert torch.equal(stats.correct, stats0.correct)
        for g, g0 in zip(grads, grads0):
            torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("need_soft", [False, True])
def test_full_logits_are_never_saved_for_backward(need_soft):
    """Under checkpointing no [chunk, V] (let alone [N*K, V]) tensor is kept for backward."""
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(4, V=37, D=5)
    V = lm_head.shape[0]
    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = compute_position_stats(
            hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
            chunk_size=3, need_soft=need_soft,
        )
    loss = stats.ce.sum() + (stats.kl.sum() + stats.tv.sum() if need_soft else 0)
    loss.backward()
    assert hidden.grad is not None and lm_head.grad is not None
    assert not any(V in s for s in saved_shapes if s != tuple(lm_head.shape)), saved_shapes


def test_low_precision_inputs_give_float32_stats():
    hidden, lm_head, labels, _, _ = make_problem(3)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = lm_head.detach().bfloat16().requires_grad_()
    stats = compute_position_stats(h16, w16, labels, chunk_size=5)
    assert stats.ce.dtype == torch.float32
    stats.ce.sum().backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    ref = compute_position_stats(h16.detach().double(), w16.detach().double(), labels)
    # A bf16 head multiplies in bf16 (no float32 copy of a 250k-row head): logits carry bf16 rounding.
    torch.testing.assert_close(stats.ce.double(), ref.ce, rtol=2e-2, atol=2e-2)


def test_no_grad_path_skips_checkpoint():
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(4)
    with torch.no_grad():
        stats = compute_position_stats(
            hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx, need_soft=True
        )
    assert not stats.ce.requires_grad and torch.isfinite(stats.kl).all()


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def test_position_decay_endpoints():
    decay = position_decay(6, 2.5, "cpu")
    assert decay.shape == (6,) and decay.dtype == torch.float32
    assert decay[0].item() == 1.0
    assert decay[-1].item() == pytest.approx(math.exp(-5 / 2.5))
    assert (decay[1:] < decay[:-1]).all()


def test_streak_weights_reduce_to_decay_when_alpha_zero():
    p = torch.rand(3, 6, dtype=torch.float64)
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[1, 4:] = False
    w = streak_weights(p, valid, gamma=2.0, alpha=0.0)
    torch.testing.assert_close(w, position_decay(6, 2.0).double().expand(3, 6))


def test_streak_weights_hand_checked():
    p = torch.tensor([[0.5, 0.8, 0.2]], dtype=torch.float64)
    w = streak_weights(p, torch.ones_like(p, dtype=torch.bool), gamma=1e9, alpha=2.0)
    # cum_prev = [1, 0.5, 0.4]
    expected = torch.tensor([[1 + 2 * 1 * 0.5, 1 + 2 * 0.5 * 0.2, 1 + 2 * 0.4 * 0.8]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)


def test_dpace_weights_hand_checked():
    p = torch.tensor([[0.5, 0.8, 0.2]], dtype=torch.float64)
    valid = torch.ones_like(p, dtype=torch.bool)
    # q~ = 0.5 q + 0.5 = [0.75, 0.9, 0.6]; prefix products = [0.75, 0.675, 0.405]
    w = dpace_weights(p, valid, a=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.83, 1.08, 0.405]], dtype=torch.float64))
    # An invalid middle position is skipped in both the product and the sum.
    valid[0, 1] = False
    w = dpace_weights(p, valid, a=0.5)
    torch.testing.assert_close(w[valid], torch.tensor([0.75 + 0.45, 0.45], dtype=torch.float64))


# --------------------------------------------------------------------------
# Registry and config
# --------------------------------------------------------------------------


def test_config_schema():
    fields = {f.name: (f.type, f.default) for f in dataclasses.fields(LossConfig)}
    assert fields == {
        "name": (str, "hard_ce"), "gamma": (float, 7.0), "temperature": (float, 1.0),
        "kl_weight": (float, 0.7), "alpha": (float, 1.0), "dpace_a": (float, 0.5),
        "lk_eta": (float, 3.0), "chunk_size": (int, 0), "lm_head_grad": (str, "fused"), "lm_head_kernel": (str, "auto"),
        "selector_alpha": (float, 1.0),
    }


def test_registry():
    assert set(ALL_LOSSES) <= set(LOSSES)
    soft = {name for name in ALL_LOSSES if LOSSES[name].needs_soft}
    assert soft == {"soft_kl", "soft_kl_streak", "lk"}
    for name in ALL_LOSSES:
        loss = build_loss(LossConfig(name=name))
        assert isinstance(loss, Loss) and isinstance(loss, LOSSES[name])


def test_build_loss_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"loss\.name") as info:
        build_loss(LossConfig(name="nope"))
    assert "nope" in str(info.value) and "hard_ce" in str(info.value)


def test_register_loss_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_loss("hard_ce")(type("Dup", (Loss,), {"position_loss": lambda self, s: s.ce}))


def test_module_does_not_import_hydra():
    tree = ast.parse(inspect.getsource(losses_module))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] in ("hydra", "omegaconf") for name in imported), imported


@pytest.mark.parametrize("path", ["fused", "recompute"])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_loss_computes_its_own_stats_from_the_batch(name, path):
    """loss(hidden [B, N, K, D], head, batch) reads temperature, chunk size and gradient path from its own
    config: the same loss and metrics as stats computed by hand from the flattened blocks."""
    from types import SimpleNamespace
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(4)
    lm_head = lm_head.detach()
    cfg = LossConfig(name=name, chunk_size=7, lm_head_grad=path, **CFG)
    loss_fn = build_loss(cfg)
    N, K, D = hidden.shape
    batch = SimpleNamespace(labels_BNK=labels.reshape(2, N // 2, K),
                            soft_vals_BNKk=soft_vals.reshape(2, N // 2, K, -1),
                            soft_idx_BNKk=soft_idx.reshape(2, N // 2, K, -1))
    loss, metrics = loss_fn(hidden.reshape(2, N // 2, K, D), lm_head, batch)
    stats = compute_position_stats(hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
                                   temperature=cfg.temperature, chunk_size=7, need_soft=loss_fn.needs_soft,
                                   lm_head_grad=path)
    expected = loss_fn.reduce(stats, labels != -100)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(expected, hidden)[0],
                               rtol=1e-12, atol=1e-14)
    for key, value in block_metrics(stats, labels != -100).items():
        torch.testing.assert_close(metrics[key], value)
    if loss_fn.needs_soft:  # the temperature is the loss's own: another T gives another loss
        other = build_loss(dataclasses.replace(cfg, temperature=1.0))(hidden.reshape(2, N // 2, K, D), lm_head, batch)
        assert not torch.isclose(other[0], loss)


def test_losses_are_a_term_and_a_weighting():
    stats_problem = make_problem(4)
    hidden, lm_head, labels, soft_vals, soft_idx = stats_problem
    stats = compute_position_stats(hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
                                   temperature=CFG["temperature"], need_soft=True)
    valid = labels != -100
    schema = {f.name for f in dataclasses.fields(LossConfig)}
    for name in ALL_LOSSES:
        cls = LOSSES[name]
        assert cls.term in TERMS and cls.weighting in WEIGHTINGS, name
        for part in (TERMS[cls.term], WEIGHTINGS[cls.weighting]):
            assert part.config is None or {f.name for f in dataclasses.fields(part.config)} <= schema
    # soft_kl_streak is the soft_kl term under the streak weighting, nothing written again
    cfg = LossConfig(name="soft_kl_streak", **CFG)
    both, soft, streak = (build_loss(dataclasses.replace(cfg, name=n)) for n in ("soft_kl_streak", "soft_kl", "streak"))
    torch.testing.assert_close(both.position_loss(stats), soft.position_loss(stats), rtol=0, atol=0)
    torch.testing.assert_close(both.position_weights(stats, valid), streak.position_weights(stats, valid),
                               rtol=0, atol=0)


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


def test_block_metrics_hand_built():
    T, F = True, False
    correct = torch.tensor([
        [T, T, F, T],  # streak 2
        [F, T, T, T],  # streak 0
        [T, T, T, T],  # last position invalid -> streak 3
        [T, T, T, T],  # fully invalid block -> excluded
    ])
    valid = torch.ones(4, 4, dtype=torch.bool)
    valid[2, 3] = False
    valid[3, :] = False
    zeros = torch.zeros(4, 4)
    stats = PositionStats(ce=zeros, kl=None, tv=None, overlap=None, p_label=zeros, correct=correct)
    m = block_metrics(stats, valid)
    assert all(isinstance(v, torch.Tensor) for v in m.values())
    assert m["acc_per_pos"].shape == (4,) and m["acc"].dim() == 0 and m["streak"].dim() == 0
    torch.testing.assert_close(m["acc_per_pos"], torch.tensor([2 / 3, 1.0, 2 / 3, 1.0]))
    torch.testing.assert_close(m["acc"], torch.tensor(9 / 11))
    torch.testing.assert_close(m["streak"], torch.tensor(5 / 3))
