"""Evaluated acceptance (docs/DESIGN.md, "Evaluation and the gate"): the number a checkpoint is judged by.

- `prompts`: eval suites (built-in `coding10`, generated `heldout`, or a JSON file of {name, prompt}).
- `heldout`: the held-out suite, header + docstring prompts from the corpus's held-out files;
  `frozen_suite`: the same suite shipped as a file (the default), read the same on every machine.
- `stats`: bootstrap confidence intervals over prompts, pooled and paired (Δτ).
- `prompt_lookup`: the n-gram prompt-lookup proposer, the zero-cost baseline in every report.
- `ground_truth`: the target's greedy continuation of each prompt plus its features, cached on disk.
- `truth_pin`: pinned ground-truth tokens (`eval.truth_dir`), so evaluations on other machines pair.
- `acceptance`: simulated rounds on the ground truth — vanilla τ, DDTree τ per budget, per-position
  acceptance — with a pluggable proposer (the drafter, or an oracle in tests).
- `tree`: the DDTree best-first builder.
- `speculative`: real draft → verify → commit decoding on the target (lossless, hybrid-state rollback).
- `report`: `evaluate(...) -> EvalReport` (metrics, stats, per-task table, artifacts).
- `evaluator`: every configured suite (`evaluate_suites`), and `make_evaluator(cfg)` for the trainer
  (in-training subset, `eval/tau_train` and the generalization-gap warning).

Importing this package is cheap (no transformers, no matplotlib): `dflash.config` imports `EvalConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dflash.evaluation.heldout import HeldoutSuiteConfig, validate_heldout
from dflash.evaluation.prompt_lookup import PromptLookupConfig, validate_prompt_lookup
from dflash.target.sampling import SamplingConfig, validate_sampling_config


@dataclass
class StopConfig:
    """Where a code suite's continuation ends besides EOS (docs/evaluation.md, "Ground truth that ends";
    `dflash.data.stops`), by suite name (eval/suite/<name>); a suite named in neither ends at EOS or the cap."""
    # suites that end at the first non-empty line indented below the prompt's body: where the function being
    # written ends (both prompts are a def/class header and its docstring)
    dedent: list[str] = field(default_factory=lambda: ["heldout", "coding10"])
    # suite -> stop sequences, e.g. HumanEval's ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
    sequences: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class OracleConfig:
    """The oracle τ beside every τ (docs/evaluation.md, "Headroom"; `dflash.evaluation.headroom`)."""
    # target continuations per round that estimate the target's marginals (0 = no oracle τ); each round of the
    # oracle costs a cached decode of `samples` rows × (block_size − 2) steps and one forward over them
    samples: int = 0


def validate_oracle(cfg: OracleConfig) -> None:
    s = cfg.samples
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        raise ValueError(f"eval.oracle.samples must be an integer >= 0 (0 = off), got {s!r}")


@dataclass
class EvalConfig:
    enabled: bool = True
    # The objective suite: its figures are eval/tau_* (what sweeps and the promotion gate read). A built-in
    # suite (coding10), a generated one (heldout) or a path to a JSON file of [{name, prompt}].
    suite: str = "coding10"
    extra_suites: list[str] = field(default_factory=list)  # also run at the end: eval/suite/<name>/...
    max_new_tokens: int = 64  # length of the target's greedy continuation (the ground truth; not heldout's)
    # DDTree node budgets, as DDTree's own benchmark counts them (liranringel/ddtree: 16 … 1024 nodes)
    tree_budgets: list[int] = field(default_factory=lambda: [16, 64, 256])
    subset: int = 3  # prompts used by the cheap in-training eval (the first `subset` of the suite)
    heldout: HeldoutSuiteConfig = field(default_factory=HeldoutSuiteConfig)
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    ci_level: float = 0.95  # confidence level of every τ interval (bootstrap over prompts)
    bootstrap: int = 2000  # bootstrap replicates (0 = no interval)
    train_tasks: int = 4  # training sequences simulated at every eval for eval/tau_train (0 = off)
    cache_dir: str = ".cache/dflash/eval"  # ground-truth cache (continuations + target features)
    # Pinned ground-truth tokens (evaluation.truth_pin): a folder of small JSON files, one per suite, written by the
    # first evaluation and used by every later one, so evaluations on other machines (GPU greedy decoding is not
    # bit-reproducible) run on the same tokens and pair. "" = off. Campaigns set it under their out folder.
    truth_dir: str = ""
    real_decode: bool = False  # also run real speculative decoding (losslessness, τ, tokens/s)
    device: str = "auto"  # where a standalone eval puts the drafter; auto = the target's device
    # How the simulated rounds get the drafter's proposals (acceptance.DRAFTER_PROPOSERS): "batched", all of a
    # task's positions in a few training forwards; "sequential", one cached drafter call per round and task (as
    # the real decoding loop drafts; the reference, and what eval/real/tau_matches_sim is exact against).
    proposer: str = "batched"
    # τ as it is served (docs/evaluation.md, "τ at temperature"): the setting the objective's rounds are verified
    # at with exact speculative sampling; -1 fields: the target's generation_config.json (the shipped reference
    # target: T=1). Its figures are eval/<setting>/... (e.g. eval/t1/tau_vanilla), the objective eval/tau_served.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    samples: int = 2  # sampled continuations per prompt at T > 0 (CIs resample prompts, pooling their samples)
    seed: int = 0  # the sampled ground truth's and the acceptance coins' seed (paired runs share them)
    greedy_beside: bool = True  # also evaluate at T = 0 (eval/t0/...) when the served setting samples
    # The engine a user serves with (engines.ENGINES: vllm, sglang, llamacpp, zlab; textbook = drafts sampled from
    # q, no engine's DFlash 1 policy). At T > 0 it decides how a draft is proposed (DFlash 1: argmax or sampled;
    # DFlash 2: best-path or sampled walk), so which τ is served: eval/<setting>/<policy>/..., e.g.
    # eval/t1/argmax/tau_vanilla; `proposal` (argmax / sampled) overrides the engine's policy.
    engine: str = "vllm"
    proposal: str = "auto"
    both_policies: bool = True  # at T > 0 also score the objective suite under the other policy, side by side
    # ground truth that ends: after the target's EOS / end-of-turn tokens (capped at max_new_tokens); false: the
    # legacy fixed-length ground truth (greedy only; what stores before sampling measured, eval/tau_vanilla)
    stop_at_eos: bool = True
    # a code suite's own ends besides EOS: the dedent below the prompt's body, stop sequences (needs stop_at_eos;
    # without it every continuation is fixed-length)
    stop: StopConfig = field(default_factory=StopConfig)
    # the oracle τ beside every τ (dflash.evaluation.headroom): target samples per round estimating its marginals
    oracle: OracleConfig = field(default_factory=OracleConfig)


def validate_eval_config(cfg: EvalConfig) -> None:
    """Checks that need no weights; raises ValueError naming the key."""
    from dflash.evaluation.prompts import DATA_SUITES, generated_suites, load_suite, suite_label
    if cfg.max_new_tokens < 2:
        raise ValueError(f"eval.max_new_tokens must be >= 2, got {cfg.max_new_tokens}")
    if cfg.subset < 1:
        raise ValueError(f"eval.subset must be >= 1, got {cfg.subset}")
    bad = [b for b in cfg.tree_budgets if int(b) < 1]
    if bad:
        raise ValueError(f"eval.tree_budgets must be positive integers, got {list(cfg.tree_budgets)}")
    if len(set(cfg.tree_budgets)) != len(cfg.tree_budgets):
        raise ValueError(f"eval.tree_budgets has duplicates: {list(cfg.tree_budgets)}")
    _check_truth_dir(cfg.truth_dir)
    if cfg.device != "auto" and cfg.device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise ValueError(f"eval.device={cfg.device!r}; expected auto, cpu, cuda[:i] or mps")
    from dflash.evaluation.stats import check_level
    check_level(cfg.ci_level, cfg.bootstrap)
    if cfg.train_tasks < 0:
        raise ValueError(f"eval.train_tasks must be >= 0, got {cfg.train_tasks}")
    validate_heldout(cfg.heldout)
    validate_sampling_config(cfg.sampling, "eval.sampling")
    if not isinstance(cfg.samples, int) or isinstance(cfg.samples, bool) or cfg.samples < 1:
        raise ValueError(f"eval.samples must be an integer >= 1 (sampled continuations per prompt), "
                         f"got {cfg.samples!r}")
    from dflash.evaluation.acceptance import DRAFTER_PROPOSERS
    DRAFTER_PROPOSERS.check(cfg.proposer)
    from dflash.evaluation.engines import resolve_policy
    resolve_policy(cfg.engine, cfg.proposal, dflash2=False)  # raises naming eval.engine / eval.proposal
    validate_prompt_lookup(cfg.prompt_lookup)
    validate_oracle(cfg.oracle)
    validate_stop(cfg.stop)
    names = [suite_label(s) for s in [cfg.suite, *cfg.extra_suites]]
    if len(set(names)) != len(names):
        raise ValueError(f"eval.suite and eval.extra_suites name a suite twice: {names}")
    if cfg.enabled:
        for s in [cfg.suite, *cfg.extra_suites]:
            if s not in generated_suites() and s not in DATA_SUITES:
                load_suite(s)  # raises FileNotFoundError / ValueError naming eval.suite


def validate_stop(stop: StopConfig) -> None:
    if not isinstance(stop.dedent, (list, tuple)) or not all(isinstance(s, str) and s for s in stop.dedent):
        raise ValueError(f"eval.stop.dedent must be a list of suite names, got {stop.dedent!r}")
    if not isinstance(stop.sequences, dict):
        raise ValueError(f"eval.stop.sequences must map suite names to lists of stop strings, got {stop.sequences!r}")
    for name, seqs in stop.sequences.items():
        if not isinstance(seqs, (list, tuple)) or not all(isinstance(x, str) and x for x in seqs):
            raise ValueError(f"eval.stop.sequences.{name} must be a list of non-empty strings, got {seqs!r}")


def _check_truth_dir(truth_dir) -> None:
    # a string by type at the command line, but a config read back from disk or built in code can hold anything
    if not isinstance(truth_dir, str):
        raise ValueError(f"eval.truth_dir must be a folder path (a string; '' = off), got "
                         f"{type(truth_dir).__name__} {truth_dir!r}")
    from pathlib import Path
    if truth_dir and Path(truth_dir).exists() and not Path(truth_dir).is_dir():
        raise ValueError(f"eval.truth_dir={truth_dir!r} is a file; expected a folder of pinned ground truth")


def __getattr__(name: str):
    # Lazy re-exports: keep `import dflash.evaluation` light.
    if name in ("evaluate", "EvalReport"):
        from dflash.evaluation import report
        return getattr(report, name)
    if name in ("make_evaluator", "evaluate_suites", "merged_metrics"):
        from dflash.evaluation import evaluator
        return getattr(evaluator, name)
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


__all__ = ["EvalConfig", "StopConfig", "OracleConfig", "HeldoutSuiteConfig", "PromptLookupConfig", "validate_eval_config",
           "evaluate_suites", "merged_metrics", "evaluate", "make_evaluator", "EvalReport", "load_suite",
           "Task", "speculative_decode", "greedy_decode", "load_or_build_ground_truth", "TaskTruth"]
