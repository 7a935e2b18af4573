"""What a campaign report adds for the served protocol (docs/evaluation.md, "τ at temperature"): every stage's
objective suite at the served setting (T = 1 for the reference target, lossless rejection sampling) and greedily
(T = 0) beside it, the degeneracy of each setting's ground truth, and the rank agreement of the options' orders:
T = 0 against T = 1, and each campaign of `compare_with` (the old protocol's, on looping greedy ground truth)
against T = 1, so a reader sees which conclusions the protocol changed.

The orders compare pooled vanilla τ means over the seeds every option has (`shared_seeds`), as the stage tables do;
Kendall's τ-b is over the options both orders have. An order's winner or loser that differs from T = 1's is a changed
conclusion only where T = 1's own paired Δ is not a tie: the agreement table says what moved, the stage table how
sure each call is.
"""
from __future__ import annotations

from pathlib import Path

from sweeps.learning_curves import agrees_word, order_agreement

SETTING_NAMES = {"served": "at the served setting", "t0": "greedy (T=0)"}


def _info(cells: list[dict], suite: str, setting: str) -> dict:
    """The first task table of `suite` at `setting` among the cells ({} where none): its info and metrics describe
    the ground truth every cell of the campaign shares (one pin)."""
    from sweeps.campaign_report import _tables
    for c in cells:
        t = _tables(Path(c["run_dir"]), setting).get(suite)
        if t is not None:
            return t
    return {}


def setting_title(cells: list[dict], suite: str) -> str:
    """The served tables' setting for a suite heading, e.g. ", sampled at T=1, top_p=1, top_k=off (the served
    setting)"; '' for legacy tables, which name none."""
    info = _info(cells, suite, "served").get("info") or {}
    return f", {info['sampling']} (the served setting)" if info.get("setting") and info.get("sampling") else ""


def ground_truth_lines(cells: list[dict], suite: str, setting: str = "served") -> list[str]:
    """One line on the ground truth's degeneracy at `setting`, with the human continuation's beside it (a τ on text
    that loops is not a result); none for a table that does not carry the figures."""
    m = _info(cells, suite, setting).get("metrics") or {}
    if "eval/gt_in_repeat16" not in m:
        return []
    line = (f"Ground truth ({SETTING_NAMES.get(setting, setting)}): 4-gram repeats {m['eval/gt_repeat4']:.3f}, "
            f"tokens in repeated 16-grams {m['eval/gt_in_repeat16']:.3f}, "
            f"{100 * m['eval/gt_cycle_share']:.1f}% of continuations end in a cycle")
    if "eval/gt_mean_tokens" in m:
        line += f", {m['eval/gt_mean_tokens']:.0f} tokens on average"
    if "eval/human_in_repeat16" in m:
        line += (f"; the human continuation: {m['eval/human_repeat4']:.3f}, {m['eval/human_in_repeat16']:.3f}, "
                 f"{100 * m['eval/human_cycle_share']:.1f}%, prompt lookup τ {m['eval/human_tau_prompt_lookup']:.3f}")
    return [line + ".", ""]


def greedy_section(cells: list[dict], suite: str, reference: str, baseline) -> list[str]:
    """The objective suite's stage table when the target decodes greedily (T = 0), if the cells have one."""
    from sweeps.campaign_report import _by_option, stage_table
    if not _by_option(cells, suite, "t0") or not (Path(cells[0]["run_dir"]) / "eval" / "served").is_dir():
        return []  # legacy runs: their one table is greedy and already shown
    return [f"### suite `{suite}`, greedy (T=0)", "", *ground_truth_lines(cells, suite, "t0"),
            *stage_table(cells, suite, reference, baseline, setting="t0"), ""]


def option_means(cells: list[dict], suite: str, setting: str = "served") -> dict[str, float]:
    """{option: pooled vanilla τ over the seeds every option has} of a stage's cells at `setting`."""
    from sweeps.campaign_report import _by_option, pooled, shared_seeds
    by_opt = _by_option(cells, suite, setting)
    shared = shared_seeds(by_opt)
    return {o: pooled([seeds[s] for s in shared]).value for o, seeds in by_opt.items()} if shared else {}


def policy_table(run_dir: Path, suite: str, policy: str) -> dict | None:
    """The run's task table of `suite` scored under proposal `policy` at its sampled served setting (docs/
    evaluation.md, "The engine's proposal policy"): the served table when that was its policy, else the one the
    evaluator scored beside it (`eval/<label>/<policy>/`); None when the run has neither (a run from before
    `eval.engine` recorded only drafts sampled from q, its served tables)."""
    from sweeps.campaign_report import _tables
    served = _tables(run_dir, "served").get(suite)
    info = (served or {}).get("info") or {}
    if served is not None and info.get("policy", "sampled") == policy and info.get("setting", "t0") != "t0":
        return served
    label = str(info.get("setting", "")).partition("/")[0]
    return _tables(run_dir, f"{label}/{policy}").get(suite) if label and label != "t0" else None


def policy_option_means(cells: list[dict], suite: str, policy: str) -> dict[str, float]:
    """{option: pooled vanilla τ over the seeds every option has} with every cell scored under `policy`."""
    from sweeps.campaign_report import pooled, shared_seeds
    by_opt: dict[str, dict[int, dict]] = {}
    for c in cells:
        t = policy_table(Path(c["run_dir"]), suite, policy)
        if t is not None:
            by_opt.setdefault(c["option"], {})[int(c["seed"])] = t
    shared = shared_seeds(by_opt)
    return {o: pooled([seeds[s] for s in shared]).value for o, seeds in by_opt.items()} if shared else {}


def agreement_row(name: str, order: dict[str, float], served: dict[str, float]) -> dict:
    """`order` against the served order (`learning_curves.order_agreement`), named and with its agreement in words;
    only `ordering` and `n` below two options in common."""
    row = order_agreement(order, served)
    if row is None:
        return {"ordering": name, "n": len(set(order) & set(served))}
    return {"ordering": name, **row, "agrees": agrees_word(row)}


def _other_stage_cells(name: str, out: Path | None, factor: str) -> tuple[list[dict] | None, str]:
    """(the cells of campaign `name`'s stage of `factor` in the store `out`, why not: '' where that campaign has no
    such stage, so there is nothing to compare)."""
    from sweeps.campaign_spec import load_campaign
    from sweeps.campaign_report import load_summary
    other = load_campaign(name)
    idx = [i for i, st in enumerate(other.stages) if st.factor == factor]
    if not idx:
        return None, ""
    if out is None or not (out / name / "summary.json").is_file():
        return None, f"`{name}`'s {factor} stage is not in this store"
    return [x for x in load_summary(other, out)["cells"] if x["stage"] == idx[0]], ""


def agreement_section(c, out: Path | None, i: int, cells: list[dict], suite: str) -> list[str]:
    """The stage's rank agreement table: greedy (T = 0) and every `c.compare_with` campaign's same-factor stage
    against the served order (T = 1); [] where the cells have no served tables."""
    served = option_means(cells, suite)
    if len(served) < 2 or not (Path(cells[0]["run_dir"]) / "eval" / "served").is_dir():
        return []
    factor = c.stages[i].factor
    greedy = option_means(cells, suite, "t0")  # none where the served setting is itself greedy
    rows = [agreement_row("greedy (T=0), the same runs", greedy, served)] if greedy else []
    engine_scored = any(((_info(cells, suite, "served").get("info") or {}).get("engine"),))
    sampled = policy_option_means(cells, suite, "sampled") if engine_scored else {}
    if sampled and sampled != served:  # the served order is the engine's policy: against drafts sampled from q
        rows.append(agreement_row("drafts sampled from q (every cell; the objective before eval.engine), the same "
                                  "runs", sampled, served))
    missing = []
    for name in c.compare_with:
        other, why = _other_stage_cells(name, out, factor)
        if other is None:
            missing += [why] if why else []
            continue
        rows.append(agreement_row(f"`{name}` (old protocol: greedy ground truth that loops)",
                                  option_means(other, suite), served))
    if not rows and not missing:
        return []
    lines = ["Rank agreement with the served order (T=1; Kendall's τ-b over the options both orders have; winner = "
             "highest mean, loser = lowest). Served order: "
             + ", ".join(f"{o} {v:.3f}" for o, v in sorted(served.items(), key=lambda kv: -kv[1])) + ".", "",
             "| ordering | options | Kendall τ-b | winner | loser | agrees |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "kendall_tau_b" not in r:
            lines.append(f"| {r['ordering']} | {r['n']} | — | — | — | too few options in common |")
        else:
            lines.append(f"| {r['ordering']} | {r['n']} | {r['kendall_tau_b']:+.2f} | {r['winner']} | {r['loser']} | "
                         f"{r['agrees']} |")
    if missing:
        lines += ["", "Not compared: " + "; ".join(missing) + "."]
    return [*lines, ""]
