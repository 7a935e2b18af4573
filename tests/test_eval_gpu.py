"""GPU checks of the real decoding loop (skipped on CPU CI): lossless on CUDA with the hybrid target's
state rollback, real τ == simulated τ, and the oracle drafter's loop (its speed printed; benchmarks/decode_ceiling.py
measures it)."""
from __future__ import annotations

import warnings

import pytest
import torch

from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation import EvalConfig
from dflash.evaluation.ground_truth import load_or_build_ground_truth
from dflash.evaluation.prompts import load_suite
from dflash.evaluation.oracle import oracle_ceiling
from dflash.evaluation.report import evaluate
from dflash.evaluation.speculative import greedy_decode, speculative_decode
from dflash.target.model import Target, TargetConfig

pytestmark = pytest.mark.gpu
N = 64


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Target(TargetConfig(device="cuda", dtype=request.param))


def _divergence(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_real_decoding_on_gpu(target, tmp_path):
    """float32: lossless token for token and real τ == simulated τ. bfloat16: a block-verify forward rounds
    differently from a one-token forward, so exact equality is not defined by the algorithm; every
    divergence must sit at a near-tie of the target's own logits (what the two tokens score)."""
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig(block_size=16), target.hidden_size, target.info.num_layers,
                      target.mask_token_id, target.layer_ids).cuda()
    # sequential: the simulation drafts through the cache as the loop does, so τ sequences compare exactly;
    # the batched proposer's forward rounds differently under the drafter's bf16 autocast (near-ties may flip)
    cfg = EvalConfig(max_new_tokens=N, cache_dir=str(tmp_path), real_decode=True, proposer="sequential")
    rep = evaluate(d, target, cfg)
    print(f"\n[{target.dtype}] kernels {target.kernels}\n{rep.console_table()}")
    m = rep.metrics
    print({k: round(v, 3) for k, v in m.items() if k.startswith("eval/real") or k == "eval/gt_consistency"})
    if target.dtype == torch.float32:
        assert m["eval/real/lossless"] == 1.0, "speculative output differs from the target's greedy output"
        assert m["eval/real/tau_matches_sim"] == 1.0
        return
    gaps = []
    truths, hit = load_or_build_ground_truth(target, load_suite("coding10"), N, tmp_path)
    assert hit
    for tr in truths:
        g = greedy_decode(target, tr.prompt_ids, N).tokens
        s = speculative_decode(d, target, tr.prompt_ids, N).tokens
        i = _divergence(s, g)
        if i is None:
            continue
        ids = torch.tensor([tr.prompt_ids.tolist() + g[:i]], device="cuda")
        logits = target.logits(ids)[0, -1].float()
        top2 = logits.topk(2).values
        gaps.append((tr.name, i, float(logits[g[i]] - logits[s[i]]), float(top2[0] - top2[1]),
                     float(logits.std())))
    print("bf16 divergences (task, index, logit gap of the two tokens, top-2 gap, logit std):", gaps)
    assert all(abs(gap) < 0.05 * std + 1e-2 for _, _, gap, _, std in gaps), gaps


def test_oracle_decoding_on_gpu(target, tmp_path):
    """The loop with a drafter that proposes the target's own tokens accepts every block (τ = block size, the last
    round clipped) and, in float32, writes the greedy tokens. Its speed against greedy decoding is printed, not
    asserted: a speed figure is a benchmark's (`benchmarks/decode_ceiling.py`). An H200 run failed an
    `> 2.0` speed-up assertion here in bfloat16; the benchmark showed why: on one prompt the block
    verify left the greedy tokens at a near-tie and the oracle, still proposing them, was accepted one token a
    round from there (0.70×). The oracle now follows the loop's own tokens (`loop_tokens`)."""
    truths, _ = load_or_build_ground_truth(target, load_suite("coding10"), N, tmp_path)
    r = oracle_ceiling(target, truths, 16, N)
    for taus in r["taus"]:
        assert all(t == 16 for t in taus[:-1]) and 1 <= taus[-1] <= 16, taus
    print(f"\n[{target.dtype}] oracle drafter: τ {r['tau']:.2f}, speculative {r['speculative_tok_s']:.0f} tok/s, "
          f"greedy {r['greedy_tok_s']:.0f} tok/s, speed-up {r['speed_up']:.2f}x, identical {r['identical']}/{r['runs']}, "
          f"oracle off greedy {r['resynced']}/{len(truths)}")
    if target.dtype == torch.float32:
        assert r["identical"] == len(truths)
