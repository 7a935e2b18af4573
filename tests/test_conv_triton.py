"""DFlash 2's convolution in Triton (`dflash.drafter.conv_triton`) against the torch ops of `convolve` and a float64
reference: output and the gradients of the input, the dynamic values and the base kernel, for K = 2 and 3 taps,
blocks shorter than a row tile, a width that is not a multiple of the channel tile, bf16 and float32. Runs on a CUDA
GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton installed); skipped elsewhere."""
import pytest
import torch

from dflash.drafter import conv, conv_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not conv_triton.available(torch.zeros(16, device=DEVICE), 16),
                                reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")


def _run(layer, x, w, triton: bool, monkeypatch):
    monkeypatch.setattr(conv, "TRITON_CONV", triton)
    layer.zero_grad()
    xg = x.detach().clone().requires_grad_()
    prepared, dyn = layer.prepare(xg)
    out = layer.finish(prepared * 1.5, dyn)  # both convolutions, the second on another tensor
    (out.float() * w).sum().backward()
    return out.detach(), xg.grad, layer.base_kernel.grad.clone(), layer.kernel_projection.weight.grad.clone()


@pytest.mark.parametrize("K,bs,H,dtype", [(2, 16, 384, torch.bfloat16), (3, 5, 160, torch.float32)])
def test_triton_conv_matches_the_torch_ops_and_float64(K, bs, H, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(K * bs)
    layer = conv.GroupedDynamicCausalConv(H, K, 16).to(DEVICE)
    with torch.no_grad():  # away from the identity start, so every tap and the dynamic part matter
        layer.base_kernel.copy_(torch.randn(2, K, H, generator=gen))
        layer.kernel_projection.weight.copy_(torch.randn(layer.kernel_projection.weight.shape, generator=gen) * 0.05)
    x = torch.randn(3, 7, bs, H, generator=gen).to(DEVICE)
    w = torch.randn(3, 7, bs, H, generator=gen).to(DEVICE)
    want = _run(layer.double(), x.double(), w.double(), False, monkeypatch)
    layer = layer.to(dtype) if dtype == torch.float32 else layer.float()
    xin = x.to(dtype)
    if dtype == torch.bfloat16:
        layer.kernel_projection.to(dtype)  # bf16 activations and dynamic values, a float32 base kernel
    tri = _run(layer, xin, w, True, monkeypatch)
    ref = _run(layer, xin, w, False, monkeypatch)
    for name, a, b, c in zip(("out", "grad x", "grad base", "grad projection"), tri, ref, want):
        err_tri = (a.double() - c).abs().max().item()
        err_ref = (b.double() - c).abs().max().item()
        scale = c.abs().max().item()
        assert err_tri <= 1.5 * err_ref + 1e-5 * scale, (name, err_tri, err_ref, scale)
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale)


def test_identity_start_is_exact(monkeypatch):
    layer = conv.GroupedDynamicCausalConv(128, 2, 16).to(DEVICE)
    layer.kernel_projection.bfloat16()
    x = torch.randn(2, 4, 16, 128, device=DEVICE).bfloat16()
    monkeypatch.setattr(conv, "TRITON_CONV", True)
    prepared, dyn = layer.prepare(x)
    assert torch.equal(prepared, x) and torch.equal(layer.finish(x, dyn), x)


def test_groups_that_straddle_a_channel_tile_take_the_torch_ops():
    assert not conv_triton.available(torch.zeros(4, 96, device=DEVICE), 48)  # 128 channels a tile: not whole groups
    assert conv_triton.available(torch.zeros(4, 96, device=DEVICE), 32)
