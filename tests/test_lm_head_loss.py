"""The fused LM-head path (dflash.training.lm_head_loss) against the checkpointed recompute path of dflash.training.losses."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from dflash.training.losses import (
    LOSSES,
    LossConfig,
    block_metrics,
    build_loss,
    compute_position_stats,
)

STAT_FIELDS = ("ce", "kl", "tv", "overlap", "p_label")
# Non-default hyper-parameters, so every loss term carries weight.
CFG = {"gamma": 3.0, "kl_weight": 0.6, "alpha": 1.3, "dpace_a": 0.3, "lk_eta": 2.0}


def make_problem(dtype=torch.float64, N=5, K=7, D=12, V=53, k=6, seed=0):
    """Frozen head (no requires_grad: the fused path applies), hidden requiring grad, top-k soft labels.

    Invalid positions: one in the middle of block 0, trailing padding in block 1, block 3 fully
    padded (soft labels there are garbage: -inf values, -100 indices).  Half the labels are the
    drafter argmax, so that p_label is far from 1/V and `correct` is exercised."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, D, generator=g, dtype=torch.float64)
    lm_head = torch.randn(V, D, generator=g, dtype=torch.float64) / math.sqrt(D) * 3
    logits = hidden @ lm_head.T
    labels = torch.randint(0, V, (N, K), generator=g)
    labels = torch.where(torch.rand(N, K, generator=g) < 0.5, logits.argmax(-1), labels)
    labels[0, 3] = -100
    labels[1, -2:] = -100
    labels[3, :] = -100
    target_logits = logits + 1.5 * torch.randn(N, K, V, generator=g, dtype=torch.float64)
    soft_vals, soft_idx = target_logits.topk(k, dim=-1)
    soft_vals[2, 1, -1] = -math.inf  # a zero-probability target entry at a valid position
    invalid = labels == -100
    soft_vals[invalid] = -math.inf
    soft_idx[invalid] = -100
    hidden = hidden.to(dtype).requires_grad_()
    return hidden, lm_head.to(dtype), labels, soft_vals.to(dtype), soft_idx


def run_loss(name, temperature, path, hidden, lm_head, labels, soft_vals, soft_idx, chunk_size=8):
    """(loss, d loss / d hidden, stats) through ``path``."""
    loss_fn = build_loss(LossConfig(name=name, temperature=temperature, chunk_size=chunk_size, **CFG))
    stats = compute_position_stats(
        hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx, temperature=temperature,
        chunk_size=chunk_size, need_soft=loss_fn.needs_soft, lm_head_grad=path,
    )
    loss = loss_fn.reduce(stats, labels != -100)
    (grad,) = torch.autograd.grad(loss, hidden)
    return loss, grad, stats


# --------------------------------------------------------------------------
# Equivalence with the recompute path
# --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_fused_matches_recompute_float64(name, temperature):
    problem = make_problem()
    assert problem[0].shape[0] * problem[0].shape[1] % 8 != 0  # chunk_size=8 leaves a ragged last chunk
    loss_f, grad_f, stats_f = run_loss(name, temperature, "fused", *problem)
    loss_r, grad_r, stats_r = run_loss(name, temperature, "recompute", *problem)

    torch.testing.assert_close(loss_f, loss_r, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad_f, grad_r, rtol=1e-10, atol=1e-13)
    assert grad_f.dtype == torch.float64 and torch.isfinite(grad_f).all()
    assert grad_f[problem[2] == -100].abs().max() == 0  # padding gets no gradient
    for field in STAT_FIELDS:
        a, b = getattr(stats_f, field), getattr(stats_r, field)
        assert (a is None) == (b is None), field
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert torch.equal(stats_f.correct, stats_r.correct) and stats_f.correct.any()
    # Gradient-carrying fields as before; downstream metrics unchanged.
    assert stats_f.ce.requires_grad and not stats_f.p_label.requires_grad and not stats_f.correct.requires_grad
    if stats_f.kl is not None:
        assert stats_f.kl.requires_grad and stats_f.tv.requires_grad and not stats_f.overlap.requires_grad
    valid = problem[2] != -100
    for key, value in block_metrics(stats_f, valid).items():
        torch.testing.assert_close(value, block_metrics(stats_r, valid)[key])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_each_stat_gradient_separately(temperature):
    """Random cotangents on ce, kl, tv (one at a time and together) give the recompute path's gradient."""
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem()
    g = torch.Generator().manual_seed(1)
    cotangent = {f: torch.randn(labels.shape, generator=g, dtype=torch.float64) for f in ("ce", "kl", "tv")}
    for used in (("ce",), ("kl",), ("tv",), ("ce", "kl", "tv")):
        grads = []
        for path in ("fused", "recompute"):
            stats = compute_position_stats(
                hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
                temperature=temperature, chunk_size=6, need_soft=True, lm_head_grad=path,
            )
            total = sum((getattr(stats, f) * cotangent[f]).sum() for f in used)
            grads.append(torch.autograd.grad(total, hidden)[0])
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-13, msg=f"{used}")


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("layout", ["full_vocab", "repeated_indices"])
def test_fused_matches_recompute_other_soft_layouts(layout, temperature):
    """Soft labels over the whole vocabulary in random order, or top-k lists that repeat an index
    (the label among them): the sparse sums must count every entry as the recompute path does."""
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(k=53 if layout == "full_vocab" else 6)
    if layout == "full_vocab":
        g = torch.Generator().manual_seed(2)
        perm = torch.stack([torch.randperm(53, generator=g) for _ in range(labels.numel())]).reshape(soft_idx.shape)
        soft_vals, soft_idx = soft_vals.gather(-1, perm), soft_idx.gather(-1, perm)
    else:
        valid = labels != -100
        soft_idx[..., 1] = torch.where(valid, labels, soft_idx[..., 1])
        soft_idx[..., 2] = torch.where(valid, labels, soft_idx[..., 2])
        soft_idx[..., 4] = soft_idx[..., 3]
    for name in ("soft_kl", "lk"):
        problem = (hidden, lm_head, labels, soft_vals, soft_idx)
        loss_f, grad_f, stats_f = run_loss(name, temperature, "fused", *problem)
        loss_r, grad_r, stats_r = run_loss(name, temperature, "recompute", *problem)
        torch.testing.assert_close(loss_f, loss_r, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(grad_f, grad_r, rtol=1e-10, atol=1e-13)
        for field in STAT_FIELDS:
            torch.testing.assert_close(getattr(stats_f, field), getattr(stats_r, field), rtol=1e-12, atol=1e-14)


def test_min_ties_split_the_gradient_like_torch_minimum():
    """An exact tie q_0 == p_0 next to a non-tie: torch.minimum gives each side half the gradient.

    Drafter logits [0, 0, -1000, -1000] (q = [1/2, 1/2, 0, 0]) and target top-2 at vocabulary [0, 2]
    with equal values (p = [1/2, 1/2]): both sides compute exp(-log 2), so index 0 ties exactly."""
    D, V = 3, 4
    lm_head = torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lm_head[:, 0] = torch.tensor([0.0, 0.0, -1000.0, -1000.0])
    hidden = torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    labels = torch.zeros(1, 1, dtype=torch.long)
    soft_vals = torch.zeros(1, 1, 2, dtype=torch.float64)
    soft_idx = torch.tensor([[[0, 2]]])
    grads = []
    for path in ("fused", "recompute"):
        stats = compute_position_stats(
            hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
            need_soft=True, lm_head_grad=path,
        )
        p_0 = torch.log_softmax(soft_vals[0, 0], dim=-1)[0].exp()
        assert stats.overlap.item() == p_0.item()  # min(p_0, q_0) + min(p_2, 0) with q_0 == p_0
        grads.append(torch.autograd.grad(stats.tv.sum(), hidden)[0])
    assert grads[1].abs().max() > 1e-3  # the tie does carry gradient
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name", ["hard_ce", "soft_kl", "lk"])
def test_fused_matches_recompute_bfloat16(name, temperature):
    """bf16 hidden and head: both paths multiply in bf16, so they agree up to bf16 rounding."""
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(D=64, V=301, k=8)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = lm_head.bfloat16()
    results = {path: run_loss(name, temperature, path, h16, w16, labels, soft_vals.float(), soft_idx)
               for path in ("fused", "recompute")}
    (loss_f, grad_f, stats_f), (loss_r, grad_r, _) = results["fused"], results["recompute"]
    assert grad_f.dtype == torch.bfloat16 and stats_f.ce.dtype == torch.float32
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-6, atol=1e-6)  # same logits, same stats
    grad_f, grad_r = grad_f.float(), grad_r.float()
    assert (grad_f - grad_r).norm() < 1e-2 * grad_r.norm()  # observed ~4e-3: bf16 rounding of the result
    scale = grad_r.abs().max()
    torch.testing.assert_close(grad_f / scale, grad_r / scale, rtol=0, atol=2e-2)


def test_default_path_is_fused_and_trainable_head_falls_back():
    hidden, lm_head, labels, _, _ = make_problem()
    with FlopCounterMode(display=False) as default:
        torch.autograd.grad(compute_position_stats(hidden, lm_head, labels).ce.sum(), hidden)
    with FlopCounterMode(display=False) as fused:
        torch.autograd.grad(compute_position_stats(hidden, lm_head, labels, lm_head_grad="fused").ce.sum(), hidden)
    assert default.get_total_flops() == fused.get_total_flops()
    # A head that requires grad still gets its gradient (through the recompute path).
    head = lm_head.clone().requires_grad_()
    stats = compute_position_stats(hidden, head, labels, lm_head_grad="fused")
    grad_head = torch.autograd.grad(stats.ce.sum(), head)[0]
    assert grad_head.abs().sum() > 0


# --------------------------------------------------------------------------
# No grad, errors
# --------------------------------------------------------------------------


class _OpRecorder(TorchDispatchMode):
    """Records (op name, output shape) of every aten call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
        self.calls.append((func.overloadpacket.__name__, shape))
        return out


def head_matmuls(recorder: _OpRecorder, V: int, D: int, P: int) -> int:
    """mm calls with the head as an operand: [C, V] logits or [C, D] products (C <= P)."""
    return sum(1 for op, shape in recorder.calls if op in ("mm", "addmm", "matmul")
               and len(shape) == 2 and shape[0] <= P and shape[1] in (V, D))


@pytest.mark.parametrize("need_soft", [False, True])
def test_no_grad_computes_no_gradients(need_soft):
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem()
    V, D = lm_head.shape
    P = labels.numel()
    n_chunks = math.ceil(P / 8)
    for context in (torch.no_grad(), torch.enable_grad()):
        h = hidden if isinstance(context, torch.no_grad) else hidden.detach()  # 2nd: hidden without grad
        with context, _OpRecorder() as rec:
            stats = compute_position_stats(
                h, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx, temperature=2.0,
                chunk_size=8, need_soft=need_soft,
            )
        assert not stats.ce.requires_grad and stats.ce.grad_fn is None
        assert head_matmuls(rec, V, D, P) == n_chunks  # the logits only
        assert not any(op == "_embedding_bag" for op, _ in rec.calls)
        assert torch.isfinite(stats.ce).all() and (not need_soft or torch.isfinite(stats.kl).all())
    # Same stats as with gradients.
    ref = compute_position_stats(hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx,
                                 temperature=2.0, chunk_size=8, need_soft=need_soft)
    torch.testing.assert_close(stats.ce, ref.ce.detach(), rtol=0, atol=0)


def test_unknown_lm_head_grad_raises():
    hidden, lm_head, labels, _, _ = make_problem()
    with pytest.raises(ValueError, match=r"loss\.lm_head_grad") as info:
        compute_position_stats(hidden, lm_head, labels, lm_head_grad="nope")
    assert "nope" in str(info.value) and "fused" in str(info.value) and "recompute" in str(info.value)
    with pytest.raises(ValueError, match=r"loss\.lm_head_grad"):  # even when the head would force recompute
        compute_position_stats(hidden, lm_head.clone().requires_grad_(), labels, lm_head_grad="nope")


# --------------------------------------------------------------------------
# Cost: no logits recompute
# --------------------------------------------------------------------------


def forward_backward_cost(path, need_soft, temperature, chunk_size=8):
    """(total FLOPs, head matmul calls) of one forward + backward."""
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem(D=32, V=257)
    with FlopCounterMode(display=False) as flops, _OpRecorder() as rec:
        stats = compute_position_stats(
            hidden, lm_head, labels, soft_vals_NKk=soft_vals, soft_idx_NKk=soft_idx, temperature=temperature,
            chunk_size=chunk_size, need_soft=need_soft, lm_head_grad=path,
        )
        loss = stats.ce.sum() + (stats.kl.sum() + stats.tv.sum() if need_soft else 0)
        loss.backward()
    V, D = lm_head.shape
    return flops.get_total_flops(), head_matmuls(rec, V, D, labels.numel())


def test_fused_hard_labels_use_two_head_matmuls_per_chunk():
    n_chunks = math.ceil(5 * 7 / 8)
    fused_flops, fused_mm = forward_backward_cost("fused", need_soft=False, temperature=1.0)
    recompute_flops, recompute_mm = forward_backward_cost("recompute", need_soft=False, temperature=1.0)
    assert fused_mm == 2 * n_chunks and recompute_mm == 3 * n_chunks
    assert fused_flops == pytest.approx(2 / 3 * recompute_flops, rel=1e-3)


@pytest.mark.parametrize("temperature, fused_per_chunk", [(1.0, 2), (2.0, 3)])
def test_fused_soft_labels_head_matmuls(temperature, fused_per_chunk):
    """At T = 1 the KL/TV gradients reuse the CE softmax product; T != 1 needs one for softmax(z / T)."""
    n_chunks = math.ceil(5 * 7 / 8)
    _, fused_mm = forward_backward_cost("fused", need_soft=True, temperature=temperature)
    _, recompute_mm = forward_backward_cost("recompute", need_soft=True, temperature=temperature)
    assert fused_mm == fused_per_chunk * n_chunks and recompute_mm == 3 * n_chunks


# --------------------------------------------------------------------------
# The auto chunk size
# --------------------------------------------------------------------------


def test_auto_chunk_size():
    """0 = auto: a power of two of positions whose [chunk, V] logits hold at most 2**28 values; the production
    vocabulary keeps the old fixed 1,024, the reference target's gets 65,536 (on the CPU 2**25 values: 8,192); an
    explicit size is kept."""
    from dflash.target.lm_head import resolve_chunk
    assert resolve_chunk(0, 248_320) == 1024
    assert resolve_chunk(0, 4096) == 65_536
    assert resolve_chunk(0, 4096, "cpu") == 8192
    assert resolve_chunk(0, 10**9) == 64  # never below 64
    assert resolve_chunk(7, 4096) == 7
    hidden, lm_head, labels, soft_vals, soft_idx = make_problem()
    for name in ("hard_ce", "soft_kl"):  # auto (one chunk here) computes what explicit chunks compute
        loss_a, grad_a, _ = run_loss(name, 1.0, "fused", hidden, lm_head, labels, soft_vals, soft_idx, chunk_size=0)
        loss_8, grad_8, _ = run_loss(name, 1.0, "fused", hidden, lm_head, labels, soft_vals, soft_idx, chunk_size=8)
        torch.testing.assert_close(loss_a, loss_8, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad_a, grad_8, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="loss.chunk_size"):
        from dflash.training.losses import validate_loss_config
        validate_loss_config(LossConfig(name="hard_ce", chunk_size=-1))
