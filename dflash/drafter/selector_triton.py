"""DFlash 2's pair scores ⟨table[idx_sj], gate_s⟩ in two Triton kernels: the candidate selector's hot loop in training.

Why: `selector.GatheredDots` (torch) makes them from gathered rows: the forward writes each chunk's [rows, k, r]
gather and reads it again in a batched product of [k, r] · [r] matrices (one per position), and the backward is an
embedding bag (another [S·k, r] read) plus that bag's own backward, which sorts the S·k ids and sums each id's run.
At the reference shapes (131,072 positions, k = 16, r = 256, V = 4,096, Zipf-like ids) that took 17.4 ms forward
and backward on one H100, these kernels 10.7 ms; at the 27B shapes (4,096 positions, V = 248,320) 1.09 and 0.51 ms
(benchmarks/gpu/selector_kernels.py, benchmarks/log/2026-12-06.md). Here each row block's gate [BS, r]
is read once and stays in registers while its k candidates' table rows stream past it (a 4,096-row table stays in
L2):
1. `_dots_kernel`: out[s, j] = Σ_c table[idx[s, j], c] · gate[s, c];
2. `_dots_backward_kernel`: grad_gate[s] = Σ_j g[s, j] · table[idx[s, j]] in registers, and g[s, j] · gate[s]
   added into grad_table[idx[s, j]] by atomic adds (into copies of it where it is small: TABLE_COPIES_BYTES);
3. `_greedy_walk_kernel`: the greedy walk (`greedy_walk`), all K positions of a row in one program.

float32 throughout (the codebooks and the gate are float32 in training). The atomic adds make the table's gradient
a sum in no fixed order: equal to the sorted segment sum to float32 rounding, not bit for bit from run to run (as
`index_add_` and `scatter_add_` on CUDA). Available where Triton imports and the tensors are float32 on a CUDA
device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; the CPU-only dev and CI machines lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ROWS = 32  # positions per program: a [32, 256] float32 gate is 32 KiB of registers at 4 warps
# The table's gradient is summed by atomic adds into up to MAX_TABLE_COPIES copies of it (program i into copy
# i % copies, as many as fit TABLE_COPIES_BYTES), then added up: a frequent id (a candidate at most positions) is
# one row that every program adds into, and the copies split that contention. At V = 4,096, r = 256 (the reference
# shapes) 16 copies of 4 MiB; at V = 248,320 (the 27B target) one.
TABLE_COPIES_BYTES = 1 << 26
MAX_TABLE_COPIES = 16


def runs_on(*tensors: Tensor) -> bool:
    """Whether Triton runs on these tensors: it imports, and they are on a CUDA device (or the interpreter runs)."""
    return triton is not None and (all(t.is_cuda for t in tensors) or os.environ.get("TRITON_INTERPRET") == "1")


def available(*tensors: Tensor) -> bool:
    """Whether the float32 kernels run on these tensors: `runs_on`, and all of them float32."""
    return all(t.dtype == torch.float32 for t in tensors) and runs_on(*tensors)


if triton is not None:

    @triton.jit
    def _dots_kernel(gate_ptr, table_ptr, idx_ptr, out_ptr, pred_ptr, prev_ptr, S, r, k, FUSED: tl.constexpr,
                     BS: tl.constexpr, R: tl.constexpr):
        rows = tl.program_id(0) * BS + tl.arange(0, BS)
        cols = tl.arange(0, R)
        row_ok = rows < S
        mask = row_ok[:, None] & (cols[None, :] < r)
        gate = tl.load(gate_ptr + rows[:, None].to(tl.int64) * r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if FUSED:  # gate_ptr holds the projection: the gate is pred[prev[s]] ⊙ proj[s], made here
            prev = tl.load(prev_ptr + rows.to(tl.int64), mask=row_ok, other=0)
            gate *= tl.load(pred_ptr + prev[:, None].to(tl.int64) * r + cols[None, :], mask=mask, other=0.0)
        for j in range(k):
            ids = tl.load(idx_ptr + rows.to(tl.int64) * k + j, mask=row_ok, other=0)
            table = tl.load(table_ptr + ids[:, None].to(tl.int64) * r + cols[None, :], mask=mask, other=0.0)
            tl.store(out_ptr + rows.to(tl.int64) * k + j, tl.sum(table * gate, axis=1), mask=row_ok)

    @triton.jit
    def _dots_backward_kernel(gate_ptr, table_ptr, idx_ptr, grad_ptr, grad_gate_ptr, grad_table_ptr, S, r, k,
                              table_size, copies, pred_ptr, prev_ptr, grad_pred_ptr, pred_size,
                              NEED_GATE: tl.constexpr, NEED_TABLE: tl.constexpr, FUSED: tl.constexpr,
                              NEED_PRED: tl.constexpr, NEED_ACC: tl.constexpr, READ_GATE: tl.constexpr,
                              BS: tl.constexpr, R: tl.constexpr):
        # FUSED: gate_ptr holds the projection proj and the gate is pred[prev[s]] ⊙ proj[s] (`dots` with `pred_Vr`);
        # NEED_GATE then asks for proj's gradient (stored in proj's dtype), NEED_PRED for pred's. NEED_ACC: NEED_GATE or
        # NEED_PRED (the gate's gradient is summed); READ_GATE: NEED_TABLE or FUSED (flags, not expressions, in the
        # kernel's static branches)
        # this program's copy of each table's gradient (`dots_backward`: copies that split the atomic adds' contention)
        copy = (tl.program_id(0) % copies).to(tl.int64)
        grad_table_ptr += copy * table_size
        rows = tl.program_id(0) * BS + tl.arange(0, BS)
        cols = tl.arange(0, R)
        row_ok = rows < S
        mask = row_ok[:, None] & (cols[None, :] < r)
        offs = rows[:, None].to(tl.int64) * r + cols[None, :]
        if READ_GATE:
            gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if FUSED:
                proj = gate
                prev = tl.load(prev_ptr + rows.to(tl.int64), mask=row_ok, other=0)
                pred_at = prev[:, None].to(tl.int64) * r + cols[None, :]
                pred = tl.load(pred_ptr + pred_at, mask=mask, other=0.0)
                gate = proj * pred
        acc = tl.zeros((BS, R), dtype=tl.float32)  # the gradient wrt the gate
        for j in range(k):
            ids = tl.load(idx_ptr + rows.to(tl.int64) * k + j, mask=row_ok, other=0)
            g = tl.load(grad_ptr + rows.to(tl.int64) * k + j, mask=row_ok, other=0.0).to(tl.float32)
            at = ids[:, None].to(tl.int64) * r + cols[None, :]
            if NEED_ACC:
                acc += g[:, None] * tl.load(table_ptr + at, mask=mask, other=0.0).to(tl.float32)
            if NEED_TABLE:
                tl.atomic_add(grad_table_ptr + at, g[:, None] * gate, mask=mask, sem="relaxed")
        if FUSED:
            if NEED_GATE:
                tl.store(grad_gate_ptr + offs, (acc * pred).to(grad_gate_ptr.dtype.element_ty), mask=mask)
            if NEED_PRED:
                tl.atomic_add(grad_pred_ptr + copy * pred_size + pred_at, acc * proj, mask=mask, sem="relaxed")
        elif NEED_GATE:
            tl.store(grad_gate_ptr + offs, acc, mask=mask)


    @triton.jit
    def _greedy_walk_kernel(proj_ptr, pred_ptr, succ_ptr, unary_ptr, cand_ptr, anchor_ptr, tok_ptr, score_ptr,
                            S, r, K, k, BS: tl.constexpr, KC: tl.constexpr, R: tl.constexpr):
        rows = tl.program_id(0) * BS + tl.arange(0, BS)
        cols = tl.arange(0, R)
        js = tl.arange(0, KC)
        row_ok = rows < S
        r64 = rows.to(tl.int64)
        mask = row_ok[:, None] & (cols[None, :] < r)  # [BS, R]
        cand_ok = row_ok[:, None] & (js[None, :] < k)  # [BS, KC]
        prev = tl.load(anchor_ptr + r64, mask=row_ok, other=0)
        for t in range(K):
            # the candidates' rows do not depend on the path: only the predecessor's row waits on the last step
            at = (r64[:, None] * K + t) * k + js[None, :]  # [BS, KC]
            cand = tl.load(cand_ptr + at, mask=cand_ok, other=0)
            succ = tl.load(succ_ptr + cand[:, :, None].to(tl.int64) * r + cols[None, None, :],
                           mask=cand_ok[:, :, None] & (cols[None, None, :] < r), other=0.0)  # [BS, KC, R]
            proj = tl.load(proj_ptr + (r64[:, None] * K + t) * r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(pred_ptr + prev[:, None].to(tl.int64) * r + cols[None, :], mask=mask, other=0.0) * proj
            score = tl.load(unary_ptr + at, mask=cand_ok, other=0.0) + tl.sum(succ * gate[:, None, :], axis=2)
            tl.store(score_ptr + at, score, mask=cand_ok)
            best = tl.argmax(tl.where(cand_ok, score, float("-inf")), axis=1, tie_break_left=True)  # [BS]
            prev = tl.sum(tl.where(js[None, :] == best[:, None], cand.to(tl.int64), 0), axis=1)
            tl.store(tok_ptr + r64 * K + t, prev, mask=row_ok)


def _rows(r: int) -> int:
    """Rows a program for rows of r floats: ROWS, fewer for wide rows (a [rows, r] float32 tile within the
    registers: 8,192 floats, one row of a 5,120-wide hidden state)."""
    return max(1, min(ROWS, 8192 // triton.next_power_of_2(r)))


def _launch(S: int, r: int) -> tuple[tuple[int], dict]:
    rows = _rows(r)
    return (triton.cdiv(S, rows),), {"BS": rows, "R": triton.next_power_of_2(r), "num_warps": 4}


def dots(gate_Sr: Tensor, table_Vr: Tensor, idx_Sk: Tensor, pred_Vr: Tensor | None = None,
         prev_S: Tensor | None = None) -> Tensor:
    """[S, k] float32: ⟨table[idx[s, j]], gate[s]⟩ (contiguous gate and table, float32 or 16-bit floats, read as
    float32; ids in 0..V-1). With `pred_Vr` and `prev_S` the gate is made in the kernel, pred[prev[s]] ⊙ gate[s]
    (`gate_Sr` then the projection, float32 or a 16-bit float read as float32): `selector.PairScores`."""
    S, k = idx_Sk.shape
    out = torch.empty(S, k, dtype=torch.float32, device=gate_Sr.device)
    if out.numel() == 0:  # no launch over an empty grid
        return out
    fused = pred_Vr is not None
    grid, meta = _launch(S, gate_Sr.shape[1])
    _dots_kernel[grid](gate_Sr, table_Vr, idx_Sk, out, pred_Vr if fused else gate_Sr, prev_S if fused else idx_Sk,
                       S, gate_Sr.shape[1], k, FUSED=fused, **meta)
    return out


def _gradient_copies(table_Vr: Tensor, need: bool) -> Tensor | None:
    """Zeroed float32 copies [c, V, r] of a table's gradient for the atomic adds (TABLE_COPIES_BYTES), None if not
    needed."""
    if not need:
        return None
    copies = max(1, min(MAX_TABLE_COPIES, TABLE_COPIES_BYTES // (table_Vr.numel() * 4)))
    return torch.zeros(copies, *table_Vr.shape, dtype=torch.float32, device=table_Vr.device)


def dots_backward(gate_Sr: Tensor, table_Vr: Tensor, idx_Sk: Tensor, grad_Sk: Tensor, need_gate: bool,
                  need_table: bool, pred_Vr: Tensor | None = None, prev_S: Tensor | None = None,
                  need_pred: bool = False) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(grad wrt gate [S, r] in its dtype, grad wrt table [V, r], grad wrt pred [V, r]) of `dots`, each None where not
    needed (pred's always without `pred_Vr`)."""
    S, k = idx_Sk.shape
    r = gate_Sr.shape[1]
    fused = pred_Vr is not None
    need_pred = need_pred and fused
    grad_gate = torch.empty_like(gate_Sr) if need_gate else None
    grad_table, grad_pred = _gradient_copies(table_Vr, need_table), _gradient_copies(pred_Vr, need_pred)
    # one number of copies for both tables (a program adds into its copy of each): the fewer of the two's
    copies = min((t.shape[0] for t in (grad_table, grad_pred) if t is not None), default=1)
    if S * k:
        grid, meta = _launch(S, r)
        _dots_backward_kernel[grid](
            gate_Sr, table_Vr, idx_Sk, grad_Sk.float().contiguous(), grad_gate if need_gate else gate_Sr,
            grad_table if need_table else table_Vr, S, r, k, table_Vr.numel(), copies,
            pred_Vr if fused else gate_Sr, prev_S if fused else idx_Sk, grad_pred if need_pred else gate_Sr,
            pred_Vr.numel() if fused else 0, NEED_GATE=need_gate, NEED_TABLE=need_table, FUSED=fused,
            NEED_PRED=need_pred, NEED_ACC=need_gate or need_pred, READ_GATE=need_table or fused, **meta)
    elif need_gate:
        grad_gate.zero_()
    return grad_gate, _sum_copies(grad_table, copies), _sum_copies(grad_pred, copies)


def _sum_copies(grad_cVr: Tensor | None, copies: int) -> Tensor | None:
    return None if grad_cVr is None else grad_cVr[0] if copies == 1 else grad_cVr[:copies].sum(0)


def greedy_walk(projected_SKr: Tensor, pred_Vr: Tensor, succ_Vr: Tensor, unary_SKk: Tensor, cand_SKk: Tensor,
                anchor_S: Tensor) -> tuple[Tensor, Tensor]:
    """The selector's greedy walk in one launch: (tokens [S, K] int64, scores [S, K, k] float32). Each row's K
    dependent steps run in one program, its k candidates' rows, gate and best candidate in registers (at r = 256,
    k = 16: one row a program, so the 256 blocks of the 27B-shape step are 256 programs): the torch walk launches a
    few small kernels per step (`CandidateSelector.walk_candidates`), a step's worth of launches K times over.
    Float32 codebooks and unary scores (`available`), projections float32 or 16-bit (read as float32: the training
    step's bf16 projection, `CandidateSelector.project`); the first of equal best scores wins, as
    torch.argmax's."""
    S, K, k = cand_SKk.shape
    r = pred_Vr.shape[1]
    tokens = torch.empty(S, K, dtype=torch.int64, device=cand_SKk.device)
    scores = torch.empty(S, K, k, dtype=torch.float32, device=cand_SKk.device)
    if S * K == 0:  # no launch over an empty grid
        return tokens, scores
    R, KC = triton.next_power_of_2(r), triton.next_power_of_2(k)
    BS = max(1, 4096 // (KC * R))  # rows per program: their k candidates' rows, [BS, k, r] float32, in registers
    _greedy_walk_kernel[(triton.cdiv(S, BS),)](
        projected_SKr.contiguous(), pred_Vr.contiguous(), succ_Vr.contiguous(), unary_SKk.float().contiguous(),
        cand_SKk.contiguous(), anchor_S.long().contiguous(), tokens, scores, S, r, K, k,
        BS=BS, KC=KC, R=R, num_warps=4)
    return tokens, scores


def weighted_rows(idx_Sk: Tensor, weights_Sk: Tensor, table_Vr: Tensor) -> Tensor:
    """Σ_j w[s, j] · table[idx[s, j]], [S, r] float32, summed in float32 from a table of any float dtype: what
    `F.embedding_bag(idx, table, per_sample_weights=w, mode="sum")` computes, without its rounding of the sum to the
    table's dtype. The backward kernel's grad_gate half (the rows streamed past a [rows, r] float32 accumulator).
    Used by `selector_loss.CandidateLogits`' backward on a GPU (the unary scores' gradient, Σ_j g_sj W[idx_sj] over the
    bf16 head): at the reference shapes 0.27 ms against the bag's 1.86 (one H100, benchmarks/log/2026-12-07.md)."""
    # `dots_backward` with only the gate's gradient asked for: the gate itself is never read, so an unfilled
    # float32 one stands in for it and sets the result's dtype
    gate = torch.empty(idx_Sk.shape[0], table_Vr.shape[1], dtype=torch.float32, device=table_Vr.device)
    return dots_backward(gate, table_Vr.contiguous(), idx_Sk.contiguous(), weights_Sk, True, False)[0]
