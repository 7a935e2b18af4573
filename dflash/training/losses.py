"""Training losses for DFlash block-diffusion drafters.

A drafter block has B positions: position 0 is the anchor token, positions
1..B-1 are masks whose targets are the target model's next tokens.  Every loss
here acts on the K = B-1 predicted positions of N blocks and returns the
weighted mean ``sum(w * l) / sum(w)`` over valid positions (label != IGNORE_INDEX),
with detached weights ``w``.

A loss owns its statistics: ``loss(hidden, lm_head, batch) -> (loss, metrics)``
computes the per-position LM-head stats (``compute_position_stats``) itself and
is made of two independent parts, each in its own registry with its own small
config: a per-position term ``l`` (``TERMS``: CE, soft-KL blend, LK) and a
position weighting ``w`` (``WEIGHTINGS``: decay, streak, D-PACE).  A loss name
(``loss.name``, ``LOSSES``) picks one of each; ``LossConfig`` (the flat
``loss.*`` keys) is the union of the parts' configs.

Sources:
  * Position decay ``w_k = exp(-(k-1)/gamma)``: DFlash, arXiv 2602.06036.
  * Soft-label (temperature) KL distillation: DistillSpec (Zhou et al. 2023).
  * Acceptance-prefix weighting ``w_j = sum_{m>=j} prod_{i<=m} q~_i``: D-PACE.
  * KL/TV mixture gated by the distribution overlap (acceptance rate): LK losses.

The stats (``dflash.training.position_stats``: CE, KL / TV / overlap against
the target's top-k at temperature T, p_label, correctness) are computed in
LM-head chunks, with the gradient path ``loss.lm_head_grad`` (fused or recompute).
"""

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from dflash.registry import Registry
from dflash.training import lm_head_triton
from dflash.training.lm_head_loss import IGNORE_INDEX, LM_HEAD_KERNELS
from dflash.training.position_stats import LM_HEAD_GRADS, PositionStats, compute_position_stats

# --------------------------------------------------------------------------
# Configs: one small dataclass per part; LossConfig is their union (flat `loss.*` keys)
# --------------------------------------------------------------------------


@dataclass
class LMHeadConfig:
    """How the loss's per-position stats are computed."""

    temperature: float = 1.0  # soft-label temperature T (KL / TV stats at T)
    chunk_size: int = 0  # positions per LM-head chunk; 0 = auto (a ~1 GiB float32 block: target/lm_head.py)
    lm_head_grad: str = "fused"  # LM-head gradient path: fused (no logits recompute) | recompute (checkpointed)
    lm_head_kernel: str = "auto"  # fused hard-label chunks: triton (2 passes over bf16 logits) | torch | auto (triton where it runs)


@dataclass
class DecayConfig:
    gamma: float = 7.0  # position decay length


@dataclass
class StreakConfig(DecayConfig):
    alpha: float = 1.0  # strength of the acceptance-prefix boost


@dataclass
class DPaceConfig:
    dpace_a: float = 0.5  # floor a in q~ = (1-a) q + a


@dataclass
class SoftKLConfig:
    kl_weight: float = 0.7  # weight of the KL term vs. hard CE


@dataclass
class LKConfig:
    lk_eta: float = 3.0  # lambda = exp(-eta * overlap)


@dataclass
class SelectorConfig:
    selector_alpha: float = 1.0  # DFlash 2 only: weight of the candidate selector's CE (dflash/training/selector_loss.py)


@dataclass
class _LossName:
    name: str = "hard_ce"  # a term and a weighting (LOSSES)


@dataclass
class LossConfig(SelectorConfig, LKConfig, SoftKLConfig, DPaceConfig, StreakConfig, LMHeadConfig, _LossName):
    """The `loss.*` keys: the loss name, then every part's knobs, flat (`loss.temperature=1.5`); a dataclass's
    fields come in reverse MRO order, so `name` (the last base) leads in a dumped config."""


@dataclass(frozen=True)
class Bounds:
    """The values a `loss.*` number may take: [low, high], each end open or closed; `why` says what breaks."""

    low: float
    high: float = math.inf
    low_open: bool = False
    why: str = ""

    def check(self, key: str, value: float) -> None:
        above = value > self.low if self.low_open else value >= self.low
        if not (math.isfinite(value) and above and value <= self.high):
            lo = f"{'(' if self.low_open else '['}{self.low:g}"
            hi = "inf)" if self.high == math.inf else f"{self.high:g}]"
            raise ValueError(f"loss.{key}={value} is outside {lo}, {hi}: {self.why}")


# Each number a loss reads, where its term or weighting breaks outside these. A loss checks only the keys it
# reads (`Loss.config_keys`): hard_ce ignores `temperature`, so any value there is harmless to it.
BOUNDS = {
    "temperature": Bounds(0.0, low_open=True, why="the soft labels are softmax(logits / T); T <= 0 divides by "
                                                  "zero or flips the distribution"),
    "gamma": Bounds(0.0, low_open=True, why="the position decay is exp(-(k-1) / gamma)"),
    "alpha": Bounds(0.0, why="the streak boost 1 + alpha * ... turns negative below 0"),
    "dpace_a": Bounds(0.0, 1.0, why="it blends q~ = (1 - a) q + a, a probability"),
    "kl_weight": Bounds(0.0, 1.0, why="it blends kl_weight * KL + (1 - kl_weight) * CE"),
    "lk_eta": Bounds(0.0, why="lambda = exp(-eta * overlap) must stay in (0, 1]"),
    "selector_alpha": Bounds(0.0, why="it weighs the selector's CE added to the block loss; below 0 it would be "
                                      "maximised"),
}


def part_config(cfg: LossConfig, part_cls: type | None) -> Any:
    """The small config of one part, taken from the loss's keys (None for a part without knobs)."""
    if part_cls is None:
        return None
    return part_cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(part_cls)})


def position_decay(
    K: int, gamma: float, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for k = 1..K, shape [K]."""
    k_K = torch.arange(K, device=device, dtype=dtype)
    return torch.exp(-k_K / gamma)


# --------------------------------------------------------------------------
# Per-position terms l [N, K]
# --------------------------------------------------------------------------


class PositionTerm(ABC):
    """The per-position loss ``l`` [N, K] from the stats; ``config`` is its small config class."""

    config: type | None = None
    needs_soft: bool = False  # reads kl / tv / overlap (the target's top-k soft labels)

    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    @abstractmethod
    def __call__(self, stats: PositionStats) -> Tensor: ...


TERMS: Registry[type[PositionTerm]] = Registry("loss term")


@TERMS.register("ce")
class CETerm(PositionTerm):
    """CE at T = 1 against the target's greedy label."""

    def __call__(self, stats):
        return stats.ce


@TERMS.register("soft_kl")
class SoftKLTerm(PositionTerm):
    """``kl_weight * T^2 * KL_T + (1 - kl_weight) * CE``; T^2 keeps the KL gradient's scale independent of T."""

    config = SoftKLConfig
    needs_soft = True

    def __call__(self, stats):
        T2 = stats.temperature**2
        return self.cfg.kl_weight * T2 * stats.kl + (1.0 - self.cfg.kl_weight) * stats.ce


@TERMS.register("lk")
class LKTerm(PositionTerm):
    """``lambda * KL + (1 - lambda) * TV`` with ``lambda = exp(-eta * overlap)`` (overlap detached)."""

    config = LKConfig
    needs_soft = True

    def __call__(self, stats):
        lam_NK = torch.exp(-self.cfg.lk_eta * stats.overlap.detach())
        return lam_NK * stats.kl + (1.0 - lam_NK) * stats.tv


# --------------------------------------------------------------------------
# Position weightings w [N, K]
# --------------------------------------------------------------------------


def streak_weights(p_label_NK: Tensor, valid_NK: Tensor, gamma: float, alpha: float) -> Tensor:
    """``w_k = decay_k * (1 + alpha * prod_{i<k} p_i * (1 - p_k))`` (detached).

    Invalid positions count as p = 0 in the prefix product.
    """
    N, K = p_label_NK.shape
    p_NK = torch.where(valid_NK, p_label_NK.detach(), 0.0)
    cum_prev_NK = torch.cumprod(torch.cat([torch.ones_like(p_NK[:, :1]), p_NK[:, :-1]], dim=1), dim=1)
    decay_K = position_decay(K, gamma, p_NK.device, p_NK.dtype)
    return decay_K * (1.0 + alpha * cum_prev_NK * (1.0 - p_NK))


def dpace_weights(p_label_NK: Tensor, valid_NK: Tensor, a: float) -> Tensor:
    """D-PACE ``w_j = sum_{m>=j} prod_{i<=m} q~_i`` with ``q~ = (1-a) q + a`` (detached).

    Products and sums run over the valid positions of each block only.
    """
    q_tilde_NK = torch.where(valid_NK, (1.0 - a) * p_label_NK.detach() + a, 1.0)
    prefix_NK = torch.where(valid_NK, torch.cumprod(q_tilde_NK, dim=1), 0.0)
    return prefix_NK.flip(1).cumsum(1).flip(1)


class PositionWeighting(ABC):
    """The per-position weights ``w`` [N, K] (detached by the loss); ``config`` is its small config class."""

    config: type | None = None

    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    @abstractmethod
    def __call__(self, stats: PositionStats, valid_NK: Tensor) -> Tensor: ...


WEIGHTINGS: Registry[type[PositionWeighting]] = Registry("loss weighting")


@WEIGHTINGS.register("decay")
class DecayWeighting(PositionWeighting):
    config = DecayConfig

    def __call__(self, stats, valid_NK):
        K = stats.ce.shape[1]
        return position_decay(K, self.cfg.gamma, stats.ce.device, stats.ce.dtype).expand_as(stats.ce)


@WEIGHTINGS.register("streak")
class StreakWeighting(PositionWeighting):
    config = StreakConfig

    def __call__(self, stats, valid_NK):
        return streak_weights(stats.p_label, valid_NK, self.cfg.gamma, self.cfg.alpha)


@WEIGHTINGS.register("dpace")
class DPaceWeighting(PositionWeighting):
    config = DPaceConfig

    def __call__(self, stats, valid_NK):
        return dpace_weights(stats.p_label, valid_NK, self.cfg.dpace_a)


# --------------------------------------------------------------------------
# Losses: a term and a weighting over the stats the loss computes itself
# --------------------------------------------------------------------------


class LabelledBatch(Protocol):
    """What a loss reads from a batch (``dflash.training.batching.DrafterBatch`` has it)."""

    labels_BNK: Tensor  # IGNORE_INDEX where the block is padding
    soft_vals_BNKk: Tensor | None  # the target's top-k logits, when the loss needs soft labels
    soft_idx_BNKk: Tensor | None


class Loss:
    """``loss(hidden, lm_head, batch) -> (sum(w * l) / sum(w), metrics)`` over valid positions.

    A registered loss names its ``term`` (``TERMS``) and ``weighting`` (``WEIGHTINGS``); each is built
    from its own small config, taken from the flat ``LossConfig``."""

    term: str = ""
    weighting: str = ""
    needs_soft: bool = False  # set from the term

    # The LossConfig keys this loss reads (what the run logs as params; the others are another loss's knobs):
    # set from the term's and the weighting's configs.
    config_keys: tuple[str, ...] = ("name", "chunk_size", "lm_head_grad", "lm_head_kernel")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.term:
            term, weighting = TERMS[cls.term], WEIGHTINGS[cls.weighting]
            cls.needs_soft = term.needs_soft
            parts = [f.name for part in (term.config, weighting.config) if part is not None
                     for f in dataclasses.fields(part)]
            cls.config_keys = (*Loss.config_keys, *(("temperature",) if cls.needs_soft else ()), *parts)

    @classmethod
    def check_config(cls, cfg: LossConfig) -> None:
        """Every number this loss reads lies in its BOUNDS (ValueError naming `loss.<key>` otherwise)."""
        for key in cls.config_keys:
            if key in BOUNDS:
                BOUNDS[key].check(key, float(getattr(cfg, key)))

    def __init__(self, cfg: LossConfig):
        self.check_config(cfg)
        self.cfg = cfg
        self.lm_head = part_config(cfg, LMHeadConfig)
        term_cls, weighting_cls = TERMS[self.term], WEIGHTINGS[self.weighting]
        self.position_loss = term_cls(part_config(cfg, term_cls.config))
        self.position_weights = weighting_cls(part_config(cfg, weighting_cls.config))

    def __call__(self, hidden_BNKH: Tensor, lm_head_VH: Tensor, batch: LabelledBatch) -> tuple[Tensor, dict]:
        """The loss (scalar, with grad) and on-device metrics (``block_metrics``) of drafter hidden states
        [..., K, H] against the batch's labels [..., K]; no host sync."""
        stats, valid_NK = self.stats(hidden_BNKH, lm_head_VH, batch)
        return self.reduce(stats, valid_NK), block_metrics(stats, valid_NK)

    def stats(self, hidden_BNKH: Tensor, lm_head_VH: Tensor, batch: LabelledBatch,
              top_k: int = 0) -> tuple[PositionStats, Tensor]:
        """Per-position stats [N, K] (all blocks flattened into N) and the valid mask; `top_k` > 0 also gives
        each position's top-k vocabulary ids from the same chunked pass (``PositionStats.top_k_idx``)."""
        K, H = hidden_BNKH.shape[-2:]
        labels_NK = batch.labels_BNK.reshape(-1, K)
        soft = self.needs_soft and batch.soft_vals_BNKk is not None
        c = self.lm_head
        stats = compute_position_stats(
            hidden_BNKH.reshape(-1, K, H), lm_head_VH, labels_NK,
            soft_vals_NKk=batch.soft_vals_BNKk.flatten(0, -3) if soft else None,
            soft_idx_NKk=batch.soft_idx_BNKk.flatten(0, -3) if soft else None,
            temperature=c.temperature, chunk_size=c.chunk_size, need_soft=self.needs_soft,
            lm_head_grad=c.lm_head_grad, lm_head_kernel=c.lm_head_kernel, top_k=top_k)
        return stats, labels_NK != IGNORE_INDEX

    def reduce(self, stats: PositionStats, valid_NK: Tensor) -> Tensor:
        """``sum(w * l) / sum(w)`` over valid positions, weights detached."""
        if self.needs_soft and stats.kl is None:
            raise ValueError(f"loss {type(self).__name__} needs soft-label stats (need_soft=True)")
        weights_NK = torch.where(valid_NK, self.position_weights(stats, valid_NK).detach(), 0.0)
        loss_NK = torch.where(valid_NK, self.position_loss(stats), 0.0)
        return (weights_NK * loss_NK).sum() / weights_NK.sum().clamp_min(1e-8)


LOSSES: Registry[type[Loss]] = Registry("loss.name")
register_loss = LOSSES.register


def build_loss(cfg: LossConfig) -> Loss:
    return LOSSES.build(cfg.name, cfg)


def validate_loss_config(cfg: LossConfig) -> None:
    """The names a loss config picks exist and the numbers the loss reads are in range (ValueError naming the
    key otherwise)."""
    LOSSES.check(cfg.name)
    LOSSES[cfg.name].check_config(cfg)
    BOUNDS["selector_alpha"].check("selector_alpha", float(cfg.selector_alpha))
    LM_HEAD_GRADS.check(cfg.lm_head_grad)
    LM_HEAD_KERNELS.check(cfg.lm_head_kernel)
    if cfg.lm_head_kernel == "triton" and lm_head_triton.triton is None:
        raise ValueError("loss.lm_head_kernel=triton: Triton does not import here; use auto or torch")
    if cfg.chunk_size < 0:
        raise ValueError(f"loss.chunk_size must be >= 1, or 0 for auto; got {cfg.chunk_size}")


@register_loss("hard_ce")
class HardCELoss(Loss):
    """The DFlash baseline: CE with the gamma decay."""

    term, weighting = "ce", "decay"


@register_loss("soft_kl")
class SoftKLLoss(Loss):
    term, weighting = "soft_kl", "decay"


@register_loss("streak")
class StreakLoss(Loss):
    term, weighting = "ce", "streak"


@register_loss("soft_kl_streak")
class SoftKLStreakLoss(Loss):
    term, weighting = "soft_kl", "streak"


@register_loss("dpace")
class DPaceLoss(Loss):
    term, weighting = "ce", "dpace"


@register_loss("lk")
class LKLoss(Loss):
    term, weighting = "lk", "decay"


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


@torch.no_grad()
def block_metrics(stats: PositionStats, valid_NK: Tensor) -> dict[str, Tensor]:
    """Accuracy metrics as on-device tensors (no host sync).

    ``acc_per_pos`` [K] and ``acc`` average ``correct`` over valid positions;
    ``streak`` is the mean, over blocks with any valid position, of the number
    of leading correct positions (the draft tokens a greedy verifier accepts);
    ``ce`` the plain cross-entropy against the label over valid positions (no
    weights: the same quantity whichever loss trains).
    """
    correct_NK = (stats.correct & valid_NK).float()
    valid_f_NK = valid_NK.float()
    acc_per_pos = correct_NK.sum(0) / valid_f_NK.sum(0).clamp_min(1.0)
    acc = correct_NK.sum() / valid_f_NK.sum().clamp_min(1.0)
    streak_N = torch.cumprod(correct_NK, dim=1).sum(1)
    block_valid_N = valid_NK.any(dim=1).float()
    streak = (streak_N * block_valid_N).sum() / block_valid_N.sum().clamp_min(1.0)
    ce = (torch.where(valid_NK, stats.ce, 0.0)).sum() / valid_f_NK.sum().clamp_min(1.0)
    return {"acc_per_pos": acc_per_pos, "acc": acc, "streak": streak, "ce": ce}
