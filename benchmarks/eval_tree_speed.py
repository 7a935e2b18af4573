"""The evaluation's DDTree rounds, old way and new, side by side in one process (CPU; no model needed):

    python benchmarks/eval_tree_speed.py [--tasks 128] [--tokens 256] [--budgets 16,64,256] [--seed 0]

Proposals shaped like the full evaluation's (block 16: 15 depths, top-256 log-probs per depth, peaked like a
trained drafter's) on made-up ground truth that follows the drafter's top ranks often enough for rounds to
accept a few tokens. Each round is computed both ways, `tree.build_tree` + `tree.tree_accept_depth` on rows cut
to the budget (the evaluation before) and `tree.tree_round` (now), and the results must be identical. Prints
the seconds of each, their ratio and the rounds compared.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash.evaluation.tree import build_tree, tree_accept_depth, tree_round  # noqa: E402


def proposals(n: int, depths: int, k: int, vocab: int, gen: torch.Generator):
    """n proposals: (top-k log-probs [depths][k] descending, their ids [depths][k]) as lists."""
    logits = torch.randn(n, depths, vocab, generator=gen) * 3.0
    logits[..., 0] += torch.linspace(6.0, 2.0, depths)  # confident early positions, less so later
    logp, idx = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return logp.tolist(), idx.tolist()


def truth_of(idx_rows, gen: torch.Generator) -> list[int]:
    """The target's tokens after the anchor: the drafter's rank 0 with p 0.6, rank 1-3 with p 0.25, else other."""
    out = []
    for row in idx_rows:
        u = float(torch.rand(1, generator=gen))
        out.append(row[0] if u < 0.6 else row[1 + int(u * 100) % 3] if u < 0.85 else -1)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    budgets = [int(b) for b in a.budgets.split(",")]
    gen = torch.Generator().manual_seed(a.seed)
    rounds = []  # (logp rows, idx rows, truth, budget), in the order a simulation would visit them
    for _ in range(a.tasks):
        logp, idx = proposals(a.tokens - 1, 15, max(budgets), 4096, gen)
        truths = [truth_of(rows, gen) for rows in idx]
        for b in budgets:
            p = 0
            while p < a.tokens - 1:
                rounds.append((logp[p], idx[p], truths[p][:a.tokens - 1 - p], b))
                p += 2  # every other position, as rounds that accept one token on average
    t0 = time.perf_counter()
    old = []
    for logp, idx, want, b in rounds:
        k = min(b, len(logp[0]))
        nodes = build_tree([row[:k] for row in logp], b)
        old.append((tree_accept_depth(nodes, [row[:k] for row in idx], want), len(nodes)))
    t_old = time.perf_counter() - t0
    t0 = time.perf_counter()
    new = [tree_round(logp, idx, want, b) for logp, idx, want, b in rounds]
    t_new = time.perf_counter() - t0
    if new != old:
        bad = next(i for i, (x, y) in enumerate(zip(old, new)) if x != y)
        raise SystemExit(f"round {bad}: build_tree + tree_accept_depth gave {old[bad]}, tree_round {new[bad]}")
    out = {"rounds": len(rounds), "old_s": t_old, "new_s": t_new, "speedup": t_old / t_new,
           "mean_depth": sum(d for d, _ in new) / len(new)}
    print(f"{len(rounds):,} DDTree rounds (budgets {budgets}), identical results; mean accepted depth "
          f"{out['mean_depth']:.2f}\n  build_tree + tree_accept_depth (rows cut to the budget): {t_old:.2f} s\n"
          f"  tree_round: {t_new:.2f} s  ({out['speedup']:.2f}x)")
    return out


if __name__ == "__main__":
    main()
