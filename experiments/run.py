"""One training run: `python -m experiments.run [+loss=soft_kl] [+noise=cosine] [key=value ...]`.

Thin on purpose: compose the config, call `dflash.app.run.train`, print the result. Sweeps, tests and
notebooks call the same functions. `--cfg` prints the resolved config and exits; `--help` lists the config
groups, their options and every key. `resume=<run dir>` continues a run from its newest intact checkpoint.
SIGTERM / Ctrl-C: the step finishes, a checkpoint is written, the MLflow run closes KILLED, exit 128 + signal.
"""
from __future__ import annotations

import sys

import yaml

from dflash.config import to_dict
from dflash.app.run import train
from experiments.config import compose_config, exit_on_help, resume_config, run_cli


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(argv, __doc__)
    show = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    resume = next((a.partition("=")[2] for a in overrides if a.startswith("resume=")), "")
    others = [a for a in overrides if not a.startswith("resume=")]
    cfg = resume_config(resume, others) if resume else compose_config(overrides)
    if show:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return {}
    result = train(cfg)
    print(f"run dir: {result.run_dir}\nmlflow run: {result.run_id}\nfinal drafter: {result.checkpoint}")
    print(closing_lines(result.metrics, cfg), flush=True)
    return result.metrics


def policy_line(metrics: dict, cfg) -> str:
    """'engine vllm, argmax drafts' (the policy the objective was scored under; docs/evaluation.md)."""
    from dflash.evaluation.engines import policy_name
    from dflash.evaluation.protocol import served_policy
    policy = served_policy(metrics)
    if policy == "greedy":
        return "greedy"
    return f"engine {cfg.eval.engine}, {policy_name(policy, cfg.drafter.is_dflash2)}"


def closing_lines(metrics: dict, cfg) -> str:
    """The run's τ at the served setting and at T = 0, each beside prompt lookup's, and three lines: what τ is, what
    to expect of a short CPU run, what to try next (docs/evaluation.md)."""
    from dflash.evaluation.protocol import OBJECTIVE, OBJECTIVE_PROMPT_LOOKUP, served_label

    def pair(pre: str) -> str:
        tau, pl = metrics.get(pre + "tau_vanilla"), metrics.get(pre + "tau_prompt_lookup")
        return "-" if tau is None else f"{tau:.3f}" + ("" if pl is None else f" (prompt lookup {pl:.3f})")
    served = served_label(metrics)
    lines = []
    if OBJECTIVE in metrics:
        lines.append(f"{OBJECTIVE} = τ at the target's sampling setting ({served}: {policy_line(metrics, cfg)}, "
                     f"lossless verification): {pair(f'eval/{served}/')}")
        other = served.rpartition("/")[0] + "/" + ("sampled" if served.endswith("/argmax") else "argmax")
        if "/" in served and f"eval/{other}/tau_vanilla" in metrics:
            lines.append(f"eval/{other}/tau_vanilla = τ under the other proposal policy, same ground truth: "
                         f"{pair(f'eval/{other}/')}")
        if served != "t0" and "eval/t0/tau_vanilla" in metrics:
            lines.append(f"eval/t0/tau_vanilla = τ when the target decodes greedily (T=0): {pair('eval/t0/')}")
    steps = cfg.trainer.max_steps
    tau, pl = metrics.get(OBJECTIVE), metrics.get(OBJECTIVE_PROMPT_LOOKUP)
    where = ("" if tau is None or pl is None else
             f" This one is {'above' if tau > pl else 'below'} it by {abs(tau - pl):.3f} (a point estimate: the "
             "interval beside it says whether that is a tie).")
    lines += [
        "τ is the tokens each target forward commits (accepted drafts + 1), on held-out prompts whose ground truth "
        "ends where the target ends it.",
        f"A drafter earns its place only above prompt lookup (the free n-gram baseline); a {steps}-step CPU drafter "
        f"usually sits near it on the code target.{where}",
        "Next: the GPU recipe, python -m experiments.run +recipe=served_reference; the runs, "
        f"mlflow ui --backend-store-uri {cfg.tracking.tracking_uri}"]
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
