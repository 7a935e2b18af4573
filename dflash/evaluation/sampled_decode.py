"""Real decoding at a sampling setting (docs/evaluation.md, "τ at temperature"): the target's own sampling, and
draft → verify → commit with exact speculative sampling (`dflash.evaluation.rejection.accept_round`). A DFlash 2
drafter drafts by its selector walk and its q is the walk's softmax over the k candidates (docs/dflash2.md).

Both stop after a stop token (EOS / end of turn; the stop token is kept), with `text_end` (a code suite's rule,
`dflash.data.stops`) after the token completing a stop sequence or the dedent below the prompt's body, or at
`max_new_tokens`: where the ground truth ends (`dflash.data.writing.first_end`, the one cut). At T = 0 the
speculative loop is the greedy one of `speculative.speculative_decode` (point masses everywhere) and reproduces
`speculative.greedy_decode` token for token in float32.

τ per round = accepted + 1, clipped as the simulated evaluation clips its last round: the continuation's end
(a stop token or the length cap) bounds how many drafts a round can accept, so the simulated τ on a sampled path
(`acceptance.simulate_task`) and this loop's τ have the same law (`rejection` module doc; tested within the CI).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from dflash.data.stops import TextEnd
from dflash.data.writing import first_end
from dflash.evaluation.rejection import accept_round
from dflash.evaluation.speculative import DecodeResult, TargetSession, _sync, drafter_autocast
from dflash.target.sampling import Sampling, draw, warp


def _end(tokens: list[int], stop_ids: frozenset[int], text_end: TextEnd | None) -> int | None:
    """The continuation's length when `tokens` (all of it so far) has reached its end, else None."""
    n, why = first_end(tokens, 0, stop_ids, text_end)
    return None if why == "length" else n


@torch.no_grad()
def sample_decode(target, prompt_ids, max_new_tokens: int, sampling: Sampling,
                  generator: torch.Generator | None, stop_ids: Sequence[int] = (),
                  text_end: TextEnd | None = None) -> DecodeResult:
    """The target's own continuation at `sampling`: prefill, then one token per forward, drawn from `generator`."""
    stops = frozenset(int(t) for t in stop_ids)
    sess = TargetSession(target, need_features=False)
    _sync(target.device)
    t0 = time.perf_counter()
    _, logits = sess.forward_logits(torch.as_tensor(prompt_ids, dtype=torch.long), features=False)
    out: list[int] = []
    while True:
        tok = draw(warp(logits[-1], sampling), generator).view(1)
        out.append(int(tok.item()))
        if len(out) >= max_new_tokens or _end(out, stops, text_end) is not None:
            break
        _, logits = sess.forward_logits(tok, features=False)
    _sync(target.device)
    return DecodeResult(out, time.perf_counter() - t0, sess.forwards)


@torch.no_grad()
def sampled_speculative_decode(drafter, target, prompt_ids, max_new_tokens: int, sampling: Sampling,
                               generator: torch.Generator | None, stop_ids: Sequence[int] = (),
                               autocast: bool | None = None, text_end: TextEnd | None = None,
                               proposal: str = "sampled") -> DecodeResult:
    """Draft (each of the bs−1 positions drawn from the drafter's q_k, warped by `sampling`; its argmax when
    greedy or when `proposal` is "argmax", the engines' policy (`engines` module doc), then verified as a point
    mass; DFlash 2: the sampled or the best-path walk) → verify (one target forward over anchor + drafts, warped into p) → `accept_round` → commit. The
    drafter's context features are the verify forward's hidden states of the committed tokens."""
    if proposal not in ("argmax", "sampled"):
        raise ValueError(f"proposal={proposal!r}; expected argmax or sampled")
    point_mass = sampling.greedy or proposal == "argmax"  # the draft is the argmax, verified as a point mass
    stops = frozenset(int(t) for t in stop_ids)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    P = prompt.numel()
    dev = next(drafter.parameters()).device
    sess = TargetSession(target, need_features=True)
    _sync(target.device)
    t0 = time.perf_counter()
    feats, logits = sess.forward_logits(prompt)
    anchor = draw(warp(logits[-1], sampling), generator).view(1)
    out = [int(anchor.item())]
    limit = _end(out, stops, text_end) or int(max_new_tokens)  # the continuation's end: a rule or the cap
    dcache = drafter.new_cache()
    with drafter_autocast(drafter, autocast):
        drafter.extend_context(dcache, feats.to(dev), 0)
    taus: list[int] = []
    p = P  # the anchor's position
    while len(out) < limit:
        with drafter_autocast(drafter, autocast):
            hidden = drafter.draft_hidden(dcache, anchor.to(dev))
        if getattr(drafter, "candidate_selector", None) is not None:  # DFlash 2: the selector walk, q over its candidates
            walk = drafter.draft(hidden, anchor.to(dev), 0.0 if point_mass else sampling.temperature, generator)
            draft = walk.tokens[0].to(target.device)
            q_KV = None if point_mass else walk.dense_q(int(drafter.lm_head_VH.shape[0]),
                                                        sampling.temperature)[0].to(target.device)
        else:
            q_KV = warp(drafter.logits(hidden)[0], sampling).to(target.device)
            draft = q_KV.argmax(-1) if point_mass else draw(q_KV, generator)
        block = torch.cat([anchor.to(target.device), draft])
        snap = sess.snapshot()
        feats, logits = sess.forward_logits(block)
        m, tok = accept_round(warp(logits, sampling), draft, None if point_mass else q_KV, generator)
        drafted = draft.tolist()
        end = _end(out + drafted[:m] + [tok], stops, text_end)
        if end is not None:
            limit = min(limit, end)
        a = min(m, limit - len(out))  # drafts the round may keep before the continuation's end
        nxt = drafted[a] if a < m else tok
        sess.commit(snap, block, a + 1)
        with drafter_autocast(drafter, autocast):
            drafter.extend_context(dcache, feats[:, :a + 1].to(dev), p)
        out += drafted[:a] + [nxt]
        anchor = torch.tensor([nxt], dtype=torch.long)
        taus.append(a + 1)
        p += a + 1
    _sync(target.device)
    return DecodeResult(out[:limit], time.perf_counter() - t0, sess.forwards, taus)
