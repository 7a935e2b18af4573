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


@pytest.mark.parametrize("S,V,r,k", [(70, 50, 24, 5), (64, 300, 256, 16)])
def test_triton_pair_scores_match_the_torch_ones_and_float64(S, V, r, k, monkeypatch):
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
