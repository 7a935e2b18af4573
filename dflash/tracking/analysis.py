"""Pull dflash runs from MLflow into pandas and draw the standard figures. Notebooks only call these.

    runs = load_runs("sqlite:///mlflow.db", experiment="dflash", study="loss_variants")
    table = ablation_table(runs, by=["loss", "noise", "buffer"])       # mean ± std over seeds (runs)
    format_table(table)                                                # "3.41 ± 0.12 (n=3)" strings
    hist = metric_history("sqlite:///mlflow.db", runs.run_id, ["train/loss", "eval/tau_vanilla"])
    plot_curves(hist, "train/loss", labels=run_labels(runs))
    plot_position_acceptance(position_acceptance(runs), labels=run_labels(runs))

`load_runs` returns one row per training run (tag `dflash.kind=train`): ids, status, times, the grouping
tags (`loss`, `noise`, `buffer`, `target`), `seed`, sweep tags (`trial`, `trial_state`, `pruned_step`), every
param as `p.<key>` and every metric's latest value under its own key (`eval/tau_vanilla`, `train/loss`, …).
Eval runs made later by `python -m experiments.eval` (tag `dflash.evaluated_run`) fill a training run's
missing `eval/*` values. Figures are `matplotlib.figure.Figure` objects not managed by pyplot (a notebook
shows each once, as the cell's value or through `display`). Only `MlflowClient` is used.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import pandas as pd

TAU_METRICS = ["eval/tau_vanilla", "eval/tau_tree_16", "eval/tau_tree_64", "eval/tau_tree_256"]  # tree: nodes
_SUITE_RE = re.compile(r"^eval/suite/(?P<suite>[^/]+)/tau_vanilla$")
GROUP_COLS = ["loss", "noise", "buffer"]
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


def _row(r) -> dict[str, Any]:
    t, p = r.data.tags, r.data.params
    start = pd.to_datetime(r.info.start_time, unit="ms") if r.info.start_time else pd.NaT
    end = pd.to_datetime(r.info.end_time, unit="ms") if r.info.end_time else pd.NaT
    row: dict[str, Any] = {
        "run_id": r.info.run_id, "run_name": r.info.run_name, "status": r.info.status,
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
        runs = [r for r in runs if r.info.status in keep]
    df = pd.DataFrame([_row(r) for r in runs])
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


def ablation_table(runs: pd.DataFrame, by: Sequence[str] = GROUP_COLS, metrics: Sequence[str] = TAU_METRICS,
                   finished_only: bool = True) -> pd.DataFrame:
    """Mean, std and count of each metric per group (the spread is over the group's runs: seeds, or a
    sweep's trials). Columns: (metric, mean|std|n); plus ('runs', 'seeds')."""
    df = runs
    if finished_only and "status" in df:
        df = df[df["status"] == "FINISHED"]
    by = [b for b in by]
    metrics = [m for m in metrics if m in df.columns]
    if df.empty or not metrics:
        return pd.DataFrame()
    df = df.copy()
    for b in by:
        if b not in df.columns:
            df[b] = "-"
        df[b] = df[b].fillna("-").astype(str)
    g = df.groupby(by, sort=True)
    parts = {}
    for m in metrics:
        parts[(m, "mean")] = g[m].mean()
        parts[(m, "std")] = g[m].std(ddof=1)
        parts[(m, "n")] = g[m].count()
    parts[("runs", "seeds")] = g["seed"].agg(lambda s: ",".join(str(x) for x in sorted(set(s.dropna()))))
    out = pd.DataFrame(parts)
    out.columns = pd.MultiIndex.from_tuples(out.columns)
    first = metrics[0]
    return out.sort_values((first, "mean"), ascending=False)


def ci_table(runs: pd.DataFrame, metrics: Sequence[str] = ("tau_vanilla", "tau_prompt_lookup"),
             digits: int = 2, label_cols: Sequence[str] = ("run_name", "loss", "noise", "buffer", "seed")
             ) -> pd.DataFrame:
    """One row per run and suite: each τ metric as `value [ci_low, ci_high]` (the eval's bootstrap interval
    over prompts, keys `<metric>_ci_low/_ci_high`) and `eval/tau_over_prompt_lookup`. Suites: the objective
    (`eval/...`, suite "objective") and every `eval/suite/<name>/...` the runs logged."""
    suites = sorted({m["suite"] for c in runs.columns if (m := _SUITE_RE.match(str(c)))})
    prefixes = [("objective", "eval/")] + [(s, f"eval/suite/{s}/") for s in suites]
    rows = []
    for _, r in runs.iterrows():
        for suite, pre in prefixes:
            if pd.isna(r.get(pre + "tau_vanilla")):
                continue
            row = {c: r.get(c) for c in label_cols if c in runs.columns}
            row["suite"] = suite
            for m in metrics:
                v, lo, hi = r.get(pre + m), r.get(f"{pre}{m}_ci_low"), r.get(f"{pre}{m}_ci_high")
                row[m] = "" if pd.isna(v) else (f"{v:.{digits}f}" if pd.isna(lo) else
                                                 f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]")
            ratio = r.get(pre + "tau_over_prompt_lookup")
            row["tau_over_prompt_lookup"] = "" if pd.isna(ratio) else f"{ratio:.{digits}f}"
            rows.append(row)
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """`mean ± std (n=k)` strings per metric; std is blank for a single run."""
    if table.empty:
        return table
    out = pd.DataFrame(index=table.index)
    for m in dict.fromkeys(c[0] for c in table.columns if c[0] != "runs"):
        def fmt(row, m=m):
            mean, std, n = row[(m, "mean")], row[(m, "std")], int(row[(m, "n")])
            if n == 0 or pd.isna(mean):
                return ""
            s = f"{mean:.{digits}f}"
            if n > 1 and not pd.isna(std):
                s += f" ± {std:.{digits}f}"
            return s + f" (n={n})"
        out[m] = table.apply(fmt, axis=1)
    if ("runs", "seeds") in table.columns:
        out["seeds"] = table[("runs", "seeds")]
    return out


def run_labels(runs: pd.DataFrame, cols: Sequence[str] = ("loss", "noise", "buffer", "seed")) -> dict[str, str]:
    """run_id -> short label from the columns that differ between runs (or the run name)."""
    cols = [c for c in cols if c in runs.columns and runs[c].astype(str).nunique() > 1]
    labels = {}
    for _, r in runs.iterrows():
        lab = " ".join(f"{c}={r[c]}" for c in cols) if cols else str(r.get("run_name", r["run_id"][:8]))
        if "trial" in runs.columns and r.get("trial") is not None and not pd.isna(r.get("trial")):
            lab = f"#{int(r['trial'])} " + lab
        labels[r["run_id"]] = lab
    return labels


def metric_history(tracking_uri: str, run_ids: Iterable[str], keys: Iterable[str]) -> pd.DataFrame:
    """Long frame [run_id, key, step, value, time] of every logged value."""
    c = client(tracking_uri)
    rows = []
    for rid in run_ids:
        for k in keys:
            for m in c.get_metric_history(rid, k):
                rows.append({"run_id": rid, "key": k, "step": m.step, "value": m.value,
                             "time": pd.to_datetime(m.timestamp, unit="ms")})
    return pd.DataFrame(rows, columns=["run_id", "key", "step", "value", "time"])


def metric_keys(tracking_uri: str, run_id: str) -> list[str]:
    return sorted(client(tracking_uri).get_run(run_id).data.metrics)


def position_acceptance(runs: pd.DataFrame, prefix: str = "eval/acc_pos") -> pd.DataFrame:
    """Per-position acceptance (final value) -> frame indexed by run_id, columns 1..K (block position)."""
    cols = {int(m.group("k")): c for c in runs.columns if (m := _POS_RE.match(str(c))) and m.group("prefix") == prefix}
    if not cols:
        return pd.DataFrame(index=runs["run_id"] if "run_id" in runs else None)
    ks = sorted(cols)
    out = runs.set_index("run_id")[[cols[k] for k in ks]].copy()
    out.columns = ks
    return out.dropna(how="all")


def run_info(tracking_uri: str, run_id: str) -> dict[str, Any]:
    r = client(tracking_uri).get_run(run_id)
    return {"run_id": run_id, "run_name": r.info.run_name, "status": r.info.status,
            "params": dict(r.data.params), "tags": dict(r.data.tags), "metrics": dict(r.data.metrics),
            "row": _row(r)}


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


# --------------------------------------------------------------------------- figures


def _fig(nrows: int = 1, ncols: int = 1, w: float = 7.0, h: float = 4.0):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_tau_table(table: pd.DataFrame, metrics: Sequence[str] = TAU_METRICS, title: str = "τ by group"):
    """Grouped bars: mean ± std per group for each τ metric."""
    fig, axes = _fig(w=max(6.0, 1.2 * max(len(table), 1) + 3))
    ax = axes[0][0]
    metrics = [m for m in metrics if not table.empty and (m, "mean") in table.columns]
    if table.empty or not metrics:
        _empty(ax, "no finished runs with these metrics")
        return fig
    labels = [" / ".join(map(str, i)) if isinstance(i, tuple) else str(i) for i in table.index]
    width = 0.8 / len(metrics)
    for j, m in enumerate(metrics):
        xs = [i + (j - (len(metrics) - 1) / 2) * width for i in range(len(table))]
        ax.bar(xs, table[(m, "mean")], width, yerr=table[(m, "std")].fillna(0), capsize=3,
               label=m.split("/")[-1])
    ax.set_xticks(range(len(table)), labels, rotation=30, ha="right")
    ax.set_ylabel("acceptance length τ")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_curves(hist: pd.DataFrame, keys: str | Sequence[str], labels: dict[str, str] | None = None,
                title: str | None = None, logy: bool = False):
    """One panel per key, one line per run."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    fig, axes = _fig(1, len(keys), w=6.0)
    for ax, key in zip(axes[0], keys):
        h = hist[hist["key"] == key] if not hist.empty else hist
        if h.empty:
            _empty(ax, f"no {key}")
            continue
        for rid, g in h.groupby("run_id", sort=False):
            g = g.sort_values("step")
            ax.plot(g["step"], g["value"], marker="." if len(g) < 30 else None,
                    label=(labels or {}).get(rid, str(rid)[:8]))
        ax.set_xlabel("step")
        ax.set_title(key)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, labs = axes[0][0].get_legend_handles_labels()
    if handles and len(handles) <= 20:
        axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def plot_position_acceptance(pos: pd.DataFrame, labels: dict[str, str] | None = None,
                             title: str = "acceptance by block position"):
    """P(position k accepted | positions < k accepted) per run."""
    fig, axes = _fig()
    ax = axes[0][0]
    if pos.empty or pos.shape[1] == 0:
        _empty(ax, "no per-position acceptance logged")
        return fig
    for rid, row in pos.iterrows():
        ax.plot(list(pos.columns), row.values, marker="o", label=(labels or {}).get(rid, str(rid)[:8]))
    ax.set_xlabel("block position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(pos) <= 20:
        ax.legend(fontsize=8)
    return fig


def plot_study(runs: pd.DataFrame, objective: str, direction: str = "maximize",
               title: str | None = None):
    """Objective per trial (pruned / failed trials marked at their last value), and the best so far."""
    fig, axes = _fig()
    ax = axes[0][0]
    if runs.empty or "trial" not in runs or runs["trial"].isna().all():
        _empty(ax, "no sweep trials")
        return fig
    df = runs.dropna(subset=["trial"]).sort_values("trial")
    vals = df[objective] if objective in df.columns else pd.Series(float("nan"), index=df.index)
    for state, marker, color in (("COMPLETE", "o", "C0"), ("PRUNED", "x", "C3"), ("FAIL", "s", "gray")):
        m = df["trial_state"] == state
        if m.any():
            ax.scatter(df.loc[m, "trial"], vals[m], marker=marker, color=color, label=state.lower())
    done = df[df["trial_state"] == "COMPLETE"]
    if not done.empty and objective in done:
        best = done[objective].cummax() if direction == "maximize" else done[objective].cummin()
        ax.step(done["trial"], best, where="post", color="C2", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.set_title(title or f"{objective} by trial")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def plot_buffer_depths(hist: pd.DataFrame, run_label: str = ""):
    """Per-bucket depth and total over steps (keys buffer/depth_b*, buffer/total, buffer/max_depth)."""
    fig, axes = _fig()
    ax = axes[0][0]
    h = hist[hist["key"].str.startswith("buffer/")] if not hist.empty else hist
    if h.empty:
        _empty(ax, "no buffer metrics")
        return fig
    for key, g in h.groupby("key"):
        if key in ("buffer/get_wait_s",):
            continue
        g = g.sort_values("step")
        style = {"linewidth": 2.0} if key in ("buffer/total", "buffer/max_depth") else {"alpha": 0.8}
        if key == "buffer/max_depth":
            style["linestyle"] = "--"
        ax.plot(g["step"], g["value"], label=key.split("/", 1)[1], **style)
    ax.set_xlabel("step")
    ax.set_ylabel("items")
    ax.set_title(f"buffer depths {run_label}".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig


def plot_perf(hist: pd.DataFrame, run_label: str = ""):
    """Throughput (perf/*_tok_s) and the consumer's wait fraction over steps."""
    fig, axes = _fig(1, 2, w=6.0)
    ax, ax2 = axes[0]
    h = hist[hist["key"].str.startswith("perf/")] if not hist.empty else hist
    if h.empty:
        _empty(ax, "no perf metrics")
        _empty(ax2, "")
        return fig
    for key, g in h.groupby("key"):
        g = g.sort_values("step")
        (ax if key.endswith("_tok_s") else ax2).plot(g["step"], g["value"], label=key.split("/", 1)[1])
    ax.set_title(f"throughput {run_label}".strip())
    ax.set_ylabel("tokens / s")
    ax2.set_title("consumer wait fraction")
    for a in (ax, ax2):
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    return fig


def summary_frame(info: dict[str, Any], keys: Sequence[str] = ("train/loss", "train/acc", "train/streak",
                                                               *TAU_METRICS)) -> pd.DataFrame:
    """Final values of the headline metrics of one run (`run_info(...)`)."""
    m = info["metrics"]
    return pd.DataFrame({"metric": [k for k in keys if k in m],
                         "value": [m[k] for k in keys if k in m]}).set_index("metric")
