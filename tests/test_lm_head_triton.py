"""The Triton hard-label LM-head chunk against the torch chunk and a float64 reference.

Runs on a CUDA GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton installed; the
interpreter needs numpy < 2.3); skipped elsewhere (the CPU-only CI machine has no Triton).
"""
import os

import pytest
import torch

from dflash.training import lm_head_triton
from dflash.training.lm_head_loss import IGNORE_INDEX, fused_position_stats

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter rounds float32 to bf16 by truncation (the GPU rounds to nearest even): twice the error
INTERPRETED = DEVICE.type == "cpu"
pytestmark = pytest.mark.skipif(not lm_head_triton.triton_available(DEVICE),
                                reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")


def _stats(kernel, hidden, head, labels, weights, chunk):
    h = hidden.detach().clone().requires_grad_()
    ce, kl, _, _, p_label, correct, _, _ = fused_position_stats(h, head, labels, None, None, temperature=1.0,
                                                          chunk_size=chunk, kernel=kernel)
    assert kl is None
    (ce * weights).sum().backward()
    return ce.detach(), p_label, correct, h.grad


@pytest.mark.parametrize("V", [5000, 4096, 8193])  # a partial last block, exactly one block, one element over two
def test_triton_chunk_matches_the_torch_chunk_and_float64(V):
    gen = torch.Generator().manual_seed(V)
    C, D = 40, 32
    head = (torch.randn(V, D, generator=gen) * 0.3).bfloat16().to(DEVICE)
    hidden = torch.randn(C, D, generator=gen).to(DEVICE)
    labels = torch.randint(0, V, (C,), generator=gen).to(DEVICE)
    labels[[3, 7, 39]] = IGNORE_INDEX
    weights = torch.linspace(0.5, 1.5, C, device=DEVICE)
    ref = _stats("torch", hidden, head, labels, weights, chunk=16)
    tri = _stats("triton", hidden, head, labels, weights, chunk=16)

    torch.testing.assert_close(tri[0], ref[0], rtol=1e-5, atol=1e-5)  # ce
    torch.testing.assert_close(tri[1], ref[1], rtol=1e-5, atol=1e-6)  # p_label
    assert torch.equal(tri[2], ref[2])  # correct
    assert (tri[0][labels == IGNORE_INDEX] == 0).all() and (tri[3][labels == IGNORE_INDEX] == 0).all()

    # The gradient of both is made from bf16 coefficients: each is as close to the float64 gradient as the other
    # (the exp sums differ in order, so a coefficient can round to the neighbouring bf16 value).
    h64 = hidden.double().requires_grad_()
    logits = h64 @ head.double().T
    valid = labels != IGNORE_INDEX
    ce64 = torch.nn.functional.cross_entropy(logits[valid], labels[valid], reduction="none")
    (ce64 * weights[valid]).sum().backward()
    err_ref = (ref[3].double() - h64.grad).abs().max().item()
    err_tri = (tri[3].double() - h64.grad).abs().max().item()
    assert err_tri <= (4 if INTERPRETED else 1.5) * err_ref + 1e-6, (err_tri, err_ref)


def test_ce_coefficients_are_the_rounded_softmax_minus_the_label():
    gen = torch.Generator().manual_seed(1)
    C, V = 8, 5000
    logits = (torch.randn(C, V, generator=gen) * 3).bfloat16().to(DEVICE)
    labels = torch.randint(0, V, (C,), generator=gen).to(DEVICE)
    labels[2] = IGNORE_INDEX
    lse, _, _, _ = lm_head_triton.row_stats(logits, torch.where(labels == IGNORE_INDEX, 0, labels))
    coef = lm_head_triton.ce_coefficients_(logits.clone(), lse, labels)
    p = torch.softmax(logits.float(), -1)
    valid = labels != IGNORE_INDEX
    p[valid] = p[valid].scatter_add(1, labels[valid, None], torch.full_like(p[valid, :1], -1.0))
    p[~valid] = 0.0
    if INTERPRETED:
        expected = (p.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    else:
        expected = p.bfloat16()
    same = (coef == expected).float().mean().item()
    assert same > 0.999, same  # the rest: exp's last float32 bit moved a value across a rounding boundary
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-30)
    assert ((coef.float() - expected.float()).abs() <= ulp).all()


def test_row_stats_takes_the_first_of_tied_maxima_across_blocks():
    V = 3 * lm_head_triton.BLOCK_V + 17
    logits = torch.zeros(4, V)
    logits[0, [5, 4100, 9000]] = 3.0  # tie across blocks: the first
    logits[1, [9000, 9001]] = 3.0  # tie inside one block
    logits[2, V - 1] = 2.0  # the last element of a partial block
    logits[3] = -torch.arange(V, dtype=torch.float32) / V  # the first element
    logits = logits.bfloat16().to(DEVICE)
    labels = torch.tensor([5, 0, V - 1, 1], device=DEVICE)
    lse, label_logit, argmax, none = lm_head_triton.row_stats(logits, labels)
    assert none is None  # no group maxima unless asked
    assert argmax.tolist() == [5, 9000, V - 1, 0]
    assert argmax.tolist() == logits.float().argmax(-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(label_logit, logits.float().gather(1, labels[:, None]).squeeze(1))


def test_explicit_triton_kernel_without_triton_names_the_key(monkeypatch):
    from dflash.training.losses import LossConfig, validate_loss_config
    monkeypatch.setattr(lm_head_triton, "triton", None)
    with pytest.raises(ValueError, match=r"loss\.lm_head_kernel=triton"):
        validate_loss_config(LossConfig(lm_head_kernel="triton"))
    assert not lm_head_triton.triton_available(DEVICE)


def test_interpreter_flag_is_what_enables_the_cpu():
    assert lm_head_triton.triton_available(torch.device("cpu")) == (os.environ.get("TRITON_INTERPRET") == "1")


def test_triton_chunk_takes_the_top_k_of_its_bf16_logits_before_overwriting_them():
    """DFlash 2's candidates from the Triton chunk: the top-k of the bf16 logits (the torch chunk's values), taken
    before the CE coefficients are written over them, with the gradient as without it."""
    gen = torch.Generator().manual_seed(4)
    C, D, V, k = 24, 32, 5000, 16
    head = (torch.randn(V, D, generator=gen) * 0.3).bfloat16().to(DEVICE)
    hidden = torch.randn(C, D, generator=gen).to(DEVICE)
    labels = torch.randint(0, V, (C,), generator=gen).to(DEVICE)
    stats, grads = lm_head_triton.hard_label_chunk(hidden, head, labels, need_grad=True, top_k=k)
    want = (hidden.to(head.dtype) @ head.T).topk(k, dim=-1)
    got_vals = (hidden.to(head.dtype) @ head.T).gather(1, stats["top_k_idx"])
    assert torch.equal(got_vals, want.values)  # the same values: ties may order their ids differently
    _, plain = lm_head_triton.hard_label_chunk(hidden, head, labels, need_grad=True)
    assert torch.equal(grads["ce"], plain["ce"])


@pytest.mark.parametrize("V", [4096, 5120, 248320 // 4])  # one block; a partial last block; 15 blocks of groups of 32
def test_row_pass_group_maxima_give_the_top_k_of_the_logits(V, monkeypatch):
    """The top-k's first pass made in the row pass (`row_stats`' group maxima) and finished by
    `topk.top_k_of_groups`: the values torch.topk gives, ids that hold them, with ties and the maxima at a block's
    edge; and the chunk's other stats as without it."""
    from dflash.training import topk
    gen = torch.Generator().manual_seed(V)
    C, D, k = 12, 32, 16
    group = lm_head_triton.top_k_group(V, k)
    assert group and V % group == 0 and lm_head_triton.BLOCK_V % group == 0
    head = (torch.randn(V, D, generator=gen) * 0.3).bfloat16().to(DEVICE)
    hidden = torch.randn(C, D, generator=gen).to(DEVICE)
    hidden[:3] = 0.0  # all-tied rows: every logit 0
    labels = torch.randint(0, V, (C,), generator=gen).to(DEVICE)
    logits = hidden.to(head.dtype) @ head.T
    logits[3, -group:] = 9.0  # the best logits in the last group of the last block
    logits[4, lm_head_triton.BLOCK_V - 1] = 9.0  # the last logit of the first block
    _, _, _, group_max = lm_head_triton.row_stats(logits, labels, group)
    assert torch.equal(group_max, logits.unflatten(1, (V // group, group)).amax(-1))
    vals, ids = topk.top_k_of_groups(logits, group_max, k)
    assert torch.equal(vals, logits.topk(k, dim=-1).values)
    assert torch.equal(logits.gather(1, ids), vals)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids
    assert ids[4, 0] == lm_head_triton.BLOCK_V - 1 and (ids[3, :group].sort().values >= V - group).all()

    stats, grads = lm_head_triton.hard_label_chunk(hidden, head, labels, need_grad=True, top_k=k)
    monkeypatch.setattr(topk, "FUSED_FIRST_PASS", False)
    unfused, plain = lm_head_triton.hard_label_chunk(hidden, head, labels, need_grad=True, top_k=k)
    assert torch.equal(stats["top_k_val"], unfused["top_k_val"]) and torch.equal(grads["ce"], plain["ce"])
    for key in ("ce", "p_label", "correct"):
        assert torch.equal(stats[key], unfused[key])


def test_row_stats_refuses_a_group_that_does_not_split_the_rows():
    logits = torch.zeros(2, 5000, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="group 16"):
        lm_head_triton.row_stats(logits, torch.zeros(2, dtype=torch.long, device=DEVICE), 16)
