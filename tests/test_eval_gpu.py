"""GPU checks of the real decoding loop (skipped on CPU CI): lossless on CUDA with the hybrid target's
state rollback, real τ == simulated τ, and the decoding speed against plain greedy (printed)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dflash.drafter import DrafterConfig, build_drafter
from dflash.evaluation import EvalConfig
from dflash.evaluation.ground_truth import load_or_build_ground_truth
from dflash.evaluation.prompts import load_suite
from dflash.evaluation.report import evaluate
from dflash.evaluation.speculative import greedy_decode, speculative_decode
from dflash.target import Target, TargetConfig

pytestmark = pytest.mark.gpu
N = 64


class _LenCache:
    def __init__(self):
        self.length = 0

    def crop(self, n):
        self.length = min(self.length, n)


class OracleDrafter(nn.Module):
    """Always proposes the target's own tokens: the speed-up ceiling of the decoding loop (τ = bs)."""

    def __init__(self, tokens: list[int], vocab: int, bs: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, device="cuda"))
        self.tokens = torch.tensor(tokens, device="cuda")
        self.vocab, self.block_size = vocab, bs

    def new_cache(self):
        return _LenCache()

    def extend_context(self, cache, features_BTLH, start):
        cache.length = start + features_BTLH.shape[1]

    def draft_hidden(self, cache, anchor_B):
        p = cache.length
        idx = torch.arange(p + 1, p + self.block_size, device="cuda").clamp(max=len(self.tokens) - 1)
        return self.tokens[idx][None]

    def logits(self, hidden):
        return torch.nn.functional.one_hot(hidden, self.vocab).float()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Target(TargetConfig(device="cuda", dtype=request.param))


def test_real_decoding_on_gpu(target, tmp_path):
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig(block_size=16), target.hidden_size, target.info.num_layers,
                      target.mask_token_id, target.layer_ids).cuda()
    cfg = EvalConfig(max_new_tokens=N, cache_dir=str(tmp_path), real_decode=True)
    rep = evaluate(d, target, cfg)
    print(f"\n[{target.dtype}] kernels {target.kernels}\n{rep.console_table()}")
    m = rep.metrics
    print({k: round(v, 3) for k, v in m.items() if k.startswith("eval/real") or k == "eval/gt_consistency"})
    assert m["eval/real/lossless"] == 1.0, "speculative output differs from the target's greedy output"
    assert m["eval/real/tau_matches_sim"] == 1.0


def test_decoding_speed_ceiling_on_gpu(target, tmp_path):
    truths, _ = load_or_build_ground_truth(target, load_suite("coding10"), N, tmp_path)
    spec_s = greedy_s = 0.0
    taus = []
    for i, tr in enumerate(truths):
        o = OracleDrafter(tr.tokens.tolist(), target.vocab_size, 16)
        if i == 0:  # warm-up
            speculative_decode(o, target, tr.prompt_ids, N)
            greedy_decode(target, tr.prompt_ids, N)
        s = speculative_decode(o, target, tr.prompt_ids, N)
        g = greedy_decode(target, tr.prompt_ids, N)
        assert s.tokens == g.tokens
        taus += s.taus
        spec_s, greedy_s = spec_s + s.seconds, greedy_s + g.seconds
    n = N * len(truths)
    print(f"\n[{target.dtype}] oracle drafter: τ {sum(taus) / len(taus):.2f}, speculative {n / spec_s:.0f} tok/s, "
          f"greedy {n / greedy_s:.0f} tok/s, speed-up {greedy_s / spec_s:.2f}x")
    assert greedy_s / spec_s > 2.0
