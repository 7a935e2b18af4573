"""Evaluated acceptance (DESIGN §5): the number a checkpoint is judged by.

- `prompts`: eval suites (built-in `coding10`, or a JSON file of {name, prompt}).
- `ground_truth`: the target's greedy continuation of each prompt plus its features, cached on disk.
- `acceptance`: simulated rounds on the ground truth — vanilla τ, DDTree τ per budget, per-position
  acceptance — with a pluggable proposer (the drafter, or an oracle in tests).
- `tree`: the DDTree best-first builder.
- `speculative`: real draft → verify → commit decoding on the target (lossless, hybrid-state rollback).
- `report`: `evaluate(...) -> EvalReport` (metrics, per-task table, artifacts) and `make_evaluator(cfg)`
  for the trainer.

Importing this package is cheap (no transformers, no matplotlib): `dflash.config` imports `EvalConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    enabled: bool = True
    suite: str = "coding10"  # a built-in suite name, or a path to a JSON file of [{name, prompt}]
    max_new_tokens: int = 64  # length of the target's greedy continuation (the ground truth)
    tree_budgets: list[int] = field(default_factory=lambda: [4, 8])  # DDTree node budgets
    subset: int = 3  # prompts used by the cheap in-training eval (the first `subset` of the suite)
    cache_dir: str = ".cache/dflash/eval"  # ground-truth cache (continuations + target features)
    real_decode: bool = False  # also run real speculative decoding (losslessness, τ, tokens/s)
    device: str = "auto"  # where a standalone eval puts the drafter; auto = the target's device


def validate_eval_config(cfg: EvalConfig) -> None:
    """Checks that need no weights; raises ValueError naming the key."""
    from dflash.evaluation.prompts import load_suite
    if cfg.max_new_tokens < 2:
        raise ValueError(f"eval.max_new_tokens must be >= 2, got {cfg.max_new_tokens}")
    if cfg.subset < 1:
        raise ValueError(f"eval.subset must be >= 1, got {cfg.subset}")
    bad = [b for b in cfg.tree_budgets if int(b) < 1]
    if bad:
        raise ValueError(f"eval.tree_budgets must be positive integers, got {list(cfg.tree_budgets)}")
    if len(set(cfg.tree_budgets)) != len(cfg.tree_budgets):
        raise ValueError(f"eval.tree_budgets has duplicates: {list(cfg.tree_budgets)}")
    if cfg.device != "auto" and cfg.device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise ValueError(f"eval.device={cfg.device!r}; expected auto, cpu, cuda[:i] or mps")
    if cfg.enabled:
        load_suite(cfg.suite)  # raises FileNotFoundError / ValueError naming eval.suite


def __getattr__(name: str):
    # Lazy re-exports: keep `import dflash.evaluation` light.
    if name in ("evaluate", "make_evaluator", "EvalReport"):
        from dflash.evaluation import report
        return getattr(report, name)
    if name in ("load_suite", "Task"):
        from dflash.evaluation import prompts
        return getattr(prompts, name)
    if name in ("speculative_decode", "greedy_decode"):
        from dflash.evaluation import speculative
        return getattr(speculative, name)
    if name in ("load_or_build_ground_truth", "TaskTruth"):
        from dflash.evaluation import ground_truth
        return getattr(ground_truth, name)
    raise AttributeError(f"module 'dflash.evaluation' has no attribute {name!r}")


__all__ = ["EvalConfig", "validate_eval_config", "evaluate", "make_evaluator", "EvalReport", "load_suite",
           "Task", "speculative_decode", "greedy_decode", "load_or_build_ground_truth", "TaskTruth"]
