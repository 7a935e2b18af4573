"""The drafter's optimizer, chosen by `trainer.optimizer`.

- `adamw`: AdamW over every parameter (betas 0.9 / 0.95, `trainer.weight_decay`), fused on CUDA.
- `muon`: Muon for the 2-D weight matrices (every Linear, the selector's hidden projection) at
  `trainer.muon_lr_scale` × `trainer.lr` (speculators' default for DFlash drafters: 10 ×), AdamW as above for the
  rest: norms, the convolutions' base kernels (3-D) and the selector's codebooks (embedding tables: a row is
  updated only where its token occurs, which Muon's orthogonalised update is not meant for). The Muon part is
  `dflash.training.muon.BatchedMuon`, torch.optim.Muon's update with each shape's matrices orthogonalised as one
  batch; `muon_torch` is the same optimizer with `torch.optim.Muon` itself (one matrix at a time: the plain
  reference, and the optimizer the committed campaigns' Muon cells trained with), whose checkpoints load into either.

Both are one `torch.optim.Optimizer` to the trainer: one LR schedule scales every group (the Muon groups keep
their 10 × ratio), and `state_dict` / `load_state_dict` carry both parts, so a run resumes exactly.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dflash.registry import Registry
from dflash.training.muon import BatchedMuon

ADAMW_BETAS = (0.9, 0.95)


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's: the 2-D weight matrices, AdamW's: everything else), trainable parameters only."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and not name.endswith("_codebook")
        (muon if matrix else adamw).append(p)
    return muon, adamw


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together; `param_groups` is all of theirs (their own
    dicts, read afresh each time, so an LR scheduler's changes reach them after a resume too), `state_dict` holds
    each by name."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        self.defaults: dict = {}
        self.state = {}  # each part keeps its own
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:
        """The parts' groups as they are now (a part's load_state_dict replaces its group dicts)."""
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        """Every part's step, between this optimizer's own step hooks (the bench's phase timer uses them)."""
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        for opt in self.parts.values():
            opt.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.parts):
            raise ValueError(f"optimizer state has parts {sorted(state_dict)}, this optimizer {sorted(self.parts)} "
                             f"(was the run trained with another trainer.optimizer?)")
        for name, opt in self.parts.items():
            opt.load_state_dict(state_dict[name])


def _adamw(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS,
                             fused=device.type == "cuda")


def build_adamw(model: nn.Module, lr: float, weight_decay: float, muon_lr_scale: float,
                device: torch.device) -> torch.optim.Optimizer:
    return _adamw(model.parameters(), lr, weight_decay, device)


def _muon_and_adamw(muon_class, model: nn.Module, lr: float, weight_decay: float, muon_lr_scale: float,
                    device: torch.device) -> torch.optim.Optimizer:
    muon, adamw = muon_parameters(model)
    parts = {"muon": muon_class(muon, lr=lr * muon_lr_scale, weight_decay=weight_decay)}
    if adamw:
        parts["adamw"] = _adamw(adamw, lr, weight_decay, device)
    return CombinedOptimizer(parts)


def build_muon(model: nn.Module, lr: float, weight_decay: float, muon_lr_scale: float,
               device: torch.device) -> torch.optim.Optimizer:
    return _muon_and_adamw(BatchedMuon, model, lr, weight_decay, muon_lr_scale, device)


def build_muon_torch(model: nn.Module, lr: float, weight_decay: float, muon_lr_scale: float,
                     device: torch.device) -> torch.optim.Optimizer:
    return _muon_and_adamw(torch.optim.Muon, model, lr, weight_decay, muon_lr_scale, device)


OPTIMIZERS = Registry("trainer.optimizer", {"adamw": build_adamw, "muon": build_muon, "muon_torch": build_muon_torch})


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float, muon_lr_scale: float,
                    device: torch.device) -> torch.optim.Optimizer:
    return OPTIMIZERS.build(name, model, lr, weight_decay, muon_lr_scale, device)
