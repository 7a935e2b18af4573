"""Fused elementwise pieces of the target's training forward (`target.fused_ops`).

Why: transformers' Qwen3.5 / Qwen3-Next layers run their norms and the MLP's activation as chains of separate
torch kernels, each a full pass over the activations: the zero-centred RMSNorm upcasts, squares, averages,
scales, multiplies by (1 + w) and casts back (~8 passes of a [tokens, 5120] float32 tensor, twice per layer), the
Gated DeltaNet's gated RMSNorm does the same over [tokens, 6144] plus a float32 SiLU of its gate, and the MLP
writes silu(gate) before multiplying it by up ([tokens, 17408]). At the 27B shapes these passes are a sizeable
share of a forward that reaches only ~61% MFU (benchmarks/RESULTS.md, session 11, has the before / after).

`compile` replaces each such module's forward, on this model's instances only, with the same math compiled by
torch.compile (one fused kernel per piece); the functions below are the reference and what gets compiled. The
replacement runs only inside `FusedForward.scope()`, which `Target.forward_features` (the producer's forward:
fixed shapes, outside any CUDA-graph capture) enters: evaluation's decoders and the CUDA graphs of
`dflash.target.static_decode` keep transformers' own code.
"""
from __future__ import annotations

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


def _norm(module: nn.Module, fn: Callable) -> Callable:
    return lambda x: fn(x, module.weight, module.eps)


def _gated_norm(module: nn.Module, fn: Callable) -> Callable | None:
    if getattr(module, "activation", "silu") != "silu":
        return None
    return lambda x, gate: fn(x, gate, module.weight, module.variance_epsilon)


def _mlp(module: nn.Module, fn: Callable) -> Callable | None:
    if getattr(module.config, "hidden_act", None) != "silu":
        return None
    return lambda x: module.down_proj(fn(module.gate_proj(x), module.up_proj(x)))


# a transformers module class -> (the fused function, how it becomes that module's forward: None = keep it)
MODULES: dict[str, tuple[Callable, Callable]] = {
    "Qwen3_5RMSNorm": (zero_centered_rms_norm, _norm),
    "Qwen3NextRMSNorm": (zero_centered_rms_norm, _norm),
    "Qwen3_5RMSNormGated": (gated_rms_norm, _gated_norm),
    "Qwen3NextRMSNormGated": (gated_rms_norm, _gated_norm),
    "Qwen3_5MLP": (silu_mul, _mlp),
    "Qwen3NextMLP": (silu_mul, _mlp),
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
        fused = {name: make(fn) for name, (fn, _) in MODULES.items()}
        for module in model.modules():
            entry = MODULES.get(type(module).__name__)
            forward = entry[1](module, fused[type(module).__name__]) if entry else None
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
        def forward(x, *args, **kwargs):
            if getattr(self._local, "active", False) and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                return fused(x, *args, **kwargs)
            return eager(x, *args, **kwargs)
        return forward

    @contextmanager
    def scope(self):
        before = getattr(self._local, "active", False)
        self._local.active = True
        try:
            yield
        finally:
            self._local.active = before
