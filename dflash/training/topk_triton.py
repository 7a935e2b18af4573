"""The top-k's steps 2 and 3 (`dflash.training.topk`) in one Triton kernel: the k best groups by their maxima, then
the k largest logits of those groups, each row's work in registers.

Why: from the first pass's group maxima `topk.top_k_of_groups` takes two torch.topk calls (over [C, n] maxima,
then over the [C, k · g] pool it gathers) and the gather between them. On short rows torch.topk is a radix select
of one block per row: at the reference shapes (65,536-row chunks, V = 4,096, n = 256 groups of 16) its two calls
took 2.9 ms of DFlash 2's 37.6 ms bench step, the step 2 and 3 of the Triton LM-head chunk 1.9 ms a chunk against
the 1.45 ms of the chunk's own products and gradient (one H100, benchmarks/log/2026-12-06.md). With this kernel the
reference chunk with its top-16 takes 2.69 ms against 3.40 (one H100, benchmarks/log/2026-12-07.md); at the 27B
shapes (3,880 groups of 64) it is slower, 8.04 against 7.74 ms, and `topk.TRITON_MAX_GROUPS` keeps it off there.

Here each program takes ELEMENTS // max(n, k · g) rows (at least one) and, per row:
1. packs each group maximum and its group's number into one integer key (`_keys`: the float's bits made
   order-preserving as a signed int in the high half, MAX_ID − number in the low half, so a larger key is a larger
   value, and among equal values the lower number), pads to a power of two with the smallest key, and keeps the k
   largest keys (`tl.topk`, a bitonic top-k);
2. gathers the k · g logits of those groups, packs each with its vocabulary id the same way, and keeps the k largest.
The keys come in two widths (`_narrow` picks): int32 where the logits and the group maxima are both bf16 or both
fp16 and V ≤ 65,536 (the 16-bit float's bits over MAX_ID16 − id: ids and group numbers fit 16 bits), else int64
(the value as float32's bits over MAX_ID − id). The H100 has no 64-bit integer compare: each int64 compare and swap
of the bitonic top-k takes several 32-bit ops, and the int32 keys halve the key width (a bf16 reference chunk's
top-16, the torch first pass and this kernel, 3.38 -> 3.20 ms: one H100, benchmarks/log/2026-12-07.md). The two widths order values alike (−0.0 below +0.0, as their bits order).
The values are the logits themselves (bit for bit, largest first: torch.topk's values); among equal values the lower
id comes first (torch.topk names no order for ties). Needs k and g powers of two (`supports`); the caller falls
back to the torch steps elsewhere.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash.drafter import selector_triton

try:  # Triton ships with CUDA builds of torch; the CPU-only dev and CI machines lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ELEMENTS = 4096  # keys a program holds at once: rows per program = ELEMENTS // the longer of a row's two passes
MAX_ID = (1 << 31) - 1
MAX_ID16 = (1 << 16) - 1  # the int32 keys' low half: ids up to this, rows of up to 65,536 logits
# Whether 16-bit logits of rows of at most 65,536 take the int32 keys (`_narrow`); False: int64 keys everywhere
# (benchmarks/gpu/selector_kernels.py times both)
NARROW_KEYS = True


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _narrow(x_CV: Tensor, group_max_Cn: Tensor) -> bool:
    """Whether the int32 keys hold these (module doc): logits and group maxima of one 16-bit float dtype, and ids that
    fit 16 bits."""
    return (NARROW_KEYS and x_CV.dtype in (torch.bfloat16, torch.float16) and group_max_Cn.dtype == x_CV.dtype
            and x_CV.shape[1] <= MAX_ID16 + 1)


def supports(x_CV: Tensor, group_max_Cn: Tensor, k: int) -> bool:
    """Whether the kernel takes these: Triton, a CUDA tensor (or the interpreter, TRITON_INTERPRET=1), contiguous
    rows, k and the group size powers of two, at least k groups, and ids that fit in 31 bits."""
    if x_CV.dim() != 2 or group_max_Cn.dim() != 2 or not selector_triton.runs_on(x_CV, group_max_Cn):
        return False
    C, V = x_CV.shape
    n = group_max_Cn.shape[1]
    return (x_CV.stride(1) == 1 and group_max_Cn.stride(1) == 1 and n >= k and V % n == 0 and _pow2(V // n) and _pow2(k) and V < MAX_ID
            and x_CV.dtype in (torch.float32, torch.bfloat16, torch.float16))


if triton is not None:
    _MAX_ID = tl.constexpr(MAX_ID)  # a kernel reads only constexpr globals
    _MAX_ID16 = tl.constexpr(MAX_ID16)
    _KEY_MIN32 = tl.constexpr(-(1 << 31))  # the smallest key of each width: the padding
    _KEY_MIN64 = tl.constexpr(-(1 << 63))

    @triton.jit
    def _keys(x, ids, NARROW: tl.constexpr):
        """Keys ordered as (value, −id): the float's bits flipped where negative (so signed-int order is float order)
        in the high half, the id counted down from the top in the low half. NARROW: int32 keys of a 16-bit float
        (bf16 or fp16: its own bits, no float32 round trip); else int64 keys of the value as float32."""
        if NARROW:
            b = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended: the sign flip below sees the sign
            b = b ^ ((b >> 31) & 0x7FFF)
            key = (b << 16) | (ids.to(tl.int32) * -1 + _MAX_ID16)
        else:
            b = x.to(tl.float32).to(tl.int32, bitcast=True)
            b = b ^ ((b >> 31) & 0x7FFFFFFF)
            key = (b.to(tl.int64) << 32) | (ids.to(tl.int32) * -1 + _MAX_ID).to(tl.int64)
        return key

    @triton.jit
    def _ids(keys, NARROW: tl.constexpr):
        """The ids (int32) of `_keys`' keys."""
        if NARROW:
            ids = (keys & 0xFFFF) * -1 + _MAX_ID16
        else:
            ids = (keys & 0x7FFFFFFF).to(tl.int32) * -1 + _MAX_ID
        return ids

    @triton.jit
    def _values(keys, DTYPE: tl.constexpr, NARROW: tl.constexpr):
        """The values of `_keys`' keys, bit for bit: in DTYPE (the logits') for int32 keys, float32 for int64 keys."""
        if NARROW:
            hi = keys >> 16
            vals = (hi ^ ((hi >> 31) & 0x7FFF)).to(tl.int16).to(DTYPE, bitcast=True)
        else:
            hi = (keys >> 32).to(tl.int32)
            vals = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        return vals

    @triton.jit
    def _top_k_of_groups_kernel(x_ptr, gmax_ptr, val_ptr, id_ptr, C, n, stride_x, stride_g,
                                K: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, RB: tl.constexpr,
                                NARROW: tl.constexpr):
        rows = tl.program_id(0) * RB + tl.arange(0, RB)
        row_ok = rows < C
        r64 = rows.to(tl.int64)
        # step 2: the K groups with the largest maxima
        grp = tl.arange(0, NP)
        ok = row_ok[:, None] & (grp[None, :] < n)
        gmax = tl.load(gmax_ptr + r64[:, None] * stride_g + grp[None, :], mask=ok, other=0.0)
        gkeys = tl.where(ok, _keys(gmax, grp[None, :], NARROW), _KEY_MIN32 if NARROW else _KEY_MIN64)
        best = _ids(tl.topk(gkeys, K), NARROW)  # [RB, K] group numbers
        # step 3: the K largest of those groups' K * G logits
        ids = tl.reshape(best[:, :, None] * G + tl.arange(0, G)[None, None, :], (RB, K * G))
        vals = tl.load(x_ptr + r64[:, None] * stride_x + ids, mask=row_ok[:, None], other=0.0)
        top = tl.topk(_keys(vals, ids, NARROW), K)  # [RB, K], largest first
        at = r64[:, None] * K + tl.arange(0, K)[None, :]
        tl.store(val_ptr + at, _values(top, val_ptr.dtype.element_ty, NARROW), mask=row_ok[:, None])
        tl.store(id_ptr + at, _ids(top, NARROW).to(tl.int64), mask=row_ok[:, None])


def top_k_of_groups(x_CV: Tensor, group_max_Cn: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values in x's dtype, ids int64) [C, k], largest first: `topk.top_k_of_groups` in one kernel (`supports`)."""
    C, V = x_CV.shape
    n = group_max_Cn.shape[1]
    narrow = _narrow(x_CV, group_max_Cn)
    # int32 keys decode to the logits' own dtype; int64 keys to float32, cast back after (exact: they came from x)
    vals = torch.empty(C, k, dtype=x_CV.dtype if narrow else torch.float32, device=x_CV.device)
    ids = torch.empty(C, k, dtype=torch.int64, device=x_CV.device)
    if C == 0:  # no launch over an empty grid
        return vals.to(x_CV.dtype), ids
    g = V // n
    NP = triton.next_power_of_2(n)
    # One ELEMENTS for both widths: the int32 keys' program then holds half the key bytes, which buys occupancy
    # (ptxas, Triton 3.6, sm_90, reference shapes: 56 registers a thread against the int64 keys' 168; 156 with
    # ELEMENTS doubled) rather than more rows a program.
    RB = max(1, ELEMENTS // max(NP, k * g))
    _top_k_of_groups_kernel[(triton.cdiv(C, RB),)](x_CV, group_max_Cn, vals, ids, C, n, x_CV.stride(0),
                                                   group_max_Cn.stride(0), K=k, G=g, NP=NP, RB=RB, NARROW=narrow,
                                                   num_warps=4)
    return vals.to(x_CV.dtype), ids
