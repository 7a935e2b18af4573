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


def oracle_ceiling(target, truths, block_size: int, max_new_tokens: int, repeats: int = 1) -> dict:
    """Speculative decoding with the oracle against greedy decoding over every prompt of `truths` (the target's
    own ground truth), `repeats` times, after one untimed pass of each loop on the first prompt (kernels,
    autotuning). τ, tokens per second of each loop and their ratio, target forwards per loop, how many runs came
    out token for token identical, and each run's τ per round (`taus`)."""
    from dflash.evaluation.speculative import greedy_decode, speculative_decode

    def oracle(tr):
        return OracleDrafter(tr.tokens.tolist(), target.vocab_size, block_size, target.device)

    speculative_decode(oracle(truths[0]), target, truths[0].prompt_ids, max_new_tokens)  # warm-up, untimed
    greedy_decode(target, truths[0].prompt_ids, max_new_tokens)
    spec_s = greedy_s = 0.0
    taus, same, fwd_spec, fwd_greedy = [], 0, 0, 0
    for _ in range(repeats):
        for tr in truths:
            s = speculative_decode(oracle(tr), target, tr.prompt_ids, max_new_tokens)
            g = greedy_decode(target, tr.prompt_ids, max_new_tokens)
            spec_s, greedy_s = spec_s + s.seconds, greedy_s + g.seconds
            taus.append(s.taus)
            same += s.tokens == g.tokens
            fwd_spec, fwd_greedy = fwd_spec + s.target_forwards, fwd_greedy + g.target_forwards
    n = max_new_tokens * len(truths) * repeats
    rounds = [t for run in taus for t in run]
    return {"tau": sum(rounds) / len(rounds), "speculative_tok_s": n / spec_s, "greedy_tok_s": n / greedy_s,
            "speed_up": greedy_s / spec_s, "identical": same, "runs": len(truths) * repeats,
            "target_forwards_speculative": fwd_spec, "target_forwards_greedy": fwd_greedy, "taus": taus}
