"""One figure per ablation stage, the same from the campaign report and the notebook (`sweeps.stage_figures`
gathers its data from either):

- left, τ of the objective against consumed tokens: one line per run, the colour its option, the line style its
  seed, the last point the run's final evaluation; prompt lookup's τ on the same prompts as a grey band (its CI);
- right, a forest plot of each option's paired Δτ against the stage's winner with its CI: a tie (interval
  containing 0, or a Δ one seed reverses) is drawn grey on a shaded row, a clear loss in colour; the winner sits
  at 0.

Legends sit outside the panels; labels name the option only (the factor the stage varies). The figure is a
`matplotlib.figure.Figure` not managed by pyplot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dflash.tracking.figures import SEED_STYLES


@dataclass
class StageFigureData:
    title: str
    options: list[str]  # in the stage's order: the colours
    curves: dict[tuple[str, int], list[tuple[float, float]]]  # (option, seed) -> [(consumed tokens, τ)]
    winner: str
    deltas: list[tuple[str, float, float, float, bool]] = field(default_factory=list)  # option, Δ, low, high, tie
    prompt_lookup: tuple[float, float, float] | None = None  # value, low, high
    objective: str = "eval/tau_vanilla"


def plot_stage(d: StageFigureData):
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    fig = Figure(figsize=(12.0, 4.2), layout="constrained")
    curve_ax, forest_ax = fig.subplots(1, 2, width_ratios=[3, 2])
    cmap = colormaps["tab10"]
    colour = {o: cmap(i % 10) for i, o in enumerate(d.options)}
    seeds = sorted({s for _, s in d.curves})
    for (opt, seed), pts in sorted(d.curves.items()):
        if pts:
            xs, ys = zip(*sorted(pts))
            curve_ax.plot([x / 1e6 for x in xs], ys, color=colour[opt], linestyle=SEED_STYLES[seeds.index(seed) %
                          len(SEED_STYLES)], marker="o", markersize=3, linewidth=1.5)
    if d.prompt_lookup is not None:
        v, lo, hi = d.prompt_lookup
        curve_ax.axhspan(lo, hi, color="0.85", zorder=0)
        curve_ax.axhline(v, color="0.45", linewidth=1.0, zorder=0)
    curve_ax.set_xlabel("consumed tokens (M)")
    curve_ax.set_ylabel(d.objective)
    curve_ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colour[o], linewidth=2, label=o + (" (winner)" if o == d.winner else ""))
               for o in d.options]
    handles += [Line2D([], [], color="black", linestyle=SEED_STYLES[i % len(SEED_STYLES)], label=f"seed {s}")
                for i, s in enumerate(seeds)]
    if d.prompt_lookup is not None:
        handles.append(Line2D([], [], color="0.45", linewidth=6, alpha=0.4, label="prompt lookup (CI)"))
    curve_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _forest(forest_ax, d, colour)
    fig.suptitle(d.title)
    return fig


def _forest(ax, d: StageFigureData, colour: dict) -> None:
    rows: Sequence[tuple[str, float, float, float, bool]] = [(d.winner, 0.0, 0.0, 0.0, False), *d.deltas]
    for y, (opt, value, low, high, tie) in enumerate(rows):
        if tie:
            ax.axhspan(y - 0.4, y + 0.4, color="0.9", zorder=0)
        c = "0.5" if tie else colour.get(opt, "black")
        ax.errorbar([value], [y], xerr=[[value - low], [high - value]], fmt="o", color=c, capsize=3)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{r[0]} (winner)" if i == 0 else r[0] for i, r in enumerate(rows)])
    ax.invert_yaxis()
    ax.set_xlabel(f"paired Δ against {d.winner} (95% CI); shaded: tie")
    ax.grid(axis="x", alpha=0.3)
