"""`GroupedDynamicCausalConv`: DFlash 2's short causal convolution around each sublayer of a draft layer.

What it computes (z-lab's reference, `GroupedDynamicCausalConv` in z-lab/dflash `dflash/model.py` at 07ebd93, and the
published checkpoints' tensor shapes; docs/dflash2.md):
- parameters: `base_kernel` [2, K, H] and `kernel_projection` = Linear(H, 2·K·H/G, no bias), K taps, G channels
  per group (K = 2, G = 16 in the published checkpoints);
- the dynamic kernels are projected from the conv's input x (the sublayer's pre-normed input) at every position:
  `kernel_projection(x_t)` → [2, K, H/G], one value per tap and channel group, shared by the group's G channels;
- `prepare(x)` convolves x with kernel 0 (base_kernel[0] + dynamic half 0) before the sublayer;
- `finish(y)` convolves the sublayer's output y with kernel 1 (base_kernel[1] + dynamic half 1);
- causal inside the block only: out_t = Σ_j w_t[j] ⊙ in_{t-j}, tap j the input j positions back (tap 0 the
  position itself: z-lab's offset order, so a published `base_kernel` loads as it is), zeros before the block's
  first position. The engines run the conv over one block's positions at a time; in training every anchor's block
  is convolved on its own, so taps never reach into the previous block.
- identity at initialisation: base_kernel[:, 0] = 1, every other tap 0, kernel_projection 0 (the trainers'
  start: a fresh DFlash 2 layer is the DFlash 1 layer).

Shapes: the block axis is explicit, x [..., bs, H] with bs the block's positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter import conv_triton

# Where Triton runs (a CUDA GPU), `convolve` is conv_triton's kernels, one each way; False: the torch ops below
# everywhere (benchmarks/gpu/conv_kernels.py times both)
TRITON_CONV = True


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden: int, kernel_size: int = 2, group_size: int = 16):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden % group_size:
            raise ValueError(f"GroupedDynamicCausalConv: hidden size {hidden} must be a multiple of the group size "
                             f"{group_size}, and the kernel size ({kernel_size}) >= 1")
        self.hidden, self.kernel_size, self.group_size = hidden, kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * hidden // group_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 (the position itself) 1, the earlier positions' taps and the dynamic part 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def dynamic(self, x_SbH: torch.Tensor) -> torch.Tensor:
        """Both convolutions' dynamic values [..., bs, 2, K, H/G]: one per position, tap and channel group."""
        K, G = self.kernel_size, self.group_size
        return self.kernel_projection(x_SbH).unflatten(-1, (2, K, self.hidden // G))

    def convolve(self, x_SbH: torch.Tensor, dyn: torch.Tensor, half: int, base_KH: torch.Tensor,
                 residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[residual +] Σ_j (base[j] + dyn[..., t, half, j, c // G]) ⊙ x[..., t-j, c] along the block axis (-2),
        zeros before its start; dyn [..., bs, 2, K, H/G] holds both convolutions' values, as `dynamic` makes them. In
        out_dtype where given.

        The channels are viewed as [H/G, G], so a group's value broadcasts over its G channels: the per-channel
        kernels are never a tensor. They were (`repeat_interleave` to [..., bs, 2, K, H]), made before the sublayer
        and kept for `finish`: 2·K activations' worth of memory per conv, written and read again in the backward
        (docs/dflash2.md, "Speed"). The sums and products are the same, in the same order. Where Triton runs (and
        `TRITON_CONV`), one kernel each way computes the same sums (`conv_triton`)."""
        bs, G = x_SbH.shape[-2], self.group_size
        if TRITON_CONV and conv_triton.available(x_SbH, dyn, G, residual):
            return conv_triton.dynamic_conv(x_SbH, dyn, half, base_KH, G, residual, out_dtype)
        dyn_SbKg = dyn[..., half, :, :]
        x_Sbgc = x_SbH.unflatten(-1, (-1, G))
        base_Kgc = base_KH.unflatten(-1, (-1, G)).to(dyn_SbKg.dtype)
        out = (base_Kgc[0] + dyn_SbKg[..., 0, :, None]) * x_Sbgc
        for lag in range(1, min(self.kernel_size, bs)):
            shifted = F.pad(x_Sbgc[..., : bs - lag, :, :], (0, 0, 0, 0, lag, 0))  # position t holds x[t - lag]
            out = out + (base_Kgc[lag] + dyn_SbKg[..., lag, :, None]) * shifted
        out = out.flatten(-2)
        if residual is not None:
            out = residual + out
        return out if out_dtype is None else out.to(out_dtype)

    def prepare(self, x_SbH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x convolved with kernel 0, both convolutions' dynamic values): `finish` takes those of the same input.

        Under autocast the result is in autocast's dtype: its only readers are the sublayer's input projections,
        which autocast casts to that dtype anyway (one rounding of the float32 result either way), so the
        convolution writes it once, at half the bytes."""
        dyn = self.dynamic(x_SbH)
        dev = x_SbH.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        return self.convolve(x_SbH, dyn, 0, self.base_kernel[0], out_dtype=out_dtype), dyn

    def finish(self, y_SbH: torch.Tensor, dyn: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The sublayer's output y convolved with kernel 1, added to `residual` (the layer's stream) where given."""
        return self.convolve(y_SbH, dyn, 1, self.base_kernel[1], residual)
