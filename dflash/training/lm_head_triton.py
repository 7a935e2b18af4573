"""The hard-label LM-head chunk in two Triton passes over its bf16 logits (`loss.lm_head_kernel`).

Why: at the 27B shapes (V = 248,320) the torch chunk of ``dflash.training.lm_head_loss`` upcasts the [C, V]
logits to float32 and then makes ~10 float32 passes over them (logsumexp's own temporaries, argmax, the
softmax in place, the scatter of -e_y, the cast back to bf16): ~58 bytes moved per logit, ~15 ms of a 139 ms
drafter step, beside ~27 ms of the two head matmuls (benchmarks/RESULTS.md, 2026-12-01). Here:

1. ``_row_stats_kernel`` reads each row of bf16 logits once and keeps a running max, the sum of exp (rescaled
   when the max grows: the online softmax of Milakov & Gimelshein 2018), the first index of the max and the
   label's logit: logsumexp, CE, p_label and "correct" come from these [C] scalars;
2. ``_ce_coef_kernel`` reads the logits again and writes softmax(z) - e_y over them, in place, rounded to bf16:
   the coefficient matrix of G_ce = (q - e_y) @ W, which the caller multiplies by the head.

6 bytes per logit beside the matmul's own write. The values are the torch chunk's: the logits are the same
bf16 matmul output (upcasting them there is exact), the statistics are float32, e_y is subtracted in float32
before the one rounding to bf16 (why that order matters: ``lm_head_loss``'s docstring), rows without a label
(IGNORE_INDEX) get zero coefficients. Only the summation order of the exp sum differs (tests: a few ulp).

Soft labels (KL / TV) keep the torch chunk. Available where Triton imports and the logits are on a CUDA device,
or on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from dflash.training import topk

try:  # Triton ships with CUDA builds of torch; the CPU-only dev and CI machines lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

IGNORE = -100  # dflash.training.lm_head_loss.IGNORE_INDEX (imported there from here would be circular)
BLOCK_V = 4096  # logits per program step: 8 KiB of bf16 per load, 16 per thread at 8 warps


def triton_available(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device` here."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _row_stats_kernel(logits_ptr, labels_ptr, lse_ptr, label_logit_ptr, argmax_ptr, group_max_ptr, V, stride_row,
                          BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """One program per row: logsumexp, the label's logit and the first index of the max, in one read; with
        GROUP > 0 also the maximum of each group of GROUP consecutive logits (GROUP divides BLOCK and V)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        run_arg = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + cols
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            if GROUP > 0:  # the top-k's first pass (dflash.training.topk), from the registers this pass holds
                n_groups = V // GROUP
                group_max = tl.max(tl.reshape(x, (BLOCK // GROUP, GROUP)), axis=1)
                at = start // GROUP + tl.arange(0, BLOCK // GROUP)
                tl.store(group_max_ptr + row * n_groups + at, group_max.to(group_max_ptr.dtype.element_ty),
                         mask=at < n_groups)
            blk_max = tl.max(x, axis=0)
            blk_arg = tl.argmax(x, axis=0).to(tl.int64)  # the first index of the block's max
            new_max = tl.maximum(run_max, blk_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            run_arg = tl.where(blk_max > run_max, start + blk_arg, run_arg)  # strict: an earlier tie stays
            run_max = new_max
        label = tl.load(labels_ptr + row)
        tl.store(lse_ptr + row, run_max + tl.log(run_sum))
        tl.store(label_logit_ptr + row, tl.load(base + label).to(tl.float32))
        tl.store(argmax_ptr + row, run_arg)

    @triton.jit
    def _ce_coef_kernel(logits_ptr, lse_ptr, labels_ptr, V, stride_row, IGNORE_LABEL: tl.constexpr,
                        BLOCK: tl.constexpr):
        """softmax(z) - e_y over the logits in place (float32, one rounding); rows without a label get 0."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        ptr = logits_ptr + row * stride_row + offs
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        label = tl.load(labels_ptr + row)
        coef = tl.exp(x - tl.load(lse_ptr + row)) - tl.where(offs == label, 1.0, 0.0)
        coef = tl.where(label != IGNORE_LABEL, coef, 0.0)
        tl.store(ptr, coef.to(logits_ptr.dtype.element_ty), mask=mask)


def row_stats(logits_CV: Tensor, safe_labels_C: Tensor, group: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(logsumexp [C] float32, the label's logit [C] float32, argmax [C] int64, the maximum of each group of `group`
    consecutive logits [C, V / group] in the logits' dtype, None at `group` 0) of contiguous [C, V] logits;
    `safe_labels_C` must lie in 0..V-1 (the caller maps IGNORE_INDEX to 0 and masks the result); `group`, a power
    of two up to BLOCK_V, must divide V."""
    C, V = logits_CV.shape
    if group and (V % group or BLOCK_V % group or group & (group - 1)):
        raise ValueError(f"row_stats: group {group} must be a power of two dividing V = {V} and {BLOCK_V}")
    lse = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    label_logit = torch.empty_like(lse)
    argmax = torch.empty(C, dtype=torch.int64, device=logits_CV.device)
    group_max = torch.empty(C, V // group, dtype=logits_CV.dtype, device=logits_CV.device) if group else None
    _row_stats_kernel[(C,)](logits_CV, safe_labels_C, lse, label_logit, argmax,
                            group_max if group else lse, V, logits_CV.stride(0),
                            BLOCK=BLOCK_V, GROUP=group, num_warps=8)
    return lse, label_logit, argmax, group_max


def ce_coefficients_(logits_CV: Tensor, lse_C: Tensor, labels_C: Tensor) -> Tensor:
    """softmax(z) - e_y written over `logits_CV` (rows labelled IGNORE_INDEX: 0); returns it."""
    C, V = logits_CV.shape
    _ce_coef_kernel[(C, triton.cdiv(V, BLOCK_V))](logits_CV, lse_C, labels_C, V, logits_CV.stride(0),
                                                  IGNORE_LABEL=IGNORE, BLOCK=BLOCK_V, num_warps=8)
    return logits_CV


def top_k_group(V: int, k: int) -> int:
    """The group size of the top-k's first pass in `row_stats`, or 0 where the chunk takes `topk.top_k_rows`
    instead (`topk.FUSED_FIRST_PASS` off, or no power of two up to BLOCK_V splits the rows)."""
    g = topk.group_size(V, k) if topk.FUSED_FIRST_PASS else 0
    return g if g and BLOCK_V % g == 0 else 0


def hard_label_chunk(hidden_CD: Tensor, head_VD: Tensor, labels_C: Tensor, need_grad: bool,
                     top_k: int = 0) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The torch chunk's (stats, grads) for hard labels — {ce, p_label, correct} (+ {top_k_idx, top_k_val} [C, top_k] when
    `top_k`: the top-k of the bf16 logits and their values, taken before the coefficients overwrite them), {ce: G_ce [C, D]
    float32} — from a bf16 / fp16 head's logits, with the two kernels above in place of its float32 passes."""
    logits_CV = hidden_CD.to(head_VD.dtype) @ head_VD.T  # [C, V] in the head's dtype, contiguous
    valid_C = labels_C != IGNORE
    group = top_k_group(logits_CV.shape[1], top_k) if top_k else 0
    lse_C, label_logit_C, argmax_C, group_max_Cn = row_stats(logits_CV, torch.where(valid_C, labels_C, 0), group)
    ce_C = torch.where(valid_C, lse_C - label_logit_C, 0.0)
    stats = {"ce": ce_C, "p_label": torch.where(valid_C, torch.exp(-ce_C), 0.0),
             "correct": (argmax_C == labels_C) & valid_C}
    if top_k:
        vals, stats["top_k_idx"] = (topk.top_k_of_groups(logits_CV, group_max_Cn, top_k) if group
                                    else topk.top_k_rows(logits_CV, top_k))
        stats["top_k_val"] = vals.float()
    if not need_grad:
        return stats, {}
    coef_CV = ce_coefficients_(logits_CV, lse_C, labels_C)
    return stats, {"ce": (coef_CV @ head_VD).float()}
