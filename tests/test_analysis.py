"""The ablation analysis compares like with like, and its figures name every run (no MLflow needed: frames
shaped like `load_runs`' output)."""
import itertools

import pandas as pd
import pytest

from dflash.tracking import analysis as A


def _run(i, loss="hard_ce", seed=0, steps=120, lr=1e-3, target="reference", tau=1.05, status="FINISHED", **extra):
    row = {"run_id": f"r{i:02d}", "run_name": f"{loss}-none-r10_20-s{seed}-2026120{i}", "status": status,
           "loss": loss, "noise": "none", "buffer": "r10_20", "target": target, "seed": seed,
           "steps": float(steps), "tokens": float(steps * 700), "p.loss.name": loss, "p.noise.name": "none",
           "p.buffer.name": "r10_20", "p.target.name": target, "p.seed": seed, "p.run_dir": f"runs/x{i}",
           "p.trainer.max_steps": steps, "p.trainer.lr": lr, "p.tracking.tracking_uri": f"sqlite:///{i}.db",
           "eval/tau_vanilla": tau}
    if loss.startswith("soft_kl"):
        row["p.loss.temperature"] = extra.pop("temperature", 2.0)
    row.update(extra)
    return row


def _issue_runs():
    """The issue's store: two 120-step hard_ce seeds, a 40-step sweep trial with a sampled lr, a trial on
    the tiny random target, two soft_kl seeds and a soft_kl at another temperature."""
    return pd.DataFrame([
        _run(0, seed=0, tau=1.05), _run(1, seed=1, tau=1.06),
        _run(2, steps=40, lr=3e-4, tau=1.04, trial=3),
        _run(3, target="tiny_random", tau=1.00),
        _run(4, loss="soft_kl", seed=0, tau=1.07), _run(5, loss="soft_kl", seed=1, tau=1.08),
        _run(6, loss="soft_kl", temperature=1.5, tau=1.02),
        _run(7, seed=2, status="KILLED", tau=1.5),
    ])


def test_incomparable_runs_never_share_a_row():
    runs = _issue_runs()
    done = runs[runs["status"] == "FINISHED"]
    assert set(A.varying_keys(done)) == {"loss", "target", "loss.temperature", "trainer.lr", "trainer.max_steps"}
    groups = A.comparable_groups(done, by=["loss"])
    f = A.factor_frame(done)
    for (_, a), (_, b) in itertools.combinations(done.iterrows(), 2):
        same_row = tuple(groups.loc[a.name]) == tuple(groups.loc[b.name])
        comparable = (f.loc[a.name] == f.loc[b.name]).all()  # every factor equal: only the seed differs
        assert same_row == comparable, (a["run_id"], b["run_id"])

    table = A.ablation_table(runs, by=["loss"])
    assert table.index.names == ["loss", "other"]
    assert int(table[("eval/tau_vanilla", "n")].sum()) == 7  # the KILLED run is not in the table
    pair = table.loc[("hard_ce", "target=reference, trainer.lr=0.001, trainer.max_steps=120")]
    assert pair[("eval/tau_vanilla", "n")] == 2 and pair[("runs", "seeds")] == "0,1"
    assert pair[("eval/tau_vanilla", "mean")] == pytest.approx(1.055)
    assert pair[("budget", "steps")] == 120 and pair[("budget", "tokens")] == 84000
    short = table.loc[("hard_ce", "target=reference, trainer.lr=0.0003, trainer.max_steps=40")]
    assert short[("eval/tau_vanilla", "n")] == 1 and short[("budget", "steps")] == 40
    assert len(table.xs("soft_kl", level="loss")) == 2  # temperature 2.0 (n=2) apart from 1.5 (n=1)
    cells = A.format_table(table)
    assert cells.loc[("hard_ce", "target=reference, trainer.lr=0.001, trainer.max_steps=120"),
                     "eval/tau_vanilla"].endswith("(n=2, ± 0.007 over seeds)")
    assert set(cells.columns) >= {"eval/tau_vanilla", "steps", "tokens", "seeds"}


def test_pooling_is_explicit_and_bookkeeping_keys_do_not_split():
    runs = pd.DataFrame([_run(0, seed=0, lr=1e-3), _run(1, seed=1, lr=3e-4)])  # run_dir and tracking URI differ
    assert A.varying_keys(runs) == ["trainer.lr"]
    assert len(A.ablation_table(runs, by=["loss"])) == 2
    pooled = A.ablation_table(runs, by=["loss"], pool=["trainer.lr"])
    assert list(pooled.index) == ["hard_ce"] and pooled.loc["hard_ce", ("eval/tau_vanilla", "n")] == 2
    assert A.format_table(pooled).loc["hard_ce", "pooled trainer.lr"] == "2 values"
    same = pd.DataFrame([_run(0, seed=0), _run(1, seed=1)])
    assert list(A.ablation_table(same, by=["loss"]).index) == ["hard_ce"]  # nothing else varies: no "other"


def test_settings_that_do_not_change_results_never_split_a_row():
    """Two seeds of one config logged with different implementation settings (seq_len 0 = auto against 320, the
    LM-head chunk, bf16 against auto) and a campaign's labels pool in one row; a named seq_len of its own splits."""
    same = dict(**{"p.data.online.seq_len": 320, "p.loss.chunk_size": 65536, "p.trainer.autocast": "bf16",
                   "p.campaign.stage": "0 loss"})
    auto = dict(**{"p.data.online.seq_len": 0, "p.loss.chunk_size": 0, "p.trainer.autocast": "auto",
                   "p.campaign.stage": "3 buffer"})
    runs = pd.DataFrame([_run(0, seed=0, **same), _run(1, seed=1, **auto)])
    assert A.varying_keys(runs) == []
    table = A.ablation_table(runs, by=["loss"], metrics=["eval/tau_vanilla"])
    assert len(table) == 1 and "other" not in table.index.names
    longer = pd.DataFrame([_run(0, seed=0, **same), _run(1, seed=1, **{**same, "p.data.online.seq_len": 512})])
    assert A.varying_keys(longer) == ["data.online.seq_len"]


def test_confidence_intervals_when_logged_else_the_spread():
    ci = {"eval/tau_vanilla_ci_low": 1.01, "eval/tau_vanilla_ci_high": 1.09, "eval/tau_prompt_lookup": 1.40}
    runs = pd.DataFrame([_run(0, tau=1.05, **ci), _run(1, loss="soft_kl", seed=0, tau=1.07),
                         _run(2, loss="soft_kl", seed=1, tau=1.09)])
    table = A.ablation_table(runs, by=["loss"])
    cells = A.format_table(table)
    assert cells.loc["hard_ce", "eval/tau_vanilla"] == "1.050 [1.010, 1.090] (n=1)"
    # no CI logged and no task tables: the seed spread, never a mean of per-run bounds
    assert cells.loc["soft_kl", "eval/tau_vanilla"] == "1.080 (n=2, ± 0.014 over seeds)"
    assert cells.loc["hard_ce", "prompt lookup τ"] == "1.400"
    from dflash.tracking.figures import _bar_errors
    below, above = _bar_errors(table, "eval/tau_vanilla")
    assert below["hard_ce"] == pytest.approx(0.04) and above["hard_ce"] == pytest.approx(0.04)
    assert below["soft_kl"] == pytest.approx(table.loc["soft_kl", ("eval/tau_vanilla", "std")])

    fig = A.plot_tau_table(table, ["eval/tau_vanilla"])
    ax = fig.axes[0]
    assert all(bar.get_y() == pytest.approx(1.0) for bar in ax.patches)  # bars rise from τ = 1
    lo, hi = ax.get_ylim()
    assert 0.9 < lo < 1.0 and hi > 1.4  # not from 0; prompt lookup's 1.40 in view
    assert ax.get_legend() is None  # the legend sits outside the panel, on the figure
    assert {"prompt lookup", "no drafter (τ = 1)"} <= {t.get_text() for lg in fig.legends for t in lg.get_texts()}


def _history():
    rows = []
    for rid, keys in (("r00", ["train/acc", "eval/tau_vanilla"]), ("r01", ["train/acc"]),
                      ("r02", ["train/acc", "eval/tau_vanilla"])):
        for key in keys:
            rows += [{"run_id": rid, "key": key, "step": s, "value": s / 10} for s in (2, 4, 6)]
    return pd.DataFrame(rows)


def test_every_line_label_names_its_run_in_one_colour():
    runs = pd.DataFrame([_run(0, seed=0), _run(1, loss="soft_kl"), _run(2, seed=1)])
    labels = A.run_labels(runs)
    assert len(set(labels.values())) == 3  # unique: a label names one run
    assert labels["r01"].startswith("soft_kl")
    colors = A.run_colors(list(labels))
    fig = A.plot_curves(_history(), ["train/acc", "eval/tau_vanilla"], labels=labels, colors=colors)
    by_label = {lab: rid for rid, lab in labels.items()}
    panels = [ax for ax in fig.axes if ax.lines]
    assert len(panels) == 2
    for ax in panels:
        for line in ax.lines:
            rid = by_label[line.get_label()]  # every line's label is its run's
            assert line.get_color() == colors[rid]  # and its colour is that run's, in every panel
    assert [ln.get_label() for ln in panels[1].lines] == [labels["r00"], labels["r02"]]  # r01 has no eval
    legend = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    assert legend == [labels[r] for r in ("r00", "r01", "r02")]  # one legend, every run


def test_run_labels_tell_identical_configs_apart():
    runs = pd.DataFrame([_run(0, seed=0), _run(1, seed=0)])  # a repeat of the same config and seed
    labels = A.run_labels(runs)
    assert len(set(labels.values())) == 2
    assert all(runs.set_index("run_id").loc[rid, "run_name"] in lab for rid, lab in labels.items())


def test_position_acceptance_leaves_unreached_positions_empty():
    runs = pd.DataFrame([{**_run(0), "p.drafter.block_size": 6, "eval/acc_pos01": 0.5, "eval/acc_pos02": 0.25}])
    pos = A.position_acceptance(runs)
    assert list(pos.columns) == [1, 2, 3, 4, 5]
    assert pos.loc["r00", 1] == 0.5 and pos.loc["r00", 3:].isna().all()


def _served_run(i, loss="hard_ce", seed=0, tau=2.0, pl=1.3, **extra):
    """A run of the current protocol: the objective eval/tau_served, every setting's eval/<setting>/..., no
    eval/tau_vanilla (never written any more)."""
    row = _run(i, loss=loss, seed=seed, tau=tau, **extra)
    del row["eval/tau_vanilla"]
    row.update({"eval/tau_served": tau, "eval/tau_served_ci_low": tau - 0.1, "eval/tau_served_ci_high": tau + 0.1,
                "eval/tau_served_prompt_lookup": pl, "eval/t1/tau_vanilla": tau,
                "eval/t1/tau_vanilla_ci_low": tau - 0.1, "eval/t1/tau_vanilla_ci_high": tau + 0.1, "eval/t1/tau_prompt_lookup": pl,
                "eval/t1/tau_over_prompt_lookup": tau / pl, "eval/t0/tau_vanilla": tau + 1.0,
                "eval/t0/tau_prompt_lookup": pl + 2.0, "eval/t0/tau_tree_16": tau + 1.5,
                "eval/suite/heldout/t1/tau_vanilla": tau - 0.5, "eval/suite/heldout/t0/tau_vanilla": tau + 0.5,
                "eval/subset/t1/tau_vanilla": 9.0})
    return row


def test_current_names_and_the_legacy_ones_are_read_apart():
    """A store's current names (eval/tau_served, eval/t1/..., eval/t0/...) are what the tables read; the legacy
    eval/tau_vanilla and eval/tau_prompt_lookup mean the old protocol and stand apart under their own setting."""
    served = pd.DataFrame([_served_run(0, seed=0, tau=2.0, pl=1.3), _served_run(1, seed=1, tau=2.2, pl=1.5)])
    assert A.tau_metrics(served) == ["eval/tau_served", "eval/t0/tau_tree_16"]
    assert A.baseline_metric(served.columns) == "eval/tau_served_prompt_lookup"
    table = A.ablation_table(served, by=["loss"])
    assert table.loc["hard_ce", ("eval/tau_served_prompt_lookup", "mean")] == pytest.approx(1.4)
    assert ("eval/tau_prompt_lookup", "mean") not in table.columns
    assert A.format_table(table).loc["hard_ce", "prompt lookup τ"] == "1.400"
    fig = A.plot_tau_table(table)
    assert "prompt lookup" in [t.get_text() for lg in fig.legends for t in lg.get_texts()]

    t = A.ci_table(served.iloc[:1])
    got = [(r.suite, r.setting, r.tau_vanilla, r.tau_prompt_lookup) for r in t.itertuples()]
    assert got == [("objective", "t0", "3.00", "3.30"), ("heldout", "t0", "2.50", ""),
                   ("objective", "t1", "2.00 [1.90, 2.10]", "1.30"), ("heldout", "t1", "1.50", "")]
    assert t.iloc[2]["tau_over_prompt_lookup"] == f"{2.0 / 1.3:.2f}"

    legacy = pd.DataFrame([_run(2, tau=1.05, **{"eval/tau_prompt_lookup": 1.4,
                                                "eval/suite/heldout/tau_vanilla": 1.2})])
    assert A.baseline_metric(legacy.columns) == "eval/tau_prompt_lookup"
    t = A.ci_table(legacy)
    assert [(r.suite, r.setting, r.tau_vanilla) for r in t.itertuples()] == [
        ("objective", "legacy", "1.05"), ("heldout", "legacy", "1.20")]
    both = A.ci_table(pd.concat([served.iloc[:1], legacy], ignore_index=True))
    assert set(both["setting"]) == {"t0", "t1", "legacy"} and len(both) == 6  # nothing read under another name

    keys = A.summary_keys(served.iloc[0].to_dict())
    assert keys[:2] == ["eval/tau_served", "eval/tau_served_prompt_lookup"]
    assert keys[2:] == ["eval/t0/tau_vanilla", "eval/t0/tau_prompt_lookup", "eval/t1/tau_vanilla",
                        "eval/t1/tau_prompt_lookup", "eval/t0/tau_tree_16"]
    assert A.summary_keys(legacy.iloc[0].to_dict()) == ["eval/tau_vanilla", "eval/tau_prompt_lookup"]
    frame = A.summary_frame({"metrics": served.iloc[0].to_dict()})
    assert frame.loc["eval/tau_served", "ci_low"] == pytest.approx(1.9)


def test_the_final_evaluations_figures_are_the_served_settings_and_say_so():
    """The per-position acceptance of the final evaluation is the served setting's (T=1), not the greedy one that
    sorts first (`eval/t0` < `eval/t1`); every τ figure names its setting; a run's τ per setting puts the served
    one first with greedy beside it and prompt lookup with each."""
    row = {**_served_run(0), "eval/served_temperature": 1.0, "eval/t0/acc_pos01": 0.9, "eval/t1/acc_pos01": 0.4}
    runs = pd.DataFrame([row])
    assert A.eval_position_prefix(runs) == "eval/t1/acc_pos"
    assert A.position_acceptance(runs).iloc[0, 0] == 0.4
    assert A.eval_position_setting(runs) == "T=1, served"
    assert A.metric_setting("eval/tau_served", runs) == "T=1, served"
    assert A.metric_setting("eval/t0/tau_tree_16", runs) == "T=0, greedy"
    # without the served setting's metrics a sampled setting still comes before the greedy one
    assert A.eval_position_prefix(runs.drop(columns=["eval/served_temperature"])) == "eval/t1/acc_pos"
    legacy = pd.DataFrame([{**_run(1), "eval/acc_pos01": 0.7}])
    assert A.eval_position_prefix(legacy) == "eval/acc_pos"
    assert A.eval_position_setting(legacy) == "T=0, greedy (old protocol)"

    frame = A.tau_settings(row)
    assert list(frame.index) == ["T=1, served", "T=0, greedy"]
    assert frame.loc["T=1, served", "drafter"] == 2.0 and frame.loc["T=1, served", "drafter_low"] == 1.9
    assert frame.loc["T=1, served", "prompt lookup"] == 1.3 and frame.loc["T=0, greedy", "drafter"] == 3.0
    assert list(A.tau_settings(legacy.iloc[0].to_dict()).index) == ["T=0, greedy (old protocol)"]
    fig = A.plot_tau_settings(frame)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["T=1, served", "T=0, greedy"]


def test_runs_served_under_different_proposal_policies_say_so():
    """An engine campaign serves DFlash 1 with argmax drafts and DFlash 2 with its sampled walk: the objective's
    figure names both policies, a per-position figure of one policy is not called the served one, and one run's τ
    per setting names its own policy (it had read "T=1/sampled, served")."""
    served = {"eval/served_temperature": 1.0, "eval/served_top_p": 1.0, "eval/served_top_k": 0.0}
    dflash1 = {**_served_run(0), **served, "eval/served_proposal": 1.0, "eval/t1/argmax/acc_pos01": 0.3}
    dflash2 = {**_served_run(1), **served, "eval/served_proposal": 0.0, "eval/t1/argmax/acc_pos01": 0.35,
               "eval/t1/sampled/acc_pos01": 0.4}
    runs = pd.DataFrame([dflash1, dflash2])
    assert A.served_settings(runs) == ["t1/argmax", "t1/sampled"]
    assert A.metric_setting("eval/tau_served", runs) == ("T=1, served: argmax drafts or drafts sampled from q, each "
                                                         "drafter as its engine proposes")
    assert A.eval_position_setting(runs) == "T=1, argmax drafts"  # DFlash 2's served acceptance is the sampled walk's
    assert A.eval_position_setting(runs.iloc[:1]) == "T=1, argmax drafts, served"
    assert list(A.tau_settings(dflash2).index) == ["T=1, drafts sampled from q, served", "T=0, greedy"]
