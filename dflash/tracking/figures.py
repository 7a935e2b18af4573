"""The standard figures of the analysis (`dflash.tracking.analysis` re-exports them).

Every figure that shows several runs draws every run it is given (each line's `gid` is its run id) and keeps
one legend, on the figure and outside its panels. With `run_styles(runs)` the colour says the configuration
(the runs' factors: loss / noise / buffer, and whatever else varies) and the line style the seed, so the legend
has one entry per configuration and one per seed however many runs there are; without it each run gets its own
colour (`run_colors`) and the legend lists every run by its label: a line never carries another run's label
because one panel skipped a run. τ bars start at 1 (τ = 1 is decoding with no drafter: the target's own token), and
prompt-lookup's τ is marked per row when the evaluation logged it. Figures are
`matplotlib.figure.Figure` objects not managed by pyplot (a notebook shows each once).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pandas as pd

SEED_STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 3))]

# Read from dflash.tracking.analysis inside the functions (it re-exports this module: no import cycle).


def _fig(nrows: int = 1, ncols: int = 1, w: float = 7.0, h: float = 4.0):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def run_colors(run_ids: Sequence[str]) -> dict[str, Any]:
    """One colour per run, in order (tab10 up to 10 runs, tab20 up to 20, then evenly spaced hues)."""
    from matplotlib import colormaps
    ids = list(dict.fromkeys(run_ids))
    if len(ids) <= 10:
        cmap, n = colormaps["tab10"], 10
    elif len(ids) <= 20:
        cmap, n = colormaps["tab20"], 20
    else:
        cmap, n = colormaps["hsv"], len(ids) + 1
    return {rid: cmap(i / n if cmap.N > 20 else i) for i, rid in enumerate(ids)}


@dataclass
class RunStyles:
    """How each run is drawn: its configuration's colour, its seed's line style (`run_styles`)."""
    color: dict[str, Any] = field(default_factory=dict)
    linestyle: dict[str, Any] = field(default_factory=dict)
    group: dict[str, str] = field(default_factory=dict)  # run id -> its configuration's label
    seed: dict[str, str] = field(default_factory=dict)  # run id -> "seed 0"

    @property
    def runs(self) -> list[str]:
        return list(self.color)

    def legend(self, fig, has_data: set[str] | None = None, title: str = "") -> None:
        """One entry per configuration (its colour) and one per seed (its line style), outside the panels."""
        from matplotlib.lines import Line2D
        groups = dict.fromkeys(self.group[r] for r in self.runs)
        color_of = {self.group[r]: self.color[r] for r in self.runs}
        drew = {self.group[r] for r in self.runs if has_data is None or r in has_data}
        handles = [Line2D([], [], color=color_of[g], linewidth=2.5,
                          label=g + ("" if g in drew else " (no data)")) for g in groups]
        seeds = dict.fromkeys(sorted({self.seed[r] for r in self.runs}))
        style_of = {self.seed[r]: self.linestyle[r] for r in self.runs}
        if len(seeds) > 1:
            handles += [Line2D([], [], color="dimgray", linestyle=style_of[sd], label=sd) for sd in seeds]
        if handles:
            fig.legend(handles=handles, loc="outside right upper", fontsize=8, title=title or None)


def run_styles(runs: pd.DataFrame, by: Sequence[str] | None = None) -> RunStyles:
    """Colour by configuration (the runs' comparable group: `analysis.comparable_groups` over `by`, default
    loss / noise / buffer, plus any other key that varies), line style by seed."""
    from dflash.tracking.analysis import GROUP_COLS, comparable_groups
    keys = comparable_groups(runs, list(by or GROUP_COLS))
    group = {rid: _row_label(list(keys.columns), tuple(row), sep=" / ", other_sep=", ")
             for rid, (_, row) in zip(runs["run_id"], keys.iterrows())}
    colors = run_colors(list(dict.fromkeys(group.values())))
    seeds = runs["seed"] if "seed" in runs else pd.Series(None, index=runs.index)
    seed_label = {rid: ("seed -" if pd.isna(sd) else f"seed {sd}") for rid, sd in zip(runs["run_id"], seeds)}
    order = sorted(set(seed_label.values()))
    return RunStyles(color={rid: colors[g] for rid, g in group.items()},
                     linestyle={rid: SEED_STYLES[order.index(seed_label[rid]) % len(SEED_STYLES)] for rid in group},
                     group=group, seed=seed_label)


def _run_legend(fig, order: Sequence[str], labels: dict[str, str], colors: dict[str, Any], has_data: set[str]):
    """The figure's one legend: every run, by its colour and label ("no data" where it drew nothing)."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colors[rid], marker="o" if rid in has_data else "x",
                      label=labels.get(rid, str(rid)[:8]) + ("" if rid in has_data else " (no data)"))
               for rid in order]
    if handles:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8)


def plot_curves(hist: pd.DataFrame, keys: str | Sequence[str] | None = None, labels: dict[str, str] | None = None,
                title: str | None = None, logy: bool = False, colors: dict[str, Any] | None = None,
                styles: RunStyles | None = None):
    """One panel per key (default `analysis.CURVE_KEYS`, the loss-independent curves), one line per run.
    `styles` (`run_styles`): colour by configuration, line style by seed, a legend of both; else one colour
    per run in every panel and a legend naming every run (`labels`' order; every labelled run is in it, with
    or without data)."""
    if keys is None:
        from dflash.tracking.analysis import CURVE_KEYS as keys
    keys = [keys] if isinstance(keys, str) else list(keys)
    if styles is not None:
        order = styles.runs
    else:
        order = list(labels) if labels else list(dict.fromkeys(hist["run_id"])) if not hist.empty else []
    labels = labels or {rid: str(rid)[:8] for rid in order}
    colors = styles.color if styles is not None else (colors or run_colors(order))
    fig, axes = _fig(1, len(keys), w=5.0)
    drawn: set[str] = set()
    for ax, key in zip(axes[0], keys):
        h = hist[hist["key"] == key] if not hist.empty else hist
        if h.empty:
            _empty(ax, f"no {key}")
            continue
        for rid in order:
            g = h[h["run_id"] == rid].sort_values("step")
            if g.empty:
                continue
            ax.plot(g["step"], g["value"], color=colors[rid], marker="." if len(g) < 30 else None,
                    linestyle=styles.linestyle[rid] if styles is not None else "-",
                    label=labels.get(rid, str(rid)[:8]), gid=rid)
            drawn.add(rid)
        ax.set_xlabel("step")
        ax.set_title(key)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if styles is not None:
        styles.legend(fig, drawn)
    else:
        _run_legend(fig, order, labels, colors, drawn)
    if title:
        fig.suptitle(title)
    return fig


def plot_position_acceptance(pos: pd.DataFrame, labels: dict[str, str] | None = None,
                             title: str = "acceptance by block position", colors: dict[str, Any] | None = None,
                             styles: RunStyles | None = None):
    """P(position k accepted | positions < k accepted) per run; unreached positions are gaps. `styles` as in
    `plot_curves`."""
    fig, axes = _fig()
    ax = axes[0][0]
    if pos.empty or pos.shape[1] == 0:
        _empty(ax, "no per-position acceptance logged")
        return fig
    order = list(dict.fromkeys(pos.index))
    labels = {rid: (labels or {}).get(rid, str(rid)[:8]) for rid in order}
    colors = styles.color if styles is not None else (colors or run_colors(order))
    for i, (rid, row) in enumerate(pos.iterrows()):  # an index may repeat (eval/train rows of one run)
        first = list(pos.index).index(rid) == i
        style = styles.linestyle.get(rid, "-") if styles is not None else ("-" if first else "--")
        ax.plot(list(pos.columns), row.values, marker="o", markersize=3, color=colors.get(rid, f"C{i}"),
                label=labels[rid], linestyle=style, gid=rid)
    ax.set_xlabel("block position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if styles is not None:
        styles.legend(fig, set(order))
    else:
        _run_legend(fig, order, labels, colors, set(order))
    return fig


def _bar_errors(table: pd.DataFrame, m: str) -> tuple[pd.Series, pd.Series]:
    """(below, above) the mean: the evaluation's CI where logged, else the spread over seeds."""
    mean = table[(m, "mean")]
    std = table[(m, "std")].fillna(0.0)
    below, above = std.copy(), std.copy()
    if (m, "ci_low") in table.columns:
        ci = table[(m, "ci_low")].notna() & table[(m, "ci_high")].notna()
        below[ci] = (mean - table[(m, "ci_low")])[ci].clip(lower=0)
        above[ci] = (table[(m, "ci_high")] - mean)[ci].clip(lower=0)
    return below, above


def short_value(v: Any) -> str:
    """A config value as a label shows it: numbers with 3 significant digits (`0.0003`, `1e-05`), else as is."""
    text = str(v)
    try:
        x = float(text)
    except ValueError:
        return text
    return text if x.is_integer() and "e" not in text.lower() else f"{x:.3g}"


def _short_other(other: str) -> list[str]:
    """`a.b.key=0.000123456789, c.d=x` -> [`key=0.000123`, `d=x`] (the option's group is in the label already)."""
    out = []
    for part in (p for p in str(other).split(", ") if p):
        key, _, value = part.partition("=")
        out.append(f"{key.rsplit('.', 1)[-1]}={short_value(value)}")
    return out


def _row_label(names: Sequence[str | None], key: Any, sep: str = " / ", other_sep: str = "\n") -> str:
    """A table row's label: the factors on the first line, then what else varied, one short key a line."""
    key = key if isinstance(key, tuple) else (key,)
    shown = [short_value(v) for n, v in zip(names, key) if n != "other"]
    other = [o for n, v in zip(names, key) if n == "other" and v for o in _short_other(v)]
    head = sep.join(shown)
    if not other:
        return head
    return head + ("\n" if other_sep == "\n" else " (") + other_sep.join(other) + ("" if other_sep == "\n" else ")")


def plot_tau_table(table: pd.DataFrame, metrics: Sequence[str] | None = None, title: str = "τ by group"):
    """Grouped bars rising from τ = 1 (no drafter), error bars from the evaluation's CI (else the spread
    over seeds), prompt-lookup's τ as a black tick per row when logged; the y-axis fits the data.
    `metrics`: default the table's τ columns."""
    from dflash.tracking.analysis import BASELINES
    if metrics is None:  # the table's own τ columns (`analysis.tau_metrics` chose them)
        metrics = [m for m in dict.fromkeys(table.columns.get_level_values(0))
                   if isinstance(m, str) and m.startswith("eval/") and m not in BASELINES]
    labels = [_row_label(table.index.names, i, sep="\n") for i in table.index]  # one factor a line: no overlap
    extra = max([lab.count("\n") for lab in labels] or [0])
    fig, axes = _fig(w=max(6.0, 1.6 * max(len(table), 1) + 2), h=4.0 + 0.18 * extra)
    ax = axes[0][0]
    metrics = [m for m in metrics if not table.empty and (m, "mean") in table.columns]
    if table.empty or not metrics:
        _empty(ax, "no finished runs with these metrics")
        return fig
    width = 0.8 / len(metrics)
    lows, highs = [1.0], [1.0]
    for j, m in enumerate(metrics):
        xs = [i + (j - (len(metrics) - 1) / 2) * width for i in range(len(table))]
        mean = table[(m, "mean")]
        below, above = _bar_errors(table, m)
        ax.bar(xs, mean - 1.0, width, bottom=1.0, yerr=[below, above], capsize=3, label=m.split("/")[-1])
        if j == 0:  # how many runs stand behind each row
            for x, top, n in zip(xs, mean + above, table[(m, "n")]):
                ax.annotate(f"n={int(n)}", (x, top), textcoords="offset points", xytext=(0, 3), ha="center",
                            fontsize=7, color="dimgray")
        lows.append(float((mean - below).min()))
        highs.append(float((mean + above).max()))
    shown = [b for b in BASELINES if (b, "mean") in table.columns and table[(b, "mean")].notna().any()]
    if shown:  # prompt lookup beside the objective (its own name, or the legacy one)
        base = table[(shown[0], "mean")]
        ax.hlines(base, [i - 0.45 for i in range(len(table))], [i + 0.45 for i in range(len(table))],
                  colors="black", linewidth=2, label="prompt lookup")
        lows.append(float(base.min()))
        highs.append(float(base.max()))
    ax.axhline(1.0, color="gray", linewidth=1, linestyle=":", label="no drafter (τ = 1)")
    lo, hi = min(lows), max(highs)
    pad = max(0.05 * (hi - lo), 0.01)
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_xticks(range(len(table)), labels, fontsize=8)
    ax.set_ylabel("acceptance length τ")
    ax.set_title(title)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_tau_settings(frame: pd.DataFrame, title: str = ""):
    """One run's τ per setting (`analysis.tau_settings`): the drafter's bar and prompt lookup's beside it, each with
    its CI, rising from τ = 1; the x-axis names each setting ("T=1, served", "T=0, greedy"), so a greedy figure
    never reads as the served one."""
    fig, axes = _fig(w=max(5.0, 2.4 * max(len(frame), 1) + 2.5), h=3.8)
    ax = axes[0][0]
    if frame.empty:
        _empty(ax, "no final evaluation logged")
        return fig
    width = 0.38
    for j, (who, color) in enumerate((("drafter", "#4477aa"), ("prompt lookup", "#999999"))):
        xs = [i + (j - 0.5) * width for i in range(len(frame))]
        v = frame[who]
        err = [(v - frame[f"{who}_low"]).fillna(0).clip(lower=0), (frame[f"{who}_high"] - v).fillna(0).clip(lower=0)]
        ax.bar(xs, v - 1.0, width, bottom=1.0, yerr=err, capsize=3, color=color, label=who)
        for x, val in zip(xs, v):
            if pd.notna(val):
                ax.annotate(f"{val:.3f}", (x, val), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=8)
    ax.axhline(1.0, color="gray", linewidth=1, linestyle=":", label="no drafter (τ = 1)")
    ax.set_xticks(range(len(frame)), list(frame.index), fontsize=9)
    ax.set_ylabel("acceptance length τ (95% CI)")
    ax.set_title(title or "τ per setting, prompt lookup on the same ground truth", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
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
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
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
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
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
    handles = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
    if handles:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    return fig
