"""What a drafter costs before it trains: its trainable parameters by part, and the bytes of its training state.

The drafter trains in float32 under bf16 autocast (`trainer.autocast`), so every trainable parameter holds its
weight and its gradient in its own dtype, and the optimizer adds its state (`dflash.training.optim`):
- `adamw`: two moments per parameter (exp_avg, exp_avg_sq);
- `muon`: `torch.optim.Muon`'s one momentum buffer for the 2-D matrices it takes (`muon_parameters`), AdamW's two
  moments for the rest (norms, the convolutions' base kernels, the selector's codebooks).
Activations are not counted (they depend on the batch and the kernels): `experiments.bench` measures a step's peak.

`meta_drafter(cfg)` builds the run's drafter on the meta device from the target's config alone (its `config.json`,
or the random target's spec), so nothing is allocated: the Qwen3.6-27B shape is counted on a laptop. The target's
embedding and LM head are the drafter's frozen buffers, not parameters: they are the target's memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash.drafter.model import build_drafter
from dflash.target.model import read_target_info, resolve_layer_ids
from dflash.training.optim import muon_parameters

OPTIMIZER_SLOTS = {"adamw": 2, "muon": 1}  # state tensors the size of a parameter, per parameter it updates


def part_of(name: str) -> str:
    """The part of the drafter a parameter belongs to (DFlash 2's modules by their own names)."""
    if name.startswith("candidate_selector."):
        return "selector"
    if "_conv." in name:  # attention_conv / mlp_conv: GroupedDynamicCausalConv
        return "convolutions"
    if name.startswith("layers."):
        return "layers"
    return "fc and norms"  # fc: the target layers' features into the drafter's width; hidden_norm, norm


@dataclass
class DrafterSize:
    parameters: dict[str, int]  # trainable parameters by part
    state_bytes: dict[str, int]  # weights + gradients + optimizer state, by optimizer name

    @property
    def total(self) -> int:
        return sum(self.parameters.values())


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def drafter_size(drafter: nn.Module) -> DrafterSize:
    parts: dict[str, int] = {}
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            part = part_of(name)
            parts[part] = parts.get(part, 0) + p.numel()
    muon, adamw = muon_parameters(drafter)  # the trainable ones, split as trainer.optimizer=muon splits them
    in_muon, in_adamw = _bytes(muon), _bytes(adamw)
    weights_and_grads = 2 * (in_muon + in_adamw)
    state = {"adamw": weights_and_grads + OPTIMIZER_SLOTS["adamw"] * (in_muon + in_adamw),
             "muon": weights_and_grads + OPTIMIZER_SLOTS["muon"] * in_muon + OPTIMIZER_SLOTS["adamw"] * in_adamw}
    return DrafterSize(parts, state)


def meta_drafter(cfg) -> nn.Module:
    """The run config's drafter on the meta device, shaped by its target's config (no weights read)."""
    info = read_target_info(cfg.target)
    mask = cfg.target.mask_token_id if cfg.target.mask_token_id >= 0 else 0  # does not change a shape
    with torch.device("meta"):
        return build_drafter(cfg.drafter, info.hidden_size, info.num_layers, mask, resolve_layer_ids(cfg.target, info),
                             info.vocab_size)
