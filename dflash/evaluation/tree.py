"""DDTree (DESIGN §5): a draft tree built best-first from the drafter's one forward.

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


def build_tree(logp: Sequence[Sequence[float]], budget: int) -> list[Node]:
    """`logp[d][r]`: log-prob of the rank-r token at depth d+1, each row sorted descending.
    Returns the chosen nodes (rank paths) in pop order (non-increasing score)."""
    D = len(logp)
    if budget <= 0 or D == 0 or not len(logp[0]):
        return []
    heap: list[tuple[float, int, Node]] = [(-float(logp[0][0]), 0, (0,))]
    counter = 1
    nodes: list[Node] = []
    while heap and len(nodes) < budget:
        neg, _, node = heapq.heappop(heap)
        nodes.append(node)
        d, r = len(node), node[-1]
        row = logp[d - 1]
        if r + 1 < len(row):  # next sibling
            heapq.heappush(heap, (neg + float(row[r]) - float(row[r + 1]), counter, node[:-1] + (r + 1,)))
            counter += 1
        if d < D and len(logp[d]):  # first child
            heapq.heappush(heap, (neg - float(logp[d][0]), counter, node + (0,)))
            counter += 1
    return nodes


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
