"""DFlash 2's pair scores in Triton (`dflash.drafter.selector_triton`) against the torch `GatheredDots` and a float64
reference: values and both gradients, with repeated ids (a frequent token), a rank that is not a power of two and
a partial last row block. Runs on a CUDA GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with
Triton installed); skipped elsewhere (the CPU-only CI machine has no Triton)."""
import pytest
import torch

from dflash.drafter import selector, selector_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not selector_triton.available(torch.zeros(1, device=DEVICE)),
                                reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")


def _grads(gate, table, idx, w, triton: bool, monkeypatch):
    monkeypatch.setattr(selector, "TRITON_PAIR_SCORES", triton)
    g, t = gate.detach().clone().requires_grad_(), table.detach().clone().requires_grad_()
    out = selector.GatheredDots.apply(g, t, idx)
    (out * w).sum().backward()
    return out.detach(), g.grad, t.grad


@pytest.mark.parametrize("copies_bytes", [0, 1 << 26])  # the table's gradient in one copy; in 16 added up
@pytest.mark.parametrize("S,V,r,k", [(70, 50, 24, 5), (64, 300, 256, 16)])
def test_triton_pair_scores_match_the_torch_ones_and_float64(S, V, r, k, copies_bytes, monkeypatch):
    monkeypatch.setattr(selector_triton, "TABLE_COPIES_BYTES", copies_bytes)
    gen = torch.Generator().manual_seed(S + r)
    gate = torch.randn(S, r, generator=gen).to(DEVICE)
    table = torch.randn(V, r, generator=gen).to(DEVICE)
    idx = torch.randint(0, V, (S, k), generator=gen)
    idx[:, 0] = 3  # one id a candidate at every position: many adds into one row
    idx = idx.to(DEVICE)
    w = torch.randn(S, k, generator=gen).to(DEVICE)
    tri = _grads(gate, table, idx, w, True, monkeypatch)
    ref = _grads(gate, table, idx, w, False, monkeypatch)
    g64, t64 = gate.double().requires_grad_(), table.double().requires_grad_()
    out64 = torch.einsum("skr,sr->sk", t64[idx], g64)
    (out64 * w.double()).sum().backward()
    for got, want, exact in zip(tri, (out64, g64.grad, t64.grad), ref):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
    assert tri[2][~torch.isin(torch.arange(V, device=DEVICE), idx)].eq(0).all()  # rows no candidate names


def _pair_grads(sel, proj, pred_ids, cand, w, fused: bool, monkeypatch):
    monkeypatch.setattr(selector, "TRITON_FUSED_GATE", fused)
    sel.zero_grad()
    p = proj.detach().clone().requires_grad_()
    out = sel.pair_scores(None, pred_ids, cand, p)
    (out * w).sum().backward()
    return out.detach(), p.grad, sel.predecessor_codebook.grad.clone(), sel.successor_codebook.grad.clone()


@pytest.mark.parametrize("proj_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copies_bytes", [0, 1 << 26])
@pytest.mark.parametrize("S,V,r,k", [(70, 50, 24, 5), (64, 300, 256, 16)])
def test_pair_scores_with_the_gate_made_in_the_kernels(S, V, r, k, copies_bytes, proj_dtype, monkeypatch):
    """`PairScores` (the gate pred[a] ⊙ proj made in the kernels, its gradient sent to proj and pred's rows) against
    the gate as a torch product (`GatheredDots`) and float64: the scores and all three gradients, with a frequent
    predecessor and candidate, the projection float32 or bf16 (its gradient then bf16, as autograd rounds it)."""
    monkeypatch.setattr(selector_triton, "TABLE_COPIES_BYTES", copies_bytes)
    gen = torch.Generator().manual_seed(S + r)
    sel = selector.CandidateSelector(8, V, r, k).to(DEVICE)
    proj = torch.randn(S, r, generator=gen).to(proj_dtype).to(DEVICE)
    pred_ids = torch.where(torch.rand(S, generator=gen) < 0.6, 3, torch.randint(0, V, (S,), generator=gen)).to(DEVICE)
    cand = torch.randint(0, V, (S, k), generator=gen)
    cand[:, 0] = 3
    cand = cand.to(DEVICE)
    w = torch.randn(S, k, generator=gen).to(DEVICE)
    fused = _pair_grads(sel, proj, pred_ids, cand, w, True, monkeypatch)
    plain = _pair_grads(sel, proj, pred_ids, cand, w, False, monkeypatch)
    p64 = proj.double().requires_grad_()
    pred64, succ64 = (t.detach().double().requires_grad_() for t in (sel.predecessor_codebook, sel.successor_codebook))
    out64 = (succ64[cand] * (pred64[pred_ids] * p64)[:, None, :]).sum(-1)
    (out64 * w.double()).sum().backward()
    assert fused[1].dtype == proj_dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[proj_dtype]  # bf16: the rounding of proj's gradient
    for got, exact, want in zip(fused, plain, (out64, p64.grad, pred64.grad, succ64.grad)):
        torch.testing.assert_close(got, exact, rtol=tol, atol=1e-4)
        torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=1e-4 + tol * float(want.detach().abs().max()))
    unused = ~torch.isin(torch.arange(V, device=DEVICE), pred_ids)
    assert fused[2][unused].eq(0).all()  # rows no predecessor names


def test_pair_scores_make_only_the_gradients_asked_for(monkeypatch):
    monkeypatch.setattr(selector, "TRITON_FUSED_GATE", True)
    sel = selector.CandidateSelector(8, 30, 16, 4).to(DEVICE)
    sel.predecessor_codebook.requires_grad_(False)
    proj = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    prev = torch.randint(0, 30, (40,), device=DEVICE)
    cand = torch.randint(0, 30, (40, 4), device=DEVICE)
    sel.pair_scores(None, prev, cand, proj).sum().backward()
    torch.testing.assert_close(proj.grad, sel.successor_codebook[cand].sum(1) * sel.predecessor_codebook[prev])
    assert sel.predecessor_codebook.grad is None and sel.successor_codebook.grad is not None
    empty = sel.pair_scores(None, prev[:0], cand[:0], proj[:0].detach().requires_grad_())
    assert empty.shape == (0, 4)


def test_only_the_gradients_asked_for_are_made(monkeypatch):
    monkeypatch.setattr(selector, "TRITON_PAIR_SCORES", True)
    gate = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    table = torch.randn(30, 16, device=DEVICE)  # frozen
    idx = torch.randint(0, 30, (40, 4), device=DEVICE)
    selector.GatheredDots.apply(gate, table, idx).sum().backward()
    torch.testing.assert_close(gate.grad, table[idx].sum(1))
    assert table.grad is None


def test_other_dtypes_take_the_torch_path():
    assert not selector_triton.available(torch.zeros(2, dtype=torch.bfloat16, device=DEVICE))
    assert not selector_triton.available(torch.zeros(2, dtype=torch.float64, device=DEVICE))


def test_no_rows_give_empty_scores_and_zero_gradients(monkeypatch):
    monkeypatch.setattr(selector, "TRITON_PAIR_SCORES", True)
    gate = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    table = torch.randn(30, 16, device=DEVICE, requires_grad=True)
    out = selector.GatheredDots.apply(gate, table, torch.zeros(0, 4, dtype=torch.long, device=DEVICE))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert gate.grad.shape == (0, 16) and table.grad.eq(0).all()


@pytest.mark.parametrize("N,K,V,r,k", [(37, 16, 512, 256, 16), (5, 7, 300, 24, 4)])
def test_greedy_walk_kernel_is_the_torch_walk(N, K, V, r, k, monkeypatch):
    """`selector_triton.greedy_walk` (one launch) against `walk_candidates`' torch loop: the same path and scores;
    a tie of two best candidates goes to the first, as torch.argmax."""
    gen = torch.Generator().manual_seed(N)
    sel = selector.CandidateSelector(32, V, r, k).to(DEVICE)
    hidden = torch.randn(N, K, 32, generator=gen).to(DEVICE)
    unary = torch.randn(N, K, k, generator=gen).to(DEVICE)
    cand = torch.randint(0, V, (N, K, k), generator=gen).to(DEVICE)
    cand[0, :, 1] = cand[0, :, 0]  # the same id twice: equal scores, the first wins
    unary[0, :, 1] = unary[0, :, 0] = 50.0
    anchor = torch.randint(0, V, (N,), generator=gen).to(DEVICE)
    with torch.no_grad():
        fast = sel.walk_candidates(hidden, unary, cand, anchor)
        monkeypatch.setattr(selector, "TRITON_WALK", False)
        slow = sel.walk_candidates(hidden, unary, cand, anchor)
    assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.tokens[0], cand[0, :, 0])
    torch.testing.assert_close(fast.scores, slow.scores, rtol=1e-5, atol=1e-5)
    assert fast.scores.dtype == slow.scores.dtype and fast.candidates is cand
    empty = sel.walk_candidates(hidden[:0], unary[:0], cand[:0], anchor[:0])
    assert empty.tokens.shape == (0, K) and empty.scores.shape == (0, K, k)


@pytest.mark.parametrize("S,k,V,r,dtype", [(70, 16, 300, 384, torch.bfloat16), (9, 4, 50, 5120, torch.bfloat16),
                                           (33, 8, 64, 256, torch.float32)])
def test_weighted_rows_is_the_embedding_bag_in_float32(S, k, V, r, dtype):
    """Σ_j w_sj table[idx_sj] in float32 from a table of any dtype: the float64 bag of the same (rounded) inputs
    to float32 rounding; the bag in the table's dtype within that dtype's rounding."""
    gen = torch.Generator().manual_seed(S)
    table = torch.randn(V, r, generator=gen).to(dtype).to(DEVICE)
    idx = torch.randint(0, V, (S, k), generator=gen).to(DEVICE)
    idx[0] = 7  # one id k times
    w = torch.randn(S, k, generator=gen).to(dtype).to(DEVICE)
    got = selector_triton.weighted_rows(idx, w, table)
    assert got.dtype == torch.float32 and got.shape == (S, r)
    exact = torch.nn.functional.embedding_bag(idx, table.double(), per_sample_weights=w.double(), mode="sum")
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    assert selector_triton.weighted_rows(idx[:0], w[:0], table).shape == (0, r)


@pytest.mark.parametrize("S,H,V,dtype", [(70, 384, 300, torch.bfloat16), (9, 5120, 50, torch.bfloat16),
                                         (33, 64, 80, torch.float32)])
def test_gold_logits_kernel_is_the_float32_product_rounded_as_the_block_pass(S, H, V, dtype):
    """`selector_loss.gold_logits` through `selector_triton.dots` (one id a row: the gold token's head row): the
    float32 sum of the head-dtype products, rounded to a bf16 head's dtype, as its torch line computes it."""
    from dflash.training.selector_loss import gold_logits
    gen = torch.Generator().manual_seed(S)
    hidden = torch.randn(S, H, generator=gen).to(DEVICE)
    head = (torch.randn(V, H, generator=gen) / 4).to(dtype).to(DEVICE)
    gold = torch.randint(0, V, (S,), generator=gen).to(DEVICE)
    got = gold_logits(hidden, head, gold)
    exact = (hidden.to(dtype).double() * head[gold].double()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (S,)
    if dtype == torch.bfloat16:  # both rounded to bf16: equal, or one bf16 step apart where the float32 sums round apart
        torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=2 ** -7, atol=1e-6)
    else:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
