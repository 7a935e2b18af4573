"""torch.compile of the drafter's forward (`trainer.compile`), in one of `trainer.compile_mode`'s modes.

The loss and the optimizer stay eager. Shapes are few when batches are padded (trainer.pad_multiple) and
anchors fixed; torch marks a dimension dynamic once it has seen it change.

- `default`: inductor's fused kernels (the drafter's norms, RoPE and elementwise glue; 1.19x the step on an
  H200, benchmarks/RESULTS.md);
- `reduce-overhead`: the same kernels replayed as CUDA graphs (the fixed-shape forward and its compiled
  backward launch as one graph each; the step is marked before every call so each training step's graph
  may overwrite the last one's outputs, which the step has consumed by then);
- `max-autotune-no-cudagraphs`: inductor also benchmarks Triton/cuBLAS choices for each matmul (slow to
  compile: minutes at the published shape);
- `max-autotune`: both.
On a CPU the CUDA-graph part does nothing and every mode computes the same function (tested).
"""
from __future__ import annotations

import torch
from torch import nn

from dflash.registry import Registry

# trainer.compile_mode → (torch.compile keyword arguments, whether the mode replays CUDA graphs)
COMPILE_MODES: Registry = Registry("trainer.compile_mode", {
    "default": ({}, False),
    "reduce-overhead": ({"mode": "reduce-overhead"}, True),
    "max-autotune-no-cudagraphs": ({"mode": "max-autotune-no-cudagraphs"}, False),
    "max-autotune": ({"mode": "max-autotune"}, True),
})


class StepMarked(nn.Module):
    """A CUDA-graph-replaying compiled forward, told that each call starts a new training step: its
    previous outputs (the last step's hidden states, consumed by then) may be overwritten."""

    def __init__(self, compiled: nn.Module):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(*args)


def compile_drafter(model: nn.Module, mode: str = "default") -> nn.Module:
    kwargs, graphs = COMPILE_MODES[mode]  # an unknown name raises, naming trainer.compile_mode
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    compiled = torch.compile(model, **kwargs)
    return StepMarked(compiled) if graphs else compiled
