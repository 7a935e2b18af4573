"""DFlash 2's grouped dynamic causal convolution (`dflash.drafter.conv`) as one Triton kernel forward and one backward.

Why: compiled, the convolution is several Inductor kernels an application; in the backward the input's gradient, the
dynamic values' gradient (a sum over each group's G channels) and the base kernel's (a sum over every position) each
read the activations again, and autograd keeps Inductor's intermediates. At the reference shapes (131,072 positions x
384 channels, 2 layers, 8 applications a step) the compiled kernels took 4.3 ms a step, these 3.3 ms against a floor
of 2.4 ms of reading and writing, and the step's peak fell from 11.5 to 8.4 GiB at the same speed (one H100,
benchmarks/log/2026-12-07.md; `benchmarks/gpu/conv_kernels.py` times both ways and prints that floor).

Each program takes a tile of RB positions x NG whole channel groups, held as [RB, NG, G]: a group's dynamic value
is one [RB, NG] load broadcast over its G channels (no per-channel gather), and the group sums are sums over the last
axis (no reshape):
- `_forward_kernel`: out[t, c] = Σ_j (base[j, c] + dyn[t, j, c // G]) · x[t − j, c], zero before the block's start
  (t − j in the same block of bs positions);
- `_backward_kernel`, from the output gradient g and the input x: grad_x[t, c] = Σ_j (base[j, c] + dyn[t + j, j,
  c // G]) · g[t + j, c] (t + j in the same block), grad_dyn[t, j, q] = Σ_{c in group q} g[t, c] · x[t − j, c], and
  the tile's partial Σ_t g[t, c] · x[t − j, c] of the base kernel's gradient, which a sum over the row tiles
  finishes (no atomics: the same result every run).

Products and sums in float32, each output rounded once to its dtype (as Inductor's compiled torch ops compute a
bfloat16 expression in float32); the base kernel is read in its own dtype (float32 in training), where the torch ops
round it to the dynamic values' dtype first. The pair is a `torch.library` custom op with its own autograd, so
`torch.compile` keeps it whole. What the compiled ops had fused around the convolution is inside the kernels: the
forward adds the layer's stream where given (`finish`) and writes the dtype asked (`prepare` under autocast); the
dynamic values are read in place in the projection's output [.., 2, K, H/G] and their gradient written in that
layout, zeros in the other convolution's half. Used where `conv.TRITON_CONV` is on, Triton imports and the
activations are on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dflash.drafter import selector_triton

try:  # Triton ships with CUDA builds of torch; the CPU-only dev and CI machines lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ROWS = 16  # positions per program
CHANNELS = 128  # channels per program (whole groups: CHANNELS // G of them, a power of two)
WARPS = 4


def available(x: Tensor, dyn: Tensor, group: int, residual: Optional[Tensor] = None) -> bool:
    """Whether the kernels take activations `x` [..., bs, H], dynamic values `dyn` [..., bs, 2, K, H / group] and the
    stream `residual` (like x, or None): Triton runs on them (`selector_triton.runs_on`), none float64 (they compute in
    float32; the float64 references keep the torch ops), the group a power of two of at most CHANNELS, and unit
    channel strides."""
    tensors = (x, dyn) if residual is None else (x, dyn, residual)
    if any(t.dtype == torch.float64 or t.stride(-1) != 1 for t in tensors):
        return False
    if group > CHANNELS or group & (group - 1) or x.shape[-1] % group:
        return False
    return selector_triton.runs_on(*tensors)


if triton is not None:

    @triton.jit
    def _tile_rows(tile, RB: tl.constexpr, WIDE: tl.constexpr):
        """The tile's row numbers: int64 where an offset can pass 2**31 (WIDE), else int32 (cheaper offsets and
        block positions)."""
        if WIDE:
            tile = tile.to(tl.int64)
        return tile * RB + tl.arange(0, RB)

    @triton.jit
    def _forward_kernel(x_ptr, dyn_ptr, base_ptr, res_ptr, out_ptr, T, bs, Hg, sx, sd, sdk, sr, so, sb,
                        K: tl.constexpr, G: tl.constexpr, RB: tl.constexpr, NG: tl.constexpr,
                        RESIDUAL: tl.constexpr, WIDE: tl.constexpr):
        rows = _tile_rows(tl.program_id(0), RB, WIDE)
        grp = tl.program_id(1) * NG + tl.arange(0, NG)
        ch = grp[:, None] * G + tl.arange(0, G)[None, :]  # [NG, G] channel ids
        row_ok = rows < T
        grp_ok = grp < Hg
        t = rows % bs
        acc = tl.zeros((RB, NG, G), dtype=tl.float32)
        for j in tl.static_range(K):
            ok = (row_ok & (t >= j))[:, None, None] & grp_ok[None, :, None]
            xv = tl.load(x_ptr + (rows - j)[:, None, None] * sx + ch[None, :, :], mask=ok, other=0.0)
            d = tl.load(dyn_ptr + rows[:, None] * sd + j * sdk + grp[None, :],
                        mask=row_ok[:, None] & grp_ok[None, :], other=0.0)
            b = tl.load(base_ptr + j * sb + ch, mask=grp_ok[:, None], other=0.0)
            acc += (b.to(tl.float32)[None, :, :] + d.to(tl.float32)[:, :, None]) * xv.to(tl.float32)
        ok = row_ok[:, None, None] & grp_ok[None, :, None]
        if RESIDUAL:  # the stream the sublayer's output joins: added before the one rounding
            acc += tl.load(res_ptr + rows[:, None, None] * sr + ch[None, :, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None, None] * so + ch[None, :, :], acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _backward_kernel(g_ptr, x_ptr, dyn_ptr, base_ptr, gx_ptr, gdyn_ptr, gbase_ptr, T, bs, Hg, H,
                         sg, sx, sd, sdk, sb, HALF: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                         RB: tl.constexpr, NG: tl.constexpr, WIDE: tl.constexpr):
        tile = tl.program_id(0)
        rows = _tile_rows(tile, RB, WIDE)
        grp = tl.program_id(1) * NG + tl.arange(0, NG)
        ch = grp[:, None] * G + tl.arange(0, G)[None, :]
        row_ok = rows < T
        grp_ok = grp < Hg
        t = rows % bs
        ok = row_ok[:, None, None] & grp_ok[None, :, None]
        g = tl.load(g_ptr + rows[:, None, None] * sg + ch[None, :, :], mask=ok, other=0.0).to(tl.float32)
        gx = tl.zeros((RB, NG, G), dtype=tl.float32)
        dyn_ok = row_ok[:, None] & grp_ok[None, :]
        for j in tl.static_range(K):
            b = tl.load(base_ptr + j * sb + ch, mask=grp_ok[:, None], other=0.0).to(tl.float32)
            later = row_ok & (t + j < bs)  # position t + j, in the same block, took x[t] with tap j
            gl = tl.load(g_ptr + (rows + j)[:, None, None] * sg + ch[None, :, :],
                         mask=later[:, None, None] & grp_ok[None, :, None], other=0.0).to(tl.float32)
            dl = tl.load(dyn_ptr + (rows + j)[:, None] * sd + j * sdk + grp[None, :],
                         mask=later[:, None] & grp_ok[None, :], other=0.0).to(tl.float32)
            gx += (b[None, :, :] + dl[:, :, None]) * gl
            xv = tl.load(x_ptr + (rows - j)[:, None, None] * sx + ch[None, :, :],
                         mask=(row_ok & (t >= j))[:, None, None] & grp_ok[None, :, None], other=0.0).to(tl.float32)
            prod = g * xv  # tap j's products: summed per group (dyn) and per channel over the tile (base)
            # the projection's layout [T, 2, K, Hg]: this convolution's half, and zeros in the other
            at = gdyn_ptr + rows[:, None] * (2 * K * Hg) + j * Hg + grp[None, :]
            tl.store(at + HALF * K * Hg, tl.sum(prod, axis=2).to(gdyn_ptr.dtype.element_ty), mask=dyn_ok)
            tl.store(at + (1 - HALF) * K * Hg, tl.zeros((RB, NG), dtype=gdyn_ptr.dtype.element_ty), mask=dyn_ok)
            tl.store(gbase_ptr + tile.to(tl.int64) * (K * H) + j * H + ch, tl.sum(prod, axis=0), mask=grp_ok[:, None])
        tl.store(gx_ptr + rows[:, None, None] * H + ch[None, :, :], gx.to(gx_ptr.dtype.element_ty), mask=ok)


def _grid(T: int, Hg: int, group: int) -> tuple[int, int]:
    return triton.cdiv(T, ROWS), triton.cdiv(Hg, CHANNELS // group)


def _wide(*tensors: Tensor) -> bool:
    """Whether an element offset into one of these can reach 2**31 (the kernels then count in int64)."""
    return any(t.numel() and (t.shape[0] + ROWS) * t.stride(0) >= 1 << 31 for t in tensors)


def _dyn_rows(dyn: Tensor) -> Tensor:
    """The projection's dynamic values [..., bs, 2, K, H / G] as [T, 2, K, H / G] (a view where it can be)."""
    return dyn.flatten(0, -4)


@torch.library.custom_op("dflash::grouped_dynamic_conv", mutates_args=())
def dynamic_conv(x: Tensor, dyn: Tensor, half: int, base: Tensor, group: int, residual: Optional[Tensor],
                 out_dtype: Optional[torch.dtype]) -> Tensor:
    """[residual +] Σ_j (base[j] + dyn[..., t, half, j, c // group]) ⊙ x[..., t − j, c] along the block axis (-2):
    x [..., bs, H], dyn [..., bs, 2, K, H / group] (both convolutions' values, as the projection makes them; any
    strides with a unit channel stride), base [K, H], residual like x or None. The result is contiguous, in out_dtype,
    else the dtype the torch ops give."""
    H, bs, K = x.shape[-1], x.shape[-2], base.shape[0]
    x2, d = x.reshape(-1, H), _dyn_rows(dyn)[:, half]
    dtype = out_dtype or _result_dtype(x, dyn, residual)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    r2 = residual.reshape(-1, H) if residual is not None else x2
    T, Hg = x2.shape[0], H // group
    if T:
        _forward_kernel[_grid(T, Hg, group)](
            x2, d, base, r2, out, T, bs, Hg, x2.stride(0), d.stride(0), d.stride(1), r2.stride(0), out.stride(0),
            base.stride(0), K=K, G=group, RB=ROWS, NG=CHANNELS // group, RESIDUAL=residual is not None,
            WIDE=_wide(x2, d, r2, out), num_warps=WARPS)
    return out.view(x.shape)


def _result_dtype(x: Tensor, dyn: Tensor, residual: Optional[Tensor]) -> torch.dtype:
    dtype = torch.promote_types(x.dtype, dyn.dtype)
    return dtype if residual is None else torch.promote_types(dtype, residual.dtype)


@dynamic_conv.register_fake
def _(x, dyn, half, base, group, residual, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype or _result_dtype(x, dyn, residual))


@torch.library.custom_op("dflash::grouped_dynamic_conv_backward", mutates_args=())
def dynamic_conv_backward(g: Tensor, x: Tensor, dyn: Tensor, half: int, base: Tensor, group: int
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """(grad wrt x, grad wrt dyn [..., bs, 2, K, H / group] contiguous, zero in the other half, grad wrt base) of
    `dynamic_conv` for its output gradient g."""
    H, bs, K = x.shape[-1], x.shape[-2], base.shape[0]
    x2, g2, d = x.reshape(-1, H), g.reshape(-1, H), _dyn_rows(dyn)[:, half]
    T, Hg = x2.shape[0], H // group
    grid = _grid(T, Hg, group)
    gx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    gdyn = torch.empty(T, 2, K, Hg, dtype=dyn.dtype, device=x.device)
    parts = torch.empty(grid[0], K, H, dtype=torch.float32, device=x.device)
    if T:
        _backward_kernel[grid](g2, x2, d, base, gx, gdyn, parts, T, bs, Hg, H, g2.stride(0), x2.stride(0),
                               d.stride(0), d.stride(1), base.stride(0), HALF=half, K=K, G=group, RB=ROWS,
                               NG=CHANNELS // group, WIDE=_wide(g2, x2, d, gdyn.view(T, -1)), num_warps=WARPS)
    return gx.view(x.shape), gdyn.view(dyn.shape), parts.sum(0).to(base.dtype)


@dynamic_conv_backward.register_fake
def _(g, x, dyn, half, base, group):
    return x.new_empty(x.shape), dyn.new_empty(dyn.shape), base.new_empty(base.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, dyn, half, base, group, residual, out_dtype = inputs
    ctx.save_for_backward(x, dyn, base)
    ctx.half, ctx.group, ctx.residual = half, group, residual is not None


def _backward(ctx, grad: Tensor):
    x, dyn, base = ctx.saved_tensors
    gx, gdyn, gbase = dynamic_conv_backward(grad, x, dyn, ctx.half, base, ctx.group)
    # the residual's gradient is the output's (the add is the identity for it)
    return gx, gdyn, None, gbase, None, grad if ctx.residual else None, None


dynamic_conv.register_autograd(_backward, setup_context=_setup_context)
