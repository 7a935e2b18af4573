"""`python -m sweeps.launch <sweep> report`: a sweep's trials as one table, from the store alone
(sweeps/sweep_report.py), against plain per-prompt arithmetic; the committed sweep store reprints what
the dated results log (benchmarks/log/) quotes."""
import datetime
import re
import json
import random
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "benchmarks" / "sweeps" / "sweeps_out.tar.xz"
optuna.logging.set_verbosity(optuna.logging.WARNING)

SWEEP = """name: tiny_report
fixed: [+target=tiny_random]
space:
  trainer.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
objective: {metric: eval/tau_vanilla, direction: maximize}
sampler: {type: random, seed: 0}
pruner: {type: none}
"""


LAUNCH = datetime.datetime(2026, 12, 2, 17, 10, 38)  # the continuing job's start, naive local as Optuna's
T0 = LAUNCH.timestamp() - 1000  # the first job's rows: a step a second, long before it
CLEAN = 6  # a quarter of the 24 prompts: the least-degenerate rows


def _run_folder(folder: Path, sums: list[int], steps: int, tree: list[int] | None = None,
                final_eval_s: float = 8.0) -> str:
    """A trial's run folder: metrics.jsonl (consumed tokens every 10 steps, one in-training eval at step 20) and,
    with `tree`, its final task table (20 rounds per prompt; prompt lookup 15 per prompt)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "time": T0 + s, "train/loss": 1.0, "data/consumed_tokens": 1000.0 * s}
            for s in range(10, steps + 1, 10)]
    rows.append({"step": 20, "eval/subset/tau_vanilla": 1.25})
    if tree is not None:
        rows.append({"step": steps, "eval/tau_vanilla": sum(sums) / (20 * len(sums))})
        rows.append({"step": steps, "sys/final_eval_s": final_eval_s})
        tasks = [{"task": f"p{i}", "rounds": 20, "tau_sum_vanilla": s, "rounds_tree_64": 10, "tau_sum_tree_64": t,
                  "rounds_prompt_lookup": 15, "tau_sum_prompt_lookup": 30,
                  "gt_copy_rate": 0.0 if i < CLEAN else 0.5}  # the first CLEAN prompts' ground truth does not loop
                 for i, (s, t) in enumerate(zip(sums, tree))]
        (folder / "eval").mkdir()
        (folder / "eval" / "tasks.json").write_text(json.dumps({"tasks": tasks,
                                                                "info": {"ground_truth_key": "gt-A"}}))
    else:  # cut: its rate as logged, and the budget it was cut short of
        rows.append({"step": steps, "perf/consumed_tok_s": 2000.0})
        (folder / "config.yaml").write_text("trainer:\n  max_steps: 60\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


@pytest.fixture
def store(tmp_path):
    """A study as a GPU sweep leaves it: trial 0 cut at step 40 and continued as trial 2 (complete, the best, gated
    and refused), trial 1 complete and worse, trial 3 cut and not continued, its checkpoint on this machine; the
    launches' starts; the run folders recorded under another machine's path."""
    from sweeps.objective import (ATTR_CONTINUES, ATTR_ERROR, ATTR_RUN_DIR, ATTR_RUN_ID, STUDY_CONTINUED,
                                  STUDY_LAUNCH_STARTS)
    from sweeps.storage import make_storage
    from sweeps.support import SweepTracker
    out = tmp_path / "sweeps_out"
    folders = out / "tiny_report"
    tracker = SweepTracker(f"sqlite:///{out / 'mlflow.db'}", "dflash")
    parent = tracker.ensure_parent("tiny_report", None, {}, {})
    rng = random.Random(1)
    best = [rng.randint(40, 60) for _ in range(24)]
    worse = [s - rng.randint(2, 8) for s in best]
    lr = {"trainer.lr": FloatDistribution(1e-4, 1e-2, log=True)}
    study = optuna.create_study(study_name="tiny_report", direction="maximize",
                                storage=make_storage(str(out / "tiny_report.journal")))
    run0 = tracker.create_child(parent, "tiny_report", 0, run_name="trial_00000")
    elsewhere = "/gpu/machine/sweeps_out/tiny_report/"
    cut = "RunInterrupted: stopped by SIGTERM after step 40; checkpoint /x/step_00000040.pt"
    specs = [  # (state, value, attrs, folder contents)
        (TrialState.FAIL, None, {ATTR_RUN_ID: run0, ATTR_ERROR: cut}, None),
        (TrialState.COMPLETE, sum(worse) / 480,
         {ATTR_RUN_ID: tracker.create_child(parent, "tiny_report", 1, run_name="trial_00001")},
         (worse, 60, [w + 3 for w in worse])),
        (TrialState.COMPLETE, sum(best) / 480, {ATTR_RUN_ID: run0, ATTR_CONTINUES: 0},
         (best, 60, [b + 5 for b in best], 10.0)),  # final evals of 8 s (trial 1) and 10 s: median 9 s
        (TrialState.FAIL, None, {ATTR_ERROR: cut.replace("40", "30")}, None),
    ]
    for i, (state, value, attrs, contents) in enumerate(specs):
        name = "trial_00000" if i == 2 else f"trial_{i:05d}"  # a continuation resumes its trial's folder
        if contents is not None:
            _run_folder(folders / name, *contents)
        elif not (folders / name).exists():
            _run_folder(folders / name, [], 40 if i == 0 else 30)
        trial = create_trial(state=state, value=value, params={"trainer.lr": 1e-3 * (i + 1)}, distributions=lr,
                             user_attrs={**attrs, ATTR_RUN_DIR: elsewhere + name})
        if i == 2:  # the continuation: started 30 s into the second job, its first step logged 12 s later
            trial.datetime_start = LAUNCH + datetime.timedelta(seconds=30)
            metrics = folders / name / "metrics.jsonl"
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            for r in rows:  # steps 50 and 60 after the resume from step 40, a step a second
                r["time"] = trial.datetime_start.timestamp() + 12 + r["step"] - 50 if r["step"] > 40 else T0 + r["step"]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        study.add_trial(trial)
    (folders / "trial_00003" / "checkpoints").mkdir()  # trial 3 can continue on this machine
    (folders / "trial_00003" / "checkpoints" / "step_00000030.pt").write_bytes(b"")
    study.set_user_attr(STUDY_LAUNCH_STARTS, [(LAUNCH - datetime.timedelta(hours=1)).isoformat(), LAUNCH.isoformat()])
    study.set_user_attr(STUDY_CONTINUED, {"0": 2})
    study.set_user_attr("mlflow.parent_run_id", parent)
    study.set_user_attr("mlflow.tracking_uri", "sqlite:////gpu/machine/sweeps_out/mlflow.db")
    from mlflow.tracking import MlflowClient
    c = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    for k, v in {"decision": "refused", "reason": "does not beat prompt-lookup", "version": "1"}.items():
        c.set_tag(run0, f"dflash.promotion.{k}", v)
    (tmp_path / "tiny_report.yaml").write_text(SWEEP)
    return tmp_path, out, best, worse, parent


def test_report_rows_against_per_prompt_arithmetic(store):
    from dflash.evaluation.stats import paired_delta_ci, pooled_ci
    from sweeps.launch import main
    tmp, out, best, worse, parent = store
    text = main([str(tmp / "tiny_report.yaml"), "report", f"out={out}"])["report"]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| trial", "| ---"))}
    assert list(rows) == ["2 ← 0", "1", "3"]  # a continued trial is one row, under its last number
    assert "4 trials" not in text and "3 trials, 2 complete" in text
    b, w = rows["2 ← 0"], rows["1"]
    iv = pooled_ci(best, [20] * len(best), 0.95)
    assert b[1] == "COMPLETE" and b[2] == "0.003" and b[3] == "60" and b[4] == "60,000"
    assert b[5] == "20 K: 1.250" and sum(best) / 480 == pytest.approx(iv.value)  # the in-training eval at 20 K
    assert b[6] == f"{iv.value:.3f} [{iv.low:.3f}, {iv.high:.3f}]" and b[7] == "best"
    d = paired_delta_ci(worse, [20] * len(worse), best, [20] * len(best), 0.95)
    assert w[7].startswith(f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]") and d.high < 0  # 1 is worse
    clean = paired_delta_ci(worse[:CLEAN], [20] * CLEAN, best[:CLEAN], [20] * CLEAN, 0.95)
    assert b[8] == "best" and w[8].startswith(f"{clean.value:+.3f} [{clean.low:+.3f}, {clean.high:+.3f}]")
    tree = pooled_ci([s + 5 for s in best], [10] * len(best), 0.95)
    assert b[9] == f"{tree.value:.3f} [{tree.low:.3f}, {tree.high:.3f}] (tree 64 nodes)"
    assert b[10].startswith("2.000 [2.000, 2.000]")  # prompt lookup: 30 over 15 rounds on every prompt
    # 30 steps of 1,000 tokens to go at 2,000 tok/s: 15 s; and what trial 2 measured of continuing: 30 s from its
    # job's start to its own, 12 s to its first step; the final evals 8 and 10 s: what the next job needs in all
    assert rows["3"][1] == ("cut at step 30 of 60 (the next job needs ~66 s: ~30 s to start it, ~12 s to its first "
                            "step, ~15 s of training at 2 K tok/s, ~9 s final eval)") and rows["3"][6] == ""
    assert "Ground truth: `gt-A`" in text and f"MLflow parent run: `{parent}`" in text
    assert "- trial 2 (run `" in text and "**refused** as version 1: does not beat prompt-lookup" in text
    assert "trial 0 (run" not in text  # its run is trial 2's: listed once


def test_report_names_a_missing_store(tmp_path):
    from sweeps.launch import main
    from sweeps.space import SweepError
    with pytest.raises(SweepError, match=r"no study storage .*nowhere.*recipe_reference\.journal.*packed_store unpack"):
        main(["recipe_reference", "report", f"out={tmp_path / 'nowhere'}"])


@pytest.mark.skipif(not STORE.is_file(), reason="no committed sweep store")
def test_committed_sweep_store_reprints_the_results(tmp_path):
    """The recipe sweep, and the rerun of its best trial (30) gated, as
    the results log of 2026-12-03 quotes it (benchmarks/log/2026-12-03.md), reprinted from the committed store."""
    from dflash.tracking.packed_store import unpack
    from sweeps.launch import main
    unpack(STORE, tmp_path)
    text = main(["recipe_reference", "report", f"out={tmp_path / 'sweeps_out'}"])["report"]
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    rerun = rows["| 32 (rerun of 30)"]
    assert "| COMPLETE |" in rerun and "7.251 [6.668, 7.879] | best |" in rerun
    assert "7.209 [6.619, 7.869] | -0.041 [-0.199, +0.126] tie |" in rows["| 30 ← 26"]  # the same params: a tie
    assert "6.588 [6.057, 7.155] | -0.662 [-0.943, -0.384] |" in rows["| 6 ← 2"]  # the first six trials' best, paired
    assert ("cut at step 2920 of 3,125 (~30 s of training at 140 K tok/s; no checkpoint on this machine: it cannot "
            "continue here)") in text and "**refused** as version 1" in text
    assert "- trial 32 (run `4d5c3bd44ea74bc0b97747ea1754542e`): **promoted** as version 2" in text
    results = (ROOT / "benchmarks" / "log" / "2026-12-03.md").read_text()
    table = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    clean = table[0].index("Δ vs best, least-degenerate rows")  # a column the report gained after that log
    assert "+0.011 [-0.164, +0.195] tie" == table[[r[0] for r in table].index("| 30 ← 26")][clean]
    # the log quotes the store's table; its intervals are the flat bootstrap's of that date (the report's are the
    # prompt × sample bootstrap's since: docs/evaluation.md), so the quote is compared without them
    bare = lambda line: re.sub(r"\[[^\]]*\]", "[…]", line)  # noqa: E731
    quoted = [bare(" | ".join(r[:clean] + r[clean + 1:])) for r in table]
    assert len(table) == 23 and all(line in bare(results) for line in quoted)
    # ABLATIONS.md's first screen carries the sweep's summary as the store renders it now (sweeps.results_summary
    # sweep=recipe_reference), with the report's own figures: the best trial, prompt lookup, the tie, the counts
    from sweeps.results_summary import sweep_summary
    summary = sweep_summary("recipe_reference", tmp_path / "sweeps_out")
    ablations = (ROOT / "benchmarks" / "ABLATIONS.md").read_text()
    key = "results-summary:sweep:recipe_reference"
    block = ablations.split(f"<!-- {key} -->\n", 1)[1].split(f"\n<!-- /{key} -->")[0]
    old_protocol = ablations.split("\n## The old protocol: measured on looping greedy ground truth\n", 1)[1]
    assert block == summary.rstrip() and block in "\n".join(old_protocol.splitlines()[:45])  # its first screen
    assert "**Best: trial 32 (trained again from scratch with trial 30's settings)**" in block
    assert "τ **7.251 [6.668, 7.879]**; prompt lookup 6.160 [5.768, 6.547], paired Δ +1.091" in block
    assert "tied with trial 30 ← 26 (-0.041 [-0.199, +0.126])" in block
    assert "- 21 trials (9 complete, 0 pruned, 12 cut by a job's limit)." in block


def test_job_costs_place_trial_starts_with_the_launch_machines_offset(tmp_path):
    """Optuna's trial starts are naive local times of the machine that ran the sweep; the launch records its UTC
    offset, so a report read in another time zone (here +05:00 against this machine's) measures the same seconds."""
    from sweeps.objective import ATTR_CONTINUES, ATTR_RUN_DIR, STUDY_LAUNCH_STARTS
    from sweeps.sweep_report import job_costs
    tz = datetime.timezone(datetime.timedelta(hours=5))
    if datetime.datetime.now().astimezone().utcoffset() == tz.utcoffset(None):
        tz = datetime.timezone(datetime.timedelta(hours=-7))  # always a zone other than this machine's
    launch = LAUNCH.replace(tzinfo=tz)
    folder = tmp_path / "trial_00002"
    folder.mkdir()
    first_step = launch.timestamp() + 30 + 12  # the continuation starts 30 s into the job, steps 12 s later
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": first_step + s - 41,
                                                              "train/loss": 1.0}) + "\n" for s in (41, 42)))
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(STUDY_LAUNCH_STARTS, [launch.isoformat()])
    trial = create_trial(state=TrialState.COMPLETE, value=1.0, params={}, distributions={},
                         user_attrs={ATTR_CONTINUES: 0, ATTR_RUN_DIR: str(folder)})
    trial.datetime_start = LAUNCH + datetime.timedelta(seconds=30)  # naive: the launch machine's wall time
    study.add_trial(trial)
    costs = job_costs(study, tmp_path)
    assert costs["launch"] == pytest.approx(30) and costs["resume"] == pytest.approx(12)


def test_a_training_metric_objective_and_a_pruned_trial(tmp_path):
    """A fresh CPU sweep minimizing `train/loss` (cpu_smoke): its objective column holds each trial's figure (a
    pruned trial's last report, with its step), not blanks; a pruned trial's run closes FINISHED (not KILLED, MLflow's
    red ✗), tagged and described as pruned, and the notebooks' rows still count it apart."""
    from mlflow.tracking import MlflowClient

    from dflash.tracking import analysis as A
    from sweeps.objective import ATTR_RUN_DIR, ATTR_RUN_ID, _outcome_tags
    from sweeps.space import parse_sweep
    from sweeps.storage import make_storage
    from sweeps.sweep_report import render
    from sweeps.support import SweepTracker
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = SweepTracker(uri, "sweeps")
    parent = tracker.ensure_parent("smoke", None, {}, {})
    study = optuna.create_study(study_name="smoke", direction="minimize",
                                storage=make_storage(str(tmp_path / "smoke.journal")))
    lr = {"trainer.lr": FloatDistribution(1e-5, 1e-2, log=True)}
    trials = [create_trial(state=TrialState.COMPLETE, value=4.91234, params={"trainer.lr": 1e-2}, distributions=lr,
                           intermediate_values={4: 5.1}),
              create_trial(state=TrialState.PRUNED, params={"trainer.lr": 1e-5}, distributions=lr,
                           intermediate_values={4: 5.5321})]
    for i, t in enumerate(trials):
        rid = tracker.create_child(parent, "smoke", i, run_name=f"trial_{i:05d}", tags={
            "mlflow.note.content": "python -m experiments.run ...", "dflash.kind": "train"})
        tracker.client.set_terminated(rid, "FAILED")  # as the trainer left it: finish_child sets what it means
        folder = tmp_path / "smoke" / f"trial_{i:05d}"
        folder.mkdir(parents=True)
        (folder / "tags.json").write_text(json.dumps({"mlflow.note.content": "python -m experiments.run ..."}))
        t.user_attrs.update({ATTR_RUN_ID: rid, ATTR_RUN_DIR: str(folder)})
        study.add_trial(t)
        tracker.finish_child(rid, t.state.name, _outcome_tags(study.trials[-1]), folder)
    sweep = parse_sweep({"name": "smoke", "fixed": [], "space": {"trainer.lr": {"type": "float", "low": 1e-5,
                                                                                "high": 1e-2, "log": True}},
                         "objective": {"metric": "train/loss", "direction": "minimize"}})
    text = render(study, sweep, tmp_path)
    head = next(line for line in text.splitlines() if line.startswith("| trial"))
    assert "| train/loss |" in head and "[95% CI]" not in head  # a loss has no interval over prompts here
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| trial", "| ---"))}
    col = head.split(" | ").index("train/loss")
    assert rows["0"][col] == "4.912" and rows["1"][col] == "5.532 at step 4"
    client = MlflowClient(uri)
    pruned = client.get_run(study.trials[1].user_attrs[ATTR_RUN_ID])
    assert pruned.info.status == "FINISHED" and pruned.data.tags["optuna.state"] == "PRUNED"
    assert pruned.data.tags["mlflow.note.content"].startswith("**Pruned** at step 4: ")
    assert pruned.data.tags["mlflow.note.content"].endswith("python -m experiments.run ...")  # kept below
    folder_tags = json.loads((tmp_path / "smoke" / "trial_00001" / "tags.json").read_text())
    assert folder_tags["mlflow.note.content"] == pruned.data.tags["mlflow.note.content"]  # the folder says the same
    assert folder_tags["optuna.state"] == "PRUNED"
    tracker.finish_child(pruned.info.run_id, "PRUNED", {"optuna.pruned_step": 4})  # again (reconcile): said once
    assert client.get_run(pruned.info.run_id).data.tags["mlflow.note.content"].count("**Pruned**") == 1
    assert client.get_run(study.trials[0].user_attrs[ATTR_RUN_ID]).info.status == "FINISHED"
    df = A.load_runs(uri, "sweeps", study="smoke").set_index("trial")  # what the notebooks call finished
    assert df.loc[1, "status"] == "PRUNED" and df.loc[0, "status"] == "FINISHED"
