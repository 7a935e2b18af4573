"""Which ground truths an evaluation runs on, and what its metrics are called (docs/evaluation.md, "τ at
temperature").

An evaluation verifies its rounds at one or two settings, each a `TruthSpec`:
- the served setting (`eval.sampling`, default the target's generation_config.json): the objective;
- with `eval.greedy_beside` and a served setting that samples, greedy (T = 0) beside it.
Both end at the target's stop tokens (`stop_ids`: EOS / end of turn) unless `eval.stop_at_eos` is off.

Metric names say the setting: `eval/<label>/...` (label `t1`, `t0`, `t0.7_p0.95_k20`: `Sampling.label`), a
suite's `eval/suite/<name>/<label>/...`, the in-training subset's `eval/subset/<label>/...`. The objective (what
the promotion gate, sweeps and campaign reports read) is `eval/tau_served` with its CI (`_ci_low`/`_ci_high`),
the served setting's τ on the objective suite, and `eval/served_temperature` / `_top_p` / `_top_k` say which
setting that was. Task tables (artifacts and files): the served setting's objective suite at `eval/served/` (file
`<out>/served/tasks.json`), another suite's at `eval/suite/<name>/served/` (`<out>/<name>/served/`), greedy's beside
them with `t0` for `served`; each table's `info.setting` names its setting. One name never carries two meanings: `eval/tau_vanilla`, the name stores made before this
protocol carry, is never written again, and readers treat it as the legacy greedy fixed-length protocol
(`LEGACY_OBJECTIVE`).
"""
from __future__ import annotations

from dflash.evaluation.ground_truth import TruthSpec
from dflash.target.sampling import Sampling, resolve_sampling, target_folder

OBJECTIVE = "eval/tau_served"
OBJECTIVE_PROMPT_LOOKUP = "eval/tau_served_prompt_lookup"  # prompt lookup beside the objective, same ground truth
SERVED_PROPOSAL = "eval/served_proposal"  # the objective's proposal policy at T > 0: 1 argmax, 0 sampled
LEGACY_OBJECTIVE = "eval/tau_vanilla"  # stores before sampled evaluation: greedy, fixed-length ground truth
LEGACY_NOTE = "eval/tau_vanilla: the old protocol (greedy, fixed-length ground truth that loops)"


def stop_ids(target) -> tuple[int, ...]:
    """The target's end tokens: its config's and generation config's eos_token_id(s), and the tokenizer's."""
    from dflash.data.online import stop_token_ids
    return stop_token_ids(target)


def served_sampling(cfg, target) -> Sampling:
    return resolve_sampling(cfg.sampling, target_folder(target))


def truth_specs(cfg, target) -> list[TruthSpec]:
    """[served, greedy beside it (when asked and the served setting samples)]."""
    stops = stop_ids(target) if cfg.stop_at_eos else ()
    served = served_sampling(cfg, target)
    specs = [TruthSpec(served, cfg.samples, cfg.seed, stops)]
    if cfg.greedy_beside and not served.greedy:
        specs.append(TruthSpec(Sampling(), 1, cfg.seed, stops))
    return specs


def labelled(metrics: dict[str, float], label: str) -> dict[str, float]:
    """`eval/X` → `eval/<label>/X` (and `eval/suite/<name>/X` → `eval/suite/<name>/<label>/X`)."""
    out = {}
    for k, v in metrics.items():
        if k.startswith("eval/suite/"):
            name, _, rest = k[len("eval/suite/"):].partition("/")
            out[f"eval/suite/{name}/{label}/{rest}"] = v
        elif k.startswith("eval/"):
            out[f"eval/{label}/{k[5:]}"] = v
        else:
            out[k] = v
    return out


def objective_metrics(metrics: dict[str, float], served: Sampling, label: str | None = None,
                      policy: str | None = None) -> dict[str, float]:
    """`eval/tau_served` (+ CI) from the served setting's objective τ (under `label`, which names the proposal
    policy at T > 0: `t1/argmax`), the setting it was measured at, and at T > 0 the policy
    (`eval/served_proposal`: 1 argmax drafts / the best-path walk, 0 drafts sampled from q / the sampled walk)."""
    pre = f"eval/{label or served.label}/"
    out = {f"{OBJECTIVE}{suffix}": metrics[f"{pre}tau_vanilla{suffix}"] for suffix in ("", "_ci_low", "_ci_high")
           if f"{pre}tau_vanilla{suffix}" in metrics}
    if f"{pre}tau_prompt_lookup" in metrics:
        out[OBJECTIVE_PROMPT_LOOKUP] = metrics[f"{pre}tau_prompt_lookup"]
    out.update({"eval/served_temperature": served.temperature, "eval/served_top_p": served.top_p,
                "eval/served_top_k": float(served.top_k)})
    if not served.greedy and policy is not None:
        out[SERVED_PROPOSAL] = float(policy == "argmax")
    return out


SERVED_DIR = "served"


def table_places(reports) -> list[tuple[str, str]]:
    """(artifact prefix, folder under the eval output) of each report of `evaluate_suites`: a setting's first
    report is its objective suite; the first setting is the served one (module doc)."""
    out, seen = [], []
    for r in reports:
        label = r.info.get("setting", "t0")
        first = label not in seen
        if first:
            seen.append(label)
        where = SERVED_DIR if label == seen[0] else label
        name = r.info.get("suite_label", "suite")
        out.append((f"eval/{where}", where) if first else (f"eval/suite/{name}/{where}", f"{name}/{where}"))
    return out


def served_label(metrics: dict[str, float]) -> str:
    """The served setting's label from a run's `eval/served_*` metrics ('t0' without them): `t1/argmax` with
    the policy it was scored under; plain `t1` for stores made before the policy was recorded (their drafts were
    sampled from q)."""
    t = metrics.get("eval/served_temperature")
    if t is None or t <= 0:
        return "t0"
    label = Sampling(float(t), float(metrics.get("eval/served_top_p", 1.0)),
                     int(metrics.get("eval/served_top_k", 0))).label
    return label if SERVED_PROPOSAL not in metrics else f"{label}/{served_policy(metrics)}"


def served_policy(metrics: dict[str, float]) -> str:
    """'argmax' / 'sampled' at T > 0 ('sampled' for stores before the policy was recorded), 'greedy' at T = 0."""
    t = metrics.get("eval/served_temperature")
    if t is None or t <= 0:
        return "greedy"
    return "argmax" if metrics.get(SERVED_PROPOSAL) == 1.0 else "sampled"
