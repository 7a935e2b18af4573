"""DDTree (docs/DESIGN.md, "Evaluation and the gate"): a draft tree built best-first from the drafter's one forward.

The drafter gives, for each depth d = 1..D (block position d), a distribution over the token at that
position; DDTree keeps the top-k tokens per depth and treats the per-depth log-probs as independent. A
node is a path of ranks (r_1, ..., r_d) — token `idx[i][r_i]` at depth i — with score
Σ_i logp[i][r_i]. Best-first: a heap starts with the root's first child (rank 0 at depth 1); popping a
node adds it to the tree and pushes its next sibling (last rank + 1) and its first child (rank 0 one
depth deeper), until `budget` nodes are in the tree.

Because every depth's log-probs are sorted in descending order, a node's next sibling and first child
never score higher than the node itself, and every node is reachable through a chain of such pushes
from the root; so the pops come in non-increasing score order and the tree is exactly the `budget`
highest-scoring rank paths (ties broken by push order), and it is prefix-closed. Only ranks < budget can
ever be chosen, so k = budget suffices.

The target verifies the tree; τ = 1 (the root: the target's bonus token) + the depth of the deepest
tree node whose path equals the target's tokens.
"""
from __future__ import annotations

import heapq
from typing import Sequence

Node = tuple[int, ...]


def _pops(logp: Sequence[Sequence[float]], budget: int):
    """The best-first pops (module doc), at most `budget`: (the parent's pop index or -1, rank, depth) each."""
    D = len(logp)
    if budget <= 0 or D == 0 or not len(logp[0]):
        return
    heap: list[tuple[float, int, int, int, int]] = [(-float(logp[0][0]), 0, -1, 0, 1)]  # neg, counter, parent, r, d
    counter, me = 1, 0
    pop, push = heapq.heappop, heapq.heappush
    while heap and me < budget:
        neg, _, parent, r, d = pop(heap)
        yield parent, r, d
        row = logp[d - 1]
        if r + 1 < len(row):  # next sibling
            push(heap, (neg + float(row[r]) - float(row[r + 1]), counter, parent, r + 1, d))
            counter += 1
        if d < D and len(logp[d]):  # first child
            push(heap, (neg - float(logp[d][0]), counter, me, 0, d + 1))
            counter += 1
        me += 1


def build_tree(logp: Sequence[Sequence[float]], budget: int) -> list[Node]:
    """`logp[d][r]`: log-prob of the rank-r token at depth d+1, each row sorted descending.
    Returns the chosen nodes (rank paths) in pop order (non-increasing score)."""
    nodes: list[Node] = []
    for parent, r, _ in _pops(logp, budget):
        nodes.append((nodes[parent] if parent >= 0 else ()) + (r,))
    return nodes


def _rank_in(row: Sequence[int], want: int, lim: int) -> int | None:
    """The rank of `want` among the first `lim` ids of `row` (one row's ids are distinct: top-k of one
    distribution); None when absent; -1 when it occurs twice (not top-k: the caller walks the full tree)."""
    row = row if isinstance(row, list) else list(row)
    try:
        r = row.index(want, 0, lim)
    except ValueError:
        return None
    try:
        row.index(want, r + 1, lim)
        return -1
    except ValueError:
        return r


def _tree_size(logp: Sequence[Sequence[float]], budget: int) -> int:
    """min(budget, the number of rank paths): what `build_tree` returns when it runs to the end."""
    total, width = 0, 1
    for row in logp:
        width *= len(row)
        total += width
        if total >= budget or width == 0:
            break
    return min(total, budget)


def tree_round(logp: Sequence[Sequence[float]], idx: Sequence[Sequence[int]], truth: Sequence[int],
               budget: int) -> tuple[int, int]:
    """One DDTree round: (`tree_accept_depth(build_tree(logp, budget), idx, truth)`, the tree's node count),
    from the same pops in the same order, without rank-path tuples (a node is its parent's pop index and its
    rank), and stopping as soon as the accepted depth is known: when the next truth token is not among its
    depth's first `budget` ids, or every truth token is accepted. The evaluation runs this ~40 K times per full
    suite; the tuple version was its largest Python cost (7.8 of 70 s of a CPU evaluation).
    `benchmarks/eval_tree_speed.py` checks both give identical results and times them side by side.

    Rows need not be cut to `budget` ranks: a node of rank r is pushed only after its r lower siblings are
    popped, so no rank ≥ budget is among the first `budget` pops, and an extra entry in the heap shifts later
    push counters without changing their order."""
    D = len(logp)
    if budget <= 0 or D == 0 or not len(logp[0]):
        return 0, 0

    def wanted(depth: int, at: int):
        """The key (parent pop index, rank) of the truth path's node at depth+1; None: the path ends here."""
        if depth >= min(len(truth), len(idx)):
            return None
        r = _rank_in(idx[depth], int(truth[depth]), budget)
        return None if r is None else (at, r)

    popped, depth = 0, 0
    need = wanted(0, -1)
    for parent, r, _ in _pops(logp, budget):
        if need is None or need[1] < 0:
            break
        if (parent, r) == need:
            depth += 1
            need = wanted(depth, popped)
        popped += 1
    if need is not None and need[1] < 0:  # an id twice in one row: the tuple version decides
        nodes = build_tree(logp, budget)
        return tree_accept_depth(nodes, [list(r)[:budget] for r in idx], truth), len(nodes)
    return depth, _tree_size(logp, budget)


def node_score(logp: Sequence[Sequence[float]], node: Node) -> float:
    return sum(float(logp[d][r]) for d, r in enumerate(node))


def tree_accept_depth(nodes: Sequence[Node], idx: Sequence[Sequence[int]], truth: Sequence[int]) -> int:
    """Depth of the deepest tree node whose tokens equal `truth[0..depth-1]` (the target's tokens after
    the anchor; pass only as many as may be accepted). Tokens of siblings are distinct (distinct ranks of
    one distribution), so at most one child matches at each depth."""
    chosen = set(nodes)
    prefix: Node = ()
    for d, want in enumerate(truth):
        row = idx[d] if d < len(idx) else ()
        nxt = next((prefix + (r,) for r, tok in enumerate(row)
                    if int(tok) == int(want) and prefix + (r,) in chosen), None)
        if nxt is None:
            break
        prefix = nxt
    return len(prefix)
