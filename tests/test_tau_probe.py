"""train/tau_rounds (dflash.training.tau_probe) is the evaluator's round simulation on the same sequence, and the
trainer logs it; trainer.eval_at_tokens runs the in-training eval at consumed-token milestones."""
from __future__ import annotations

import json

import pytest
import torch

from dflash.config import ConfigError
from dflash.evaluation.acceptance import BatchedDrafterProposer, simulate_task
from dflash.training.tau_probe import (
    TauProbeConfig,
    leading_matches,
    probe_tau,
    rounds_taus,
    sequence_round_taus,
    trained_span,
)
from dflash.app.run import train
from tests.test_eval_batched_proposer import BS, _chained_truth, _drafter


def _varied_truth(d, P, N):
    """A chained truth (every first draft right) with every 5th token changed: rounds of different lengths."""
    truth = _chained_truth(d, P=P, N=N)
    truth.continuation[3::5] = (truth.continuation[3::5] + 1) % 49
    return truth


def _labels(tokens_T: torch.Tensor) -> torch.Tensor:
    """A target-written greedy sequence's labels: the token after each position (the last one: anything)."""
    return torch.cat([tokens_T[1:], tokens_T[:1]])


def test_rounds_follow_the_accepted_length():
    assert rounds_taus([0, 0, 0, 0], 5) == [1, 1, 1, 1]
    assert rounds_taus([3, 9, 9, 9, 0, 1, 0], 8) == [4, 1, 2]  # offsets 0, 4, 5; 7 = n_new - 1 ends them
    m = leading_matches(torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([[1, 2, 0], [1, 2, 3]]),
                        torch.tensor([3, 2]))
    assert m.tolist() == [2, 2]  # a mismatch ends the lead; fewer tokens left clip it


@pytest.mark.parametrize("layout", ["full", "windowed"])
@pytest.mark.parametrize("P,N", [(6, 31), (2, 40)])
def test_probe_equals_the_evaluators_simulation(layout, P, N):
    d = _drafter(layout)
    truth = _varied_truth(d, P, N)
    want = simulate_task(truth, BatchedDrafterProposer(d), BS).taus_vanilla
    got = sequence_round_taus(d, truth.tokens, truth.features, _labels(truth.tokens), window=N)
    assert got == want
    assert len(set(got)) > 1  # rounds of different lengths: the comparison has something to catch


def test_probe_metric_is_the_mean_over_rounds_and_streak_overstates_it():
    d = _drafter("full")
    truth = _varied_truth(d, 4, 48)

    class It:  # the fields of a buffered training item the probe reads
        tokens_T, features_TLH, labels_T = truth.tokens, truth.features, _labels(truth.tokens)

    m = probe_tau(d, [It(), It()], TauProbeConfig(sequences=1, window=48))
    taus = simulate_task(truth, BatchedDrafterProposer(d), BS).taus_vanilla
    assert m["train/tau_rounds"] == pytest.approx(sum(taus) / len(taus))
    assert m["train/tau_rounds_n"] == len(taus)  # sequences=1: the second item is not probed
    assert probe_tau(d, [It()], TauProbeConfig(sequences=0)) == {}


def test_trainer_logs_tau_rounds_and_evaluates_at_token_milestones(fast_cfg):
    calls = []

    def evaluator(drafter, target, step, final, logger=None):
        calls.append((step, final))
        return {"eval/tau_vanilla": 1.0}

    # 2 sequences x 72 tokens = 144 consumed tokens a step: milestones 300 and 600 fall in steps 3 and 5
    cfg = fast_cfg("trainer.eval_at_tokens=[300,600]", "trainer.tau_probe.window=32", "data.min_len=72")
    res = train(cfg, evaluator)
    assert calls == [(3, False), (5, False), (6, True)]
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    taus = [r["train/tau_rounds"] for r in rows if "train/tau_rounds" in r]
    assert len(taus) == cfg.trainer.max_steps and all(1.0 <= t <= cfg.drafter.block_size for t in taus)


@pytest.mark.parametrize("override", ["trainer.eval_at_tokens=[600,300]", "trainer.eval_at_tokens=[0]",
                                      "trainer.tau_probe.window=1", "trainer.tau_probe.sequences=-1"])
def test_bad_probe_and_milestone_settings_name_the_key(fast_cfg, override):
    from dflash.config import validate
    with pytest.raises(ConfigError, match=override.split("=")[0].rsplit(".", 1)[-1]):
        validate(fast_cfg(override))


def test_masked_data_is_probed_over_its_last_trained_span_only():
    """Conversations: rounds run over the last assistant span, never over a user or system turn."""
    m = torch.zeros(40, dtype=torch.bool)
    m[5:12] = True
    m[20:31] = True
    assert trained_span(None, 40, 16) == (16, 40)
    assert trained_span(m, 40, 128) == (11, 31)  # tokens 20..30: anchors 20..29
    assert trained_span(m, 40, 4) == (4, 24)  # the span's first 4 tokens
    assert trained_span(torch.zeros(40, dtype=torch.bool), 40, 16)[0] == 0
    d = _drafter("full")
    truth = _varied_truth(d, 4, 48)
    T = truth.tokens.numel()
    mask = torch.zeros(T, dtype=torch.bool)
    mask[T - 30:T - 6] = True  # a span that ends before the sequence does

    class It:
        tokens_T, features_TLH, labels_T, loss_mask_T = truth.tokens, truth.features, _labels(truth.tokens), mask

    got = probe_tau(d, [It()], TauProbeConfig(sequences=1, window=128))
    want = sequence_round_taus(d, truth.tokens, truth.features, _labels(truth.tokens), 24, end=T - 6)
    assert got["train/tau_rounds_n"] == len(want) and got["train/tau_rounds"] == pytest.approx(sum(want) / len(want))


def test_probe_runs_at_the_first_log_interval_past_each_multiple_of_every():
    from dflash.training.tau_probe import TauProbeConfig, probe_due
    cfg = TauProbeConfig(sequences=2, every=25)
    probed, last = [], 0
    for done in range(10, 101, 10):  # log intervals of 10 steps
        if probe_due(cfg, done, last, final=done == 100):
            probed.append(done)
            last = done
    assert probed == [30, 50, 80, 100]  # 25 → 30, 50, 75 → 80, 100 (also the last step)
    assert probe_due(TauProbeConfig(every=0), 10, 0)  # 0: every log interval
    assert not probe_due(TauProbeConfig(sequences=0), 100, 0, final=True)  # off


def test_negative_probe_cadence_is_refused_by_name():
    import pytest

    from dflash.training.tau_probe import TauProbeConfig, validate_tau_probe_config
    with pytest.raises(ValueError, match="trainer.tau_probe.every"):
        validate_tau_probe_config(TauProbeConfig(every=-1), 16)
