"""Fused elementwise pieces of the target's training forward (`target.fused_ops`).

Why: transformers' Qwen3.5 / Qwen3-Next layers run their norms and the MLP's activation as chains of separate
torch kernels, each a full pass over the activations: the zero-centred RMSNorm upcasts, squares, averages,
scales, multiplies by (1 + w) and casts back (~8 passes of a [tokens, 5120] float32 tensor, twice per layer), the
Gated DeltaNet's gated RMSNorm does the same over [tokens, 6144] plus a float32 SiLU of its gate, and the MLP
writes silu(gate) before multiplying it by up ([tokens, 17408]); the gated attention's per-head norms, rotary
embedding and output gate run as strided kernels over [B, heads, T, 256] views. At the 27B shapes these passes
held a forward of 4 × 2,048 tokens at 63% MFU; fused, it runs at 73% (9,504 → 11,124 tok/s in one process, the
27B pipeline 5,790 → 6,617 trained-on tok/s with the Triton LM-head loss: benchmarks/RESULTS.md, 2026-12-01).

`compile` replaces each such module's forward, on this model's instances only, with the same math compiled by
torch.compile (one fused kernel per piece); the functions below are the reference and what gets compiled. The
replacement runs only inside `FusedForward.scope()`, which `Target.forward_features` (the producer's forward:
fixed shapes, outside any CUDA-graph capture) enters: evaluation's decoders and the CUDA graphs of
`dflash.target.static_decode` keep transformers' own code.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.registry import Registry


def zero_centered_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNorm / Qwen3NextRMSNorm: x / rms(x) · (1 + w), in float32, cast back to x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNormGated / Qwen3NextRMSNormGated: w · (x / rms(x)) rounded to x's dtype, times silu(gate)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed) * F.silu(gate.float())).to(dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The SwiGLU MLP's silu(gate) · up."""
    return F.silu(gate) * up


def attention_qk(q_BTHD: Tensor, k_BTHD: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin: Tensor, rotary: Callable) -> tuple[Tensor, Tensor]:
    """The gated attention's q / k: per-head zero-centred RMSNorm, heads first, then the modelling module's own
    (partial) rotary embedding, `rotary` (its `apply_rotary_pos_emb`)."""
    q = zero_centered_rms_norm(q_BTHD, q_weight, eps).transpose(1, 2)
    k = zero_centered_rms_norm(k_BTHD, k_weight, eps).transpose(1, 2)
    return rotary(q, k, cos, sin)


def sigmoid_gate(attn_BTHD: Tensor, gate_BTX: Tensor) -> Tensor:
    """The attention output, heads flattened ([B, T, H·D]), times sigmoid(gate)."""
    return attn_BTHD.reshape(gate_BTX.shape) * torch.sigmoid(gate_BTX)


def _norm(module: nn.Module, fns: tuple, eager: Callable) -> Callable:
    return lambda x: fns[0](x, module.weight, module.eps)


def _gated_norm(module: nn.Module, fns: tuple, eager: Callable) -> Callable | None:
    if getattr(module, "activation", "silu") != "silu":
        return None
    return lambda x, gate: fns[0](x, gate, module.weight, module.variance_epsilon)


def _mlp(module: nn.Module, fns: tuple, eager: Callable) -> Callable | None:
    if getattr(module.config, "hidden_act", None) != "silu":
        return None
    return lambda x: module.down_proj(fns[0](module.gate_proj(x), module.up_proj(x)))


def _attention(module: nn.Module, fns: tuple, eager: Callable) -> Callable | None:
    """transformers' gated attention forward (Qwen3_5Attention / Qwen3NextAttention, 5.17 to 5.24) without a cache,
    its norms + rotary and its output gate fused: at the 27B shapes the unfused rotary alone was ~34 ms of GPU time
    per 4 × 2,048-token forward, in strided elementwise kernels over [B, heads, T, 256] views. With a cache (decode)
    it is transformers' own forward."""
    modeling = sys.modules[type(module).__module__]
    rotary = getattr(modeling, "apply_rotary_pos_emb", None)
    interfaces = getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None)
    if rotary is None or interfaces is None or not hasattr(module, "q_norm"):
        return None
    qk, gated = fns

    def forward(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        if module.training or any(kwargs.get(k) is not None for k in ("past_key_values", "cache")):
            return eager(hidden_states, position_embeddings, attention_mask, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")}
        lead, d = hidden_states.shape[:-1], module.head_dim
        q, gate = torch.chunk(module.q_proj(hidden_states).view(*lead, -1, 2 * d), 2, dim=-1)
        k = module.k_proj(hidden_states).view(*lead, -1, d)
        v = module.v_proj(hidden_states).view(*lead, -1, d).transpose(1, 2)
        q, k = qk(q, k, module.q_norm.weight, module.k_norm.weight, module.q_norm.eps, *position_embeddings, rotary)
        attend = interfaces.get_interface(module.config._attn_implementation, modeling.eager_attention_forward)
        out, weights = attend(module, q, k, v, attention_mask, dropout=0.0, scaling=module.scaling, **kwargs)
        return module.o_proj(gated(out, gate.reshape(*lead, -1))), weights
    return forward


# a transformers module class -> (the fused functions, how they become that module's forward: None = keep it)
MODULES: dict[str, tuple[tuple[Callable, ...], Callable]] = {
    "Qwen3_5RMSNorm": ((zero_centered_rms_norm,), _norm),
    "Qwen3NextRMSNorm": ((zero_centered_rms_norm,), _norm),
    "Qwen3_5RMSNormGated": ((gated_rms_norm,), _gated_norm),
    "Qwen3NextRMSNormGated": ((gated_rms_norm,), _gated_norm),
    "Qwen3_5MLP": ((silu_mul,), _mlp),
    "Qwen3NextMLP": ((silu_mul,), _mlp),
    "Qwen3_5Attention": ((attention_qk, sigmoid_gate), _attention),
    "Qwen3NextAttention": ((attention_qk, sigmoid_gate), _attention),
}


def _compile(fn: Callable) -> Callable:
    # dynamic=None: static kernels for the first shape, one dynamic recompile when a second shape comes
    # (the norms see [B, T, 5120] and the per-head [B, T, heads, 256]; online data varies T)
    return torch.compile(fn, fullgraph=True, dynamic=None)


# target.fused_ops -> how the fused functions are made (None: the modules keep their own forward)
FUSED_OPS: Registry = Registry("target.fused_ops", {"off": None, "eager": lambda fn: fn, "compile": _compile})


def resolve_fused_ops(name: str, device: torch.device) -> str:
    """`auto`: compile on CUDA (the measured win), off on the CPU (compiling costs more than tiny models save)."""
    if name == "auto":
        return "compile" if device.type == "cuda" else "off"
    FUSED_OPS.check(name)
    return name


class FusedForward:
    """The fused forwards installed on one model's modules; they run only inside `scope()` on the thread that
    entered it, and never inside a CUDA-graph capture."""

    def __init__(self, model: nn.Module, mode: str):
        self.mode = mode
        self._local = threading.local()
        self._saved: list[tuple[nn.Module, Callable | None]] = []  # (module, its own instance forward, if any)
        make = FUSED_OPS[mode]
        if make is None:
            return
        fused = {fn: make(fn) for fns, _ in MODULES.values() for fn in fns}  # one compiled function per piece
        for module in model.modules():
            entry = MODULES.get(type(module).__name__)
            forward = entry[1](module, tuple(fused[f] for f in entry[0]), module.forward) if entry else None
            if forward is not None:
                self._saved.append((module, module.__dict__.get("forward")))
                module.forward = self._dispatch(module.forward, forward)

    @property
    def patched(self) -> int:
        """How many modules run fused inside `scope()`."""
        return len(self._saved)

    def remove(self) -> None:
        """Gives every patched module its own forward back."""
        for module, own in self._saved:
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._saved = []

    def _dispatch(self, eager: Callable, fused: Callable) -> Callable:
        def forward(*args, **kwargs):
            if getattr(self._local, "active", False) and not self._capturing(args[0] if args else
                                                                             next(iter(kwargs.values()))):
                return fused(*args, **kwargs)
            return eager(*args, **kwargs)
        return forward

    @staticmethod
    def _capturing(x: Tensor) -> bool:
        return x.is_cuda and torch.cuda.is_current_stream_capturing()

    @contextmanager
    def scope(self):
        before = getattr(self._local, "active", False)
        self._local.active = True
        try:
            yield
        finally:
            self._local.active = before
