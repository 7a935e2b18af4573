"""A drafter that proposes the target's own continuation: the speed-up ceiling of the decoding loop.

Every round of `speculative_decode` with it accepts the whole block (τ = block size, the last round clipped), so
its wall time is the loop's own cost at the highest acceptance there is: one drafter call (free here), one
verify forward over the block, the state snapshot and the commit. Against `greedy_decode` on the same prompts it
says what a perfect drafter could buy on this target, dtype and device (`benchmarks/decode_ceiling.py`), which
bounds every real drafter's speed-up from above.
"""
from __future__ import annotations

import torch
from torch import nn


class LengthCache:
    """The oracle's cache: only the committed length (the drafter cache's `crop` contract)."""

    def __init__(self):
        self.length = 0

    def crop(self, n: int) -> None:
        self.length = min(self.length, n)


class OracleDrafter(nn.Module):
    """Proposes `tokens` (the target's greedy continuation of one prompt, the prompt included) after the committed
    position; `logits` are one-hot, so the loop's argmax reads them back."""

    def __init__(self, tokens: list[int], vocab_size: int, block_size: int, device: str | torch.device = "cpu"):
        super().__init__()
        # no weights to learn: one parameter, because the decoding loop reads a drafter's device off its parameters
        self.device_probe = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)
        self.register_buffer("tokens", torch.tensor(tokens, device=device), persistent=False)
        self.vocab_size, self.block_size = vocab_size, block_size

    def new_cache(self) -> LengthCache:
        return LengthCache()

    def extend_context(self, cache: LengthCache, features_BTLH: torch.Tensor, start: int) -> None:
        cache.length = start + features_BTLH.shape[1]

    def draft_hidden(self, cache: LengthCache, anchor_B: torch.Tensor) -> torch.Tensor:
        p = cache.length  # the anchor is tokens[p]; the drafts are the next block_size - 1
        idx = torch.arange(p + 1, p + self.block_size, device=self.tokens.device).clamp(max=len(self.tokens) - 1)
        return self.tokens[idx][None]

    def logits(self, hidden_BK: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(hidden_BK, self.vocab_size).float()


def loop_tokens(target, truth, block_size: int, max_new_tokens: int, passes: int = 8) -> tuple[list[int], int]:
    """The oracle's tokens for one prompt: prompt + the continuation the decoding loop itself commits, found by
    untimed passes of the loop from `truth` (the target's greedy tokens) until every round accepts its whole block.
    A block verify forward can round a near-tie differently from greedy's one-token forward (bfloat16): from there
    on the greedy tokens continue another prefix, the oracle's drafts stop matching and every later round accepts
    one token (one of 6 coding10 prompts in bfloat16 on the H200 went 10, 1, 1, … for 120 rounds, so the "ceiling"
    read 0.70×: benchmarks/RESULTS.md, 2026-12-03). Each pass keeps what the loop committed; a pass whose every
    round is whole ends it.
    Returns the tokens and how many passes found a divergence (0: the greedy tokens already were the loop's)."""
    from dflash.evaluation.speculative import speculative_decode

    prompt_ids = truth.prompt_ids
    tokens = truth.tokens.tolist()
    for n in range(passes):
        s = speculative_decode(OracleDrafter(tokens, target.vocab_size, block_size, target.device), target,
                               prompt_ids, max_new_tokens)
        if all(t == block_size for t in s.taus[:-1]):
            return tokens, n
        tokens = prompt_ids.tolist() + s.tokens
    return tokens, passes


def oracle_ceiling(target, truths, block_size: int, max_new_tokens: int, repeats: int = 1) -> dict:
    """Speculative decoding with the oracle against greedy decoding over every prompt of `truths` (the target's
    own ground truth), `repeats` times, after untimed passes that fit each oracle to the loop's own tokens
    (`loop_tokens`) and one untimed pass of greedy decoding on the first prompt (kernels, autotuning). τ, tokens
    per second of each loop and their ratio, target forwards per loop, how many runs came out token for token
    identical to greedy decoding, how many prompts' oracles had to follow the loop off the greedy tokens
    (`resynced`), and each run's τ per round (`taus`)."""
    from dflash.evaluation.speculative import greedy_decode, speculative_decode

    fitted = [loop_tokens(target, tr, block_size, max_new_tokens) for tr in truths]
    greedy_decode(target, truths[0].prompt_ids, max_new_tokens)  # warm-up, untimed
    spec_s = greedy_s = 0.0
    taus, same, fwd_spec, fwd_greedy = [], 0, 0, 0
    for _ in range(repeats):
        for tr, (tokens, _) in zip(truths, fitted):
            oracle = OracleDrafter(tokens, target.vocab_size, block_size, target.device)
            s = speculative_decode(oracle, target, tr.prompt_ids, max_new_tokens)
            g = greedy_decode(target, tr.prompt_ids, max_new_tokens)
            spec_s, greedy_s = spec_s + s.seconds, greedy_s + g.seconds
            taus.append(s.taus)
            same += s.tokens == g.tokens
            fwd_spec, fwd_greedy = fwd_spec + s.target_forwards, fwd_greedy + g.target_forwards
    n = max_new_tokens * len(truths) * repeats
    rounds = [t for run in taus for t in run]
    return {"tau": sum(rounds) / len(rounds), "speculative_tok_s": n / spec_s, "greedy_tok_s": n / greedy_s,
            "speed_up": greedy_s / spec_s, "identical": same, "runs": len(truths) * repeats,
            "resynced": sum(k > 0 for _, k in fitted),
            "target_forwards_speculative": fwd_spec, "target_forwards_greedy": fwd_greedy, "taus": taus}
