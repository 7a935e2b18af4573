"""The significance gate (dflash.serving.promotion, issue 19) on runs that carry per-prompt task tables:
paired Δτ interval vs the holder on one ground truth, prompt-lookup baseline, default floor above 1."""
from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("mlflow")
from mlflow.entities import Metric  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from dflash.serving.promotion import DECISION_TAG, PREFIX, PromoteConfig, promote  # noqa: E402

PROMPTS = 60


def table(gain: float, noise: float, pl_tau: float = 1.5, truth: str = "gt-A", seed: int = 0) -> dict:
    """A task table as EvalReport.to_dict() writes it: per prompt 20 rounds; prompt i's τ is a shared
    difficulty + `gain` + per-run noise (so the paired Δ is `gain` ± noise)."""
    rng, diff = random.Random(seed), random.Random(42)
    rows = []
    for i in range(PROMPTS):
        base = 2.0 + diff.uniform(-0.8, 0.8)
        tau = max(1.0, base + gain + rng.gauss(0, noise))
        rows.append({"task": f"p{i}", "rounds": 20, "tau_sum_vanilla": round(20 * tau),
                     "tau_vanilla": round(20 * tau) / 20, "rounds_prompt_lookup": 20,
                     "tau_sum_prompt_lookup": round(20 * pl_tau)})
    return {"tasks": rows, "info": {"ground_truth_key": truth}}


def pooled(t: dict, col: str = "vanilla") -> float:
    rows = t["tasks"]
    cnt = "rounds" if col == "vanilla" else f"rounds_{col}"
    return sum(r[f"tau_sum_{col}"] for r in rows) / sum(r[cnt] for r in rows)


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(uri)
    exp = c.create_experiment("gate", artifact_location=(tmp_path / "art").as_uri())
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")

    def run(t: dict | None, tau: float | None = None) -> str:
        rid = c.create_run(exp).info.run_id
        ts = int(time.time() * 1000)
        tau = pooled(t) if tau is None else tau
        ms = [Metric("eval/tau_served", tau, ts, 1)]
        if t is not None:
            ms.append(Metric("eval/tau_served_prompt_lookup", pooled(t, "prompt_lookup"), ts, 1))
            c.log_text(rid, json.dumps(t), "eval/served/tasks.json")
        c.log_batch(rid, metrics=ms)
        c.log_artifacts(rid, str(ck), "checkpoint")
        c.set_terminated(rid, "FINISHED")
        return rid
    return uri, c, run


def test_candidate_whose_interval_straddles_the_margin_is_refused(store):
    uri, c, run = store
    first = promote(run(table(0.0, 0.3, seed=1)), PromoteConfig(), uri)
    assert first.promoted and first.comparison == "" and "beats prompt-lookup" in first.reason
    # +0.05 on average but noisy (+0.6 / -0.5 on alternate prompts): the point value beats the holder's,
    # its paired interval reaches below 0
    holder = table(0.0, 0.3, seed=1)  # the first run's table
    cand = json.loads(json.dumps(holder))
    for i, r in enumerate(cand["tasks"]):
        r["tau_sum_vanilla"] += 12 if i % 2 == 0 else -10
    d = promote(run(cand), PromoteConfig(), uri)
    assert d.candidate_value > first.candidate_value
    assert not d.promoted and d.comparison == "paired"
    assert d.delta_ci_low < 0 < d.delta_ci_high and "lower end of the interval does not clear" in d.reason
    tags = c.get_model_version("dflash-drafter", d.version).tags
    record = json.loads(tags[PREFIX + "record"])  # the whole decision, one tag
    assert tags[DECISION_TAG] == "refused" and record["delta_ci_low"] == d.delta_ci_low
    assert record["prompt_lookup"] == pytest.approx(1.5) and record["holder_version"] == first.version
    # a clear, consistent gain is promoted; with a margin above the interval's lower end it is not
    clear = table(0.3, 0.05, seed=3)
    assert not promote(run(clear), PromoteConfig(margin=0.3), uri, dry_run=True).promoted
    d = promote(run(clear), PromoteConfig(margin=0.1), uri)
    assert d.promoted and d.delta_ci_low > 0.1 and c.get_registered_model("dflash-drafter").aliases["champion"] \
        == int(d.version)


def test_never_promoted_without_beating_prompt_lookup(store):
    uri, _, run = store
    d = promote(run(table(0.0, 0.2, pl_tau=2.1)), PromoteConfig(), uri)  # τ ≈ 2.0 vs prompt lookup 2.1
    assert not d.promoted and "does not beat prompt-lookup" in d.reason
    assert d.delta_prompt_lookup_ci_low < 0
    # an interval wholly below 0 is said to lie below it, not to "reach" 0
    assert d.delta_prompt_lookup_ci_high < 0 and "lies wholly below 0" in d.reason and "reaches 0" not in d.reason
    d = promote(run(table(0.0, 0.6, pl_tau=2.0, seed=5)), PromoteConfig(), uri, dry_run=True)
    assert d.delta_prompt_lookup_ci_low < 0 < d.delta_prompt_lookup_ci_high and "contains 0" in d.reason


def test_different_ground_truth_is_refused_and_dead_drafter_below_default_floor(store):
    uri, _, run = store
    assert promote(run(table(0.0, 0.2)), PromoteConfig(), uri).promoted
    d = promote(run(table(0.5, 0.05, truth="gt-B")), PromoteConfig(), uri)
    assert not d.promoted and "different ground truth" in d.reason and "experiments.eval" in d.reason
    assert PromoteConfig().floor > 1.0
    d = promote(run(None, tau=1.0), PromoteConfig(margin=-5.0), uri, dry_run=True)
    assert not d.promoted and "below the floor" in d.reason


def test_a_candidate_that_wins_by_copying_loops_is_refused(store):
    """Paired with the holder, the candidate must not be worse on the least-degenerate prompt samples (the quarter of
    prompts whose ground truth repeats the fewest 8-grams): one that gains on looping ground truth and loses on the
    rest wins by copying loops."""
    uri, c, run = store
    holder = table(0.0, 0.05, seed=1)
    for i, r in enumerate(holder["tasks"]):
        r["gt_copy_rate"] = 0.0 if i < PROMPTS // 4 else 0.8  # the first quarter does not loop
    assert promote(run(holder), PromoteConfig(), uri).promoted
    copier = json.loads(json.dumps(holder))
    for i, r in enumerate(copier["tasks"]):
        r["tau_sum_vanilla"] += -6 if i < PROMPTS // 4 else 20  # −0.3 τ where it does not loop, +1.0 where it does
    d = promote(run(copier), PromoteConfig(), uri)
    assert not d.promoted and d.delta_ci_low > 0  # it does win overall
    assert d.delta_least_degenerate == pytest.approx(-0.3) and d.delta_least_degenerate_ci_high < 0
    assert "but is worse on the 15 least-degenerate prompt samples" in d.reason and "repeats itself" in d.reason
    record = json.loads(c.get_model_version("dflash-drafter", d.version).tags[PREFIX + "record"])
    assert record["delta_least_degenerate"] == pytest.approx(-0.3)
    reader = json.loads(json.dumps(holder))
    for r in reader["tasks"]:
        r["tau_sum_vanilla"] += 6  # +0.3 everywhere
    d = promote(run(reader), PromoteConfig(), uri)
    assert d.promoted and "on the 15 least-degenerate prompt samples Δ +0.3000" in d.reason


def test_a_paired_decision_records_the_paired_delta_not_the_point_difference(store):
    """With both task tables on one ground truth (and no copy rates in them), the recorded Δ is the paired one over
    prompts, not the difference of the two runs' recorded values (a misplaced branch once overwrote it)."""
    uri, _, run = store
    holder = table(0.0, 0.05, seed=1)
    assert promote(run(holder), PromoteConfig(), uri).promoted
    cand = json.loads(json.dumps(holder))
    for r in cand["tasks"]:
        r["tau_sum_vanilla"] += 6  # +0.3 on every prompt
    d = promote(run(cand, tau=9.0), PromoteConfig(), uri, dry_run=True)  # a recorded value far from its table's
    assert d.comparison == "paired" and d.delta == pytest.approx(0.3) and d.delta_least_degenerate is None
