"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), the rule engines verify sampled requests
with and z-lab's `dflash_generate` uses.

One round: drafts x_1..x_K drawn from the proposal q_1..q_K (a block drafter draws each position from its own
q_k; prompt lookup's q_k is the point mass on its token), the target's p_1..p_{K+1} from one verify forward over
anchor + drafts. For k = 1..K: accept x_k when u·q_k(x_k) < p_k(x_k), u ~ U[0, 1); at the first rejection draw
the committed token from the residual norm(max(p_k − q_k, 0)) and end the round; when all K are accepted, draw
the bonus token from p_{K+1}. The committed tokens are then distributed exactly as the target's own samples
(tests/test_eval_sampling.py checks it by chi-square on a tiny target).

Why the simulated evaluation can score a drafter on a sampled ground truth (`acceptance.simulate_task`): the
joint law of a round factorizes as Π_k p_k(y_k) · Π_{k≤m} a_k(y_k) · (1 − a_{m+1}(y_{m+1})), a_k(y) =
min(1, q_k(y) / p_k(y)). So a path y drawn from the target, with acceptance coins of probability a_k(y_k) along
it, has exactly the law of the real loop's committed tokens and round boundaries. For a point-mass q (greedy
drafts, prompt lookup) a_k is 1 on the drafted token and 0 elsewhere: plain matching against the sampled path.
"""
from __future__ import annotations

import torch

from dflash.target.sampling import draw


def accept_round(p_K1V: torch.Tensor, draft_K: torch.Tensor, q_KV: torch.Tensor | None,
                 generator: torch.Generator | None) -> tuple[int, int]:
    """(accepted m in 0..K, the round's last committed token: the residual's draw at the first rejection, or the
    bonus token from p_{K+1}). `q_KV` None: point-mass proposals (q_k(x_k) = 1). `p_K1V` float, rows summing
    to 1; draws come from `generator` (on p's device)."""
    K = int(draft_K.numel())
    dev = p_K1V.device
    draft_K = draft_K.to(dev)
    u_K = torch.rand(K, generator=generator, device=dev)
    idx = torch.arange(K, device=dev)
    p_x = p_K1V[idx, draft_K]
    q_x = torch.ones(K, device=dev) if q_KV is None else q_KV[idx, draft_K].to(dev)
    ok = (u_K * q_x < p_x).int()
    m = int(ok.cumprod(0).sum().item())  # the round's one host sync for the coins
    if m == K:
        return m, int(draw(p_K1V[K], generator).item())
    if q_KV is None:
        q_row = torch.zeros_like(p_K1V[m])
        q_row[draft_K[m]] = 1.0
    else:
        q_row = q_KV[m].to(dev).float()
    residual = (p_K1V[m] - q_row).clamp_min(0.0)
    total = residual.sum()
    if float(total) <= 0.0:  # only when p_m == q_m, where the draft is always accepted; kept for rounding
        residual, total = p_K1V[m], p_K1V[m].sum()
    return m, int(draw(residual / total, generator).item())


def acceptance_probs(p_path_N: torch.Tensor, q_path_N: torch.Tensor | None) -> torch.Tensor:
    """a(y) = min(1, q(y) / p(y)) for the path's tokens y (module doc): p_path / q_path are the target's and the
    proposal's probabilities of each path token. q None: point masses, handled by the caller (matching)."""
    return torch.where(p_path_N > 0, (q_path_N / p_path_N.clamp_min(1e-30)).clamp(max=1.0),
                       torch.ones_like(p_path_N))
