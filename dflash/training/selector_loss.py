"""DFlash 2's training objective: any block loss plus α × the candidate selector's K-way cross-entropy.

z-lab did not publish DFlash 2's objective; the public trainers (speculators' `dflash2`, SpecForge, ModelOpt)
converge on this one (docs/dflash2.md):
- candidates: each position's unary top-k (the drafter's logits, no gradient through the choice), taken in the
  block loss's own chunked pass over the vocabulary, from the logits it computes anyway, in the head's dtype
  (`PositionStats.top_k_idx`), with their logits, the unary scores (`top_k_val`): no second full-vocabulary product
  and no second gather of their head rows. At the 27B shapes, with that second pass (a 2·S·H·V = 10.4 TFLOP product
  and a top-k over [S, V]), DFlash 2's loss phase took 58.6 ms against DFlash 1's 26.5
  (benchmarks/log/2026-12-05.md). `candidates="recompute"` keeps it (`unary_topk`, `CandidateLogits` in float32):
  the plain reference;
- the gold token (the target's greedy label) is injected in place of the last candidate when the top-k misses it,
  so the CE always has a target;
- the predecessor is teacher-forced: the gold token of the previous position (the anchor before position 1;
  token 0 after an ignored position, whose label is unknown);
- scores s(a, b) = unary(b) + ⟨pred[a] ⊙ h·P, succ[b]⟩ (dflash/drafter/selector.py), CE over the k scores;
- `loss.selector_alpha` weighs it against the block loss (plain mean over valid positions).
Metrics (device tensors, logged as train/…): `selector_ce`, `candidate_recall` (the gold token in the unary
top-k), `selector_acc` (the teacher-forced selector picks the gold token from the un-injected candidates) and
`selector_streak` (the self-conditioned walk's accepted length: leading positions where its own path matches).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.drafter import selector_triton
from dflash.training.lm_head_loss import _LOW_PRECISION, IGNORE_INDEX, _sparse_product
from dflash.training.losses import block_metrics
from dflash.training.topk import top_k_rows

TOPK_LOGITS_BYTES = 1 << 30  # float32 logits per no-grad top-k chunk (1 GiB, as the block loss's chunks)


@torch.no_grad()
def unary_topk(hidden_SH: Tensor, lm_head_VH: Tensor, k: int, shape_logits) -> Tensor:
    """Candidate ids [S, k]: the top-k of `shape_logits(h · W)` per row, in row chunks of TOPK_LOGITS_BYTES.

    The product runs in the head's own dtype, as an engine computes the logits it takes the top-k of (bfloat16 for a
    bfloat16 target): only the choice of candidates comes from it, their scores are float32 (`CandidateLogits`).
    It used to be a float32 product: for a bfloat16 head that ran at the GPU's float32 rate (2·S·H·V = 10.4 TFLOP a
    step on the 27B-shape bench, at least 0.16 s at an H100's 67 TFLOP/s, of the 0.23 s by which DFlash 2's loss
    phase exceeded DFlash 1's) and copied the whole head to float32 for every chunk (4.7 GiB at V = 248,320,
    H = 5,120; benchmarks/log/2026-12-05.md)."""
    rows = max(1, TOPK_LOGITS_BYTES // (4 * lm_head_VH.shape[0]))
    dt = _at_least_f32(lm_head_VH.dtype)
    out = [top_k_rows(shape_logits((h.to(lm_head_VH.dtype) @ lm_head_VH.T).to(dt)), k)[1]
           for h in hidden_SH.split(rows)]
    return torch.cat(out)


class CandidateLogits(torch.autograd.Function):
    """h_s · W[idx_s, :] for each row's k candidate ids, [S, k], with the gradient to h only (the head is the
    target's, frozen). `values_Sk`: these products if already made (the block loss's pass, whose logits they are),
    else made here in float32, rows in chunks of GATHER_BYTES of gathered head rows (a plain gather would hold
    S·k·H floats at once: GBs at a 5,120-wide target and thousands of positions).

    The backward is Σ_j g_sj W[idx_sj] by `F.embedding_bag` (the LM-head loss's `_sparse_product`): the rows are
    read once and never stored as [S, k, H]. It used to gather them again and contract in float32, two [S, k, H]
    float32 passes of the DFlash 2 step's backward (docs/dflash2.md, "Speed"). With a bfloat16 head the
    coefficients are rounded to bfloat16 first, as autograd rounds a bfloat16 product's output gradient. On a GPU
    the sum is `selector_triton.weighted_rows`: the same rounded coefficients and rows, summed in float32."""

    @staticmethod
    def forward(ctx, hidden_SH: Tensor, head_VH: Tensor, idx_Sk: Tensor, values_Sk: Tensor | None = None) -> Tensor:
        ctx.save_for_backward(head_VH, idx_Sk)
        ctx.hidden_dtype = hidden_SH.dtype
        if values_Sk is not None:
            return values_Sk.clone()  # autograd needs a fresh output tensor
        rows = _gather_rows(idx_Sk.shape[-1], head_VH.shape[-1])
        dt = _at_least_f32(hidden_SH.dtype)
        return torch.cat([torch.einsum("sh,skh->sk", h.to(dt), head_VH[i].to(dt))
                          for h, i in zip(hidden_SH.split(rows), idx_Sk.split(rows))])

    @staticmethod
    def backward(ctx, grad_Sk: Tensor):
        head_VH, idx_Sk = ctx.saved_tensors
        if TRITON_UNARY_GRAD and selector_triton.runs_on(head_VH, grad_Sk) and head_VH.is_cuda:
            # the same sum in one Triton kernel, in float32 (the bag rounds it to the head's dtype): at the reference
            # shapes 0.27 ms against the bag's 1.86 (one H100, benchmarks/log/2026-12-07.md)
            coef = grad_Sk.to(head_VH.dtype)
            return selector_triton.weighted_rows(idx_Sk, coef, head_VH).to(ctx.hidden_dtype), None, None, None
        return _sparse_product(idx_Sk, grad_Sk, head_VH, ctx.hidden_dtype), None, None, None


def gold_logits(hidden_SH: Tensor, head_VH: Tensor, gold_S: Tensor) -> Tensor:
    """h_s · W[gold_s] [S], as the block loss's chunk computes the logit (`lm_head_loss.chunk_logits`): the hidden
    state in the head's dtype, the product rounded to a low-precision head's dtype, returned in float32 (or
    float64): the injected candidate's unary score beside the others' (the top-k values of that pass)."""
    dt = _at_least_f32(hidden_SH.dtype)
    h = hidden_SH.to(head_VH.dtype)
    if TRITON_GOLD_LOGITS and dt == torch.float32 and selector_triton.runs_on(h, head_VH, gold_S):
        # one kernel reads each position's gold row and sums the products in float32, as the line below does
        # through a float32 [S, H] gather and product (four [S, H] passes at the reference shapes' 131,072 x 384)
        out = selector_triton.dots(h.contiguous(), head_VH.contiguous(), gold_S.reshape(-1, 1).contiguous())[:, 0]
    else:
        out = (h.to(dt) * F.embedding(gold_S, head_VH).to(dt)).sum(-1)
    return out.to(head_VH.dtype).to(dt) if head_VH.dtype in _LOW_PRECISION else out


GATHER_BYTES = 1 << 28
# CandidateLogits' backward on a GPU by `selector_triton.weighted_rows` (False: the embedding bag everywhere)
TRITON_UNARY_GRAD = True
# `gold_logits` on a GPU by one `selector_triton.dots` launch (False: the torch gather and product everywhere)
TRITON_GOLD_LOGITS = True
# The walk metric (`selector_streak`) follows at most this many blocks a step, evenly strided: a diagnostic's sample,
# read as a mean over tracking.log_every steps. Over all 8,192 blocks of the reference-shape bench step its 15
# sequential steps cost 2.4 ms of a 48 ms step (one H100, benchmarks/log/2026-12-06.md); the 27B-shape step has
# 256 blocks, all of them followed. On a GPU the greedy walk is one Triton launch (`selector.TRITON_WALK`).
WALK_BLOCKS = 1024


def _at_least_f32(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (the references' precision)."""
    return torch.promote_types(dtype, torch.float32)


def _gather_rows(k: int, H: int) -> int:
    return max(1, GATHER_BYTES // (4 * k * H))


def selector_terms(hidden_NKH: Tensor, lm_head_VH: Tensor, labels_NK: Tensor, anchor_N: Tensor, selector,
                   shape_logits, block_pass: tuple[Tensor, Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Per position [N, K]: the selector CE (with grad), gold-in-top-k, teacher-forced correctness; per block [N]:
    the self-conditioned walk's matched prefix length on at most WALK_BLOCKS blocks, evenly strided ("matched";
    "walked": which of those hold a valid position). `shape_logits`: the drafter's output multiplier and cap.
    `block_pass`: (the hidden states the block loss saw [N, K, H] = multiplier · hidden, the top-k ids [N, K, k] and
    their logits [N, K, k]) when that pass took them: its logits are the unary scores (no cap trains); None takes the
    candidates here (`unary_topk`) and computes their scores (`CandidateLogits`): the plain reference."""
    N, K, H = hidden_NKH.shape
    k = selector.top_k
    valid_NK = labels_NK != IGNORE_INDEX
    gold_NK = labels_NK.clamp_min(0)
    if block_pass is None:
        cand_NKk = unary_topk(hidden_NKH.detach().reshape(-1, H), lm_head_VH, k, shape_logits).view(N, K, k)
    else:
        scaled_NKH, cand_NKk, top_val_NKk = block_pass
    hit_NK = (cand_NKk == gold_NK[..., None]).any(-1)
    injected = cand_NKk.clone()
    injected[..., -1] = torch.where(hit_NK, cand_NKk[..., -1], gold_NK)
    target_NK = (injected == gold_NK[..., None]).int().argmax(-1)
    # unary scores of the injected candidates (with grad), and of the plain ones, which the walk at inference sees:
    # the two differ in the last column only
    if block_pass is None:
        raw_NKk = CandidateLogits.apply(hidden_NKH.reshape(-1, H), lm_head_VH, injected.reshape(-1, k))
        unary_NKk = shape_logits(raw_NKk.view(N, K, k))
        with torch.no_grad():
            dt = unary_NKk.dtype
            last_NK = shape_logits((hidden_NKH.to(dt) * lm_head_VH[cand_NKk[..., -1]].to(dt)).sum(-1))
            plain_NKk = torch.cat([unary_NKk[..., :-1], last_NK[..., None]], dim=-1)
    else:
        with torch.no_grad():
            gold_val_NK = gold_logits(scaled_NKH.reshape(-1, H), lm_head_VH, gold_NK.reshape(-1)).view(N, K)
            values = top_val_NKk.clone()
            values[..., -1] = torch.where(hit_NK, top_val_NKk[..., -1], gold_val_NK.to(values.dtype))
        unary_NKk = CandidateLogits.apply(scaled_NKH.reshape(-1, H), lm_head_VH, injected.reshape(-1, k),
                                          values.reshape(-1, k)).view(N, K, k)
        plain_NKk = top_val_NKk.to(unary_NKk.dtype)
    prev_NK = torch.cat([anchor_N[:, None].long(), gold_NK[:, :-1]], dim=1)
    # one projection for the pair scores and the walk, in a low-precision head's dtype (bf16 for a bf16 target),
    # as the block loss's logits: in float32 its three products (forward, both gradients) ran at the GPU's float32
    # rate (reference shapes 1.99 ms against 1.49 in bf16; the 27B step's GEMMs 82.3 -> 81.3 ms,
    # benchmarks/log/2026-12-07.md); the pair scores read it as float32 and stay float32
    projected_NKr = selector.project(hidden_NKH, lm_head_VH.dtype if lm_head_VH.dtype in _LOW_PRECISION else None)
    scores_NKk = unary_NKk + selector.pair_scores(hidden_NKH, prev_NK, injected, projected_NKr).to(unary_NKk.dtype)
    ce_NK = F.cross_entropy(scores_NKk.reshape(-1, k), target_NK.reshape(-1), reduction="none").view(N, K)
    with torch.no_grad():
        correct_NK = hit_NK & (scores_NKk.argmax(-1) == target_NK)
        w = slice(None, None, -(-N // WALK_BLOCKS))  # the blocks the walk metric follows
        walk = selector.walk_candidates(hidden_NKH[w].detach(), plain_NKk[w], cand_NKk[w], anchor_N[w],
                                        projected_SKr=projected_NKr[w].detach())
        matched_W = torch.cumprod(((walk.tokens == gold_NK[w]) & valid_NK[w]).int(), dim=1).sum(1)
    return {"ce": ce_NK, "hit": hit_NK, "correct": correct_NK, "matched": matched_W, "walked": valid_NK[w].any(1),
            "valid": valid_NK}


def selector_metrics(terms: dict[str, Tensor]) -> dict[str, Tensor]:
    """The selector's CE (mean over valid positions) and its three metrics, on the device."""
    valid = terms["valid"]
    n = valid.sum().clamp_min(1)
    blocks = terms["walked"]
    return {"selector_ce": torch.where(valid, terms["ce"], 0.0).sum() / n,
            "candidate_recall": (terms["hit"] & valid).sum() / n,
            "selector_acc": (terms["correct"] & valid).sum() / n,
            "selector_streak": (terms["matched"] * blocks).sum() / blocks.sum().clamp_min(1)}


# Where the selector's candidates come from: "block", the block loss's chunked pass (the trainer's); "recompute", a
# second no-grad pass over the vocabulary (`unary_topk`), the slow plain reference the tests hold "block" to.
CANDIDATE_SOURCES = ("block", "recompute")


class SelectorLoss:
    """A block loss (any of `LOSSES`) plus `alpha` × the selector CE of `drafter` (a DFlash 2 drafter). The block
    loss sees the hidden states times the output multiplier (logits = multiplier · h · W; a soft cap is refused
    for training at composition), and its chunks also take the selector's candidates, the top-k of those logits
    (`candidates`: CANDIDATE_SOURCES). Same call and attributes as a `Loss`."""

    def __init__(self, block_loss, drafter, alpha: float, candidates: str = "block"):
        if drafter.candidate_selector is None:
            raise ValueError("SelectorLoss needs a drafter with a candidate selector (drafter.architecture=dflash2)")
        if candidates not in CANDIDATE_SOURCES:
            raise ValueError(f"SelectorLoss: candidates={candidates!r}; expected one of {CANDIDATE_SOURCES}")
        self.block, self.drafter, self.alpha, self.candidates = block_loss, drafter, float(alpha), candidates
        self.needs_soft = block_loss.needs_soft
        self.config_keys = (*block_loss.config_keys, "selector_alpha")
        self.cfg = block_loss.cfg

    def __call__(self, hidden_BNKH: Tensor, lm_head_VH: Tensor, batch) -> tuple[Tensor, dict]:
        d = self.drafter
        m = d.cfg.output_multiplier
        scaled_BNKH = hidden_BNKH * m if m != 1.0 else hidden_BNKH
        K, H = hidden_BNKH.shape[-2:]
        block_pass = None
        if self.candidates == "block":
            # the top-k of multiplier · h · W: the shaped logits' own top-k (the multiplier is > 0, and no cap trains)
            stats, valid_NK = self.block.stats(scaled_BNKH, lm_head_VH, batch, top_k=d.candidate_selector.top_k)
            loss, metrics = self.block.reduce(stats, valid_NK), block_metrics(stats, valid_NK)
            block_pass = (scaled_BNKH.reshape(-1, K, H), stats.top_k_idx, stats.top_k_val)
        else:
            loss, metrics = self.block(scaled_BNKH, lm_head_VH, batch)
        terms = selector_terms(hidden_BNKH.reshape(-1, K, H), lm_head_VH, batch.labels_BNK.reshape(-1, K),
                               batch.anchor_tokens_BN.reshape(-1), d.candidate_selector, d.shape_logits, block_pass)
        sel = selector_metrics(terms)
        metrics.update(sel)
        return loss + self.alpha * sel["selector_ce"], metrics


def with_selector(loss_fn, drafter, alpha: float):
    """`loss_fn` itself for a DFlash 1 drafter; wrapped in `SelectorLoss` for a DFlash 2 one."""
    return loss_fn if getattr(drafter, "candidate_selector", None) is None else SelectorLoss(loss_fn, drafter, alpha)
