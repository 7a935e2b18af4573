"""Per-position drafter stats against a frozen LM head, with the hidden-state gradient made in the forward.

Why this module exists: the recompute path in ``dflash.training.position_stats`` runs each chunk of positions under
activation checkpointing, so the backward recomputes the [C, V] logits.  Per chunk that costs three
head matmuls (logits, the recompute, the gradient wrt hidden) plus a second round of float32
elementwise passes over [C, V] (and the allocator churn of their temporaries) — the same churn the
original pipeline's chunked loss had.  Here every stat of position p depends only on hidden[p], and
its gradient wrt the logits z is "dense softmax + sparse top-k", so the forward can finish the
job while the logits are still alive:

    G_ce = (q - e_y) @ W                                              q = softmax(z)
    G_kl = (Σp q_T - Σ_k p_k e_{i_k}) @ W / T                         q_T = softmax(z / T)
    G_tv = (s q_T@W - Σ_k c_k q_k W[i_k]) / T                         c_k = d min(p_k, q_k) / d q_k
                                                                      s = Σ_k c_k q_k

These [C, D] float32 gradients are kept and the backward only forms Σ_stat grad_stat · G_stat.
Per chunk that is no recompute, two head matmuls instead of three (logits + one dense product;
soft labels at T != 1 need a second dense product, for q_T), the top-k sums done by
``F.embedding_bag`` (never a [C, k, D] gather), and at most two [C, V] float32 blocks alive at a
time (temporaries are made in place).  The head must be frozen (its gradient is never formed);
``dflash.training.position_stats.compute_position_stats`` falls back to the recompute path otherwise.

Precision: with a bf16 head the [C, V] coefficients are rounded to bf16 before the matmul, as
autograd does with the logits' gradient.  So the sparse parts of the smooth stats (e_y for CE, the
top-k p for KL) are scattered into the coefficient matrix in float32 *before* that rounding rather
than subtracted after the matmul: near the optimum softmax@W and W[y] (or Σ p_k W[i_k]) nearly
cancel, and subtracting them after bf16 rounding leaves an error as large as the gradient itself.
With soft labels the q_T product carries KL's coefficients; at T = 1 it is the chunk's only dense
product and CE's gradient is derived from it with a small bag whose coefficients are formed in
float32.  Measured on an H200 with the production head (V = 248,320, D = 5120, bf16), each stat's
gradient stays within 2x of the recompute path's own bf16 error.

On CUDA the hard-label chunk (the default loss's) runs on two Triton kernels instead (``loss.lm_head_kernel``,
``dflash.training.lm_head_triton``): the same values from 6 bytes moved per logit instead of ~58.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.registry import Registry
from dflash.target.lm_head import resolve_chunk  # noqa: F401  (the chunk rule the losses share with the target)
from dflash.training import lm_head_triton
from dflash.training.topk import top_k_rows

# The label of a position with no target (block padding): written by dflash.training.batching, skipped by
# every stat and loss. torch's cross_entropy default ignore_index; the project's one spelling of it.
IGNORE_INDEX = lm_head_triton.IGNORE
_LOW_PRECISION = (torch.bfloat16, torch.float16)

def _triton_kernel_or_fail(device: torch.device) -> bool:
    if not lm_head_triton.triton_available(device):
        raise ValueError(f"loss.lm_head_kernel=triton needs Triton and a CUDA device (here: {device}, Triton "
                         f"{'imports' if lm_head_triton.triton is not None else 'does not import'}); use auto or torch")
    return True


# loss.lm_head_kernel -> whether the hard-label chunk runs on lm_head_triton's two kernels on this device (soft
# labels, a float32 / float64 head and the recompute path always take the torch chunk). auto: where they can run.
# At the 27B shapes, in one process: the LM-head loss 41.6 -> see benchmarks/RESULTS.md, 2026-12-01.
LM_HEAD_KERNELS: Registry = Registry("loss.lm_head_kernel", {
    "auto": lm_head_triton.triton_available,
    "torch": lambda device: False,
    "triton": _triton_kernel_or_fail,
})


# --------------------------------------------------------------------------
# Head products (shared with the recompute path)
# --------------------------------------------------------------------------


def chunk_logits(hidden_CD: Tensor, lm_head_VD: Tensor) -> Tensor:
    """[C, V] logits in float32 (float64 for float64 inputs); a bf16/fp16 head multiplies on tensor cores
    in its own dtype and only the chunk's logits are upcast — never a float32 copy of a 250k-row head."""
    out_dtype = torch.promote_types(hidden_CD.dtype, torch.float32)
    if lm_head_VD.dtype in _LOW_PRECISION:
        return (hidden_CD.to(lm_head_VD.dtype) @ lm_head_VD.T).to(out_dtype)
    return hidden_CD.to(out_dtype) @ lm_head_VD.to(out_dtype).T


def _dense_product(coef_CV: Tensor, head_VD: Tensor, out_dtype: torch.dtype) -> Tensor:
    """coef @ W, [C, D], multiplied in the head's dtype (like autograd's grad wrt hidden) and upcast."""
    return (coef_CV.to(head_VD.dtype) @ head_VD).to(out_dtype)


def _sparse_product(idx_Ck: Tensor, coef_Ck: Tensor, head_VD: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Σ_k coef_k W[idx_k], [C, D], without materialising the [C, k, D] gathered rows."""
    bag_CD = F.embedding_bag(idx_Ck, head_VD, per_sample_weights=coef_Ck.to(head_VD.dtype), mode="sum")
    return bag_CD.to(out_dtype)


# --------------------------------------------------------------------------
# One chunk: stats, and (optionally) their gradients wrt hidden
# --------------------------------------------------------------------------


def _soft_target(soft_vals_Ck: Tensor, valid_C: Tensor, temperature: float, dtype: torch.dtype):
    """log p and p of the target's top-k, p = softmax(vals / T).  Invalid rows get dummy values so
    padding garbage (e.g. all -inf) cannot yield NaNs."""
    vals_Ck = torch.where(valid_C[:, None], soft_vals_Ck.to(dtype), 0.0)
    log_p_Ck = torch.log_softmax(vals_Ck / temperature, dim=-1)
    return log_p_Ck, log_p_Ck.exp()


def _min_grad_weight(q_Ck: Tensor, p_Ck: Tensor) -> Tensor:
    """d min(p, q) / d q: 1 where q < p, 0 where q > p and, as torch.minimum's backward, 1/2 on ties."""
    return torch.where(q_Ck < p_Ck, 1.0, torch.where(q_Ck == p_Ck, 0.5, 0.0)).to(q_Ck.dtype)


def _chunk_forward(
    hidden_CD: Tensor,
    head_VD: Tensor,
    labels_C: Tensor,
    soft_vals_Ck: Tensor | None,
    soft_idx_Ck: Tensor | None,
    temperature: float,
    need_grad: bool,
    use_triton: bool = False,
    top_k: int = 0,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Stats ({ce, p_label, correct} + {kl, tv, overlap} with soft labels, + {top_k_idx, top_k_val} [C, top_k] when
    ``top_k``) and, when ``need_grad``, the [C, D] gradient of each differentiable stat wrt hidden ({ce} + {kl, tv}).
    ``use_triton``: hard labels with a bf16 / fp16 head take ``lm_head_triton.hard_label_chunk`` (the same values,
    6 bytes per logit). ``top_k``: each row's top-k vocabulary ids and their logits, taken from these very logits
    (the head's dtype's values) before they are overwritten: DFlash 2's selector candidates and their unary scores
    without a second pass over the vocabulary."""
    if use_triton and soft_vals_Ck is None and head_VD.dtype in _LOW_PRECISION and hidden_CD.dtype != torch.float64:
        # unlabelled rows: 0 coefficients
        return lm_head_triton.hard_label_chunk(hidden_CD, head_VD, labels_C, need_grad, top_k)
    logits_CV = chunk_logits(hidden_CD, head_VD)
    valid_C = labels_C != IGNORE_INDEX
    safe_labels_C = torch.where(valid_C, labels_C, 0)

    lse_C = torch.logsumexp(logits_CV, dim=-1)
    label_logit_C = logits_CV.gather(1, safe_labels_C[:, None]).squeeze(1)
    ce_C = torch.where(valid_C, lse_C - label_logit_C, 0.0)
    stats = {
        "ce": ce_C,
        "p_label": torch.where(valid_C, torch.exp(-ce_C), 0.0),
        "correct": (logits_CV.argmax(dim=-1) == labels_C) & valid_C,
    }
    if top_k:
        stats["top_k_val"], stats["top_k_idx"] = top_k_rows(logits_CV, top_k)
    grads: dict[str, Tensor] = {}
    shared_T = temperature == 1.0  # q_T is the CE softmax: one dense product serves CE, KL and TV
    if soft_vals_Ck is not None:
        safe_idx_Ck = torch.where(valid_C[:, None], soft_idx_Ck, 0)
        soft_stats, soft_grads, (p_Ck, q_Ck) = _soft_stats_and_grads(
            logits_CV, lse_C, head_VD, valid_C, soft_vals_Ck, safe_idx_Ck, temperature, need_grad
        )
        stats.update(soft_stats)
        grads.update(soft_grads)

    if need_grad:
        # softmax(z) in place of the logits, which are not needed any more.
        probs_CV = logits_CV.sub_(lse_C[:, None]).exp_()
        del logits_CV
        if soft_vals_Ck is not None and shared_T:
            grads.update(_soft_grads_shared_softmax(probs_CV, head_VD, safe_labels_C, safe_idx_Ck, p_Ck, q_Ck))
        else:
            grads["ce"] = _ce_grad(probs_CV, head_VD, safe_labels_C)
        del probs_CV
        for G_CD in grads.values():  # padding positions have constant (zero) stats
            G_CD.masked_fill_(~valid_C[:, None], 0.0)
    return stats, grads


def chunk_stats(
    hidden_CD: Tensor,
    head_VD: Tensor,
    labels_C: Tensor,
    soft_vals_Ck: Tensor | None = None,
    soft_idx_Ck: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
) -> dict[str, Tensor]:
    """One chunk's stats ({ce, p_label, correct}, + {kl, tv, overlap} with soft labels, + {top_k_idx, top_k_val} when
    ``top_k``) in plain torch ops that autograd differentiates: the one implementation of the CE / KL / TV maths.
    The fused path forms their gradients by hand (``_chunk_forward`` with ``need_grad``); the recompute path
    (``position_stats``) runs this under activation checkpointing."""
    return _chunk_forward(hidden_CD, head_VD, labels_C, soft_vals_Ck, soft_idx_Ck, temperature, need_grad=False,
                          top_k=top_k)[0]


def _soft_stats_and_grads(
    logits_CV: Tensor,
    lse_C: Tensor,
    head_VD: Tensor,
    valid_C: Tensor,
    soft_vals_Ck: Tensor,
    safe_idx_Ck: Tensor,
    temperature: float,
    need_grad: bool,
) -> tuple[dict[str, Tensor], dict[str, Tensor], tuple[Tensor, Tensor]]:
    """KL / TV / overlap against the target's top-k, their gradients wrt hidden when ``need_grad`` and
    T != 1 (from q_T's own dense product; at T = 1 the caller makes them with CE's from one product),
    and (p, q) at the target's indices."""
    # Drafter q_T = softmax(z / T) over V; at T = 1 the CE log-normaliser is reused.
    shared_T = temperature == 1.0
    scaled_CV = logits_CV if shared_T else logits_CV / temperature
    lse_T_C = lse_C if shared_T else torch.logsumexp(scaled_CV, dim=-1)
    log_q_Ck = scaled_CV.gather(1, safe_idx_Ck) - lse_T_C[:, None]
    log_p_Ck, p_Ck = _soft_target(soft_vals_Ck, valid_C, temperature, logits_CV.dtype)
    q_Ck = log_q_Ck.exp()
    kl_terms_Ck = torch.where(p_Ck > 0, p_Ck * (log_p_Ck - log_q_Ck), 0.0)
    overlap_C = torch.where(valid_C, torch.minimum(p_Ck, q_Ck).sum(dim=-1), 0.0)
    stats = {
        "kl": torch.where(valid_C, kl_terms_Ck.sum(dim=-1), 0.0),
        "tv": torch.where(valid_C, 1.0 - overlap_C, 0.0),
        "overlap": overlap_C,
    }
    grads: dict[str, Tensor] = {}
    if need_grad and not shared_T:
        # q_T in place of the scaled logits (their last use): the chunk's second [C, V] block.
        q_T_CV = scaled_CV.sub_(lse_T_C[:, None]).exp_()
        del scaled_CV
        grads = _soft_grads_own_softmax(q_T_CV, head_VD, safe_idx_Ck, p_Ck, q_Ck, temperature)
    return stats, grads, (p_Ck, q_Ck)


def _ce_grad(probs_CV: Tensor, head_VD: Tensor, safe_labels_C: Tensor) -> Tensor:
    """G_ce = (softmax - e_y) @ W; consumes ``probs_CV`` (e_y is subtracted in place, before the cast)."""
    probs_CV.scatter_add_(1, safe_labels_C[:, None], torch.full_like(probs_CV[:, :1], -1.0))
    return _dense_product(probs_CV, head_VD, probs_CV.dtype)


def _kl_product(q_T_CV: Tensor, head_VD: Tensor, safe_idx_Ck: Tensor, p_Ck: Tensor) -> Tensor:
    """(Σp q_T - Σ_k p_k e_{i_k}) @ W = T G_kl; consumes ``q_T_CV`` (coefficients formed in place)."""
    kl_coef_CV = q_T_CV.mul_(p_Ck.sum(dim=-1, keepdim=True)).scatter_add_(1, safe_idx_Ck, -p_Ck)
    return _dense_product(kl_coef_CV, head_VD, p_Ck.dtype)


def _tv_grad(
    kl_product_CD: Tensor, head_VD: Tensor, safe_idx_Ck: Tensor, p_Ck: Tensor, q_Ck: Tensor, temperature: float
) -> Tensor:
    """G_tv = (s q_T@W - Σ_k c_k q_k W[i_k]) / T, s = Σ_k c_k q_k, c_k = d min(p_k, q_k) / d q_k.

    q_T@W = (kl_product + Σ_k p_k W[i_k]) / Σp, so one bag over the top-k with coefficients
    c_k q_k - s p_k / Σp (formed in float32) completes it."""
    p_sum_C1 = p_Ck.sum(dim=-1, keepdim=True)
    cq_Ck = _min_grad_weight(q_Ck, p_Ck) * q_Ck
    s_C1 = cq_Ck.sum(dim=-1, keepdim=True)
    sparse_CD = _sparse_product(safe_idx_Ck, cq_Ck - s_C1 * p_Ck / p_sum_C1, head_VD, kl_product_CD.dtype)
    return (s_C1 / p_sum_C1 * kl_product_CD - sparse_CD) / temperature


def _soft_grads_own_softmax(
    q_T_CV: Tensor, head_VD: Tensor, safe_idx_Ck: Tensor, p_Ck: Tensor, q_Ck: Tensor, temperature: float
) -> dict[str, Tensor]:
    """KL and TV gradients for T != 1 from one dense product of q_T (consumed)."""
    kl_product_CD = _kl_product(q_T_CV, head_VD, safe_idx_Ck, p_Ck)
    return {
        "kl": kl_product_CD / temperature,
        "tv": _tv_grad(kl_product_CD, head_VD, safe_idx_Ck, p_Ck, q_Ck, temperature),
    }


def _soft_grads_shared_softmax(
    probs_CV: Tensor, head_VD: Tensor, safe_labels_C: Tensor, safe_idx_Ck: Tensor, p_Ck: Tensor, q_Ck: Tensor
) -> dict[str, Tensor]:
    """CE, KL and TV gradients for T = 1 from one dense product, the KL one (``probs_CV`` consumed).

    The dense coefficients are KL's, so its (smooth, vanishing at the optimum) gradient keeps
    autograd's precision; G_ce = G_kl / Σp + (Σ_k p_k e_{i_k} / Σp - e_y) @ W adds one small bag,
    whose coefficient at y (usually the target's top-1) is formed in float32 as p_k / Σp - 1."""
    kl_product_CD = _kl_product(probs_CV, head_VD, safe_idx_Ck, p_Ck)
    p_sum_C1 = p_Ck.sum(dim=-1, keepdim=True)
    is_label_Ck = safe_idx_Ck == safe_labels_C[:, None]
    is_label_Ck &= is_label_Ck.cumsum(dim=-1) == 1  # e_y once, should the top-k repeat an index
    label_outside_C1 = (~is_label_Ck.any(dim=-1, keepdim=True)).to(p_Ck.dtype)
    bag_idx_Cj = torch.cat([safe_idx_Ck, safe_labels_C[:, None]], dim=1)
    bag_coef_Cj = torch.cat([p_Ck / p_sum_C1 - is_label_Ck.to(p_Ck.dtype), -label_outside_C1], dim=1)
    return {
        "ce": kl_product_CD / p_sum_C1 + _sparse_product(bag_idx_Cj, bag_coef_Cj, head_VD, p_Ck.dtype),
        "kl": kl_product_CD,
        "tv": _tv_grad(kl_product_CD, head_VD, safe_idx_Ck, p_Ck, q_Ck, 1.0),
    }


# --------------------------------------------------------------------------
# Autograd function over all positions
# --------------------------------------------------------------------------

_GRAD_STATS = ("ce", "kl", "tv")  # differentiable outputs, in output order
_OUTPUTS = ("ce", "kl", "tv", "overlap", "p_label", "correct", "top_k_idx", "top_k_val")


class FusedLMHeadStats(torch.autograd.Function):
    """Per-position stats [P] (ce, kl, tv, overlap, p_label, correct; the soft ones None without soft
    labels) and the top-k ids and logits [P, top_k] (None at top_k 0; not differentiable), whose backward is
    Σ_stat grad_stat · G_stat with G made in the forward."""

    @staticmethod
    def forward(ctx, hidden_PD, lm_head_VD, labels_P, soft_vals_Pk, soft_idx_Pk, temperature, chunk_size, need_grad,
                kernel="torch", top_k=0):
        out_dtype = torch.promote_types(hidden_PD.dtype, torch.float32)
        # A full-precision head is cast once per call, not once per chunk (a no-op in the usual cases).
        head_VD = lm_head_VD if lm_head_VD.dtype in _LOW_PRECISION else lm_head_VD.to(out_dtype)
        soft = soft_vals_Pk is not None
        use_triton = LM_HEAD_KERNELS[kernel](hidden_PD.device)
        stat_parts: dict[str, list[Tensor]] = {}
        grad_parts: dict[str, list[Tensor]] = {}
        for start in range(0, hidden_PD.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            stats, grads = _chunk_forward(
                hidden_PD[sl], head_VD, labels_P[sl],
                soft_vals_Pk[sl] if soft else None, soft_idx_Pk[sl] if soft else None,
                temperature, need_grad, use_triton, top_k,
            )
            for parts, chunk in ((stat_parts, stats), (grad_parts, grads)):
                for name, t in chunk.items():
                    parts.setdefault(name, []).append(t)

        outputs = tuple(torch.cat(stat_parts[n]) if n in stat_parts else None for n in _OUTPUTS)
        ctx.mark_non_differentiable(*(t for n, t in zip(_OUTPUTS, outputs) if n not in _GRAD_STATS and t is not None))
        ctx.set_materialize_grads(False)
        ctx.grad_names = tuple(n for n in _GRAD_STATS if n in grad_parts)
        ctx.hidden_dtype = hidden_PD.dtype
        ctx.save_for_backward(*(torch.cat(grad_parts[n]) for n in ctx.grad_names))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_of = dict(zip(_OUTPUTS, grad_outputs))
        grad_hidden_PD = None
        for name, G_PD in zip(ctx.grad_names, ctx.saved_tensors):
            g_P = grad_of[name]
            if g_P is None:  # stat not used by the loss
                continue
            term_PD = g_P.to(G_PD.dtype)[:, None] * G_PD
            grad_hidden_PD = term_PD if grad_hidden_PD is None else grad_hidden_PD.add_(term_PD)
        if grad_hidden_PD is not None:
            grad_hidden_PD = grad_hidden_PD.to(ctx.hidden_dtype)
        return grad_hidden_PD, None, None, None, None, None, None, None, None, None


def fused_position_stats(
    hidden_PD: Tensor,
    lm_head_VD: Tensor,
    labels_P: Tensor,
    soft_vals_Pk: Tensor | None,
    soft_idx_Pk: Tensor | None,
    *,
    temperature: float,
    chunk_size: int,
    kernel: str = "auto",
    top_k: int = 0,
) -> tuple[Tensor | None, ...]:
    """(ce, kl, tv, overlap, p_label, correct), each [P] (soft ones None without soft labels), and top_k_idx,
    top_k_val [P, top_k] (None at top_k 0): each position's top-k ids of the logits the chunks compute anyway, and
    those logits (no gradient: `selector_loss.CandidateLogits` gives the selector's).

    The head is treated as frozen: no gradient flows to ``lm_head_VD``.  Gradients wrt hidden are
    only formed (and kept) when grad mode is on and ``hidden_PD`` requires grad. ``kernel``: LM_HEAD_KERNELS."""
    if (soft_vals_Pk is None) != (soft_idx_Pk is None):
        raise ValueError("soft_vals_Pk and soft_idx_Pk must be given together")
    need_grad = torch.is_grad_enabled() and hidden_PD.requires_grad
    return FusedLMHeadStats.apply(
        hidden_PD, lm_head_VD, labels_P, soft_vals_Pk, soft_idx_Pk, temperature, chunk_size, need_grad, kernel, top_k
    )
