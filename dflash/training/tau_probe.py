"""A training-time estimate of τ that follows decoding rounds: `train/tau_rounds`.

Why not the loss's streak (`train/anchor_streak`): it is the mean accepted-draft length over *uniformly drawn*
anchors. Decoding does not visit positions uniformly: a round that accepts s tokens jumps s + 1 positions, so
rounds skip quickly over easy stretches and linger where drafting is hard. On the reference target a 5-layer
drafter read `train/streak` 9.07 while its evaluated τ on its own training text was 3.9; on coding10 the mean of
(s + 1) over every position was 8.58, the round simulation 4.56 (benchmarks/RESULTS.md, 2026-12-01). A uniform
mean over anchors over-weights the long streaks.

The probe runs the evaluation's simulator on training sequences (`docs/DESIGN.md`, "Evaluation"): for each probed
sequence of length T, the last `window` positions are the ground truth, i.e. prompt = tokens[:T − window], and the
target's label at position t (its argmax next token; for online target-written greedy data that is token t + 1)
is what a round must match. One drafter forward proposes a block at every round start (anchors T − window ..
T − 2, as `BatchedDrafterProposer` does), the leading matches are reduced on the device, and one small transfer
per sequence feeds the rounds: p = T − window; τ_round = 1 + matched; p += τ_round while p < T − 1. For online
data with `window` ≤ seq_len − max_prompt_len, the window is all target-written, so the probe is the evaluator's
`simulate_task` on that sequence (tests/test_tau_probe.py checks equality on a fixed drafter). On text that the
target did not write it is the same rounds against the target's teacher-forced labels: an approximation. Data
with a loss mask (conversations) is probed over its last trained (assistant) span instead (`trained_span`).

It runs at log intervals only (the interval's host sync is already there), on `sequences` items of the step,
with the clean features (no training noise), under no_grad, and only at the first log interval at or past each
multiple of `every` steps (0: every interval). Its cost is on the consumer's critical path: at the 27B shapes
(5-layer drafter of width 5,120, V = 248,320, 2 x 2,048-token sequences) one probe takes about 0.34 s; probing at
every log interval held the one-H200 pipeline at 6,055 trained-on tok/s against 6,609 with `every: 200`, in one
process (benchmarks/RESULTS.md, 2026-12-04), so `conf/trainer/gpu.yaml` probes every 200 steps.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.drafter.model import greedy_draft


@dataclass
class TauProbeConfig:
    sequences: int = 2  # training sequences probed per log interval (0: off)
    window: int = 128  # trailing tokens of each probed sequence that the rounds run over
    every: int = 0  # steps between probes: the first log interval at or past each multiple (0: every interval)


def validate_tau_probe_config(cfg: TauProbeConfig, block_size: int) -> None:
    if cfg.sequences < 0:
        raise ValueError(f"trainer.tau_probe.sequences must be >= 0 (0: off), got {cfg.sequences}")
    if cfg.every < 0:
        raise ValueError(f"trainer.tau_probe.every must be >= 0 steps (0: every log interval), got {cfg.every}")
    if cfg.window < 2:
        raise ValueError(f"trainer.tau_probe.window must be >= 2 tokens (a round needs an anchor and a token "
                         f"after it), got {cfg.window}")


def leading_matches(draft_NK: Tensor, labels_NK: Tensor, avail_N: Tensor) -> Tensor:
    """Per row: how many leading draft tokens equal the labels, at most `avail` (the tokens left)."""
    K = draft_NK.shape[1]
    ok = (draft_NK == labels_NK) & (torch.arange(K, device=draft_NK.device)[None] < avail_N[:, None])
    return ok.long().cumprod(1).sum(1)


def rounds_taus(matched: list[int], n_new: int) -> list[int]:
    """The rounds over a ground truth of `n_new` tokens whose round at offset i accepts matched[i] drafts."""
    taus, i = [], 0
    while i < n_new - 1:
        tau = matched[i] + 1
        taus.append(tau)
        i += tau
    return taus


@torch.no_grad()
def sequence_round_taus(drafter, tokens_T: Tensor, features_TLH: Tensor, labels_T: Tensor, window: int,
                        autocast: bool = False, end: int | None = None) -> list[int]:
    """The rounds' τ over the `window` positions of one sequence that end at `end` (default: its length; module
    doc): the first anchor is at end − window, with at least one context token before it."""
    T = int(tokens_T.numel()) if end is None else int(end)
    n_new = min(window, T - 1)
    P = T - n_new
    K = drafter.block_size - 1
    dev = next(drafter.parameters()).device
    tokens_T, labels_T = tokens_T.to(dev), labels_T.to(dev)
    anchors_n = torch.arange(P, T - 1, device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else nullcontext()
    with amp:
        hidden_1nKH = drafter(features_TLH.to(dev)[None, : T - 2], anchors_n[None], tokens_T[anchors_n][None])
    # float32 logits, outside autocast (as the evaluator); DFlash 2: the selector walk's greedy path
    draft_nK = greedy_draft(drafter, hidden_1nKH[0], tokens_T[anchors_n])
    pos_nK = (anchors_n[:, None] + torch.arange(K, device=dev)).clamp(max=T - 1)
    matched = leading_matches(draft_nK, labels_T[pos_nK], (T - 1) - anchors_n)
    return rounds_taus(matched.tolist(), n_new)  # the one transfer: n_new − 1 ints


def trained_span(loss_mask_T: Tensor | None, length: int, window: int) -> tuple[int, int]:
    """(window, end) of the probed stretch: the last `window` tokens, or, for data with a loss mask (conversations:
    assistant tokens only), the first `window` tokens of its last trained span, so no round runs over a user or
    system turn. A span shorter than 2 tokens gives window 0 (nothing to probe)."""
    if loss_mask_T is None:
        return window, length
    trained = loss_mask_T.to("cpu", torch.bool).tolist()  # at log intervals only
    if not any(trained):
        return 0, length
    last = len(trained) - 1 - trained[::-1].index(True)
    first = last
    while first > 1 and trained[first - 1]:  # back over the contiguous run (a context token stays before it)
        first -= 1
    end = min(last + 1, first + window)
    return (end - first if end - first >= 2 else 0), end


def probe_due(cfg: TauProbeConfig, done: int, last_probed: int, final: bool = False) -> bool:
    """Whether the log interval at step `done` probes: the first interval at or past each multiple of `every`
    since the last probe (at `last_probed`), and always at the run's last step."""
    if cfg.sequences <= 0:
        return False
    return final or cfg.every <= 0 or done // cfg.every > last_probed // cfg.every


def probe_tau(drafter, items, cfg: TauProbeConfig, autocast: bool = False) -> dict[str, float]:
    """`train/tau_rounds` (mean τ over the rounds of the probed sequences) and `train/tau_rounds_n` (rounds)."""
    if cfg.sequences <= 0 or not items:
        return {}
    taus: list[int] = []  # the drafter has no dropout: no eval() toggle (it would retrigger a compiled forward's guards)
    for it in items[: cfg.sequences]:
        window, end = trained_span(getattr(it, "loss_mask_T", None), int(it.tokens_T.numel()), cfg.window)
        if window:
            taus += sequence_round_taus(drafter, it.tokens_T, it.features_TLH, it.labels_T, window, autocast, end)
    if not taus:
        return {}
    return {"train/tau_rounds": sum(taus) / len(taus), "train/tau_rounds_n": float(len(taus))}
