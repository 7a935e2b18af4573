"""DFlash 2's grouped dynamic causal convolution (dflash/drafter/conv.py) as one Triton kernel forward and one backward.

Why: compiled, the convolution is a handful of Inductor kernels per application: the product and the shifted
product forward; in the backward the input's gradient, the dynamic values' gradient (a sum over each group's G
channels) and the base kernel's (a sum over every position), each reading the activations again. At the 27B shapes
(5 layers, two convolutions each, 4,096 positions × 5,120 channels) DFlash 2's compiled Triton kernels took 6.1 ms
a step more than DFlash 1's (one H100, benchmarks/log/2026-12-06.md). Here, for a tile of ROWS positions ×
COLS channels (whole groups):
- `_forward_kernel`: out[t, c] = Σ_j (base[j, c] + dyn[t, j, c // G]) · x[t − j, c], zero before the block's start;
- `_backward_kernel`, from one read of the output gradient g and the input x: grad_x[t, c] = Σ_j (base[j, c] +
  dyn[t + j, j, c // G]) · g[t + j, c] (positions in the same block), grad_dyn[t, j, q] = Σ_{c in group q}
  g[t, c] · x[t − j, c], and each program's partial Σ_t g[t, c] · x[t − j, c] of the base kernel's gradient, which a
  sum over the row tiles finishes (no atomics: the same result every run).

Products and sums in float32, each output rounded once to its dtype (Inductor's compiled torch ops also compute a
bfloat16 expression in float32; the eager ops round each product: tests hold both to a float64 reference). The
pair is a `torch.library` custom op with its own autograd, so `torch.compile` keeps it whole. Used where Triton
imports and the activations are on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1),
which the tests use.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; the CPU-only dev and CI machines lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ROWS = 32  # positions per program
COLS = 128  # channels per program: whole groups (a multiple of the group size)


def available(x: Tensor, group: int) -> bool:
    """Whether the kernels run on activations `x` [..., bs, H] with groups of `group` channels: not float64 (they
    compute in float32; the float64 references keep the torch ops)."""
    if triton is None or x.dtype == torch.float64 or COLS % group or x.shape[-1] % group:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, dyn_ptr, base_ptr, out_ptr, T, H, bs, Hg, K: tl.constexpr, G: tl.constexpr,
                        RB: tl.constexpr, CB: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
        cols = tl.program_id(1) * CB + tl.arange(0, CB)
        t = rows % bs
        ok = (rows < T)[:, None] & (cols < H)[None, :]
        acc = tl.zeros((RB, CB), dtype=tl.float32)
        for j in tl.static_range(K):
            xv = tl.load(x_ptr + (rows - j)[:, None] * H + cols[None, :], mask=ok & (t >= j)[:, None], other=0.0)
            d = tl.load(dyn_ptr + rows[:, None] * (K * Hg) + j * Hg + (cols // G)[None, :], mask=ok, other=0.0)
            b = tl.load(base_ptr + j * H + cols, mask=cols < H, other=0.0)
            acc += (b.to(tl.float32)[None, :] + d.to(tl.float32)) * xv.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _backward_kernel(g_ptr, x_ptr, dyn_ptr, base_ptr, gx_ptr, gdyn_ptr, gbase_ptr, T, H, bs, Hg,
                         K: tl.constexpr, G: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
        cols = tl.program_id(1) * CB + tl.arange(0, CB)
        groups = tl.program_id(1) * (CB // G) + tl.arange(0, CB // G)
        t = rows % bs
        row_ok = rows < T
        ok = row_ok[:, None] & (cols < H)[None, :]
        g = tl.load(g_ptr + rows[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        gx = tl.zeros((RB, CB), dtype=tl.float32)
        for j in tl.static_range(K):
            b = tl.load(base_ptr + j * H + cols, mask=cols < H, other=0.0).to(tl.float32)
            later = ok & (t + j < bs)[:, None]  # position t + j, in the same block, took x[t] with tap j
            gl = tl.load(g_ptr + (rows + j)[:, None] * H + cols[None, :], mask=later, other=0.0).to(tl.float32)
            dl = tl.load(dyn_ptr + (rows + j)[:, None] * (K * Hg) + j * Hg + (cols // G)[None, :], mask=later,
                         other=0.0).to(tl.float32)
            gx += (b[None, :] + dl) * gl
            xv = tl.load(x_ptr + (rows - j)[:, None] * H + cols[None, :], mask=ok & (t >= j)[:, None],
                         other=0.0).to(tl.float32)
            prod = g * xv  # [RB, CB]: tap j's product, summed per group (dyn) and per channel (base)
            gd = tl.sum(tl.reshape(prod, (RB, CB // G, G)), axis=2)
            tl.store(gdyn_ptr + rows[:, None] * (K * Hg) + j * Hg + groups[None, :],
                     gd.to(gdyn_ptr.dtype.element_ty), mask=row_ok[:, None] & (groups < Hg)[None, :])
            tl.store(gbase_ptr + tl.program_id(0).to(tl.int64) * (K * H) + j * H + cols, tl.sum(prod, axis=0),
                     mask=cols < H)
        tl.store(gx_ptr + rows[:, None] * H + cols[None, :], gx.to(gx_ptr.dtype.element_ty), mask=ok)

    def _grid(T: int, H: int) -> tuple[int, int]:
        return triton.cdiv(T, ROWS), triton.cdiv(H, COLS)


@torch.library.custom_op("dflash::dynamic_conv", mutates_args=())
def dynamic_conv(x: Tensor, dyn: Tensor, base: Tensor, group: int) -> Tensor:
    """Σ_j (base[j] + dyn[..., t, j, c // group]) ⊙ x[..., t − j, c] along the block axis (-2): x [..., bs, H]
    contiguous, dyn [..., bs, K, H / group] contiguous, base [K, H]."""
    H, bs, K = x.shape[-1], x.shape[-2], base.shape[0]
    out = torch.empty_like(x)
    T = x.numel() // H
    _forward_kernel[_grid(T, H)](x, dyn, base.contiguous(), out, T, H, bs, H // group, K=K, G=group, RB=ROWS,
                                 CB=COLS, num_warps=4)
    return out


@dynamic_conv.register_fake
def _(x: Tensor, dyn: Tensor, base: Tensor, group: int) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dflash::dynamic_conv_backward", mutates_args=())
def dynamic_conv_backward(g: Tensor, x: Tensor, dyn: Tensor, base: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """(grad wrt x, grad wrt dyn, grad wrt base) of `dynamic_conv` for its output gradient g."""
    H, bs, K = x.shape[-1], x.shape[-2], base.shape[0]
    T = x.numel() // H
    grid = _grid(T, H)
    gx, gdyn = torch.empty_like(x), torch.empty_like(dyn)
    gbase_parts = torch.empty(grid[0], K, H, dtype=torch.float32, device=x.device)
    _backward_kernel[grid](g.contiguous(), x, dyn, base.contiguous(), gx, gdyn, gbase_parts, T, H, bs, H // group,
                           K=K, G=group, RB=ROWS, CB=COLS, num_warps=4)
    return gx, gdyn, gbase_parts.sum(0).to(base.dtype)


@dynamic_conv_backward.register_fake
def _(g: Tensor, x: Tensor, dyn: Tensor, base: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(dyn), torch.empty_like(base)


def _setup_context(ctx, inputs, output) -> None:
    x, dyn, base, group = inputs
    ctx.save_for_backward(x, dyn, base)
    ctx.group = group


def _backward(ctx, grad: Tensor):
    x, dyn, base = ctx.saved_tensors
    gx, gdyn, gbase = dynamic_conv_backward(grad, x, dyn, base, ctx.group)
    return gx, gdyn, gbase, None


dynamic_conv.register_autograd(_backward, setup_context=_setup_context)
