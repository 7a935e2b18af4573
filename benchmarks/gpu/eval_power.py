"""The evaluation's power on one GPU (docs/evaluation.md): train a drafter for a fixed time, then evaluate it on
coding10 and on the full held-out suite (128 prompts × 256 tokens), τ ± 95% CI beside prompt lookup's.

    PYTHONPATH=$PWD python benchmarks/gpu/eval_power.py                       # ~7 min on one H200
    PYTHONPATH=$PWD python benchmarks/gpu/eval_power.py trainer.time_budget_s=120 +loss=soft_kl

Overrides are Hydra overrides on top of `+trainer=gpu +eval=full trainer.time_budget_s=240`. Prints the
suite summary (also written to $OUT/eval_power.md when $OUT is set) and returns the metrics.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from dflash.evaluation.evaluator import summary_table
from dflash.app.run import train
from experiments.config import compose_config

DEFAULTS = ["+trainer=gpu", "+eval=full", "trainer.time_budget_s=240", "trainer.eval_every=0",
            "tracking.system_metrics=false"]


def main(argv: list[str]) -> dict:
    cfg = compose_config(DEFAULTS + list(argv))
    res = train(cfg)
    text = (f"{cfg.loss.name} drafter, {res.metrics.get('train/step', cfg.trainer.max_steps)} steps, run "
            f"{res.run_dir}\n\n{summary_table(res.metrics, cfg.eval.ci_level)}\n")
    print(text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "eval_power.md").write_text(text)
    return res.metrics


if __name__ == "__main__":
    main(sys.argv[1:])
