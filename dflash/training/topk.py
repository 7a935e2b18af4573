"""The top-k of each row of a logits block in two short passes: DFlash 2's selector candidates (docs/dflash2.md).

Why: torch.topk over rows of a 248,320-token vocabulary is a radix select that reads each row several times; the
selector takes the top-16 of every position's logits in every LM-head chunk, so at the 27B shapes it reads the
[positions, V] block that often again. Here:

1. the maximum of each group of `group` consecutive logits (one read of the block): [C, V / group];
2. the top-k groups by their maximum: every one of the row's k largest logits lies in one of them (a logit x in
   a group g outside them has k groups whose maxima exceed max(g) >= x, so k logits larger than x);
3. the top-k of those k · group logits, mapped back to vocabulary ids.

The values are exactly torch.topk's, sorted largest first; among equal values the ids may differ from torch.topk's
(which names no order for ties either). Rows whose length is not a multiple of `group`, or too short for the two
passes to read less than one, take torch.topk; so do CPU tensors, and rows shorter than GROUPED_MIN_VOCAB, unless
asked (`grouped`). Measured in DFlash 2's bench step (one H100, benchmarks/log/2026-12-06.md): at the 27B shapes
(V = 248,320, bf16 chunks) the two passes took 2.2 ms off the loss phase; at the reference shapes (V = 4,096, bf16
chunks of 65,536 rows) they added 2.4 ms, the first pass (a maximum over 16 consecutive logits, a reduction over
the innermost axis) alone 4.4 ms a step against torch.topk's 3.9 ms for the whole select. On the CPU torch.topk's
single pass is the faster (3x on a 4,096 x 4,096 float32 block here), and the CPU runs keep torch.topk's ids.

The Triton LM-head chunk (dflash.training.lm_head_triton) reads every logit once anyway: it makes step 1 in that
read (`FUSED_FIRST_PASS`) and `top_k_of_groups` does steps 2 and 3, at any vocabulary the groups split. The chunk with
its top-16, forward and gradient, ms (one H100, benchmarks/gpu/selector_kernels.py, benchmarks/log/2026-12-06.md):
27B chunk (1,024 x 5,120, V = 248,320) 7.58 without a top-k, 9.95 with torch.topk, 9.12 with the two passes here,
7.82 with the first pass in the row pass; reference chunk (65,536 x 384, V = 4,096) 1.45, 4.15, 5.53, 3.39.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash.training import topk_triton

# Whether the Triton LM-head chunk (dflash.training.lm_head_triton) makes the first pass's group maxima in its own
# read of the logits and takes the top-k from them (steps 2 and 3 here), for rows of any length `group_size` splits;
# False: `top_k_rows` on its logits, as the torch chunk does.
FUSED_FIRST_PASS = True

# Whether steps 2 and 3 run as one Triton kernel (dflash.training.topk_triton) where it applies (a CUDA tensor, k
# and the group size powers of two, at most TRITON_MAX_GROUPS groups a row); False: the torch steps below (two
# torch.topk calls and a gather) everywhere. Measured in the Triton LM-head chunk with its top-16 and gradient (one
# H100, benchmarks/log/2026-12-07.md): reference chunk (256 groups of 16) 3.40 -> 2.69 ms; 27B chunk (3,880 groups of
# 64, padded to 4,096 in the kernel) 7.74 -> 8.04 ms, slower: the kernel's bitonic top-k over 4,096 keys a row costs
# more than torch.topk's select there.
TRITON_SECOND_PASS = True
TRITON_MAX_GROUPS = 1024

# The shortest rows the two passes take by default: a size between the two vocabularies measured (4,096: slower;
# 248,320: faster); where between them the two passes start to win has not been measured.
GROUPED_MIN_VOCAB = 1 << 16


def group_size(vocab: int, k: int) -> int:
    """A power of two near sqrt(vocab / k) (the two passes' sizes balanced: V / g groups, then k · g logits); 0
    where it does not divide `vocab` or leaves fewer than 4 · k groups (torch.topk then)."""
    g = 1 << max(3, round((vocab / max(k, 1)) ** 0.5).bit_length() - 1)
    return g if vocab % g == 0 and vocab // g >= 4 * k else 0


def grouping(V: int, k: int, on_gpu: bool, grouped: bool | None = None) -> int:
    """The group size the two passes use for rows of V logits, or 0 for torch.topk. `grouped`: the two passes
    where the rows split (True), torch.topk (False), or the two passes on a GPU for rows of GROUPED_MIN_VOCAB or
    more (None)."""
    wanted = on_gpu and V >= GROUPED_MIN_VOCAB if grouped is None else grouped
    return group_size(V, k) if wanted else 0


def top_k_rows(x_CV: Tensor, k: int, grouped: bool | None = None) -> tuple[Tensor, Tensor]:
    """(values, ids) [C, k] of each row's k largest entries, largest first (module doc; `grouped`: `grouping`)."""
    C, V = x_CV.shape
    g = grouping(V, k, x_CV.is_cuda, grouped)
    if not g:
        top = x_CV.topk(k, dim=-1)
        return top.values, top.indices
    return top_k_of_groups(x_CV, x_CV.unflatten(1, (V // g, g)).amax(-1), k)


def top_k_of_groups(x_CV: Tensor, group_max_Cn: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Steps 2 and 3 (module doc) from the first pass's group maxima [C, n] of groups of V / n consecutive logits,
    wherever they were made (`top_k_rows`, or the Triton LM-head chunk's row pass, which reads the logits anyway).
    On a GPU both steps are one kernel for up to TRITON_MAX_GROUPS groups (`TRITON_SECOND_PASS`, `topk_triton`), with
    the same values."""
    if TRITON_SECOND_PASS and group_max_Cn.shape[1] <= TRITON_MAX_GROUPS and topk_triton.supports(x_CV, group_max_Cn, k):
        return topk_triton.top_k_of_groups(x_CV, group_max_Cn, k)
    C, V = x_CV.shape
    g = V // group_max_Cn.shape[1]
    groups_CnG = x_CV.unflatten(1, (V // g, g))
    best_groups_Ck = group_max_Cn.topk(k, dim=-1).indices  # [C, k]
    pool_CkG = groups_CnG.gather(1, best_groups_Ck[..., None].expand(C, k, g))
    vals_Ck, at_Ck = pool_CkG.flatten(1).topk(k, dim=-1)
    ids_Ck = best_groups_Ck.gather(1, at_Ck // g) * g + at_Ck % g
    return vals_Ck, ids_Ck
