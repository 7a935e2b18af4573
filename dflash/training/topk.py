"""The top-k of each row of a logits block in two short passes: DFlash 2's selector candidates (docs/dflash2.md).

Why: torch.topk over rows of a 248,320-token vocabulary is a radix select that reads each row several times; the
selector takes the top-16 of every position's logits in every LM-head chunk, so at the 27B shapes it reads the
[positions, V] block that often again. Here:

1. the maximum of each group: the V ids viewed as [g, V / g], group j the column of ids j, j + V/g, j + 2V/g, ...
   (one read of the block, a reduction over the middle axis, coalesced along the rows): [C, V / g];
2. the top-k groups by their maximum: every one of the row's k largest logits lies in one of them (a logit x in
   a group outside them has k groups whose maxima exceed that group's maximum >= x, so k logits larger than x);
3. the top-k of those k · g logits, mapped back to vocabulary ids.

Groups of consecutive ids, [C, V / g, g] reduced over the last axis, made the first pass a reduction over 16
contiguous elements: 2.2 ms a call at the reference shapes' [65,536, 4,096] bf16 chunk (one H100), slower than
torch.topk's whole select (benchmarks/log/2026-12-06.md).

The values are exactly torch.topk's, sorted largest first; among equal values the ids may differ from torch.topk's
(which names no order for ties either). Rows whose length is not a multiple of `group`, or too short for the two
passes to read less than one, take torch.topk; so do CPU tensors unless asked (`grouped`): there torch.topk's
single pass is the faster (3x on a 4,096 x 4,096 float32 block here), and the CPU runs keep torch.topk's ids.
"""
from __future__ import annotations

import torch
from torch import Tensor


def group_size(vocab: int, k: int) -> int:
    """A power of two near sqrt(vocab / k) (the two passes' sizes balanced: V / g groups, then k · g logits); 0
    where it does not divide `vocab` or leaves fewer than 4 · k groups (torch.topk then)."""
    g = 1 << max(3, round((vocab / max(k, 1)) ** 0.5).bit_length() - 1)
    return g if vocab % g == 0 and vocab // g >= 4 * k else 0


def top_k_rows(x_CV: Tensor, k: int, grouped: bool | None = None) -> tuple[Tensor, Tensor]:
    """(values, ids) [C, k] of each row's k largest entries, largest first (module doc). `grouped`: the two passes
    (True), torch.topk (False), or the two passes on a GPU only (None)."""
    C, V = x_CV.shape
    g = group_size(V, k)
    if not g or not (x_CV.is_cuda if grouped is None else grouped):
        top = x_CV.topk(k, dim=-1)
        return top.values, top.indices
    n = V // g
    groups_CgN = x_CV.view(C, g, n)  # group j: the ids congruent to j modulo n
    best_groups_Ck = groups_CgN.amax(1).topk(k, dim=-1).indices  # [C, k]
    pool_CgK = groups_CgN.gather(2, best_groups_Ck[:, None, :].expand(C, g, k))  # member i of group j: [c, i, j]
    vals_Ck, at_Ck = pool_CgK.flatten(1).topk(k, dim=-1)
    ids_Ck = (at_Ck // k) * n + best_groups_Ck.gather(1, at_Ck % k)
    return vals_Ck, ids_Ck
