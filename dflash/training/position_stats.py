"""Per-position drafter statistics against the LM head, chunk by chunk (the stats every loss reads).

The LM head is shared with the target (V up to ~250k), so drafter logits are computed in float32, chunk by
chunk: only per-position scalars leave a chunk, and the N*K*V logits never exist at once, neither in the
forward nor in the backward pass.  Two interchangeable paths compute them (``loss.lm_head_grad``,
``LM_HEAD_GRADS``): "fused" (``dflash.training.lm_head_loss``) forms each stat's gradient wrt the hidden
state in the forward and never recomputes logits; "recompute" (here) runs each chunk under activation
checkpointing and recomputes its logits in the backward.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash.registry import Registry
from dflash.target.lm_head import resolve_chunk
from dflash.training.lm_head_loss import IGNORE_INDEX, LM_HEAD_KERNELS, chunk_stats, fused_position_stats


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
    top_k_idx: Tensor | None = None  # [N, K, k]: each position's top-k vocabulary ids (asked for: DFlash 2's)
    top_k_val: Tensor | None = None  # [N, K, k]: their logits, float32 (detached: the selector's unary scores)


def _hard_chunk(hidden_CD: Tensor, lm_head_VD: Tensor, labels_C: Tensor, top_k: int) -> tuple[Tensor, ...]:
    """CE, correctness and the top-k ids and logits (empty [C, 0] at top_k 0) for one chunk of positions
    (``lm_head_loss.chunk_stats``)."""
    stats = chunk_stats(hidden_CD, lm_head_VD, labels_C, top_k=top_k)
    return stats["ce"], stats["correct"], *_top_k_or_empty(stats, hidden_CD, labels_C)


def _soft_chunk(
    hidden_CD: Tensor,
    lm_head_VD: Tensor,
    labels_C: Tensor,
    soft_vals_Ck: Tensor,
    soft_idx_Ck: Tensor,
    temperature: float,
    top_k: int,
) -> tuple[Tensor, ...]:
    """CE, correctness, the top-k ids and logits, KL, TV and overlap (detached) against top-k soft labels for one
    chunk: the maths of ``lm_head_loss.chunk_stats``, the one implementation both paths share."""
    stats = chunk_stats(hidden_CD, lm_head_VD, labels_C, soft_vals_Ck, soft_idx_Ck, temperature, top_k)
    return (stats["ce"], stats["correct"], *_top_k_or_empty(stats, hidden_CD, labels_C), stats["kl"], stats["tv"],
            stats["overlap"].detach())


def _top_k_or_empty(stats: dict[str, Tensor], hidden_CD: Tensor, labels_C: Tensor) -> tuple[Tensor, Tensor]:
    """The chunk's top-k ids and (detached, float32) logits, or empty [C, 0] ones (a checkpointed chunk returns
    tensors only)."""
    if "top_k_idx" not in stats:
        return labels_C.new_empty(labels_C.shape[0], 0), hidden_CD.new_empty(labels_C.shape[0], 0)
    return stats["top_k_idx"], stats["top_k_val"].detach()


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
    kernel: str = "torch",  # noqa: ARG001 - the fused path's option; the recompute chunks are torch only
    top_k: int = 0,
) -> tuple[Tensor | None, ...]:
    """(ce, kl, tv, overlap, p_label, correct), each [P], and top_k_idx, top_k_val [P, top_k] (None at 0): chunks under
    activation checkpointing, whose backward recomputes the chunk's logits (also differentiates a trainable head)."""
    outputs = []
    for start in range(0, hidden_PD.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if soft_vals_Pk is not None:
            outputs.append(
                _maybe_checkpoint(
                    _soft_chunk, hidden_PD[sl], lm_head_VD, labels_P[sl],
                    soft_vals_Pk[sl], soft_idx_Pk[sl], temperature, top_k,
                )
            )
        else:
            outputs.append(_maybe_checkpoint(_hard_chunk, hidden_PD[sl], lm_head_VD, labels_P[sl], top_k))
    ce, correct, top_k_idx, top_k_val, *soft = (torch.cat(parts) for parts in zip(*outputs))
    kl, tv, overlap = soft if soft else (None, None, None)
    p_label = torch.where(labels_P != IGNORE_INDEX, torch.exp(-ce.detach()), 0.0)
    return (ce, kl, tv, overlap, p_label, correct, *((top_k_idx, top_k_val) if top_k else (None, None)))


# loss.lm_head_grad -> per-position stats over flattened positions; both return
# (ce, kl, tv, overlap, p_label, correct), each [P], the soft ones None without soft labels, and top_k_idx,
# top_k_val [P, k] (None unless top_k is asked for).
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
    chunk_size: int = 0,
    need_soft: bool = False,
    lm_head_grad: str = "fused",
    lm_head_kernel: str = "auto",
    top_k: int = 0,
) -> PositionStats:
    """Per-position CE / KL / TV stats of the drafter, computed in LM-head chunks.

    Logits are float32 (float64 if the inputs are float64; a bf16 head multiplies
    in bf16 with the chunk's logits upcast), ``chunk_size`` flattened positions at
    a time (0: ``resolve_chunk``'s size for this vocabulary), so only [chunk, V] logits exist at any
    time.  ``lm_head_grad`` picks
    how the gradient wrt the hidden state is made (see ``LM_HEAD_GRADS``): "fused"
    in the forward, without recomputing logits; "recompute" under activation
    checkpointing.  A head that requires grad always takes "recompute" (the fused
    path treats the head as frozen).  Soft labels are the target's top-k logits
    (``soft_vals``) at vocabulary indices ``soft_idx``; they are only used when
    ``need_soft`` is set. ``lm_head_kernel`` (``lm_head_loss.LM_HEAD_KERNELS``): whether the fused path's
    hard-label chunks run on Triton kernels. ``top_k`` > 0 also gives each position's top-k vocabulary ids
    (``PositionStats.top_k_idx``) and their logits (``top_k_val``), taken in the same chunks from the same logits
    (DFlash 2's selector candidates and their unary scores).
    """
    N, K, D = hidden_NKD.shape
    if need_soft and (soft_vals_NKk is None or soft_idx_NKk is None):
        raise ValueError("need_soft=True requires soft_vals_NKk and soft_idx_NKk")
    if need_soft and not 0.0 < temperature < float("inf"):  # the soft stats divide the logits by it
        raise ValueError(f"loss.temperature must be > 0 and finite, got {temperature}")
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0: auto), got {chunk_size}")
    chunk_size = resolve_chunk(chunk_size, lm_head_VD.shape[0], lm_head_VD.device)
    LM_HEAD_GRADS.check(lm_head_grad)
    LM_HEAD_KERNELS.check(lm_head_kernel)
    if lm_head_VD.requires_grad:  # only the recompute path differentiates the head
        lm_head_grad = "recompute"

    soft_vals_Pk = soft_idx_Pk = None
    if need_soft:
        k = soft_vals_NKk.shape[-1]
        soft_vals_Pk = soft_vals_NKk.reshape(N * K, k)
        soft_idx_Pk = soft_idx_NKk.reshape(N * K, k)
    per_position = LM_HEAD_GRADS[lm_head_grad](
        hidden_NKD.reshape(N * K, D), lm_head_VD, labels_NK.reshape(N * K), soft_vals_Pk, soft_idx_Pk,
        temperature=temperature, chunk_size=chunk_size, kernel=lm_head_kernel, top_k=top_k,
    )
    *scalars, top_k_idx, top_k_val = per_position
    ce, kl, tv, overlap, p_label, correct = (None if t is None else t.reshape(N, K) for t in scalars)
    top_idx, top_val = (None if t is None else t.reshape(N, K, -1) for t in (top_k_idx, top_k_val))
    return PositionStats(ce=ce, kl=kl, tv=tv, overlap=overlap, p_label=p_label, correct=correct,
                         temperature=temperature, top_k_idx=top_idx, top_k_val=top_val)
