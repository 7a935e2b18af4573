"""`dflash.training.topk_triton`: the top-k's steps 2 and 3 in one Triton kernel, against torch.topk.

Runs on a CUDA GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton installed; the
interpreter needs numpy < 2.3); skipped elsewhere (the CPU-only CI machine has no Triton)."""
from __future__ import annotations

import pytest
import torch

from dflash.training import topk, topk_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not topk_triton.supports(torch.zeros(1, 64, device=DEVICE), torch.zeros(1, 8, device=DEVICE), 4),
    reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")


def _case(C: int, V: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(C, V, generator=gen).to(dtype)
    x[0] = 0.0  # every logit tied
    x[1, 100:140] = x[1].max()  # 40 ties at the maximum: more than k
    x[2] = -x[2].abs()  # negative values only (their bits order the other way)
    x[3, -3:] = 50.0  # the best at the row's end
    g = topk.group_size(V, k)
    return x.to(DEVICE), g


@pytest.mark.parametrize("C,V,k,dtype", [(37, 4096, 16, torch.bfloat16),    # the reference shapes' rows, blocks of 16 rows
                                         (5, 248320, 16, torch.bfloat16),   # 3,880 groups of 64: padded to 4,096
                                         (9, 4096, 16, torch.float32), (6, 1024, 8, torch.float16)])
def test_kernel_gives_torch_topk_values_and_ids_that_hold_them(C, V, k, dtype):
    x, g = _case(C, V, k, dtype, V + C)
    group_max = x.unflatten(1, (V // g, g)).amax(-1)
    assert topk_triton.supports(x, group_max, k)
    vals, ids = topk_triton.top_k_of_groups(x, group_max, k)
    assert vals.dtype == x.dtype and ids.dtype == torch.int64
    assert torch.equal(vals, x.topk(k, dim=-1).values)  # bit for bit, largest first
    assert torch.equal(x.gather(1, ids), vals)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids
    assert ids[0].tolist() == list(range(k)) and ids[1].tolist() == list(range(100, 100 + k))  # ties: lower id first
    assert ids[3, :3].sort().values.tolist() == [V - 3, V - 2, V - 1]


def test_top_k_of_groups_takes_the_kernel_with_the_torch_steps_values(monkeypatch):
    x, g = _case(20, 4096, 16, torch.bfloat16, 1)
    group_max = x.unflatten(1, (4096 // g, g)).amax(-1)
    fast = topk.top_k_of_groups(x, group_max, 16)
    monkeypatch.setattr(topk, "TRITON_SECOND_PASS", False)
    slow = topk.top_k_of_groups(x, group_max, 16)
    assert torch.equal(fast[0], slow[0]) and torch.equal(x.gather(1, fast[1]), slow[0])


def test_supports_refuses_what_the_kernel_cannot_take():
    x = torch.zeros(4, 4096, device=DEVICE)
    assert not topk_triton.supports(x, torch.zeros(4, 256, device=DEVICE), 12)  # k not a power of two
    assert not topk_triton.supports(x, torch.zeros(4, 8, device=DEVICE), 16)  # fewer groups than k
    assert not topk_triton.supports(x, torch.zeros(4, 4096 // 3 + 1, device=DEVICE), 4)  # groups that do not split V
    assert not topk_triton.supports(x[:, ::2], torch.zeros(4, 128, device=DEVICE), 16)  # strided rows


def test_no_rows_no_launch():
    vals, ids = topk_triton.top_k_of_groups(torch.zeros(0, 4096, device=DEVICE), torch.zeros(0, 256, device=DEVICE), 16)
    assert vals.shape == ids.shape == (0, 16)


def test_rows_of_many_groups_keep_the_torch_steps(monkeypatch):
    """More than TRITON_MAX_GROUPS groups a row (the 27B vocabulary: measured slower in the kernel) take the torch
    steps; as many or fewer take the kernel."""
    calls = []
    real = topk_triton.top_k_of_groups
    monkeypatch.setattr(topk_triton, "top_k_of_groups", lambda *a: calls.append(a[1].shape[1]) or real(*a))
    for n in (256, 2048):
        x = torch.randn(3, n * 16, device=DEVICE)
        vals, _ = topk.top_k_of_groups(x, x.unflatten(1, (n, 16)).amax(-1), 16)
        assert torch.equal(vals, x.topk(16, dim=-1).values)
    assert calls == [256]
