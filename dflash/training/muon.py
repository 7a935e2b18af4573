"""`BatchedMuon`: `torch.optim.Muon`'s update with the matrices of one shape orthogonalised together.

Why: `torch.optim.Muon` steps its parameters one by one (`torch.optim._muon._single_tensor_muon`, torch 2.11: "Foreach
is not supported for Muon yet"), about twenty kernel launches a matrix (the momentum, a bfloat16 copy, its norm, five
Newton-Schulz iterations of three products each, weight decay and the update), each from Python. A drafter's matrices
come in a few shapes (every layer's q, k, v, o, gate, up and down projections, the convolutions' kernel projections),
so here each shape's matrices go through the five iterations as one batch (`torch.bmm` / `torch.baddbmm`), and the
momentum, weight decay and update are `torch._foreach_*` calls over all of them: the same sums, far fewer launches.

The maths is torch's, term for term (`tests/test_muon.py` holds the two to the same parameters and momentum buffers over
several steps): momentum buffer B ← μB + (1 − μ)g (`lerp`), Nesterov's g + μ(B − g), the update in bfloat16 scaled to
Frobenius norm ≤ 1 and orthogonalised by the quintic Newton-Schulz iteration with torch's coefficients (a tall matrix
as its transpose), weight decay θ ← θ(1 − lr·λ), θ ← θ − lr·√max(1, rows/cols)·update ("original" `adjust_lr_fn`).
The state is torch's too (one `momentum_buffer` per parameter), so a checkpoint of either loads into the other.

Only small matrices are batched (at most `BATCH_MAX_ELEMENTS` each, `BATCH_BYTES` of bfloat16 matrices a batch): there
the launches are the cost. A large matrix keeps torch's own one-at-a-time path: its products are compute-bound, and a
batch's stacked copies only added memory (one H100, the DFlash 2 drafter step, benchmarks/log/2026-12-07.md: the
optimizer 2.3 -> 1.1 ms at the reference shapes; at the 27B shapes batching every shape took 349.6 -> 359.4 ms and
6 GiB more peak memory).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr  # torch's lr for a matrix's shape: the same scaling by construction

BATCH_BYTES = 1 << 28
BATCH_MAX_ELEMENTS = 1 << 21  # 2,097,152: the reference drafter's matrices are batched, the 27B drafter's are not


def orthogonalize(updates: list[Tensor], ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float) -> Tensor:
    """Newton-Schulz orthogonalisation of equally shaped matrices at once, [n, rows, cols] bfloat16: torch's
    `_zeropower_via_newtonschulz` for each (a tall matrix iterated as its transpose)."""
    a, b, c = ns_coefficients
    tall = updates[0].shape[0] > updates[0].shape[1]
    mats = [u.bfloat16().T if tall else u.bfloat16() for u in updates]
    X = torch.stack(mats) if len(mats) > 1 else mats[0][None]  # one matrix: a view, no stacked copy
    X = X / X.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # torch: each matrix by its own bfloat16 norm
    for _ in range(ns_steps):
        gram = torch.bmm(X, X.transpose(1, 2))
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.baddbmm(X, gram_update, X, beta=a)
    return X.transpose(1, 2) if tall else X


class BatchedMuon(torch.optim.Muon):
    """`torch.optim.Muon` (same arguments, groups and state) whose step batches each shape's matrices."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            if params:
                self._step_group(group, params, grads, bufs)
        return loss

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor], bufs: list[Tensor]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        if isinstance(lr, Tensor):
            lr = lr.item()  # a tensor lr is torch's option too (its `_to_scalar`); the trainer's is a float
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        for idx in _batches(params):
            # Nesterov's update a batch at a time, as torch makes it a matrix at a time: all at once would hold a
            # float32 copy of every gradient (3.8 GiB more peak at the 27B shapes)
            g, b = [grads[i] for i in idx], [bufs[i] for i in idx]
            updates = torch._foreach_lerp(g, b, momentum) if group["nesterov"] else b
            ortho = orthogonalize(updates, group["ns_coefficients"], group["ns_steps"], group["eps"])
            targets = [params[i] for i in idx]
            step = -_adjust_lr(lr, group["adjust_lr_fn"], targets[0].shape)
            if len(targets) == 1:  # torch's own add of the bfloat16 update into the parameter
                targets[0].add_(ortho[0], alpha=step)
            else:
                torch._foreach_add_(targets, [o.to(p.dtype) for o, p in zip(ortho.unbind(0), targets)], alpha=step)


def _batches(params: list[Tensor]) -> list[list[int]]:
    """Indices of `params` by (shape, device), each list at most BATCH_BYTES of bfloat16 matrices, in first-seen
    order; a matrix of more than BATCH_MAX_ELEMENTS alone."""
    by_shape: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        by_shape.setdefault((tuple(p.shape), p.device), []).append(i)
    out = []
    for (shape, _), idx in by_shape.items():
        n = math.prod(shape)
        per = 1 if n > BATCH_MAX_ELEMENTS else max(1, BATCH_BYTES // (2 * n))
        out += [idx[j:j + per] for j in range(0, len(idx), per)]
    return out
