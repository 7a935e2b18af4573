"""`CandidateSelector`: DFlash 2's choice of each block position's token among the drafter's unary top-k.

Parameters, named as z-lab's `CandidateSelector` (z-lab/dflash `dflash/model.py` at 07ebd93) and the published
checkpoints: `predecessor_codebook` [V, r] and `successor_codebook` [V, r] (embedding tables, stored without a
`.weight` suffix), `hidden_projection` = Linear(H, r, no bias) (stored as `hidden_projection.weight` [r, H]);
r = `selector_rank` (256 published), k = `selector_top_k` (16).

The score of candidate b at block position t after predecessor a:
    s_t(a, b) = unary_t(b) + ⟨pred[a] ⊙ (h_t · P), succ[b]⟩
with unary_t the drafter's logits at t (after output_multiplier and the soft cap), h_t its final hidden state and
P the hidden projection. `walk` goes through the block in order, the predecessor of position 1 being the anchor:
greedy takes each position's best-scoring candidate; sampled draws from q_t = softmax(s_t / T) over the k
candidates, which is the draft distribution that rejection sampling verifies against (q is 0 outside them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter import selector_triton


class SelectorWalk(NamedTuple):
    """A walk's result per block position: the chosen tokens [..., K], the candidates [..., K, k] and the
    scores [..., K, k] of those candidates after the walk's own predecessor (q = softmax(scores / T))."""
    tokens: torch.Tensor
    candidates: torch.Tensor
    scores: torch.Tensor

    def q(self, temperature: float = 1.0) -> torch.Tensor:
        return torch.softmax(self.scores.float() / temperature, dim=-1)

    def dense_q(self, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
        """q over the whole vocabulary [..., K, V]: the candidates' softmax, 0 elsewhere (what rejection sampling
        compares with the target's p; the residual max(p − q, 0) then covers every token outside the top-k)."""
        out = torch.zeros(*self.scores.shape[:-1], vocab_size, device=self.scores.device)
        return out.scatter_(-1, self.candidates, self.q(temperature))


class GatheredDots(torch.autograd.Function):
    """⟨table[idx_sj], gate_s⟩ for each row s and its k ids, [S, k], without keeping the [S, k, r] gathered rows: the
    forward gathers GATHER_BYTES of them at a time (a chunk that stays in cache) and keeps nothing but its inputs;
    the backward is one `F.embedding_bag` (Σ_j g_sj table[idx_sj], the gradient wrt gate) and that bag's own
    backward with `gate` as its output gradient (Σ g_sj gate_s into row idx_sj, the table's gradient: a sorted
    segment sum, never a [S·k, r] product or an atomic add per element). With the rows gathered whole, autograd
    kept a [131,072, 16, 256] float32 gather for the backward at the reference shapes: this took the bench step's
    peak from 15.2 to 11.7 GiB, at the same speed (one H100, benchmarks/log/2026-12-06.md)."""

    @staticmethod
    def forward(ctx, gate_Sr: torch.Tensor, table_Vr: torch.Tensor, idx_Sk: torch.Tensor) -> torch.Tensor:
        ctx.triton = TRITON_PAIR_SCORES and selector_triton.available(gate_Sr, table_Vr)
        if ctx.triton:  # the same sums in two kernels that never write the gathered rows (selector_triton)
            gate_Sr, table_Vr, idx_Sk = gate_Sr.contiguous(), table_Vr.contiguous(), idx_Sk.contiguous()
            ctx.save_for_backward(gate_Sr, table_Vr, idx_Sk)
            return selector_triton.dots(gate_Sr, table_Vr, idx_Sk)
        ctx.save_for_backward(gate_Sr, table_Vr, idx_Sk)
        k, r = idx_Sk.shape[-1], table_Vr.shape[-1]
        rows = max(1, GATHER_BYTES // (table_Vr.element_size() * k * r))
        dt = torch.promote_types(gate_Sr.dtype, table_Vr.dtype)
        return torch.cat([torch.einsum("skr,sr->sk", F.embedding(i, table_Vr).to(dt), g.to(dt))
                          for g, i in zip(gate_Sr.split(rows), idx_Sk.split(rows))])

    @staticmethod
    def backward(ctx, grad_Sk: torch.Tensor):
        gate_Sr, table_Vr, idx_Sk = ctx.saved_tensors
        if ctx.triton:
            grad_gate, grad_table, _ = selector_triton.dots_backward(gate_Sr, table_Vr, idx_Sk, grad_Sk,
                                                                    *ctx.needs_input_grad[:2])
            return grad_gate, grad_table, None
        grad_gate = grad_table = None
        weights = grad_Sk.to(table_Vr.dtype)
        with torch.enable_grad():
            table = table_Vr.detach().requires_grad_(ctx.needs_input_grad[1])
            bag_Sr = F.embedding_bag(idx_Sk, table, per_sample_weights=weights, mode="sum")
            if ctx.needs_input_grad[1]:
                (grad_table,) = torch.autograd.grad(bag_Sr, table, grad_outputs=gate_Sr.to(bag_Sr.dtype))
        if ctx.needs_input_grad[0]:
            grad_gate = bag_Sr.detach().to(gate_Sr.dtype)
        return grad_gate, grad_table, None


class PairScores(torch.autograd.Function):
    """⟨pred[a_s] ⊙ proj_s, succ[b_sj]⟩ [S, k] in `selector_triton`'s two kernels with the gate made in them: the
    gate pred[a_s] ⊙ proj_s is never a tensor, and its gradient goes straight to proj (in proj's dtype, as autograd
    rounds a bf16 product's output gradient) and, by atomic adds, to pred's rows. With `GatheredDots` the gate was
    an [S, r] float32 gather and product, kept for the backward, whose gradient then took two more float32 [S, r]
    products and the predecessor codebook's sorted embedding backward (docs/dflash2.md, "Speed"). The same sums;
    the tables' gradients in no fixed order (`selector_triton`)."""

    @staticmethod
    def forward(ctx, proj_Sr: torch.Tensor, pred_Vr: torch.Tensor, prev_S: torch.Tensor, succ_Vr: torch.Tensor,
                cand_Sk: torch.Tensor) -> torch.Tensor:
        tensors = tuple(t.contiguous() for t in (proj_Sr, pred_Vr, prev_S, succ_Vr, cand_Sk))
        ctx.save_for_backward(*tensors)
        proj, pred, prev, succ, cand = tensors
        return selector_triton.dots(proj, succ, cand, pred, prev)

    @staticmethod
    def backward(ctx, grad_Sk: torch.Tensor):
        proj, pred, prev, succ, cand = ctx.saved_tensors
        need_proj, need_pred, _, need_succ, _ = ctx.needs_input_grad
        grad_proj, grad_succ, grad_pred = selector_triton.dots_backward(proj, succ, cand, grad_Sk, need_proj, need_succ,
                                                                        pred, prev, need_pred)
        return grad_proj, grad_pred, None, grad_succ, None


GATHER_BYTES = 1 << 25  # gathered table rows per forward chunk (32 MiB: within an H100's 50 MB L2)
# float32 pair scores on a GPU take selector_triton's two kernels (False: the torch ops above everywhere)
TRITON_PAIR_SCORES = True
# ... with the gate made in them (`PairScores`; False: the gate a torch product, the kernels `GatheredDots`')
TRITON_FUSED_GATE = True
# the greedy walk over float32 tables on a GPU is selector_triton's one launch (False: walk_candidates' torch loop)
TRITON_WALK = True


_KERNEL_PROJECTIONS = (torch.float32, torch.bfloat16, torch.float16)


def _fused_inputs(projected: torch.Tensor, *tables: torch.Tensor) -> bool:
    """Whether the kernels that read the projection themselves take these: float32 tables on Triton's device
    (`selector_triton.available`), a float32 or 16-bit float projection beside them."""
    return (projected.dtype in _KERNEL_PROJECTIONS and selector_triton.available(*tables)
            and selector_triton.runs_on(projected))


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab_size: int, rank: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        if vocab_size < top_k or rank < 1 or top_k < 1:
            raise ValueError(f"CandidateSelector: needs rank >= 1 and 1 <= top_k <= vocab_size; got rank={rank}, "
                             f"top_k={top_k}, vocab_size={vocab_size}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=self.init_std)

    def project(self, hidden_SH: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """h · P [..., r]: the hidden projection, which every candidate's pair score at a position shares. `dtype`: the
        product's precision and the result's (h and P cast to it), e.g. bf16 as the drafter's other products under
        autocast and as an engine's bf16 weights compute it; the pair scores read it as float32 (`pair_scores`);
        None: P's own dtype."""
        weight = self.hidden_projection.weight
        dt = dtype or weight.dtype
        return F.linear(hidden_SH.to(dt), weight.to(dt))

    def pair_scores(self, hidden_SH: torch.Tensor, pred_S: torch.Tensor, cand_Sk: torch.Tensor,
                    projected_Sr: torch.Tensor | None = None) -> torch.Tensor:
        """⟨pred[a] ⊙ (h · P), succ[b]⟩ for each row's predecessor a and its k candidates b: [..., k].
        `projected_Sr`: `project(hidden_SH)` if already made (the training step's walk reuses its pair scores')."""
        # F.embedding, not codebook[ids]: indexing's backward (index_put_ with accumulate) walks each run of a
        # repeated id in one warp, and a frequent token is a candidate at most positions (the reference-shape step's
        # backward 11x DFlash 1's, docs/dflash2.md "Speed"); embedding's backward splits long runs.
        if projected_Sr is None:
            projected_Sr = self.project(hidden_SH)
        pred_Vr, succ_Vr = self.predecessor_codebook, self.successor_codebook
        k, r = cand_Sk.shape[-1], projected_Sr.shape[-1]
        if TRITON_PAIR_SCORES and TRITON_FUSED_GATE and _fused_inputs(projected_Sr, pred_Vr, succ_Vr):
            scores = PairScores.apply(projected_Sr.reshape(-1, r), pred_Vr, pred_S.reshape(-1), succ_Vr,
                                      cand_Sk.reshape(-1, k))
            return scores.view(cand_Sk.shape)
        gate_Sr = F.embedding(pred_S, pred_Vr) * projected_Sr.to(pred_Vr.dtype)
        scores = GatheredDots.apply(gate_Sr.reshape(-1, r), succ_Vr, cand_Sk.reshape(-1, k))
        return scores.view(cand_Sk.shape)

    @torch.no_grad()
    def walk(self, hidden_SKH: torch.Tensor, logits_SKV: torch.Tensor, anchor_S: torch.Tensor,
             temperature: float = 0.0, generator: torch.Generator | None = None) -> SelectorWalk:
        """The block's path: K positions after each row's anchor. temperature 0: greedy (each position's best
        candidate); > 0: sampled from q_t = softmax(s_t / T). `logits` are the unary logits (float32)."""
        unary_SKk, cand_SKk = logits_SKV.float().topk(self.top_k, dim=-1)
        return self.walk_candidates(hidden_SKH, unary_SKk, cand_SKk, anchor_S, temperature, generator)

    @torch.no_grad()
    def path_probs(self, hidden_SKH: torch.Tensor, logits_SKV: torch.Tensor, anchor_S: torch.Tensor,
                   path_SK: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """q_t(y_t | y_{t-1}) [..., K] for a given path y (the anchor before y_1): the probability the sampled walk
        gives each path token when the path so far is its own draft (0 for a token outside the top-k). What the
        simulated sampled evaluation needs: along a path the target sampled, a draft that followed it to t − 1
        proposes y_t with exactly this probability."""
        unary_SKk, cand_SKk = logits_SKV.float().topk(self.top_k, dim=-1)
        prev_SK = torch.cat([anchor_S.long()[..., None], path_SK[..., :-1].long()], dim=-1)
        scores = unary_SKk + self.pair_scores(hidden_SKH, prev_SK, cand_SKk).float()
        q_SKk = torch.softmax(scores / temperature, dim=-1)
        return torch.where(cand_SKk == path_SK[..., None], q_SKk, 0.0).sum(-1)

    @torch.no_grad()
    def walk_candidates(self, hidden_SKH: torch.Tensor, unary_SKk: torch.Tensor, cand_SKk: torch.Tensor,
                        anchor_S: torch.Tensor, temperature: float = 0.0,
                        generator: torch.Generator | None = None,
                        projected_SKr: torch.Tensor | None = None) -> SelectorWalk:
        """`walk` over given candidates and their unary scores (the training metrics' self-conditioned path).
        `projected_SKr`: `project(hidden_SKH)` if already made; else made here, once for every position."""
        if projected_SKr is None:
            projected_SKr = self.project(hidden_SKH)
        tables = self.predecessor_codebook, self.successor_codebook
        if (temperature <= 0 and TRITON_WALK and unary_SKk.dtype == torch.float32
                and _fused_inputs(projected_SKr, *tables)):
            lead = cand_SKk.shape[:-2]  # one launch for the whole walk (the loop below, K steps of small kernels)
            tokens, scores = selector_triton.greedy_walk(
                projected_SKr.reshape(-1, *projected_SKr.shape[-2:]), *tables, unary_SKk.reshape(-1, *unary_SKk.shape[-2:]),
                cand_SKk.reshape(-1, *cand_SKk.shape[-2:]), anchor_S.reshape(-1))
            return SelectorWalk(tokens.view(*lead, -1), cand_SKk, scores.view(cand_SKk.shape).to(unary_SKk.dtype))
        prev_S = anchor_S.long()
        tokens, scores = [], []
        for t in range(cand_SKk.shape[-2]):
            pair_Sk = self.pair_scores(hidden_SKH[..., t, :], prev_S, cand_SKk[..., t, :], projected_SKr[..., t, :])
            s_Sk = unary_SKk[..., t, :] + pair_Sk.float()
            if temperature > 0:
                q_Sk = torch.softmax(s_Sk / temperature, dim=-1)
                pick_S = torch.multinomial(q_Sk.reshape(-1, q_Sk.shape[-1]), 1, generator=generator).view(prev_S.shape)
            else:
                pick_S = s_Sk.argmax(-1)
            prev_S = cand_SKk[..., t, :].gather(-1, pick_S[..., None])[..., 0]
            tokens.append(prev_S)
            scores.append(s_Sk)
        return SelectorWalk(torch.stack(tokens, -1), cand_SKk, torch.stack(scores, -2))
