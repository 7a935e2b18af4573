"""A real engine in the loop: `python -m experiments.serve_check <run dir | serving folder> [key=value ...]`
[--suite coding10] [--max-new-tokens N] [--seed S] [--work DIR] [--cache DIR].

Builds llama.cpp at the pinned llama-cpp-python sdist (cached under ~/.cache/dflash/llamacpp/<version>), converts
the run's target and the drafter to GGUF with llama.cpp's own converter, serves them with `llama-server` (DFlash
speculative decoding, 127.0.0.1) at T=0 and at the target's sampling setting, and prints the engine's τ beside the
evaluator's τ under llama.cpp's policy (argmax drafts, DFlash 2's best path) on the engine's own tokens, with
their agreement (docs/engines.md). Exit status: 0 they agree, 1 they do not (or llama.cpp cannot convert or
serve the drafter: its message is printed), 2 bad input before any work.

The target is the run's (`target.*` overrides as for experiments.eval); a bare serving folder takes it from the
overrides (default: the shipped reference target). It must be a checkpoint folder (`target.path`): a random
target has nothing llama.cpp can load.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dflash.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from experiments.config import ArgParser
    p = ArgParser(prog="python -m experiments.serve_check", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="run directory, serving folder or checkpoint .pt")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run config (target.*)")
    p.add_argument("--suite", default="coding10", help="prompt suite (built-in or a JSON file; default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="each request's budget (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the sampled requests' seeds start here (default %(default)s)")
    p.add_argument("--work", default=None, help="keep the GGUF files and the server log here (default: a temp dir)")
    p.add_argument("--cache", default=None, help="llama.cpp build cache (default ~/.cache/dflash/llamacpp)")
    return p


def main(argv: list[str] | None = None) -> list:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from dflash.app.serve_check import ServeCheck, settings_for
    from dflash.evaluation.engine_check import format_results
    from dflash.evaluation.prompts import load_suite
    from dflash.serving.export import read_serving_config
    from dflash.target.model import Target, checkpoint_path
    from dflash.target.sampling import read_generation_config
    from experiments.eval import resolve_source
    if args.max_new_tokens < 2:
        raise ConfigError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    cfg, _, _, _, _, src = resolve_source(Path(args.source), args.overrides)
    try:
        tasks = load_suite(args.suite)
        if not cfg.target.path:
            raise ValueError("the target is random (no target.path): llama.cpp needs a checkpoint folder")
        target_dir = Path(checkpoint_path(cfg.target))
        settings = settings_for(read_generation_config(target_dir))
        drafter_dir = src.serving
        if drafter_dir is not None:
            read_serving_config(drafter_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from e
    with tempfile.TemporaryDirectory(prefix="dflash-serve-check-") as tmp:
        work = Path(args.work or tmp)
        if drafter_dir is None:  # a checkpoint: its serving folder first, in float32 (what the engine loads)
            from dflash.app.export import export_drafter
            drafter_dir = export_drafter(src.checkpoint, work / "drafter", "float32", target=target_dir)
        chk = ServeCheck(drafter_dir, target_dir, tasks, args.max_new_tokens, settings, seed=args.seed)
        results = _run(chk, Target(cfg.target), args, work)
    print(f"llama.cpp against the evaluator's rounds on the engine's tokens: {args.source}, suite {args.suite}, "
          f"≤ {args.max_new_tokens} tokens")
    print(format_results(results))
    if not all(r.agrees for r in results):
        print("error: the engine's rounds and the simulated rounds disagree beyond the near-tie allowance",
              file=sys.stderr)
        raise SystemExit(1)
    return results


def _run(chk, target, args, work: Path) -> list:
    from dflash.app.serve_check import serve_check
    from dflash.serving.llamacpp import ConversionError, LlamaCppError
    try:
        return serve_check(chk, target, cache=Path(args.cache) if args.cache else None, work=work)
    except ConversionError as e:
        print(f"error: the check failed: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from e


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(main)
