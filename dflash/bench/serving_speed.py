"""What τ buys at production shapes (`bench.sections=serving`, docs/benchmarks.md).

Decoding is memory-bandwidth bound, so an eval τ turns into serving speed only through the cost of one
speculative round against one greedy step. After a context of C tokens already in the caches (the target's
attention K/V and Gated-DeltaNet conv/recurrent states via `dflash.target.cache`, the drafter's context K/V),
this section times, one call at a time (device-synchronised around each call, the caches rolled back between
calls by `TargetSession.snapshot/restore`):

- `greedy`: the target's decode step (one token, LM head, argmax);
- `verify_block`: one verify forward of a block (anchor + B − 1 drafts) with the hidden states the drafter
  needs and the greedy labels;
- `readvance`: after a rejection, this repo's exact rollback for hybrid targets (restore the recurrent states,
  crop the K/V, re-run the accepted tokens; B / 2 of them here);
- `verify_tree_<n>`: one verify forward of a DDTree of n nodes (+ the root) under a tree attention mask in the
  attention layers (each node sees the context, its ancestors and itself; positions = context + depth). The
  Gated-DeltaNet layers have no tree form: they run the n nodes as one chain of n tokens, which is what a
  forward of n tokens costs them (the timing proxy; a real tree verify on a hybrid target needs per-branch
  recurrent states, not built here);
- `draft`: the drafter's round: extend its context by B positions, one block forward, the LM head and argmax;
  `tree_build_<n>`: the top-k, the one host transfer and the best-first heap (dflash/evaluation/tree.py).

The drafter runs in the target's dtype (bf16 on a GPU, as served), through the repo's own inference path
(`extend_context`, `draft_hidden`, `logits`). Speed-up of a round that commits τ tokens, against greedy: τ · t_greedy / (t_draft + t_verify) (with the
re-advance added for τ < B on the `block + re-advance` column; trees add their build time). Throughput does
not depend on weight values, so random weights (and random drafter context features) measure it.
"""
from __future__ import annotations

import time

import torch

from dflash.bench.config import BenchConfig, int_list
from dflash.config import RunConfig
from dflash.drafter.model import build_drafter, greedy_draft
from dflash.evaluation.acceptance import reduce_logits
from dflash.evaluation.speculative import TargetSession, drafter_autocast
from dflash.evaluation.tree import build_tree
from dflash.target.model import Target


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, reset, iters: int, device: torch.device, warmup: int = 2) -> float:
    """Median seconds of `fn()`, each call alone on the device; `reset()` (untimed) before every call."""
    times = []
    for i in range(warmup + iters):
        reset()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def tree_inputs(nodes: list[tuple[int, ...]], idx: list[list[int]], root_token: int, context: int,
                device: torch.device):
    """Token ids [1, n+1], positions [1, n+1] and the boolean attention mask [1, 1, n+1, context+n+1] of a
    tree (root first, then `nodes` in pop order: every node's parent comes before it)."""
    order = {node: i + 1 for i, node in enumerate(nodes)}
    n = len(nodes) + 1
    ids = torch.tensor([root_token] + [idx[len(node) - 1][node[-1]] for node in nodes], device=device)
    depth = torch.tensor([0] + [len(node) for node in nodes], device=device)
    tree_NN = torch.eye(n, dtype=torch.bool, device=device)
    tree_NN[:, 0] = True  # every node sees the root
    for node, i in order.items():
        for d in range(1, len(node)):
            tree_NN[i, order[node[:d]]] = True  # and its ancestors
    mask = torch.cat([torch.ones(n, context, dtype=torch.bool, device=device), tree_NN], dim=1)
    return ids[None], (context + depth)[None], mask[None, None]


@torch.no_grad()
def verify_tree(sess: TargetSession, ids_1N: torch.Tensor, pos_1N: torch.Tensor, mask_11NS: torch.Tensor):
    """One target forward of a tree after the session's cache: the tree mask in the attention layers (the
    linear-attention layers take no mask: a chain of the same tokens). Returns (features, greedy labels [N])."""
    target = sess.target
    with sess._lock:
        out = sess.decoder(input_ids=ids_1N, position_ids=pos_1N, use_cache=True, output_hidden_states=True,
                           attention_mask={"full_attention": mask_11NS, "linear_attention": None},
                           **{sess._kw: sess.cache})
        feats = torch.stack([out.hidden_states[i + 1] for i in target.layer_ids], dim=2)
        labels, _, _ = target.labels_from_hidden(out.last_hidden_state, 0)
    sess.length += ids_1N.shape[1]
    return feats, labels[0]


def _time_target(target: Target, C: int, budgets: list[int], rnd: "DraftRound", iters: int,
                 errors: dict[str, str]) -> dict[str, float]:
    """Target-side times after a prefill of C tokens; the cache is rolled back to C before every call. The
    trees are the drafter's own (`rnd`: DDTree from one draft of random-weight logits)."""
    dev, bs = target.device, rnd.block_size
    sess = TargetSession(target, need_features=False)
    gen = torch.Generator().manual_seed(C)
    sess.forward(torch.randint(0, target.vocab_size - 1, (C,), generator=gen), features=False)  # prefill
    snap = sess.snapshot()
    reset = lambda: sess.restore(snap)  # noqa: E731
    block = torch.randint(0, target.vocab_size - 1, (bs,), generator=gen).to(dev)
    out = {"greedy": time_calls(lambda: sess.forward(block[:1], features=False), reset, iters, dev),
           "verify_block": time_calls(lambda: sess.forward(block, features=True), reset, iters, dev)}
    # the rollback after a rejection: restore + re-run the accepted tokens (timed from the verify's end state)
    out["readvance"] = time_calls(lambda: (sess.restore(snap), sess.forward(block[:bs // 2], features=False)),
                                  lambda: (sess.restore(snap), sess.forward(block, features=True)), iters, dev)
    for n in budgets:  # a tree the target's attention cannot take (a transformers build without mask dicts)
        try:  # is recorded, and the other figures still come back
            nodes, idx = rnd.tree(n)
            args = tree_inputs(nodes, idx, int(block[0]), C, dev)
            out[f"verify_tree_{n}"] = time_calls(lambda args=args: verify_tree(sess, *args), reset, iters, dev)
            out[f"tree_nodes_{n}"] = float(len(nodes))
        except Exception as e:  # noqa: BLE001
            errors[f"tree-{n}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


class DraftRound:
    """The drafter after a context of C positions (random features of the target's shape), and its round."""

    def __init__(self, drafter, target: Target, C: int):
        self.drafter, self.dev, self.C = drafter, next(drafter.parameters()).device, C
        self.block_size = drafter.block_size
        L, H = len(target.layer_ids), target.hidden_size
        feats = lambda T: torch.randn(1, T, L, H, dtype=target.dtype, device=self.dev)  # noqa: E731
        self.cache = drafter.new_cache()
        with torch.no_grad(), drafter_autocast(drafter):
            drafter.extend_context(self.cache, feats(C), 0)
        self.new_feats, self.anchor = feats(self.block_size), torch.zeros(1, dtype=torch.long, device=self.dev)

    @torch.no_grad()
    def hidden(self) -> torch.Tensor:
        """Extend the context by B positions (the round's committed tokens, at most B), draft one block."""
        with drafter_autocast(self.drafter):
            self.drafter.extend_context(self.cache, self.new_feats, self.C)  # crops back to C first
            return self.drafter.draft_hidden(self.cache, self.anchor)

    def logits(self) -> torch.Tensor:
        return self.drafter.logits(self.hidden())[0]

    def draft(self) -> torch.Tensor:
        """The greedy draft: the argmax, or a DFlash 2 drafter's selector walk (its cost included)."""
        return greedy_draft(self.drafter, self.hidden(), self.anchor)[0]

    def tree(self, budget: int):
        """DDTree of `budget` nodes from one draft (the top-k, one host transfer, the heap)."""
        prop = reduce_logits(self.logits(), budget)
        return build_tree(prop.topk_logp, budget), prop.topk_idx


def bench_serving(cfg: RunConfig, target: Target, b: BenchConfig) -> dict:
    contexts, budgets = int_list(b.serving_contexts, "serving_contexts"), int_list(b.serving_budgets, "serving_budgets")
    t = target
    # in the target's dtype, as a served drafter runs (bf16 on a GPU: no fp32 master weights cast every call)
    from dflash.serving.export import facts_of_target
    dcfg = cfg.drafter.for_target(facts_of_target(t).rope_theta)  # rope_theta 0: the target's
    drafter = build_drafter(dcfg, t.hidden_size, t.info.num_layers, t.mask_token_id, t.layer_ids,
                            t.info.vocab_size).to(
        t.device, dtype=t.dtype)
    drafter.attach_target_head(t.embed_weight(), t.lm_head_weight())
    drafter.eval()
    if drafter.candidate_selector is not None:  # DDTree is DFlash 1 only: a DFlash 2 round is its selector walk's block
        budgets = []
    out: dict = {"block_size": drafter.block_size, "budgets": budgets, "contexts": {}}
    for C in contexts:
        rnd, errors = DraftRound(drafter, t, C), {}
        ms = _time_target(t, C, budgets, rnd, b.serving_iters, errors)
        ms["draft"] = time_calls(rnd.draft, lambda: None, b.serving_iters, rnd.dev)
        for n in (n for n in budgets if f"verify_tree_{n}" in ms):
            ms[f"tree_build_{n}"] = time_calls(lambda n=n: rnd.tree(n), lambda: None, b.serving_iters, rnd.dev) \
                - ms["draft"]
        ms = {k: v if k.startswith("tree_nodes") else v * 1e3 for k, v in ms.items()}  # ms
        out["contexts"][C] = {**ms, "speedup": speedups(ms, drafter.block_size, budgets), "errors": errors}
        del rnd
    return out


def speedups(ms: dict[str, float], block_size: int, budgets: list[int]) -> dict[str, list[float]]:
    """× greedy for τ = 1 .. B, per verify kind: τ · t_greedy / (t_draft + t_verify [+ re-advance if τ < B])."""
    g, d = ms["greedy"], ms["draft"]
    kinds = {"block": lambda tau: d + ms["verify_block"],
             "block + re-advance": lambda tau: d + ms["verify_block"] + (ms["readvance"] if tau < block_size else 0)}
    for n in (n for n in budgets if f"verify_tree_{n}" in ms):
        kinds[f"tree-{n}"] = lambda tau, n=n: d + max(ms[f"tree_build_{n}"], 0.0) + ms[f"verify_tree_{n}"]
    return {k: [tau * g / cost(tau) for tau in range(1, block_size + 1)] for k, cost in kinds.items()}


def serving_table(s: dict) -> str:
    """Per context: the times (ms), then τ = 1 .. B → × greedy for each verify kind."""
    lines = []
    for C, ms in s["contexts"].items():
        times = ", ".join(f"{k} {v:.2f}" for k, v in ms.items()
                          if k not in ("speedup", "errors") and not k.startswith("tree_nodes"))
        lines.append(f"serving after {C} tokens (ms): {times}")
        lines += [f"  {kind} failed: {err}" for kind, err in ms.get("errors", {}).items()]
        kinds = list(ms["speedup"])
        lines.append("  tau  " + "  ".join(f"{k:>18}" for k in kinds))
        for i in range(s["block_size"]):
            lines.append(f"  {i + 1:>3}  " + "  ".join(f"{ms['speedup'][k][i]:>17.2f}x" for k in kinds))
    return "\n".join(lines)
