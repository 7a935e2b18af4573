"""How many positions go through the target's LM head at a time: the one rule the target's label forward and
the drafter's LM-head losses share (both multiply hidden states by the same [V, H] head).

Positions per chunk when `loss.chunk_size` (or `target.lm_head_chunk`) is 0, "auto": as many as keep one
[chunk, V] float32 block near 1 GiB. At V = 248,320 that is 1,024, the fixed default it replaces; at the
reference target's V = 4,096 it is 65,536. There 1,024 made 128 chunks of ~20 small kernels each per step:
launch-bound. On an H200, in one process: the LM-head loss 72.2 -> 10.3 ms, the drafter step 80.0 -> 43.9 ms
(benchmarks/RESULTS.md, 2026-12-01).
"""
from __future__ import annotations

AUTO_CHUNK_LOGITS = 1 << 28


def resolve_chunk(chunk_size: int, vocab_size: int) -> int:
    """`chunk_size` itself when > 0; for 0 (auto) the largest power of two (at least 64) of positions whose
    [chunk, V] logits hold at most AUTO_CHUNK_LOGITS values."""
    if chunk_size > 0:
        return chunk_size
    return 1 << max(6, (AUTO_CHUNK_LOGITS // max(vocab_size, 1)).bit_length() - 1)
