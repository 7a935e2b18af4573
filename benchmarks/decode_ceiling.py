"""The decoding loop's speed-up ceiling: speculative decoding with a drafter that always proposes the target's own
tokens (τ = block size, `dflash.evaluation.oracle`) against plain greedy decoding, on the same prompts, per
dtype, side by side in one process.

    python benchmarks/decode_ceiling.py [--dtypes float32,bfloat16] [--tasks 10] [--tokens 64] [--repeats 2]
                                        [--json out.json] [run overrides, e.g. target.path=/models/qwen eval.suite=heldout]

The target, the suite, the block size and the device are the run config's (`experiments.config.compose_config`
with the overrides: by default the shipped reference target, `coding10`, block 16, CUDA when there is one). Per
dtype: the ground truth (the target's greedy continuations), one untimed pass of both loops on the first prompt
(kernels, autotuning), then `repeats` timed passes over every prompt. Prints per dtype τ, tokens per second of
each loop, their ratio (the ceiling a real drafter's speed-up stays under: no drafter cost, every draft accepted),
target forwards per loop, how many prompts came out token for token identical (float32 must be all of them;
bfloat16's block verify may round a near-tie differently from a one-token forward), and for how many prompts the
oracle follows the loop's own tokens off the greedy ones (`dflash.evaluation.oracle.loop_tokens`: else one such
near-tie turns every later round into a one-token round and the "ceiling" measures a drafter that is wrong).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash.devices import resolve_device  # noqa: E402
from dflash.evaluation.ground_truth import load_or_build_ground_truth  # noqa: E402
from dflash.evaluation.oracle import oracle_ceiling  # noqa: E402
from dflash.evaluation.prompts import load_suite  # noqa: E402
from dflash.target.model import Target  # noqa: E402
from experiments.config import compose_config  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="run config overrides (key=value)")
    ap.add_argument("--dtypes", default="", help="comma-separated; default: float32,bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tasks", type=int, default=10, help="prompts of the suite")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    cfg = compose_config(args.overrides)
    device = resolve_device(cfg.target.device).type
    dtypes = args.dtypes.split(",") if args.dtypes else (["float32", "bfloat16"] if device == "cuda" else ["float32"])
    tasks = load_suite(cfg.eval.suite)[:args.tasks]
    out = {"device": device, "suite": cfg.eval.suite, "tasks": len(tasks), "tokens": args.tokens,
           "block_size": cfg.drafter.block_size, "target": cfg.target.path or cfg.target.name, "dtypes": {}}
    for dtype in dtypes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the slow-path kernel warning is printed as `kernels` below
            target = Target(dataclasses.replace(cfg.target, device=device, dtype=dtype))
        truths, _ = load_or_build_ground_truth(target, tasks, args.tokens, None)
        out["dtypes"][dtype] = {**oracle_ceiling(target, truths, cfg.drafter.block_size, args.tokens, args.repeats),
                                "kernels": dict(getattr(target, "kernels", {}) or {})}
        del target
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"decoding-loop ceiling on {device}: {out['target']}, {out['suite']} × {len(tasks)} prompts × "
          f"{args.tokens} tokens, block {out['block_size']}, {args.repeats} timed passes")
    print("| dtype | τ | speculative tok/s | greedy tok/s | speed-up | target forwards (spec / greedy) | identical | "
          "oracle off greedy |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, r in out["dtypes"].items():
        print(f"| {dtype} | {r['tau']:.2f} | {r['speculative_tok_s']:,.0f} | {r['greedy_tok_s']:,.0f} | "
              f"**{r['speed_up']:.2f}×** | {r['target_forwards_speculative']} / {r['target_forwards_greedy']} | "
              f"{r['identical']}/{r['runs']} | {r['resynced']}/{out['tasks']} |")
    for dtype, r in out["dtypes"].items():
        print(f"{dtype} kernels: {r['kernels']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
