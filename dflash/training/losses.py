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

The LM head is shared with the target (V up to ~250k), so drafter logits are
computed in float32, chunk by chunk: only per-position scalars leave a chunk,
and the N*K*V logits never exist at once, neither in the forward nor in the
backward pass.  Two interchangeable paths compute them (``loss.lm_head_grad``):
"fused" (``dflash.training.lm_head_loss``) forms each stat's gradient wrt the hidden
state in the forward and never recomputes logits; "recompute" runs each chunk
under activation checkpointing and recomputes its logits in the backward.
"""

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash.registry import Registry
from dflash.training.lm_head_loss import IGNORE_INDEX, fused_position_stats
from dflash.training.lm_head_loss import chunk_logits as _chunk_logits

# --------------------------------------------------------------------------
# Configs: one small dataclass per part; LossConfig is their union (flat `loss.*` keys)
# --------------------------------------------------------------------------


@dataclass
class LMHeadConfig:
    """How the loss's per-position stats are computed."""

    temperature: float = 1.0  # soft-label temperature T (KL / TV stats at T)
    chunk_size: int = 1024  # positions per LM-head chunk
    lm_head_grad: str = "fused"  # LM-head gradient path: fused (no logits recompute) | recompute (checkpointed)


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
class _LossName:
    name: str = "hard_ce"  # a term and a weighting (LOSSES)


@dataclass
class LossConfig(LKConfig, SoftKLConfig, DPaceConfig, StreakConfig, LMHeadConfig, _LossName):
    """The `loss.*` keys: the loss name, then every part's knobs, flat (`loss.temperature=1.5`); a dataclass's
    fields come in reverse MRO order, so `name` (the last base) leads in a dumped config."""


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
# Per-position statistics
# --------------------------------------------------------------------------


@dataclass
class PositionStats:
    """Per-position scalars, all [N, K]; invalid positions hold 0 / False."""

    ce: Tensor  # cross-entropy at T=1 against the label (with grad)
    kl: Tensor | None  # KL(p_target || q_drafter) at temperature T (with grad)
    tv: Tensor | None  # total variation 1 - sum min(p, q) (with grad)
    overlap: Tensor | None  # sum min(p, q) (detached)
    p_label: Tensor  # drafter probability of the label (detached)
    correct: Tensor  # bool, drafter argmax == label
    temperature: float = 1.0  # the T of kl / tv / overlap


def _ce_and_correct(logits_CV: Tensor, labels_C: Tensor) -> tuple[Tensor, Tensor]:
    """CE at T=1 and argmax correctness; both 0 / False where label == IGNORE_INDEX."""
    valid_C = labels_C != IGNORE_INDEX
    safe_labels_C = torch.where(valid_C, labels_C, 0)
    label_logit_C = logits_CV.gather(1, safe_labels_C[:, None]).squeeze(1)
    ce_C = torch.where(valid_C, torch.logsumexp(logits_CV, dim=-1) - label_logit_C, 0.0)
    correct_C = (logits_CV.argmax(dim=-1) == labels_C) & valid_C
    return ce_C, correct_C


def _hard_chunk(hidden_CD: Tensor, lm_head_VD: Tensor, labels_C: Tensor) -> tuple[Tensor, Tensor]:
    """CE and correctness for one chunk of positions."""
    return _ce_and_correct(_chunk_logits(hidden_CD, lm_head_VD), labels_C)


def _soft_chunk(
    hidden_CD: Tensor,
    lm_head_VD: Tensor,
    labels_C: Tensor,
    soft_vals_Ck: Tensor,
    soft_idx_Ck: Tensor,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """CE, correctness, KL, TV and overlap (top-k soft labels) for one chunk."""
    logits_CV = _chunk_logits(hidden_CD, lm_head_VD)
    ce_C, correct_C = _ce_and_correct(logits_CV, labels_C)
    valid_C = labels_C != IGNORE_INDEX

    # Drafter log q at the target's top-k indices, q = softmax(d / T) over V.
    scaled_CV = logits_CV / temperature
    safe_idx_Ck = torch.where(valid_C[:, None], soft_idx_Ck, 0)
    log_q_Ck = scaled_CV.gather(1, safe_idx_Ck) - torch.logsumexp(scaled_CV, dim=-1, keepdim=True)
    # Target p = softmax(vals / T) over its top-k.  Invalid rows get dummy
    # values so padding garbage (e.g. all -inf) cannot yield NaN gradients.
    vals_Ck = torch.where(valid_C[:, None], soft_vals_Ck.to(logits_CV.dtype), 0.0)
    log_p_Ck = torch.log_softmax(vals_Ck / temperature, dim=-1)
    p_Ck = log_p_Ck.exp()
    kl_terms_Ck = torch.where(p_Ck > 0, p_Ck * (log_p_Ck - log_q_Ck), 0.0)
    kl_C = torch.where(valid_C, kl_terms_Ck.sum(dim=-1), 0.0)
    overlap_C = torch.where(valid_C, torch.minimum(p_Ck, log_q_Ck.exp()).sum(dim=-1), 0.0)
    tv_C = torch.where(valid_C, 1.0 - overlap_C, 0.0)
    return ce_C, correct_C, kl_C, tv_C, overlap_C.detach()


def _maybe_checkpoint(fn: Callable, *args) -> tuple[Tensor, ...]:
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(a, Tensor) and a.requires_grad for a in args
    )
    if needs_grad:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _recompute_position_stats(
    hidden_PD: Tensor,
    lm_head_VD: Tensor,
    labels_P: Tensor,
    soft_vals_Pk: Tensor | None,
    soft_idx_Pk: Tensor | None,
    *,
    temperature: float,
    chunk_size: int,
) -> tuple[Tensor | None, ...]:
    """(ce, kl, tv, overlap, p_label, correct), each [P]: chunks under activation checkpointing,
    whose backward recomputes the chunk's logits (also differentiates a trainable head)."""
    outputs = []
    for start in range(0, hidden_PD.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if soft_vals_Pk is not None:
            outputs.append(
                _maybe_checkpoint(
                    _soft_chunk, hidden_PD[sl], lm_head_VD, labels_P[sl],
                    soft_vals_Pk[sl], soft_idx_Pk[sl], temperature,
                )
            )
        else:
            outputs.append(_maybe_checkpoint(_hard_chunk, hidden_PD[sl], lm_head_VD, labels_P[sl]))
    ce, correct, *soft = (torch.cat(parts) for parts in zip(*outputs))
    kl, tv, overlap = soft if soft else (None, None, None)
    p_label = torch.where(labels_P != IGNORE_INDEX, torch.exp(-ce.detach()), 0.0)
    return ce, kl, tv, overlap, p_label, correct


# loss.lm_head_grad -> per-position stats over flattened positions; both return
# (ce, kl, tv, overlap, p_label, correct), each [P], the soft ones None without soft labels.
LM_HEAD_GRADS: Registry[Callable[..., tuple[Tensor | None, ...]]] = Registry("loss.lm_head_grad", {
    "fused": fused_position_stats,
    "recompute": _recompute_position_stats,
})


def compute_position_stats(
    hidden_NKD: Tensor,
    lm_head_VD: Tensor,
    labels_NK: Tensor,
    *,
    soft_vals_NKk: Tensor | None = None,
    soft_idx_NKk: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    need_soft: bool = False,
    lm_head_grad: str = "fused",
) -> PositionStats:
    """Per-position CE / KL / TV stats of the drafter, computed in LM-head chunks.

    Logits are float32 (float64 if the inputs are float64; a bf16 head multiplies
    in bf16 with the chunk's logits upcast), ``chunk_size`` flattened positions at
    a time, so only [chunk, V] logits exist at any time.  ``lm_head_grad`` picks
    how the gradient wrt the hidden state is made (see ``LM_HEAD_GRADS``): "fused"
    in the forward, without recomputing logits; "recompute" under activation
    checkpointing.  A head that requires grad always takes "recompute" (the fused
    path treats the head as frozen).  Soft labels are the target's top-k logits
    (``soft_vals``) at vocabulary indices ``soft_idx``; they are only used when
    ``need_soft`` is set.
    """
    N, K, D = hidden_NKD.shape
    if need_soft and (soft_vals_NKk is None or soft_idx_NKk is None):
        raise ValueError("need_soft=True requires soft_vals_NKk and soft_idx_NKk")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    LM_HEAD_GRADS.check(lm_head_grad)
    if lm_head_VD.requires_grad:  # only the recompute path differentiates the head
        lm_head_grad = "recompute"

    soft_vals_Pk = soft_idx_Pk = None
    if need_soft:
        k = soft_vals_NKk.shape[-1]
        soft_vals_Pk = soft_vals_NKk.reshape(N * K, k)
        soft_idx_Pk = soft_idx_NKk.reshape(N * K, k)
    per_position = LM_HEAD_GRADS[lm_head_grad](
        hidden_NKD.reshape(N * K, D), lm_head_VD, labels_NK.reshape(N * K), soft_vals_Pk, soft_idx_Pk,
        temperature=temperature, chunk_size=chunk_size,
    )
    ce, kl, tv, overlap, p_label, correct = (None if t is None else t.reshape(N, K) for t in per_position)
    return PositionStats(ce=ce, kl=kl, tv=tv, overlap=overlap, p_label=p_label, correct=correct,
                         temperature=temperature)


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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.term:
            cls.needs_soft = TERMS[cls.term].needs_soft

    def __init__(self, cfg: LossConfig):
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

    def stats(self, hidden_BNKH: Tensor, lm_head_VH: Tensor, batch: LabelledBatch) -> tuple[PositionStats, Tensor]:
        """Per-position stats [N, K] (all blocks flattened into N) and the valid mask."""
        K, H = hidden_BNKH.shape[-2:]
        labels_NK = batch.labels_BNK.reshape(-1, K)
        soft = self.needs_soft and batch.soft_vals_BNKk is not None
        c = self.lm_head
        stats = compute_position_stats(
            hidden_BNKH.reshape(-1, K, H), lm_head_VH, labels_NK,
            soft_vals_NKk=batch.soft_vals_BNKk.flatten(0, -3) if soft else None,
            soft_idx_NKk=batch.soft_idx_BNKk.flatten(0, -3) if soft else None,
            temperature=c.temperature, chunk_size=c.chunk_size, need_soft=self.needs_soft,
            lm_head_grad=c.lm_head_grad)
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
    """The names a loss config picks exist (ValueError naming the key otherwise)."""
    LOSSES.check(cfg.name)
    LM_HEAD_GRADS.check(cfg.lm_head_grad)
    if cfg.chunk_size < 1:
        raise ValueError(f"loss.chunk_size must be >= 1, got {cfg.chunk_size}")


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
    of leading correct positions (the draft tokens a greedy verifier accepts).
    """
    correct_NK = (stats.correct & valid_NK).float()
    valid_f_NK = valid_NK.float()
    acc_per_pos = correct_NK.sum(0) / valid_f_NK.sum(0).clamp_min(1.0)
    acc = correct_NK.sum() / valid_f_NK.sum().clamp_min(1.0)
    streak_N = torch.cumprod(correct_NK, dim=1).sum(1)
    block_valid_N = valid_NK.any(dim=1).float()
    streak = (streak_N * block_valid_N).sum() / block_valid_N.sum().clamp_min(1.0)
    return {"acc_per_pos": acc_per_pos, "acc": acc, "streak": streak}
