"""Noise on the target features fed to the drafter (docs/DESIGN.md, "Losses and noise").

Noise is added to every selected target layer *except the last one*: the last selected layer is the
one closest to the target's output and carries most of the next-token signal, so corrupting it teaches
the drafter to ignore its best feature (the original pipeline's convention).

One schedule object per run: the trainer advances it (`advance(step)`) and draws the noise itself when it
makes each batch (`dflash.training.batching.make_batch` calls `add` with `sigma()`, seeded per item), so
the buffered target features stay clean and a resumed run draws exactly the noise the uninterrupted run did.
Schedules register in `NOISES` (`noise.name`).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dflash.registry import Registry


@dataclass
class NoiseConfig:
    name: str = "none"
    distribution: str = "uniform"  # uniform: U(-σ, σ); gaussian: N(0, σ²)
    sigma: float = 0.05  # fixed scale for `uniform` / `gaussian` schedules
    start: float = 0.10  # cosine: σ at step 0
    end: float = 0.01  # cosine: σ from step `steps` on
    steps: int = 0  # cosine horizon S; 0 → the trainer's max_steps


class NoiseSchedule(ABC):
    """σ as a function of the trainer's step; `add` draws the noise."""

    config_keys: tuple[str, ...] = ("name", "distribution")  # the NoiseConfig keys this schedule reads

    def __init__(self, cfg: NoiseConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = cfg.steps or total_steps
        self.step = 0

    def advance(self, step: int) -> None:
        self.step = step

    @abstractmethod
    def sigma_at(self, step: int) -> float: ...

    def sigma(self) -> float:
        return self.sigma_at(self.step)

    def add(self, features_TLH: torch.Tensor, sigma: float, generator: torch.Generator | None = None):
        """Features [..., L, H] with noise on every selected layer but the last (dim -2 = layers)."""
        if sigma <= 0 or features_TLH.shape[-2] < 2:
            return features_TLH
        noisy = features_TLH.clone()
        head = noisy[..., :-1, :]
        draw = torch.empty(head.shape, dtype=torch.float32, device=head.device)
        if self.cfg.distribution == "gaussian":
            draw.normal_(0.0, sigma, generator=generator)
        else:
            draw.uniform_(-sigma, sigma, generator=generator)
        head += draw.to(head.dtype)
        return noisy


NOISES: Registry[type[NoiseSchedule]] = Registry("noise.name")
register_noise = NOISES.register


@register_noise("none")
class NoNoise(NoiseSchedule):
    config_keys = ("name",)
    def sigma_at(self, step: int) -> float:
        return 0.0


@register_noise("uniform")
class UniformNoise(NoiseSchedule):
    """Fixed ±σ uniform noise (the original pipeline: ±0.05)."""

    config_keys = NoiseSchedule.config_keys + ("sigma",)

    def sigma_at(self, step: int) -> float:
        return self.cfg.sigma


@register_noise("gaussian")
class GaussianNoise(NoiseSchedule):
    config_keys = NoiseSchedule.config_keys + ("sigma",)
    def sigma_at(self, step: int) -> float:
        return self.cfg.sigma


@register_noise("cosine")
class CosineNoise(NoiseSchedule):
    """σ(s) = end + (start − end)·½(1 + cos(π·min(s/S, 1))): strong regularisation early, precision late."""

    config_keys = NoiseSchedule.config_keys + ("start", "end", "steps")

    def sigma_at(self, step: int) -> float:
        frac = min(step / max(self.total_steps, 1), 1.0)
        return self.cfg.end + (self.cfg.start - self.cfg.end) * 0.5 * (1 + math.cos(math.pi * frac))


def build_noise(cfg: NoiseConfig, total_steps: int) -> NoiseSchedule:
    NOISES.check(cfg.name)
    if cfg.distribution not in ("uniform", "gaussian"):
        raise ValueError(f"noise.distribution={cfg.distribution!r}; expected 'uniform' or 'gaussian'")
    for key in ("sigma", "start", "end"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"noise.{key} must be >= 0, got {getattr(cfg, key)}")
    return NOISES.build(cfg.name, cfg, total_steps)
