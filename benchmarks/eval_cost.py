"""Where an evaluation's time goes, part by part, in a cold pass and a warm one: the target's ground truth, the
drafter's simulated vanilla rounds, its DDTree rounds, prompt lookup's rounds, and the real decoding loop (greedy
and speculative side by side, as `eval.real_decode` runs them).

    python benchmarks/eval_cost.py [--dtype float32] [--tasks 10] [--tokens 64] [--proposer sequential]
                                   [--json out.json] [run overrides, e.g. target.path=/models/qwen eval.suite=heldout]

The target, suite, tree budgets, block size and device are the run config's (`experiments.config.compose_config`);
the drafter is a random one of the config's shape (its τ is about 1, so the real loop runs about one round per
token: the most rounds a drafter can cost). Each part runs twice, back to back: the first pass pays for what a
process pays once (Triton compiling and tuning kernels for each new shape, the allocator), the second is the
steady cost. Why it exists: on the H200, `tests/test_eval_gpu.py::test_real_decoding_on_gpu` took 187 s (float32)
and 206 s (bfloat16) for an evaluation that takes 40 s on two CPU cores (`benchmarks/log/2026-12-03.md`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash.devices import resolve_device  # noqa: E402
from dflash.drafter.model import build_drafter  # noqa: E402
from dflash.evaluation.acceptance import DRAFTER_PROPOSERS, proposal_width, simulate  # noqa: E402
from dflash.evaluation.ground_truth import build_ground_truth  # noqa: E402
from dflash.evaluation.prompt_lookup import PromptLookupProposer  # noqa: E402
from dflash.evaluation.prompts import load_suite  # noqa: E402
from dflash.evaluation.report import check_compatible  # noqa: E402
from dflash.evaluation.speculative import greedy_decode, speculative_decode  # noqa: E402
from dflash.target.model import Target  # noqa: E402
from experiments.config import compose_config  # noqa: E402


def _timed(device: str, fn):
    """(seconds, result) of fn(), the device's queue drained on both sides."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _parts(drafter, target, tasks, tokens: int, budgets: list[int], proposer_name: str, pl_cfg) -> dict:
    """Every part once, in evaluate's order: {part: (seconds, what it gives)}."""
    device, bs = target.device.type, drafter.block_size
    out = {}
    out["ground truth"] = _timed(device, lambda: build_ground_truth(target, tasks, tokens))
    truths = out["ground truth"][1]
    proposer = DRAFTER_PROPOSERS.build(proposer_name, drafter, proposal_width(budgets))
    out["vanilla rounds"] = _timed(device, lambda: simulate(truths, proposer, bs))
    tree_proposer = DRAFTER_PROPOSERS.build(proposer_name, drafter, proposal_width(budgets))
    out[f"vanilla + trees {budgets}"] = _timed(device, lambda: simulate(truths, tree_proposer, bs, budgets))
    lookup = PromptLookupProposer(bs, pl_cfg.min_n, pl_cfg.max_n)
    out["prompt lookup rounds"] = _timed(device, lambda: simulate(truths, lookup, bs))
    out["greedy decoding"] = _timed(device, lambda: [greedy_decode(target, t.prompt_ids, t.n_new) for t in truths])
    out["speculative decoding"] = _timed(
        device, lambda: [speculative_decode(drafter, target, t.prompt_ids, t.n_new) for t in truths])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="run config overrides (key=value)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=10, help="prompts of the suite")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--proposer", default="sequential", help="eval.proposer (the GPU test's is sequential)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    cfg = compose_config(args.overrides)
    DRAFTER_PROPOSERS.check(args.proposer)
    device = resolve_device(cfg.target.device).type
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-path kernel warning is printed as `kernels` below
        target = Target(dataclasses.replace(cfg.target, device=device, dtype=args.dtype))
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, target.hidden_size, target.info.num_layers, target.mask_token_id,
                            target.layer_ids, target.info.vocab_size).to(target.device).eval()
    check_compatible(drafter, target)  # as evaluate does: the target's embedding and head into the drafter
    tasks = load_suite(cfg.eval.suite)[:args.tasks]
    budgets = [int(b) for b in cfg.eval.tree_budgets]
    passes = []
    with torch.no_grad():
        for _ in range(2):
            passes.append(_parts(drafter, target, tasks, args.tokens, budgets, args.proposer, cfg.eval.prompt_lookup))
    spec = passes[1]["speculative decoding"][1]
    rounds = sum(len(r.taus) for r in spec)
    out = {"device": device, "dtype": args.dtype, "suite": cfg.eval.suite, "tasks": len(tasks),
           "tokens": args.tokens, "proposer": args.proposer, "real_rounds": rounds,
           "real_tau": sum(sum(r.taus) for r in spec) / max(rounds, 1),
           "kernels": dict(getattr(target, "kernels", {}) or {}),
           "seconds": {part: [p[part][0] for p in passes] for part in passes[0]}}
    print(f"evaluation's parts on {device} ({args.dtype}): {out['suite']} × {len(tasks)} prompts × {args.tokens} "
          f"tokens, a random drafter ({args.proposer} proposer; the real loop's τ {out['real_tau']:.3f}, "
          f"{rounds} rounds)")
    print("| part | cold pass s | warm pass s |")
    print("|---|---|---|")
    for part, (cold, warm) in out["seconds"].items():
        print(f"| {part} | {cold:.2f} | {warm:.2f} |")
    print(f"kernels: {out['kernels']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
