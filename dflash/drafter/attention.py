"""Attention kernels for the drafter's training forward, chosen by `drafter.attn_kernel`.

In training, N blocks of `block_size` query tokens per sequence attend to the context K/V (positions < their
anchor) and to their own block, both directions; blocks never see each other, so each block sees exactly what
it would see when drafted alone at inference (DFlash, arXiv 2602.06036; docs/DESIGN.md, "The drafter").
`training_mask` is that mask as a dense bool tensor; `block_mask_mod` is the same predicate for FlexAttention.

A layer may attend through a sliding window (`LayerAttention`): the published Qwen3.6-27B drafter has 4 such
layers (window 2,048) and one full-attention layer. As the engines run them (SGLang: DECODER attention with a
window of `sliding_window - 1` back; vLLM and z-lab: causal when `layer_types[i] == "sliding_attention"` and no
`is_causal` says otherwise), a windowed layer is also causal inside the block: block token k sees block tokens
0..k and context positions p - j < window, p = anchor + k its own position.

A kernel is three things, looked up once at build time (`attention_kernel`):
  groups_anchors  whether `DFlashDrafter.forward` batches anchors in groups of `drafter.attn_group`
  mask(anchors_BN, ctx_len, block_size, layer)  what `attend` needs, built once per forward for each distinct
                 `LayerAttention` and shared by the layers that have it
  attend(q_BhQd, k_BhKd, v_BhKd, mask, num_heads, num_kv_heads) -> out_BhQd  (K/V may have fewer heads: GQA)

The inference path (one block after a cache) does not come here for full-attention layers: it is plain SDPA
with enable_gqa, whose flash kernel takes GQA natively when there is no mask. Windowed layers at inference use
`training_mask` of their one block over what their cache keeps (`ctx_offset`), through the "sdpa" kernel.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash.registry import Registry


class LayerAttention(NamedTuple):
    """What one layer's block queries see. Full attention (the default): all context before the anchor and the
    whole block. `window`: only keys with position p - j < window (p the query's position), and causal inside
    the block (the engines' rule for sliding-window DFlash layers, see the module docstring) unless
    `window_causal` is False (DFlash 2: its config.json says `is_causal: false`, its windowed layers see the
    whole block)."""
    window: int | None = None
    window_causal: bool = True

    @property
    def causal(self) -> bool:
        return self.window is not None and self.window_causal


FULL_ATTENTION = LayerAttention()


def training_mask(anchors_BN: torch.Tensor, ctx_len: int, block_size: int,
                  layer: LayerAttention = FULL_ATTENTION, ctx_offset: int = 0) -> torch.Tensor:
    """Bool mask [B, N·bs, ctx_len + N·bs]: block n sees context j < anchor_n and its own block, both
    directions inside the block; blocks never see each other. This is exactly what the block sees at
    inference (context = committed features before the anchor), tested against the inference path.
    A windowed `layer` also hides context with anchor_n + k - j >= window and later tokens of its own block.
    `ctx_offset`: the position of the first context key (inference: what a windowed layer's cache still keeps)."""
    B, N = anchors_BN.shape
    dev = anchors_BN.device
    ctx_pos = torch.arange(ctx_len, device=dev) + ctx_offset
    sees_ctx_BNT = ctx_pos[None, None, :] < anchors_BN[:, :, None]
    sees_ctx = sees_ctx_BNT[:, :, None, :].expand(B, N, block_size, ctx_len)
    k_in_block = torch.arange(block_size, device=dev)
    if layer.window is not None:
        q_pos_BNk = anchors_BN[:, :, None] + k_in_block
        sees_ctx = sees_ctx & (q_pos_BNk[..., None] - ctx_pos < layer.window)
    sees_ctx = sees_ctx.reshape(B, N * block_size, ctx_len)
    block_id = torch.arange(N * block_size, device=dev) // block_size  # (no repeat_interleave: older torch syncs)
    sees_blk = block_id[:, None] == block_id[None, :]
    if layer.causal:
        k_of = torch.arange(N * block_size, device=dev) % block_size
        sees_blk = sees_blk & (k_of[None, :] <= k_of[:, None])
    return torch.cat([sees_ctx, sees_blk.expand(B, -1, -1)], dim=-1)


def block_mask_mod(anchors_BN: torch.Tensor, ctx_len: int, block_size: int,
                   layer: LayerAttention = FULL_ATTENTION):
    """`training_mask` as a FlexAttention mask_mod(b, h, q_idx, kv_idx) (same predicate, tested equal)."""
    last_block = anchors_BN.shape[1] - 1
    window, causal = layer.window, layer.causal

    def mask_mod(b, h, q_idx, kv_idx):
        # Clamped: flex has evaluated mask_mods on the padding of a last partial 128-tile (pytorch#137801);
        # those rows are discarded, but the anchors lookup must stay in bounds. A no-op on real rows.
        blk = (q_idx // block_size).clamp(max=last_block)
        anchor = anchors_BN[b, blk]
        sees_ctx = (kv_idx < ctx_len) & (kv_idx < anchor)
        sees_own = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == blk)
        if window is not None:  # windowed layers: context within the window (and causal in the block)
            sees_ctx = sees_ctx & (anchor + q_idx % block_size - kv_idx < window)
        if causal:
            sees_own = sees_own & ((kv_idx - ctx_len) % block_size <= q_idx % block_size)
        return sees_ctx | sees_own

    return mask_mod


class AttentionKernel(Protocol):
    groups_anchors: bool

    def mask(self, anchors_BN: torch.Tensor, ctx_len: int, block_size: int,
             layer: LayerAttention = FULL_ATTENTION) -> Any: ...

    def attend(self, q_BhQd: torch.Tensor, k_BhKd: torch.Tensor, v_BhKd: torch.Tensor, mask: Any,
               num_heads: int, num_kv_heads: int) -> torch.Tensor: ...


class KernelMask(NamedTuple):
    """A training forward's kernel and the mask it built, handed to every layer (the drafter alone holds the
    kernel choice)."""
    kernel: AttentionKernel
    mask: Any


def expand_heads(x_BhSd: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, kv_heads, S, d] → [B, num_heads, S, d], each K/V head serving its num_heads/kv_heads query heads."""
    B, h, S, d = x_BhSd.shape
    return x_BhSd[:, :, None].expand(B, h, num_heads // h, S, d).reshape(B, num_heads, S, d)


class SdpaKernel:
    """SDPA with the dense bool mask. Anchors run in groups (`attn_group`) so each query meets the context and
    its group's blocks, not every block of the sequence: the mask hides the rest but SDPA still computes it.

    expand_kv=False ("sdpa"): K/V keep their 8 heads and SDPA gets enable_gqa; on an H200 with torch 2.11 it
    picks cuDNN's fused attention, which takes both the mask and GQA.
    expand_kv=True ("sdpa_expanded"): K/V copied out to every query head, for SDPA builds whose masked kernels
    lack GQA (older torch falls back to the math kernel there, pytorch/pytorch#139586). Measured side by side in
    benchmarks/RESULTS.md: the copies cost more than they save on the H200."""

    groups_anchors = True

    def __init__(self, expand_kv: bool):
        self.expand_kv = expand_kv

    def mask(self, anchors_BN, ctx_len, block_size, layer=FULL_ATTENTION):
        return training_mask(anchors_BN, ctx_len, block_size, layer)[:, None]  # [B, 1, Q, K]: shared by all heads

    def attend(self, q_BhQd, k_BhKd, v_BhKd, mask, num_heads, num_kv_heads):
        gqa = num_heads != num_kv_heads
        if gqa and self.expand_kv:
            k_BhKd, v_BhKd = expand_heads(k_BhKd, num_heads), expand_heads(v_BhKd, num_heads)
            gqa = False
        return F.scaled_dot_product_attention(q_BhQd, k_BhKd, v_BhKd, attn_mask=mask, enable_gqa=gqa)


_COMPILED: dict[str, Callable] = {}


def _compiled_on_cuda(fn: Callable, device: torch.device) -> Callable:
    """torch.compile(fn) on CUDA, made on first use and kept for the process (one compile cache, not one per
    call). Eager elsewhere, and inside an outer torch.compile (trainer.compile), which compiles fn itself."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return fn
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn)
    return _COMPILED[fn.__name__]


def _common_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would run in: autocast's where it is on. FlexAttention is not autocast-aware, and q/k
    come out of the fp32-weighted q_norm/k_norm in fp32 while v is bf16: mixed dtypes are rejected, and fp32
    flex is far slower than bf16 at head_dim 128 (~12x per call on an H100 in k2-fsa/OmniVoice#212). So flex
    gets what autocast would have given SDPA."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class FlexKernel:
    """FlexAttention with a BlockMask: ONE call over all N blocks, no anchor groups. The block mask skips the
    128×128 tiles nobody sees, so the context part costs about anchor/T of dense attention and block-to-block
    only the diagonal tiles; grouping would only repeat the context K/V. GQA is native (no head expansion).

    On CUDA, flex_attention and create_block_mask run compiled (eager flex materialises the full scores and
    eager create_block_mask the dense mask). On CPU they run eager: fine for test shapes, and torch's CPU
    flex_attention has no backward, so CPU training uses "sdpa"."""

    groups_anchors = False

    def mask(self, anchors_BN, ctx_len, block_size, layer=FULL_ATTENTION) -> BlockMask:
        B, N = anchors_BN.shape
        Q = N * block_size
        make = _compiled_on_cuda(create_block_mask, anchors_BN.device)
        return make(block_mask_mod(anchors_BN, ctx_len, block_size, layer), B, None, Q, ctx_len + Q,
                    device=anchors_BN.device)

    def attend(self, q_BhQd, k_BhKd, v_BhKd, mask, num_heads, num_kv_heads):
        dtype = _common_dtype(q_BhQd)
        q, k, v = q_BhQd.to(dtype), k_BhKd.to(dtype), v_BhKd.to(dtype)
        attend = _compiled_on_cuda(flex_attention, q.device)
        return attend(q, k, v, block_mask=mask, enable_gqa=num_heads != num_kv_heads)


ATTN_KERNELS: Registry[AttentionKernel] = Registry("drafter.attn_kernel", {
    "sdpa": SdpaKernel(expand_kv=False),
    "sdpa_expanded": SdpaKernel(expand_kv=True),
    "flex": FlexKernel(),
})


def attention_kernel(name: str) -> AttentionKernel:
    """The kernel registered as `name`; a ValueError naming the config key and the options otherwise."""
    return ATTN_KERNELS[name]
