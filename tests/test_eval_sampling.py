"""Sampling settings and exact speculative sampling (dflash.target.sampling, dflash.evaluation.rejection,
dflash.evaluation.sampled_decode): the rule is lossless, on its own and in the real draft → verify → commit loop
on a tiny hybrid target (chi-square of the committed tokens against the target's exact sampling distribution)."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from scipy.stats import chisquare

from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.evaluation.rejection import accept_round
from dflash.evaluation.sampled_decode import sample_decode, sampled_speculative_decode
from dflash.evaluation.speculative import greedy_decode
from dflash.target.sampling import (GREEDY, Sampling, SamplingConfig, read_generation_config, resolve_sampling,
                                    validate_sampling_config, warp)

ALPHA = 1e-3  # fixed seeds: deterministic; a wrong rule fails far below this (checked below)


def _pvalue(observed, probs) -> float:
    """Chi-square p-value of counts `observed` against the law `probs` (expected counts rescaled to their sum)."""
    total, mass = sum(observed), sum(float(x) for x in probs)
    return float(chisquare(observed, [total * float(x) / mass for x in probs]).pvalue)


def test_warp_matches_a_plain_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 11)
    s = Sampling(0.7, 0.8, 5)
    got = warp(logits, s)
    for r in range(3):  # plain loops: top-k by sorting, then the smallest prefix reaching top_p
        z = (logits[r] / 0.7).tolist()
        order = sorted(range(11), key=lambda i: -z[i])[:5]
        ex = torch.tensor([z[i] for i in order]).softmax(0).tolist()
        keep, mass = [], 0.0
        for i, pr in zip(order, ex):
            if mass >= 0.8:
                break
            keep.append((i, pr))
            mass += pr
        want = torch.zeros(11)
        for i, pr in keep:
            want[i] = pr / mass
        assert torch.allclose(got[r], want, atol=1e-6)
    assert torch.equal(warp(logits, GREEDY).argmax(-1), logits.argmax(-1))
    assert float(warp(logits, GREEDY).sum()) == 3.0


def test_generation_config_decides_the_default(tmp_path):
    assert read_generation_config("") == GREEDY
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    assert read_generation_config(tmp_path) == Sampling(0.6, 1.0, 50)  # transformers' default top_k
    assert resolve_sampling(SamplingConfig(), tmp_path) == Sampling(0.6, 1.0, 50)
    assert resolve_sampling(SamplingConfig(temperature=0.0), tmp_path) == GREEDY
    assert resolve_sampling(SamplingConfig(top_k=0), tmp_path).label == "t0.6"
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert read_generation_config(tmp_path) == GREEDY
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="generation_config.json"):
        read_generation_config(tmp_path)
    with pytest.raises(ValueError, match="eval.sampling.top_p"):
        validate_sampling_config(SamplingConfig(top_p=1.5), "eval.sampling")


def test_shipped_reference_target_recommends_t1():
    from importlib.resources import files
    folder = files("dflash") / "assets" / "reference_target"
    assert read_generation_config(str(folder)) == Sampling(1.0, 1.0, 0)


def _round_law(p_K1V, q_KV, n, seed=0, rule=accept_round):
    """Empirical law of (m, committed token) over n seeded rounds with drafts drawn from q."""
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        draft = torch.multinomial(q_KV, 1, generator=gen).view(-1)
        m, tok = rule(p_K1V, draft, q_KV, gen)
        first = tok if m == 0 else int(draft[0])
        counts[first] = counts.get(first, 0) + 1
    return counts


def test_accept_round_commits_the_targets_distribution():
    """K = 2 drafts against fixed p, q over 4 tokens: the first committed token's law is p_1 (chi-square), and a
    rule that skips the residual (resamples from p) is caught by the same test."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    n = 6000
    got = _round_law(p, q, n)
    obs = [got.get(t, 0) for t in range(4)]
    assert _pvalue(obs, p[0]) > ALPHA

    def biased(p_K1V, draft, q_KV, gen):  # the residual replaced by p: over-weights the drafted tokens
        m, _ = accept_round(p_K1V, draft, q_KV, gen)
        return m, int(torch.multinomial(p_K1V[m], 1, generator=gen)) if m < len(draft) else 0
    bad = _round_law(p, q, n, rule=biased)
    assert _pvalue([bad.get(t, 0) for t in range(4)], p[0]) < 1e-6


def test_accept_round_point_mass_accepts_with_the_targets_probability():
    p = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]])
    gen = torch.Generator().manual_seed(1)
    ms = [accept_round(p, torch.tensor([0]), None, gen) for _ in range(4000)]
    acc = sum(m for m, _ in ms) / len(ms)
    assert abs(acc - 0.6) < 0.03
    assert all(tok == 1 for m, tok in ms if m == 0)  # the residual of a point mass at 0: p without token 0


def _drafter(target, bs=4, seed=0):
    torch.manual_seed(seed)
    d = build_drafter(DrafterConfig(num_layers=1, head_dim=16, intermediate_size=64, block_size=bs),
                      target.hidden_size, target.info.num_layers, target.mask_token_id, target.layer_ids)
    d.attach_target_head(target.embed_weight(), target.lm_head_weight())
    return d.eval()


@torch.no_grad()
def _exact_law(target, prompt: list[int], s: Sampling, n: int) -> dict[tuple[int, ...], float]:
    """The target's own sampling law of its first n tokens, by enumerating the warped support (full forwards)."""
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, pr in law.items():
            logits = target.logits(torch.tensor([prompt + list(seq)]))[0, -1]
            probs = warp(logits, s)
            for t in probs.nonzero().view(-1).tolist():
                nxt[seq + (t,)] = pr * float(probs[t])
        law = nxt
    return law


class SupportDrafter(torch.nn.Module):
    """Proposes every position uniformly over a fixed token set (the target's likely tokens and one it never
    samples): drafts are accepted, rejected for a residual draw, and rejected outright, at every position."""

    def __init__(self, tokens, vocab: int, bs: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.block_size, self.vocab = bs, vocab
        self.row = torch.full((vocab,), -1e4)
        self.row[list(tokens)] = 0.0

    def new_cache(self):
        return None

    def extend_context(self, cache, features_BTLH, start):
        pass

    def draft_hidden(self, cache, anchor_B):
        return torch.zeros(1, self.block_size - 1, 1)

    def logits(self, hidden):
        return self.row.expand(1, self.block_size - 1, self.vocab).clone()


@pytest.mark.parametrize("runs", [250, pytest.param(1000, marks=pytest.mark.slow)])
def test_speculative_sampling_is_lossless_on_a_byte_target(byte_target, runs):
    """The first 3 committed tokens of the real loop against the target's exact law at T=1, top_k=2 (8
    outcomes), over `runs` seeds (the fast run 250, ~25 s; the slow one 1,000); the target's own sampler (the
    sampled ground truth's) likewise in the slow run."""
    s, prompt, n = Sampling(1.0, 1.0, 2), [5, 17, 33, 2, 9], 3
    law = _exact_law(byte_target, prompt, s, n)
    likely = sorted({t for seq in law for t in seq})
    drafter = SupportDrafter(likely[:3] + [200], byte_target.vocab_size, bs=4)
    counts = dict.fromkeys(law, 0)
    taus = []
    for seed in range(runs):
        r = sampled_speculative_decode(drafter, byte_target, prompt, n, s, torch.Generator().manual_seed(seed))
        counts[tuple(r.tokens)] += 1
        taus += r.taus
    keys = sorted(law)
    assert _pvalue([counts[k] for k in keys], [law[k] for k in keys]) > ALPHA
    assert 1 < sum(taus) / len(taus) < n  # drafts were both accepted and rejected: the test saw both paths
    if runs < 1000:
        return
    own = dict.fromkeys(law, 0)
    for seed in range(runs):
        own[tuple(sample_decode(byte_target, prompt, n, s, torch.Generator().manual_seed(seed)).tokens)] += 1
    assert _pvalue([own[k] for k in keys], [law[k] for k in keys]) > ALPHA


def test_greedy_setting_reproduces_greedy_decoding(byte_target):
    drafter = _drafter(byte_target, seed=3)
    for prompt in ([5, 17, 33], [1, 2, 3, 4, 5, 6]):
        g = greedy_decode(byte_target, prompt, 20)
        s = sampled_speculative_decode(drafter, byte_target, prompt, 20, GREEDY, None)
        assert s.tokens == g.tokens


def test_stop_tokens_end_the_continuation(byte_target):
    drafter = _drafter(byte_target, seed=3)
    g = greedy_decode(byte_target, [5, 17, 33], 20).tokens
    stop = g[6]
    first = g.index(stop)
    s = sampled_speculative_decode(drafter, byte_target, [5, 17, 33], 20, GREEDY, None, stop_ids=[stop])
    assert s.tokens == g[:first + 1]
    assert sample_decode(byte_target, [5, 17, 33], 20, GREEDY, None, stop_ids=[stop]).tokens == g[:first + 1]
    assert list(itertools.accumulate(s.taus))[-1] >= first


def test_simulated_tau_at_t1_agrees_with_the_real_loop(byte_target):
    """The evaluator's τ at T=1 (rounds simulated on sampled paths with the rule's acceptance coins) against the
    real draft → verify → commit loop's measured τ on the same prompts (independent seeds): the real τ lies inside
    the simulated τ's 95% CI over prompts (`eval/real/tau_in_sim_ci`), and their intervals overlap."""
    from dflash.evaluation import EvalConfig
    from dflash.evaluation.ground_truth import TruthSpec
    from dflash.evaluation.prompts import Task
    from dflash.evaluation.protocol import stop_ids
    from dflash.evaluation.report import evaluate
    s = Sampling(1.0, 1.0, 0)
    cfg = EvalConfig(max_new_tokens=16, tree_budgets=[], samples=4, cache_dir="", bootstrap=500, real_decode=True,
                     sampling=SamplingConfig(1.0, 1.0, 0), engine="textbook")  # drafts sampled from q: coins
    tasks = [Task(f"p{i}", text) for i, text in enumerate(["def f(x):", "import os\n", "class A:\n  ", "# sum\n",
                                                             "for i in", "x = [1, 2"])]
    rep = evaluate(_drafter(byte_target, bs=4, seed=5), byte_target, cfg, tasks,
                   spec=TruthSpec(s, 4, 0, stop_ids(byte_target)))
    m, st = rep.metrics, rep.stats
    assert 1.2 < m["eval/tau_vanilla"] < 3.5  # drafts are accepted and rejected: the comparison has content
    assert m["eval/real/tau_in_sim_ci"] == 1.0, (m["eval/real/tau"], st["eval/tau_vanilla_ci_low"],
                                                 st["eval/tau_vanilla_ci_high"])
    assert m["eval/real/tau_ci_low"] <= st["eval/tau_vanilla_ci_high"]
    assert st["eval/tau_vanilla_ci_low"] <= m["eval/real/tau_ci_high"]
    assert m["eval/num_prompts"] == 6 and m["eval/num_tasks"] == 24


def test_degeneracy_figures_against_plain_counts():
    from dflash.data.degeneracy import cycle_start, in_repeat_share, repeat_share, summarize
    human = list(range(40))
    loop = [1, 2, 3] + [7, 8, 9, 10] * 10
    assert repeat_share(human) == 0.0 and in_repeat_share(human) == 0.0 and cycle_start(human) is None
    grams = [tuple(loop[i:i + 4]) for i in range(len(loop) - 3)]  # plain: a 4-gram seen before it
    assert repeat_share(loop) == sum(g in grams[:i] for i, g in enumerate(grams)) / len(grams)
    assert in_repeat_share(loop) == 40 / 43  # every token of the loop lies in a repeated 16-gram, not the head
    assert cycle_start(loop) == 3
    assert cycle_start([5] * 10) is None  # too short to call a cycle (< 24 tokens)
    s = summarize([human, loop])
    assert s["cycle_share"] == 0.5 and s["count"] == 2


def test_pins_are_keyed_by_the_protocol():
    """A greedy (legacy) pin is never read for a sampled ground truth: the keys differ, and a pin read under the
    wrong protocol is refused by name."""
    from dflash.evaluation.ground_truth import TruthSpec
    from dflash.evaluation.truth_pin import PinError, PinnedSuite
    legacy = PinnedSuite("t", ("a",), ((1, 2),), 4)
    t1 = TruthSpec(Sampling(1.0, 1.0, 0), 1, 0, (0,))
    sampled = PinnedSuite("t", ("a",), ((1, 2),), 4, 0, t1.key())
    greedy_ends = PinnedSuite("t", ("a",), ((1, 2),), 4, 0, TruthSpec(stop_ids=(0,)).key())
    assert TruthSpec().key() is None and len({legacy.key(), sampled.key(), greedy_ends.key()}) == 3
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "pin.json"
        legacy.write(path, "s", [[5, 6, 7, 8]])
        with pytest.raises(PinError, match="protocol"):
            sampled.read(path)
        sampled.write(Path(d) / "p2.json", "s", [[5, 0]])  # ended early at the stop token 0
        assert sampled.read(Path(d) / "p2.json").continuations == [[5, 0]]


def test_quick_start_closing_lines_name_both_settings_and_the_next_step():
    from dflash.config import RunConfig
    from experiments.run import closing_lines
    m = {"eval/tau_served": 1.4, "eval/t1/tau_vanilla": 1.4, "eval/t1/tau_prompt_lookup": 1.3,
         "eval/t0/tau_vanilla": 2.1, "eval/t0/tau_prompt_lookup": 3.0, "eval/served_temperature": 1.0,
         "eval/served_top_p": 1.0, "eval/served_top_k": 0.0}
    lines = closing_lines(m, RunConfig()).splitlines()
    assert "1.400 (prompt lookup 1.300)" in lines[0] and "t1" in lines[0]
    assert lines[1].startswith("eval/t0/tau_vanilla") and "2.100 (prompt lookup 3.000)" in lines[1]
    assert "τ is" in lines[2] and "above prompt lookup" in lines[3] and "+recipe=served_reference" in lines[4]
    assert "This one" not in lines[3]  # no prompt lookup recorded beside the objective: no claim about it
    above = closing_lines({**m, "eval/tau_served_prompt_lookup": 1.353, "eval/tau_served": 1.563}, RunConfig())
    assert "This one is above it by 0.210" in above
    below = closing_lines({**m, "eval/tau_served_prompt_lookup": 1.5}, RunConfig())
    assert "This one is below it by 0.100" in below
