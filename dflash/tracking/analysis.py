"""Pull dflash runs from MLflow into pandas and compare like with like. Notebooks only call these.

    runs = load_runs("sqlite:///mlflow.db", experiment="dflash", study="loss_variants")
    print(describe_comparison(runs))              # what varies between these runs, what is held fixed
    table = ablation_table(runs, by=["loss", "noise", "buffer"])
    format_table(table)                           # "1.071 ± 0.009 [1.05, 1.09] (n=3)" strings
    plot_tau_table(table)                         # bars from τ = 1 (no drafter), prompt lookup marked
    hist = metric_history("sqlite:///mlflow.db", runs.run_id, CURVE_KEYS)
    plot_curves(hist, CURVE_KEYS, styles=run_styles(runs))   # colour = configuration, line style = seed

Comparable rows: a row of `ablation_table` holds runs whose configs differ only in the seed (and in keys
that change neither what is trained nor what is measured: `NOT_A_FACTOR`). Every config key that varies
between the runs (`varying_keys`: a sampled learning rate, the step budget, the target, ...) is a grouping
key: the ones asked for (`by`) as index levels, the others joined into the index level `other`, so a
40-step trial never pools with a 120-step run, and the ± is the spread over seeds only. `pool=[keys]` lets
named keys vary inside a row, on purpose (the row then says so). Each row shows n, its budget (trained
steps, consumed tokens) and one interval: τ pooled over the row's runs with its run × prompt × sample
bootstrap interval, from the runs' eval task tables (as the campaign report; one run: its logged
`<metric>_ci_low/_high`), never the mean of per-run bounds; and prompt-lookup's τ (`eval/tau_prompt_lookup`) as the baseline.

`load_runs` returns one row per training run (tag `dflash.kind=train`): ids, status (PRUNED for a pruned sweep
trial, `run_status`), times, the grouping tags (`loss`, `noise`, `buffer`, `target`), `seed`, sweep tags
(`trial`, `trial_state`, `pruned_step`), the budget (`steps`, `tokens`), every param as `p.<key>` and every
metric's latest value under its own key. Eval runs made later by `python -m experiments.eval` (tag
`dflash.evaluated_run`) fill a training run's missing `eval/*` values. Figures (`dflash.tracking.figures`,
re-exported here) are `matplotlib.figure.Figure` objects not managed by pyplot. Only `MlflowClient` is used.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import pandas as pd

from dflash.evaluation.protocol import LEGACY_OBJECTIVE, OBJECTIVE, OBJECTIVE_PROMPT_LOOKUP
from dflash.evaluation.stats import Interval

# Metric names (dflash.evaluation.protocol): a store's runs wrote either the current ones (the objective
# eval/tau_served beside eval/tau_served_prompt_lookup; every setting's eval/<setting>/..., setting t1, t0, ...) or,
# before evaluation named its setting, the legacy ones (eval/tau_vanilla beside eval/tau_prompt_lookup), which mean
# the legacy protocol: greedy, fixed-length ground truth that loops. One name never reads as the other.
TAU_METRICS = [LEGACY_OBJECTIVE, "eval/tau_tree_16", "eval/tau_tree_64", "eval/tau_tree_256"]  # legacy; tree: nodes
LEGACY_SETTING = "legacy"  # ci_table's setting of the legacy names: greedy, fixed-length ground truth
_SETTING_TREE_RE = re.compile(r"^eval/(?P<label>t[^/]+)/tau_tree_(?P<b>\d+)$")
_SETTING_RE = re.compile(r"^eval/(?:suite/(?P<suite>[^/]+)/)?(?P<label>t[^/]+(?:/(?:argmax|sampled))?)/tau_vanilla$")
_SUITE_RE = re.compile(r"^eval/suite/(?P<suite>[^/]+)/tau_vanilla$")  # legacy
GROUP_COLS = ["loss", "noise", "buffer"]
# Curves whose scale does not depend on the loss: comparable between runs of different losses
# (train/loss of soft_kl is T²-scaled KL, 11-34 where CE reads ~5.5).
# τ during training is the eval subset's: `eval/subset/tau_served` (the served setting); stores before it logged the
# legacy protocol's `eval/subset/tau_vanilla` (older ones `eval/tau_vanilla`: LEGACY_KEYS). The full suite's τ is one
# final value.
CURVE_KEYS = ["train/acc", "train/anchor_streak", "train/tau_rounds", "train/ce", "eval/subset/tau_served",
              "eval/subset/tau_vanilla"]
BASELINE_METRIC = "eval/tau_prompt_lookup"  # legacy: prompt lookup's τ beside eval/tau_vanilla
# prompt lookup's τ on the τ columns' ground truth: the objective's, else the legacy one (`baseline_metric`)
BASELINES = (OBJECTIVE_PROMPT_LOOKUP, BASELINE_METRIC)
CI_SUFFIXES = ("_ci_low", "_ci_high")
CI_LEVEL = 0.95  # the rows' pooled intervals (the campaign report's level)
# Config keys (and prefixes, ending in ".") that change neither what is trained nor what is measured: the
# replicate seed, bookkeeping, placement, intermediate-eval and checkpoint cadence.
# `campaign.*`: a campaign's labels of its runs (sweeps.results_summary); the chunk sizes and the producer's
# placement change how the same sums are scheduled, not what is trained or measured
NOT_A_FACTOR = ("seed", "run_dir", "resume", "tracking.", "promote.", "campaign.", "eval.cache_dir", "eval.subset",
                "eval.device", "trainer.eval_every", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                "trainer.device", "target.device", "data.regen_cache_dir", "buffer.timeout_s", "loss.chunk_size",
                "target.lm_head_chunk", "trainer.producer_mode")
# A key's "auto" spelling is no value of its own: a run that left it to auto (data.online.seq_len=0: data.max_len,
# which is a factor itself; trainer.autocast=auto: bf16 on a GPU, off on a CPU, and runs of one experiment share
# their device) pools with the runs that name what auto resolved to, and never splits a row by the spelling alone.
# Two different named values still split.
AUTO_SPELLING = {"data.online.seq_len": "0", "trainer.autocast": "auto"}
SHORT_NAMES = {"loss.name": "loss", "noise.name": "noise", "buffer.name": "buffer", "target.name": "target"}
_POS_RE = re.compile(r"^(?P<prefix>.+/acc_pos)(?P<k>\d+)$")


def client(tracking_uri: str):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=tracking_uri)


def _experiment_ids(c, experiment: str | Sequence[str] | None) -> list[str]:
    if experiment is None:
        return [e.experiment_id for e in c.search_experiments()]
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    ids = []
    for n in names:
        e = c.get_experiment_by_name(n)
        if e is not None:
            ids.append(e.experiment_id)
    return ids


def _search(c, exp_ids: list[str], filter_string: str) -> list[Any]:
    if not exp_ids:
        return []
    out, token = [], None
    while True:
        page = c.search_runs(exp_ids, filter_string=filter_string, max_results=1000, page_token=token,
                             order_by=["attributes.start_time ASC"])
        out.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return out


def _num(v: Any) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in str(v) and "e" not in str(v).lower() else f


def _last_step(r) -> float:
    """The step of the run's latest training metric (its real length under a time budget)."""
    steps = [m.step for m in getattr(r.data, "_metric_objs", []) or [] if m.key.startswith("train/")]
    return float(max(steps)) if steps else float("nan")


def run_status(r) -> str:
    """A run's status as the analyses read it: MLflow's, except PRUNED for a sweep trial the pruner stopped (its
    run closes FINISHED, `sweeps.support.RUN_STATUS`, but it never reached its final evaluation)."""
    return "PRUNED" if r.data.tags.get("optuna.state") == "PRUNED" else r.info.status


def _row(r, tracking_uri: str = "") -> dict[str, Any]:
    from dflash.tracking.run_info import local_artifact_dir
    t, p = r.data.tags, r.data.params
    start = pd.to_datetime(r.info.start_time, unit="ms") if r.info.start_time else pd.NaT
    end = pd.to_datetime(r.info.end_time, unit="ms") if r.info.end_time else pd.NaT
    row: dict[str, Any] = {
        "run_id": r.info.run_id, "run_name": r.info.run_name, "status": run_status(r),
        "start_time": start, "duration_s": (end - start).total_seconds() if end is not pd.NaT and start is not pd.NaT
        else float("nan"),
        "loss": t.get("loss", p.get("loss.name")), "noise": t.get("noise", p.get("noise.name")),
        "buffer": t.get("buffer", p.get("buffer.name")), "target": t.get("target", p.get("target.name")),
        "seed": _num(p["seed"]) if "seed" in p else None,
        "study": t.get("optuna.study_name"), "parent_run_id": t.get("mlflow.parentRunId"),
        "trial": int(t["optuna.trial_number"]) if "optuna.trial_number" in t else None,
        "trial_state": t.get("optuna.state"),
        "pruned_step": int(t["optuna.pruned_step"]) if t.get("optuna.pruned_step") else None,
        "run_dir": t.get("dflash.run_dir"),
        "steps": _last_step(r), "tokens": r.data.metrics.get("data/consumed_tokens", float("nan")),
        "artifact_dir": str(d) if (d := local_artifact_dir(r.info.artifact_uri, tracking_uri, r.info.run_id))
        else None,
    }
    row.update({f"p.{k}": _num(v) for k, v in p.items()})
    row.update(dict(r.data.metrics))
    return row


def load_runs(tracking_uri: str, experiment: str | Sequence[str] | None = "dflash", study: str | None = None,
              kind: str = "train", statuses: Iterable[str] | None = None,
              merge_eval_runs: bool = True) -> pd.DataFrame:
    """Training runs of `experiment` (None: all experiments), optionally only one sweep `study`'s trials."""
    c = client(tracking_uri)
    ids = _experiment_ids(c, experiment)
    f = f"tags.`dflash.kind` = '{kind}'"
    if study:
        f += f" and tags.`optuna.study_name` = '{study}'"
    runs = _search(c, ids, f)
    if statuses is not None:
        keep = set(statuses)
        runs = [r for r in runs if run_status(r) in keep]
    df = pd.DataFrame([_row(r, tracking_uri) for r in runs])
    if df.empty:
        return pd.DataFrame(columns=["run_id", "run_name", "status", "loss", "noise", "buffer", "seed"])
    if merge_eval_runs and kind == "train":
        _merge_eval_runs(c, ids, df)
    return df.sort_values("start_time", kind="stable").reset_index(drop=True)


def _merge_eval_runs(c, ids: list[str], df: pd.DataFrame) -> None:
    evals = [r for r in _search(c, ids, "tags.`dflash.kind` = 'eval'")
             if r.info.status == "FINISHED" and r.data.tags.get("dflash.evaluated_run")]
    latest: dict[str, Any] = {}
    for r in evals:  # ascending start time: the last one wins
        latest[r.data.tags["dflash.evaluated_run"]] = r
    for rid, r in latest.items():
        idx = df.index[df["run_id"] == rid]
        if len(idx) == 0:
            continue
        for k, v in r.data.metrics.items():
            if not k.startswith("eval/"):
                continue
            if k not in df.columns:
                df[k] = float("nan")
            if pd.isna(df.at[idx[0], k]):
                df.at[idx[0], k] = v


# --------------------------------------------------------------------------- what varies


def _not_a_factor(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in NOT_A_FACTOR)


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "-"
    return str(v)


def factor_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """The config of each run as strings, one column per key that could change the result (`-`: the run
    has no such key, e.g. another loss's knob). Columns `loss`, `noise`, `buffer`, `target` first."""
    cols: dict[str, pd.Series] = {}
    for c in runs.columns:
        if isinstance(c, str) and c.startswith("p.") and not _not_a_factor(c[2:]):
            cols[SHORT_NAMES.get(c[2:], c[2:])] = runs[c]
    for name in ("loss", "noise", "buffer", "target"):  # tags: runs logged before these were params
        if name in runs.columns:
            cols[name] = cols[name].where(cols[name].notna(), runs[name]) if name in cols else runs[name]
    first = [k for k in ("loss", "noise", "buffer", "target") if k in cols]
    order = first + sorted(k for k in cols if k not in first)
    frame = pd.DataFrame({k: cols[k].map(_cell) for k in order}, index=runs.index)
    for key, auto in AUTO_SPELLING.items():
        if key in frame:
            frame[key] = frame[key].where(frame[key] != auto, "-")
    return frame


def varying_keys(runs: pd.DataFrame) -> list[str]:
    """Config keys with more than one value among `runs` (a key some runs lack does not count by itself)."""
    f = factor_frame(runs)
    return [k for k in f.columns if f[k][f[k] != "-"].nunique() > 1]


def describe_comparison(runs: pd.DataFrame, finished_only: bool = True) -> str:
    """One paragraph: how many runs, which keys vary between them, what is held fixed, the budgets."""
    df = runs[runs["status"] == "FINISHED"] if finished_only and "status" in runs else runs
    if df.empty:
        return "no finished runs"
    f = factor_frame(df)
    vary = varying_keys(df)
    fixed = [k for k in ("target", "loss", "noise", "buffer") if k in f and k not in vary]
    fixed += [k for k in ("trainer.max_steps", "trainer.lr", "trainer.time_budget_s") if k in f and k not in vary]
    lines = [f"{len(df)} finished runs; seeds {_seeds(df)}",
             "varying: " + (", ".join(f"{k} ({f[k].nunique()})" for k in vary) or "nothing but the seed"),
             "fixed: " + ", ".join(f"{k}={f[k].iloc[0]}" for k in fixed)]
    if "steps" in df and df["steps"].notna().any():
        lines.append(f"trained steps {int(df['steps'].min())}-{int(df['steps'].max())}" +
                     (f", tokens {_fmt_tokens(df['tokens'].min())}-{_fmt_tokens(df['tokens'].max())}"
                      if "tokens" in df and df["tokens"].notna().any() else ""))
    return "\n".join(lines)


def _seeds(df: pd.DataFrame) -> str:
    return ",".join(str(x) for x in sorted(set(df["seed"].dropna()))) if "seed" in df else ""


def _fmt_tokens(v: float) -> str:
    if pd.isna(v):
        return "-"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


# --------------------------------------------------------------------------- the table


def _implied(f: pd.DataFrame, by: list[str], key: str) -> bool:
    """True when `key` has one value for each combination of the `by` values (an option's own setting, such as
    `buffer.max_depth` under `buffer=r10_20`): naming it beside the option says nothing new."""
    return bool(by) and bool((f.groupby(by, sort=False)[key].nunique(dropna=False) <= 1).all())


def comparable_groups(runs: pd.DataFrame, by: Sequence[str] = GROUP_COLS, pool: Sequence[str] = ()) -> pd.DataFrame:
    """Each run's row key in `ablation_table`: the `by` keys' values and, in column `other`, every other
    varying key as `key=value` (absent when nothing else varies). Runs with equal keys differ only in the
    seed, in `NOT_A_FACTOR` keys and in the `pool` keys."""
    f = factor_frame(runs)
    for b in by:
        if b not in f:
            f[b] = runs[b].map(_cell) if b in runs else "-"
    keys = f[list(by)].copy()
    other = [k for k in varying_keys(runs) if k not in by and k not in pool and not _implied(f, list(by), k)]
    if other:
        keys["other"] = f[other].apply(lambda r: ", ".join(f"{k}={v}" for k, v in r.items() if v != "-"), axis=1)
    return keys


def tau_metrics(runs: pd.DataFrame) -> list[str]:
    """The τ columns to show, read from the names the evaluation wrote (`dflash.evaluation.protocol`): the
    objective `eval/tau_served` and each setting's tree budgets (`eval/<setting>/tau_tree_<b>`) where the runs
    logged them; else the legacy names (`TAU_METRICS`) of older stores."""
    cols = [c for c in runs.columns if isinstance(c, str)]
    if OBJECTIVE not in cols:
        return list(TAU_METRICS)
    trees = sorted((m["label"], int(m["b"]), c) for c in cols if (m := _SETTING_TREE_RE.match(c)))
    return [OBJECTIVE, *(c for _, _, c in trees)]


def baseline_metric(columns: Iterable[Any]) -> str:
    """Prompt lookup's τ beside the τ columns `tau_metrics` picks: `eval/tau_served_prompt_lookup` where the runs
    logged the objective, else the legacy `eval/tau_prompt_lookup`."""
    return OBJECTIVE_PROMPT_LOOKUP if OBJECTIVE in set(columns) else BASELINE_METRIC


def ablation_table(runs: pd.DataFrame, by: Sequence[str] = GROUP_COLS, metrics: Sequence[str] | None = None,
                   finished_only: bool = True, pool: Sequence[str] = ()) -> pd.DataFrame:
    """One row per set of comparable runs (module doc, `comparable_groups`): index `by` (+ `other`),
    columns (metric, mean|std|n|pooled|ci_low|ci_high) (pooled τ and its CI: `_pooled_interval`), (budget, steps|tokens), (runs, seeds), and
    (prompt lookup's τ, mean) when logged (`baseline_metric`: the objective's, else the legacy one). `pool`: keys
    allowed to vary inside a row."""
    df = runs[runs["status"] == "FINISHED"] if finished_only and "status" in runs else runs
    metrics = [m for m in (tau_metrics(runs) if metrics is None else metrics) if m in df.columns]
    if df.empty or not metrics:
        return pd.DataFrame()
    by = list(by)
    keys = comparable_groups(df, by, pool)
    f = factor_frame(df)
    g = df.groupby([keys[c] for c in keys.columns], sort=True)
    parts: dict[tuple[str, str], pd.Series] = {}
    for m in metrics:
        parts[(m, "mean")], parts[(m, "std")], parts[(m, "n")] = g[m].mean(), g[m].std(ddof=1), g[m].count()
        pooled = pd.Series([_pooled_interval(rows, m) for _, rows in g], index=g[m].mean().index, dtype=object)
        if pooled.map(lambda iv: isinstance(iv, Interval)).any():
            parts[(m, "pooled")] = pooled.map(lambda iv: iv.value if isinstance(iv, Interval) else float("nan"))
            parts[(m, "ci_low")] = pooled.map(lambda iv: iv.low if isinstance(iv, Interval) else float("nan"))
            parts[(m, "ci_high")] = pooled.map(lambda iv: iv.high if isinstance(iv, Interval) else float("nan"))
    base = baseline_metric(df.columns)
    if base in df.columns and base not in metrics:
        parts[(base, "mean")] = g[base].mean()
    for col in ("steps", "tokens"):
        if col in df.columns:
            parts[("budget", col)] = g[col].mean()
    parts[("runs", "seeds")] = g["seed"].agg(lambda s: ",".join(str(x) for x in sorted(set(s.dropna()))))
    for k in pool:
        if k in f:
            parts[("pooled", k)] = f[k].groupby([keys[c] for c in keys.columns], sort=True).nunique()
    out = pd.DataFrame(parts)
    out.columns = pd.MultiIndex.from_tuples(out.columns)
    out.index.names = list(keys.columns)
    return out.sort_values((metrics[0], "mean"), ascending=False)


def _task_table(artifact_dir: Any, artifact: str) -> dict | None:
    import json
    from pathlib import Path
    if not isinstance(artifact_dir, str) or not artifact_dir:
        return None
    f = Path(artifact_dir) / artifact
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None


def _pooled_interval(group: pd.DataFrame, m: str, level: float = CI_LEVEL) -> Any:
    """τ pooled over the row's runs with its run × prompt × sample bootstrap interval (each run a training seed),
    from the runs' task tables (the campaign report's interval, `hierarchical_ci`); one run: its own logged
    interval. None where neither can be had: a row never shows the mean of its runs' bounds, which is no interval of anything."""
    from dflash.evaluation.pairing import NotPaired, metric_columns, task_rows
    from dflash.evaluation.stats import Rows, hierarchical_ci
    lo, hi = (f"{m}{s}" for s in CI_SUFFIXES)
    group = group[group[m].notna()]
    if "seed" in group:  # (seed, prompt) pairs in seed order, as the campaign report resamples them
        group = group.sort_values("seed", kind="stable")
    if len(group) == 1:
        r = group.iloc[0]
        if lo in group and hi in group and pd.notna(r[lo]) and pd.notna(r[hi]):
            return Interval(float(r[m]), float(r[lo]), float(r[hi]))
    cols = metric_columns(m)
    if cols is None or group.empty or "artifact_dir" not in group:
        return None
    keys: list = []
    sums: list[float] = []
    counts: list[float] = []
    for run, d in enumerate(group["artifact_dir"]):
        t = _task_table(d, cols.artifact)
        if t is None:
            return None
        try:
            rows = task_rows(t, cols.sum_col, cols.count_col, seed=run)
        except NotPaired:
            return None
        keys, sums, counts = keys + list(rows.keys), sums + list(rows.sums), counts + list(rows.counts)
    return hierarchical_ci(Rows(keys, sums, counts), None, level) if sum(counts) else None


def ci_prefixes(columns: Iterable[Any]) -> list[tuple[str, str, str]]:
    """(suite, setting, metric prefix) of every τ the runs logged: the current names' objective suite
    (`eval/<setting>/`) and suites (`eval/suite/<name>/<setting>/`), then the legacy names' (`eval/`,
    `eval/suite/<name>/`; setting `LEGACY_SETTING`)."""
    cols = [str(c) for c in columns]
    found = {(m["suite"] or "", m["label"]) for c in cols if (m := _SETTING_RE.match(c))}
    labels = sorted({lab for _, lab in found})
    out = []
    for lab in labels:
        if ("", lab) in found:
            out.append(("objective", lab, f"eval/{lab}/"))
        out += [(s, lab, f"eval/suite/{s}/{lab}/") for s in sorted(s for s, la in found if s and la == lab)]
    legacy = sorted({m["suite"] for c in cols if (m := _SUITE_RE.match(c))})
    if LEGACY_OBJECTIVE in cols:
        out.append(("objective", LEGACY_SETTING, "eval/"))
    return out + [(s, LEGACY_SETTING, f"eval/suite/{s}/") for s in legacy]


def ci_table(runs: pd.DataFrame, metrics: Sequence[str] = ("tau_vanilla", "tau_prompt_lookup"),
             digits: int = 2, label_cols: Sequence[str] = ("run_name", "loss", "noise", "buffer", "seed")
             ) -> pd.DataFrame:
    """One row per run, suite and setting: each τ metric as `value [ci_low, ci_high]` (the eval's bootstrap interval
    over prompts, keys `<metric>_ci_low/_ci_high`) and `tau_over_prompt_lookup`. Suites: the objective and every
    `eval/suite/<name>/...` the runs logged, at each setting (`t1`, `t0`, ...: `eval/<setting>/...`), and under the
    legacy names (`eval/tau_vanilla`, setting `legacy`: greedy, fixed-length ground truth): `ci_prefixes`."""
    rows = []
    for _, r in runs.iterrows():
        for suite, setting, pre in ci_prefixes(runs.columns):
            if pd.isna(r.get(pre + "tau_vanilla")):
                continue
            row = {c: r.get(c) for c in label_cols if c in runs.columns}
            row["suite"], row["setting"] = suite, setting
            for m in metrics:
                v, lo, hi = r.get(pre + m), r.get(f"{pre}{m}_ci_low"), r.get(f"{pre}{m}_ci_high")
                row[m] = "" if pd.isna(v) else (f"{v:.{digits}f}" if pd.isna(lo) else
                                                 f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]")
            ratio = r.get(pre + "tau_over_prompt_lookup")
            row["tau_over_prompt_lookup"] = "" if pd.isna(ratio) else f"{ratio:.{digits}f}"
            rows.append(row)
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """Readable cells: `mean ± std` (spread over seeds, n > 1), `[lo, hi]` (the evaluation's CI, when
    logged), `(n=k)`; then the budget, prompt lookup's τ, the seeds (and pooled keys)."""
    if table.empty:
        return table
    out = pd.DataFrame(index=table.index)
    tops = dict.fromkeys(c[0] for c in table.columns)
    for m in [t for t in tops if t not in ("runs", "budget", "pooled", *BASELINES)
              or (t in BASELINES and (t, "n") in table.columns)]:
        out[m] = table.apply(lambda row, m=m: _fmt_cell(row, m, digits), axis=1)
    for b in BASELINES:
        if (b, "mean") in table.columns and (b, "n") not in table.columns:
            out["prompt lookup τ"] = table[(b, "mean")].map(lambda v: "" if pd.isna(v) else f"{v:.{digits}f}")
    if ("budget", "steps") in table.columns:
        out["steps"] = table[("budget", "steps")].map(lambda v: "" if pd.isna(v) else f"{v:.0f}")
    if ("budget", "tokens") in table.columns:
        out["tokens"] = table[("budget", "tokens")].map(_fmt_tokens)
    if ("runs", "seeds") in table.columns:
        out["seeds"] = table[("runs", "seeds")]
    for c in [c for c in table.columns if c[0] == "pooled"]:
        out[f"pooled {c[1]}"] = table[c].map(lambda v: f"{int(v)} values")
    return out


def _fmt_cell(row: pd.Series, m: str, digits: int) -> str:
    mean, std, n = row[(m, "mean")], row[(m, "std")], int(row[(m, "n")])
    if n == 0 or pd.isna(mean):
        return ""
    pooled = row.get((m, "pooled"), float("nan"))
    lo, hi = row.get((m, "ci_low"), float("nan")), row.get((m, "ci_high"), float("nan"))
    s = f"{mean if pd.isna(pooled) else pooled:.{digits}f}"
    if not (pd.isna(lo) or pd.isna(hi)):
        s += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    if n > 1 and not pd.isna(std):
        s += f" (n={n}, ± {std:.{digits}f} over seeds)"
        return s
    return s + f" (n={n})"


def run_labels(runs: pd.DataFrame, cols: Sequence[str] | None = None) -> dict[str, str]:
    """run_id -> a label unique to the run: the values of the keys that vary between `runs` (and its seed),
    `#trial` for sweep trials; the run name when nothing varies or two runs would read the same."""
    f = factor_frame(runs)
    cols = [c for c in (cols if cols is not None else varying_keys(runs)) if c in f]
    seeds = runs["seed"] if "seed" in runs else pd.Series(None, index=runs.index)
    with_seed = seeds.dropna().nunique() > 1
    labels: dict[str, str] = {}
    for i, r in runs.iterrows():
        parts = [f[c][i] if c in SHORT_NAMES.values() else f"{c.rsplit('.', 1)[-1]}={f[c][i]}"
                 for c in cols if f[c][i] != "-"]
        if with_seed and pd.notna(seeds[i]):
            parts.append(f"s{seeds[i]}")
        lab = " ".join(parts) or str(r.get("run_name") or r["run_id"][:8])
        if "trial" in runs.columns and r.get("trial") is not None and not pd.isna(r.get("trial")):
            lab = f"#{int(r['trial'])} " + lab
        labels[r["run_id"]] = lab
    counts = pd.Series(list(labels.values())).value_counts()
    names = runs.set_index("run_id")["run_name"] if "run_name" in runs else {}
    return {rid: (f"{lab} ({names.get(rid) or rid[:8]})" if counts[lab] > 1 else lab) for rid, lab in labels.items()}


# --------------------------------------------------------------------------- one run, the store


# Names a store written before the current ones used (its runs show under the new name): the in-training eval
# was logged under eval/ beside the final one, the anchor streak as train/streak.
LEGACY_KEYS = {"eval/subset/tau_vanilla": "eval/tau_vanilla", "train/anchor_streak": "train/streak"}


def metric_history(tracking_uri: str, run_ids: Iterable[str], keys: Iterable[str]) -> pd.DataFrame:
    """Long frame [run_id, key, step, value, time] of every logged value (a run without a key that has a
    `LEGACY_KEYS` name: that name's values, under the key)."""
    c = client(tracking_uri)
    rows = []
    for rid in run_ids:
        for k in keys:
            hist = c.get_metric_history(rid, k)
            if not hist and k in LEGACY_KEYS:
                hist = c.get_metric_history(rid, LEGACY_KEYS[k])
                if k.startswith("eval/subset/"):  # there the last value is the final suite's, not the subset's
                    hist = sorted(hist, key=lambda m: m.step)[:-1]
            for m in hist:
                rows.append({"run_id": rid, "key": k, "step": m.step, "value": m.value,
                             "time": pd.to_datetime(m.timestamp, unit="ms")})
    return pd.DataFrame(rows, columns=["run_id", "key", "step", "value", "time"])


def metric_keys(tracking_uri: str, run_id: str) -> list[str]:
    return sorted(client(tracking_uri).get_run(run_id).data.metrics)


def eval_position_prefix(runs: pd.DataFrame) -> str:
    """Where the final evaluation's per-position acceptance is: `eval/acc_pos` (stores before evaluation named its
    setting), else the served setting's `eval/<setting>/acc_pos` (`served_setting`), else a sampled setting's
    before the greedy `eval/t0/`: the objective's setting, never the greedy one for sorting first."""
    found = {m["prefix"] for c in runs.columns if (m := _POS_RE.match(str(c)))
             and re.match(r"^eval/(t[^/]+/(?:(?:argmax|sampled)/)?)?acc_pos$", m["prefix"])}
    if "eval/acc_pos" in found or not found:
        return "eval/acc_pos"
    served = served_setting(runs)
    if f"eval/{served}/acc_pos" in found:
        return f"eval/{served}/acc_pos"
    return sorted(found, key=lambda p: (p == "eval/t0/acc_pos", p))[0]


def setting_title(prefix: str, served: str | None = None) -> str:
    """What a metric prefix measures, for a figure's title: `eval/t1/...` "T=1, served" (where `served` is its
    label), `eval/t0/...` "T=0, greedy", the legacy `eval/...` "T=0, greedy (old protocol)"."""
    m = re.match(r"^eval/(t[^/]+)/(?:(argmax|sampled)/)?", prefix)
    if m is None:
        return "T=0, greedy (old protocol)" if prefix.startswith("eval/") else prefix.rstrip("/")
    if m[1] == "t0":
        return "T=0, greedy" + (", served" if served == "t0" else "")
    label = m[1] + (f"/{m[2]}" if m[2] else "")
    policy = {"argmax": ", argmax drafts", "sampled": ", drafts sampled from q"}.get(m[2] or "", "")
    return _temperature(m[1]) + policy + (", served" if served == label else "")


def served_settings(runs: pd.DataFrame) -> list[str]:
    """Every served setting's label among the runs (`eval/served_temperature` ...), first seen first: an engine
    campaign scores DFlash 1 under argmax drafts (`t1/argmax`) and DFlash 2 under its sampled walk (`t1/sampled`)."""
    from dflash.evaluation.protocol import served_label
    labels = []
    for _, row in runs.filter(like="eval/served_").iterrows():
        got = {k: float(v) for k, v in row.items() if pd.notna(v)}
        if got and served_label(got) not in labels:
            labels.append(served_label(got))
    return labels


def served_setting(runs: pd.DataFrame) -> str | None:
    """The served setting's label of the runs (the first run's that logged one)."""
    labels = served_settings(runs)
    return labels[0] if labels else None


def metric_setting(metric: str, runs: pd.DataFrame) -> str:
    """The setting a τ metric is measured at, in words: the objective `eval/tau_served` "T=1, served", a
    `eval/<setting>/...` key by its label (`setting_title`), a legacy key "T=0, greedy (old protocol)". Runs served
    under different proposal policies say so ("T=1, served: argmax drafts or drafts sampled from q, each drafter
    as its engine proposes")."""
    labels = served_settings(runs)
    served = labels[0] if len(labels) == 1 else None
    if metric.startswith(OBJECTIVE) and len(labels) > 1:
        words = [setting_title(f"eval/{label}/") for label in labels]
        head = {w.split(", ", 1)[0] for w in words}
        if len(head) == 1:  # one sampling setting, several policies
            return (f"{head.pop()}, served: " + " or ".join(w.split(", ", 1)[1] for w in words if ", " in w)
                    + ", each drafter as its engine proposes")
        return "served: " + " or ".join(words)
    if metric.startswith(OBJECTIVE):
        return setting_title(f"eval/{served or 't0'}/", served).replace(", served", "") + ", served"
    return setting_title(metric, served)


def eval_position_setting(runs: pd.DataFrame) -> str:
    """The setting of the per-position acceptance `position_acceptance` shows by default, in words ("served" only
    where every run was served so)."""
    labels = served_settings(runs)
    return setting_title(eval_position_prefix(runs) + "/", labels[0] if len(labels) == 1 else None)


def position_acceptance(runs: pd.DataFrame, prefix: str | None = None) -> pd.DataFrame:
    """Per-position acceptance (final value) -> frame indexed by run_id, columns 1..K (block position); `prefix`
    default: the final evaluation's (`eval_position_prefix`).

    Positions that no round reached are not logged (there is no acceptance to log): they read NaN, and the
    columns run to the block size (`p.drafter.block_size`) so those gaps show."""
    prefix = eval_position_prefix(runs) if prefix is None else prefix
    cols = {int(m.group("k")): c for c in runs.columns if (m := _POS_RE.match(str(c))) and m.group("prefix") == prefix}
    if not cols:
        return pd.DataFrame(index=runs["run_id"] if "run_id" in runs else None)
    bs = pd.to_numeric(runs.get("p.drafter.block_size", pd.Series(dtype=float)), errors="coerce").max()
    ks = list(range(1, max(max(cols), int(bs) - 1 if pd.notna(bs) else 0) + 1))
    out = runs.set_index("run_id").reindex(columns=[cols.get(k, f"{prefix}{k:02d}") for k in ks])
    out.columns = ks
    return out.dropna(how="all")


def run_info(tracking_uri: str, run_id: str) -> dict[str, Any]:
    r = client(tracking_uri).get_run(run_id)
    return {"run_id": run_id, "run_name": r.info.run_name, "status": r.info.status,
            "params": dict(r.data.params), "tags": dict(r.data.tags), "metrics": dict(r.data.metrics),
            "row": _row(r, tracking_uri)}


def latest_run(tracking_uri: str, experiment: str | None = "dflash", study: str | None = None,
               status: str = "FINISHED") -> str | None:
    runs = load_runs(tracking_uri, experiment, study=study, statuses=[status], merge_eval_runs=False)
    return None if runs.empty else str(runs.iloc[-1]["run_id"])


def sweep_parent(tracking_uri: str, study: str, experiment: str | None = "dflash") -> dict[str, Any] | None:
    """The study's parent run (tags `sweep.best_*`), or None."""
    c = client(tracking_uri)
    runs = _search(c, _experiment_ids(c, experiment),
                   f"tags.`dflash.kind` = 'sweep' and tags.`optuna.study_name` = '{study}'")
    if not runs:
        return None
    r = runs[0]
    return {"run_id": r.info.run_id, "status": r.info.status, "tags": dict(r.data.tags),
            "params": dict(r.data.params), "metrics": dict(r.data.metrics)}


HEADLINE_KEYS = ("train/acc", "train/anchor_streak", "train/ce", "train/loss")


def summary_keys(metrics: Iterable[str]) -> list[str]:
    """The headline metrics a run logged: training's, the objective with prompt lookup beside it, each setting's
    τ, prompt lookup and trees on the objective suite (`eval/<setting>/...`), then the legacy names."""
    ms = set(metrics)
    settings = sorted({m["label"] for k in ms if (m := _SETTING_RE.match(k)) and not m["suite"]})
    per = [f"eval/{lab}/{what}" for lab in settings for what in ("tau_vanilla", "tau_prompt_lookup")]
    trees = sorted((m["label"], int(m["b"]), k) for k in ms if (m := _SETTING_TREE_RE.match(k)))
    keys = [*HEADLINE_KEYS, OBJECTIVE, OBJECTIVE_PROMPT_LOOKUP, *per, *(k for *_, k in trees), *TAU_METRICS,
            BASELINE_METRIC]
    return [k for k in keys if k in ms]


def tau_settings(metrics: dict[str, float]) -> pd.DataFrame:
    """One run's τ at each setting, labelled, with prompt lookup's on the same ground truth, each with its CI: the
    served setting first (`eval/tau_served`, e.g. "T=1, served"), greedy beside it ("T=0, greedy", `eval/t0/...`);
    a run from before sampled evaluation has the old protocol's greedy τ only (`eval/tau_vanilla`). Rows `setting`,
    columns `drafter`, `drafter_low`, `drafter_high`, `prompt lookup`, ... (NaN where not logged)."""
    from dflash.evaluation.protocol import served_label
    nan = float("nan")
    lo, hi = CI_SUFFIXES
    sources = []  # (setting label, the drafter's τ key, prompt lookup's τ key)
    if OBJECTIVE in metrics:
        served = served_label(metrics)  # its proposal policy named (`t1/sampled`: "T=1, drafts sampled from q")
        sources.append((setting_title(f"eval/{served}/", served), OBJECTIVE, f"eval/{served}/tau_prompt_lookup"))
        if served != "t0" and "eval/t0/tau_vanilla" in metrics:
            sources.append(("T=0, greedy", "eval/t0/tau_vanilla", "eval/t0/tau_prompt_lookup"))
    elif LEGACY_OBJECTIVE in metrics:
        sources.append(("T=0, greedy (old protocol)", LEGACY_OBJECTIVE, BASELINE_METRIC))
    rows = {}
    for setting, tau, pl in sources:
        rows[setting] = {f"{who}{end}": metrics.get(key + suffix, nan) for who, key in (("drafter", tau),
                         ("prompt lookup", pl)) for end, suffix in (("", ""), ("_low", lo), ("_high", hi))}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("setting")


def _temperature(label: str) -> str:
    """A setting label in words: `t1` → "T=1", `t0.7_p0.95` → "T=0.7, top_p 0.95"."""
    from dflash.tracking.ui_view import setting_words
    return setting_words(label)


def summary_frame(info: dict[str, Any], keys: Sequence[str] | None = None) -> pd.DataFrame:
    """Final values of the headline metrics of one run (`run_info(...)`; `keys` default: `summary_keys`), each τ
    with the evaluation's confidence interval (`ci_low`, `ci_high`; empty where none was logged)."""
    m = info["metrics"]
    keys = summary_keys(m) if keys is None else keys
    shown = [k for k in keys if k in m]
    lo, hi = CI_SUFFIXES
    return pd.DataFrame({"metric": shown, "value": [m[k] for k in shown],
                         "ci_low": [m.get(k + lo, float("nan")) for k in shown],
                         "ci_high": [m.get(k + hi, float("nan")) for k in shown]}).set_index("metric")


from dflash.tracking.figures import (  # noqa: E402  (the figures read this module's constants)
    plot_buffer_depths, plot_curves, plot_perf, plot_position_acceptance, plot_study, plot_tau_settings,
    plot_tau_table, run_colors, run_styles,
)
