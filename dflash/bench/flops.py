"""FLOPs and time of one call: torch's FLOP counter for matmuls, our own formula for fused attention, a
bf16 matmul peak (the MFU denominator, measured on the spot) and a CUDA-synchronised timer."""
from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode


def timed(fn, iters: int, device: torch.device, warmup: int = 0) -> float:
    """Mean seconds per call over `iters` calls after `warmup` untimed ones (CUDA-synchronised around the timed
    loop, not inside it)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def _attention_flops(q, k, v, mask, is_causal: bool) -> int:
    """Useful forward FLOPs of one SDPA call: both matmuls over the key positions each query may see.
    Grouped-query attention (fewer K/V heads) is fine; a boolean mask or causal flag scales the count to
    the visible fraction (the drafter's block mask leaves most of the keys hidden)."""
    b, h, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    visible = 1.0
    if mask is not None:
        vis = mask if mask.dtype == torch.bool else torch.isfinite(mask) & (mask > -1e30)
        visible = vis.expand(b, h, s_q, s_k).float().mean().item()
    elif is_causal:
        visible = min(1.0, (s_q + 1) / (2 * s_k))
    return int(2 * b * h * s_q * s_k * (d + d_v) * visible)


def _sdpa_formula(op, backward: bool):
    """A raw-argument flop formula for one fused-attention op, its arguments bound by the op's schema."""
    names = [arg.name for arg in op._schema.arguments]

    def formula(*args, out_val=None, **kwargs) -> int:
        bound = {**dict(zip(names, args)), **kwargs}
        fwd = _attention_flops(bound["query"], bound["key"], bound["value"], bound.get("attn_bias"),
                               bool(bound.get("is_causal", False)))
        return 2 * fwd if backward else fwd  # backward: four matmuls of the forward's size
    formula._get_raw = True  # FlopCounterMode passes tensors, not shapes
    return formula


def _sdpa_flop_mapping() -> dict:
    aten = torch.ops.aten
    out = {}
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention"):
        for suffix, backward in (("", False), ("_backward", True)):
            if hasattr(aten, name + suffix):
                packet = getattr(aten, name + suffix)  # the counter looks ops up by overload packet
                out[packet] = _sdpa_formula(packet.default, backward)
    return out


def count_flops(fn) -> int:
    """FLOPs of one call: torch's counter for matmuls, our own formula for fused attention (torch 2.11's
    asserts equal Q and K/V head counts and ignores masks)."""
    with FlopCounterMode(display=False, custom_mapping=_sdpa_flop_mapping()) as counter:
        fn()
    return counter.get_total_flops()


def dflash2_elementwise_flops(cfg, hidden_size: int, blocks: int) -> int:
    """The FLOPs of one DFlash 2 training step that torch's counter does not see (it counts matmuls only), for
    `blocks` anchor blocks; 0 for DFlash 1. Forward, then backward at twice the forward (a product's gradient
    goes to both factors):
    - each GroupedDynamicCausalConv (2 a layer) applies two K-tap kernels (prepare, finish) at every block
      position: a multiply and an add per tap and channel, 2·2·K·H;
    - the selector's pair scores at each predicted position: the gate pred ⊙ (h·P) (r multiplies) and the k
      candidates' dot products with it (2·k·r), once for the loss and once for the self-conditioned walk
      (no gradient: forward only).
    The kernel projections, h·P, the candidates' logits and the top-k's full logits are matmuls: counted."""
    if getattr(cfg, "architecture", "dflash") != "dflash2":
        return 0
    bs, K, H = cfg.block_size, cfg.conv_kernel_size, hidden_size
    conv_fwd = cfg.num_layers * 2 * (2 * 2 * K * H) * blocks * bs
    pair_fwd = (cfg.selector_rank + 2 * cfg.selector_top_k * cfg.selector_rank) * blocks * (bs - 1)
    return 3 * conv_fwd + 3 * pair_fwd + pair_fwd


def matmul_peak(n: int, device: torch.device, iters: int = 10) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, iters, device, warmup=3)
