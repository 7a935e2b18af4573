"""DFlash 2's convolution in Triton (`dflash.drafter.conv_triton`) against the torch ops of `convolve` and a float64
reference: both convolutions' outputs (the second added to a stream) and the gradients of their inputs, the stream,
the base kernel and the kernel projection (through the dynamic values, read in place in the projection's layout, each
convolution's gradient written in it), for K = 2 and 3 taps, blocks shorter than a row tile, widths that are not a
multiple of the channel tile, groups of 16 and 8, bf16 and float32; row-strided inputs; `torch.compile`; autocast;
int64 offsets. These run on a CUDA GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton
installed), and skip elsewhere. The last test compiles both kernels to an sm_90 cubin wherever Triton is installed
(no GPU needed), which the interpreter does not."""
import os

import pytest
import torch

from dflash.drafter import conv, conv_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not conv_triton.available(torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 1, device=DEVICE), 16),
    reason="needs Triton on a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")


def _layer(H, K, G, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = conv.GroupedDynamicCausalConv(H, K, G)
    with torch.no_grad():  # away from the identity start, so every tap and the dynamic part matter
        layer.base_kernel.copy_(torch.randn(2, K, H, generator=gen))
        layer.kernel_projection.weight.copy_(torch.randn(layer.kernel_projection.weight.shape, generator=gen) * 0.05)
    return layer.to(DEVICE)


def _run(layer, x, y, stream, w, triton: bool, monkeypatch):
    """Both convolutions on inputs of their own (so neither path's rounding in the first reaches the second):
    prepare(x), and finish(y, dyn, stream) with x's dynamic values; the gradients of x (through prepare and the
    dynamic values), y, the stream, the base kernel and the projection."""
    monkeypatch.setattr(conv, "TRITON_CONV", triton)
    layer.zero_grad()
    xg, yg, sg = (t.detach().clone().requires_grad_() for t in (x, y, stream))
    prepared, dyn = layer.prepare(xg)
    out = layer.finish(yg, dyn, sg)
    (prepared.float() * w).sum().add((out.float() * w.flip(0)).sum()).backward()
    return (prepared.detach(), out.detach(), xg.grad, yg.grad, sg.grad, layer.base_kernel.grad.clone(),
            layer.kernel_projection.weight.grad.clone())


@needs_triton
@pytest.mark.parametrize("K,bs,H,G,dtype", [(2, 16, 384, 16, torch.bfloat16), (3, 5, 160, 16, torch.float32),
                                            (2, 16, 200, 8, torch.float32), (2, 1, 64, 16, torch.float32)])
def test_triton_conv_matches_the_torch_ops_and_float64(K, bs, H, G, dtype, monkeypatch):
    layer = _layer(H, K, G, K * bs + H)
    gen = torch.Generator().manual_seed(1)
    x, y, stream, w = (torch.randn(3, 7, bs, H, generator=gen).to(DEVICE) for _ in range(4))
    inputs = [t.to(dtype) for t in (x, y, stream)]
    want = _run(layer.double(), *(t.double() for t in inputs), w.double(), False, monkeypatch)
    layer = layer.float()
    if dtype == torch.bfloat16:
        layer.kernel_projection.to(dtype)  # bf16 activations and dynamic values, a float32 base kernel
    tri = _run(layer, *inputs, w, True, monkeypatch)
    ref = _run(layer, *inputs, w, False, monkeypatch)
    names = ("prepared", "finished", "grad x", "grad y", "grad stream", "grad base", "grad projection")
    for name, a, b, c in zip(names, tri, ref, want):
        assert a.dtype == b.dtype, name
        err_tri = (a.double() - c).abs().max().item()
        err_ref = (b.double() - c).abs().max().item()
        scale = c.abs().max().item()
        assert err_tri <= 1.5 * err_ref + 1e-5 * scale, (name, err_tri, err_ref, scale)
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale)


@needs_triton
def test_strided_input_and_compiled(monkeypatch):
    """Row-strided inputs (every other block of a longer tensor) and the ops under torch.compile give the torch ops'
    outputs and gradients (float32: to rounding); an input without a unit channel stride takes the torch ops."""
    layer = _layer(96, 2, 16, 5)
    gen = torch.Generator().manual_seed(2)
    x, y, stream = (torch.randn(2, 6, 16, 96, generator=gen).to(DEVICE)[:, ::2] for _ in range(3))
    w = torch.randn(2, 3, 16, 96, generator=gen).to(DEVICE)
    assert not conv_triton.available(torch.randn(2, 3, 16, 192, device=DEVICE)[..., ::2], layer.dynamic(x), 16)
    assert conv_triton.available(x, layer.dynamic(x), 16, stream)
    ref = _run(layer, x, y, stream, w, False, monkeypatch)
    tri = _run(layer, x, y, stream, w, True, monkeypatch)
    for a, b in zip(tri, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if DEVICE.type != "cuda":
        return  # torch.compile of a Triton op needs the GPU (the interpreter runs it eagerly only)
    monkeypatch.setattr(conv, "TRITON_CONV", True)
    layer.zero_grad()

    @torch.compile
    def both(x, y, stream):
        prepared, dyn = layer.prepare(x)
        return prepared, layer.finish(y, dyn, stream)

    xg, yg, sg = (t.detach().clone().requires_grad_() for t in (x, y, stream))
    prepared, out = both(xg, yg, sg)
    (prepared * w).sum().add((out * w.flip(0)).sum()).backward()
    got = (prepared, out, xg.grad, yg.grad, sg.grad, layer.base_kernel.grad, layer.kernel_projection.weight.grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)


@needs_triton
def test_identity_start_is_exact(monkeypatch):
    layer = conv.GroupedDynamicCausalConv(128, 2, 16).to(DEVICE)
    layer.kernel_projection.bfloat16()
    x = torch.randn(2, 4, 16, 128, device=DEVICE).bfloat16()
    monkeypatch.setattr(conv, "TRITON_CONV", True)
    prepared, dyn = layer.prepare(x)
    assert torch.equal(prepared, x) and torch.equal(layer.finish(x, dyn), x)
    assert torch.equal(layer.finish(x, dyn, x.float()), 2 * x.float())


@needs_triton
@pytest.mark.parametrize("triton", [True, False])
def test_prepare_under_autocast_writes_the_autocast_dtype(triton, monkeypatch):
    """Under autocast `prepare` returns autocast's dtype (its readers, the sublayer's Linears, cast to it anyway):
    the float32 result rounded once, the same values either way; the gradient reaches the float32 input."""
    layer = _layer(64, 2, 16, 3)
    x = torch.randn(2, 3, 16, 64, device=DEVICE, requires_grad=True)
    monkeypatch.setattr(conv, "TRITON_CONV", triton)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        prepared, dyn = layer.prepare(x)
        want = layer.convolve(x, dyn, 0, layer.base_kernel[0])
    assert prepared.dtype == torch.bfloat16 and want.dtype == torch.float32
    torch.testing.assert_close(prepared.float(), want.float(), rtol=8e-3, atol=1e-5)
    prepared.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


@needs_triton
def test_what_the_kernels_take():
    x, d = torch.zeros(4, 96, device=DEVICE), torch.zeros(4, 2, 2, 6, device=DEVICE)
    assert conv_triton.available(x, d, 16) and conv_triton.available(x, d, 32)
    assert not conv_triton.available(x, d, 48)  # not a power of two
    assert not conv_triton.available(x, d, 256)  # a group wider than a program's channels
    assert not conv_triton.available(x.double(), d, 16)  # float64: the references keep the torch ops
    assert not conv_triton.available(x, d, 16, x.double())
    assert not conv_triton.available(x, d, 16, x.t().contiguous().t())  # a stream without unit channel stride


@needs_triton
def test_int64_offsets_give_the_same_results(monkeypatch):
    """The kernels' int64 row offsets (taken where an offset can pass 2**31) compute what the int32 ones do."""
    layer = _layer(128, 2, 16, 7)
    gen = torch.Generator().manual_seed(3)
    x, y, stream, w = (torch.randn(2, 3, 16, 128, generator=gen).to(DEVICE) for _ in range(4))
    narrow = _run(layer, x, y, stream, w, True, monkeypatch)
    monkeypatch.setattr(conv_triton, "_wide", lambda *tensors: True)
    wide = _run(layer, x, y, stream, w, True, monkeypatch)
    for a, b in zip(wide, narrow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wide", [False, True])
def test_kernels_compile_for_an_h100(wide):
    """Both kernels compile to an sm_90 cubin (no GPU needed): the interpreter runs code the compiler refuses (a
    jit helper's two returns of different int widths did)."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the kernels: compile them without TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, consts in ((conv_triton._forward_kernel, dict(RESIDUAL=True)), (conv_triton._backward_kernel,
                                                                                 dict(HALF=1))):
        consts = dict(consts, K=2, G=16, RB=conv_triton.ROWS, NG=conv_triton.CHANNELS // 16, WIDE=wide)
        sig = {n: "constexpr" if n in consts else "*fp32" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
        out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert out.asm["cubin"]
