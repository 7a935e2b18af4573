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


class _Launches:
    """Stands in for the kernel and records each launch's NARROW (the key width it took) before launching it."""

    def __init__(self, kernel):
        self.kernel, self.narrow = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.narrow.append(kwargs["NARROW"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def launches(monkeypatch):
    rec = _Launches(topk_triton._top_k_of_groups_kernel)
    monkeypatch.setattr(topk_triton, "_top_k_of_groups_kernel", rec)
    return rec


@pytest.mark.parametrize("C,V,k,dtype,narrow", [
    (37, 4096, 16, torch.bfloat16, True),   # the reference shapes' rows, blocks of 16 rows
    (37, 4096, 16, torch.float16, True),
    (5, 248320, 16, torch.bfloat16, False),  # 3,880 groups of 64: padded to 4,096; ids past 16 bits
    (5, 65536, 16, torch.bfloat16, True),   # the int32 keys' largest vocabulary: the best at ids 65,533 to 65,535
    (5, 65600, 16, torch.bfloat16, False),  # 64 logits more: int64 keys
    (9, 4096, 16, torch.float32, False), (6, 1024, 8, torch.float16, True)])
def test_kernel_gives_torch_topk_values_and_ids_that_hold_them(C, V, k, dtype, narrow, launches):
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
    assert launches.narrow == [narrow]  # int32 keys for 16-bit floats and ids of 16 bits


def test_mixed_dtypes_take_the_int64_keys(launches):
    """bf16 logits with float32 group maxima: the int32 keys hold only the logits' own 16-bit dtype."""
    x, g = _case(7, 4096, 16, torch.bfloat16, 3)
    group_max = x.unflatten(1, (4096 // g, g)).amax(-1).float()
    assert not topk_triton._narrow(x, group_max) and topk_triton._narrow(x, group_max.bfloat16())
    vals, ids = topk_triton.top_k_of_groups(x, group_max, 16)
    assert torch.equal(vals, x.topk(16, dim=-1).values) and torch.equal(x.gather(1, ids), vals)
    assert launches.narrow == [False]


def _both_widths(x, group_max, k, monkeypatch):
    """(values, ids) by the int32 keys, then by the int64 keys (`_narrow` made to refuse)."""
    assert topk_triton._narrow(x, group_max)
    narrow = topk_triton.top_k_of_groups(x, group_max, k)
    monkeypatch.setattr(topk_triton, "_narrow", lambda *a: False)
    return narrow, topk_triton.top_k_of_groups(x, group_max, k)


def _spec_top_k(x, k):
    """The ids the kernel's keys order by: value descending, +0.0 before −0.0 (their bits), then the lower id."""
    by_sign = x.float().signbit().to(torch.int8).sort(dim=-1, stable=True).indices  # +0.0 first, each side by id
    return by_sign.gather(1, x.gather(1, by_sign).float().sort(dim=-1, descending=True, stable=True).indices)[:, :k]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_both_key_widths_order_every_finite_16_bit_float(dtype, monkeypatch):
    """Every finite bf16 / fp16 bit pattern once a row (shuffled), capped so each row's top-16 falls in another part
    of the range (the largest, around 1, the smallest normals, the subnormals, the zeros, the negatives): both key
    widths give torch.topk's values and the ids of a stable sort."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    bits = bits[bits.float().isfinite()]
    fi = torch.finfo(dtype)
    caps = [float("inf"), 1.0, fi.tiny, fi.tiny / 2, fi.smallest_normal * 2 ** -9, 0.0, -fi.tiny, -1.0, -fi.max]
    gen = torch.Generator().manual_seed(0)
    x = torch.full((len(caps), 1 << 16), float("-inf"), dtype=dtype)
    for row, cap in zip(x, caps):
        row[:len(bits)] = bits[torch.randperm(len(bits), generator=gen)]
        row[row.float() > cap] = float("-inf")
    want = _spec_top_k(x, 16).to(DEVICE)
    x = x.to(DEVICE)
    group_max = x.unflatten(1, (1024, 64)).amax(-1)
    # Triton 3.6's interpreter converts bf16 subnormals to float32 wrongly (its _convert_float), which the int64 keys
    # read; a GPU converts them exactly. The int32 keys take the bits as they are.
    exact_wide = DEVICE.type == "cuda" or dtype != torch.bfloat16
    for (vals, ids), exact in zip(_both_widths(x, group_max, 16, monkeypatch), (True, exact_wide)):
        if exact:
            assert torch.equal(ids, want) and torch.equal(vals.view(torch.int16), x.gather(1, want).view(torch.int16))
            assert torch.equal(vals, x.topk(16, dim=-1).values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_signed_zeros_order_as_their_bits_in_both_widths(dtype, monkeypatch):
    """+0.0 above −0.0 (their bits' order; torch.topk counts them equal), then the lower id: both key widths."""
    x = torch.full((2, 1024), -1.0, dtype=dtype)
    x[:, [5, 9]] = -0.0
    x[:, [7, 300]] = 0.0
    x = x.to(DEVICE)
    group_max = x.unflatten(1, (64, 16)).amax(-1)
    for vals, ids in _both_widths(x, group_max, 4, monkeypatch):
        assert ids.tolist() == [[7, 300, 5, 9]] * 2
        assert vals.view(torch.int16).tolist() == x[:, [7, 300, 5, 9]].view(torch.int16).tolist()


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
