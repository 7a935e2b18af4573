"""`BatchedMuon` against `torch.optim.Muon`, the plain reference: the same parameters and momentum buffers after
several steps (matrices of shared and unique shapes, tall and wide, weight decay, Nesterov on and off, a group whose
lr a schedule changed), batches split by BATCH_BYTES, and checkpoints that load both ways."""
import copy

import pytest
import torch

from dflash.training import muon as muon_mod
from dflash.training.muon import BatchedMuon, orthogonalize
from dflash.training.optim import build_optimizer

SHAPES = [(8, 12), (8, 12), (12, 8), (12, 8), (12, 8), (5, 7), (16, 16), (3, 20)]


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _run(cls, steps=4, **kw):
    params = _params()
    opt = cls([{"params": params[:6]}, {"params": params[6:], "lr": 0.03}], lr=0.02, weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize("kw", [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw"}, {"ns_steps": 3}])
def test_the_same_steps_as_torch_muon(kw):
    ref, ref_opt = _run(torch.optim.Muon, **kw)
    got, got_opt = _run(BatchedMuon, **kw)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6)  # float32 parameters; bf16 products summed in one order
    for a, b in zip(ref, got):
        torch.testing.assert_close(got_opt.state[b]["momentum_buffer"], ref_opt.state[a]["momentum_buffer"],
                                   rtol=0, atol=0)
    moved = [not torch.equal(a, b) for a, b in zip(_params(), got)]
    assert all(moved)


def test_orthogonalize_matches_torch_for_each_matrix():
    from torch.optim._muon import _zeropower_via_newtonschulz
    g = torch.Generator().manual_seed(2)
    for shape in [(6, 10), (10, 6), (9, 9)]:
        mats = [torch.randn(shape, generator=g) for _ in range(3)]
        out = orthogonalize(mats, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert out.shape == (3, *shape) and out.dtype == torch.bfloat16
        for m, o in zip(mats, out):
            torch.testing.assert_close(o, _zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7),
                                       rtol=0, atol=1e-2)


def test_batches_split_at_the_byte_cap_and_leave_large_matrices_alone(monkeypatch):
    params = _params()
    assert muon_mod._batches(params) == [[0, 1], [2, 3, 4], [5], [6], [7]]
    monkeypatch.setattr(muon_mod, "BATCH_BYTES", 2 * 12 * 8 * 2)  # two 12 x 8 bf16 matrices a batch
    assert muon_mod._batches(params) == [[0, 1], [2, 3], [4], [5], [6], [7]]
    ref, _ = _run(torch.optim.Muon)
    for a, b in zip(ref, _run(BatchedMuon)[0]):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6)
    monkeypatch.setattr(muon_mod, "BATCH_MAX_ELEMENTS", 95)  # 8 x 12 = 96 elements: one at a time
    assert muon_mod._batches(params) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    for a, b in zip(ref, _run(BatchedMuon)[0]):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6)


def test_checkpoints_load_both_ways():
    _, ref_opt = _run(torch.optim.Muon, steps=2)
    _, got_opt = _run(BatchedMuon, steps=2)
    def groups():
        p = _params()
        return [{"params": p[:6]}, {"params": p[6:]}]

    fresh = BatchedMuon(groups(), lr=0.5)
    fresh.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    back = torch.optim.Muon(groups(), lr=0.5)
    back.load_state_dict(copy.deepcopy(got_opt.state_dict()))
    assert [g["lr"] for g in fresh.param_groups] == [0.02, 0.03] and len(back.state) == len(SHAPES)
    for p, q in zip(fresh.state.values(), ref_opt.state.values()):
        assert torch.equal(p["momentum_buffer"], q["momentum_buffer"])


def test_the_muon_names_build_each_implementation():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    for name, cls in (("muon", BatchedMuon), ("muon_torch", torch.optim.Muon)):
        opt = build_optimizer(name, model, 1e-3, 0.0, 10.0, torch.device("cpu"))
        assert type(opt.parts["muon"]) is cls and set(opt.parts) == {"muon", "adamw"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_same_steps_as_torch_muon_on_a_gpu():
    """cuBLAS's batched and single bf16 products round apart, and five Newton-Schulz iterations carry that on: the
    parameters within 4e-3 after four steps, about a tenth of one step's largest change (lr 0.02-0.03 times
    √1.5 times entries up to about 1; one H100 measured 1.4e-3 at worst); the momentum buffers (float32 lerps, no
    products) to float32 rounding."""
    def run(cls):
        params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
        opt = cls([{"params": params[:6]}, {"params": params[6:], "lr": 0.03}], lr=0.02, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).cuda()
            opt.step()
        return params, opt

    (ref, ref_opt), (got, got_opt) = run(torch.optim.Muon), run(BatchedMuon)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=4e-3)
        torch.testing.assert_close(got_opt.state[b]["momentum_buffer"], ref_opt.state[a]["momentum_buffer"])
