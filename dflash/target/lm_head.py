"""How many positions go through the target's LM head at a time: the one rule the target's label forward and
the drafter's LM-head losses share (both multiply hidden states by the same [V, H] head).

Positions per chunk when `loss.chunk_size` (or `target.lm_head_chunk`) is 0, "auto": as many as keep one
[chunk, V] float32 block near 1 GiB. At V = 248,320 that is 1,024, the fixed default it replaces; at the
reference target's V = 4,096 it is 65,536. There 1,024 made 128 chunks of ~20 small kernels each per step:
launch-bound. On an H200, in one process: the LM-head loss 72.2 -> 10.3 ms, the drafter step 80.0 -> 43.9 ms
(benchmarks/RESULTS.md, 2026-12-01).

On the CPU there is no launch to amortize, and the block is host memory beside everything else a run holds: auto
keeps it near 128 MiB instead (8,192 positions at V = 4,096): a step at a GPU sweep's shapes (64 x 320, 128
anchors: 131,072 positions) on a CPU peaked 2.2 GiB lower than with 1 GiB blocks (docs/faults.md, "Sweep memory",
2026-12-05).
"""
from __future__ import annotations

AUTO_CHUNK_LOGITS = 1 << 28
AUTO_CHUNK_LOGITS_CPU = 1 << 25


def resolve_chunk(chunk_size: int, vocab_size: int, device: "str | object" = "cuda") -> int:
    """`chunk_size` itself when > 0; for 0 (auto) the largest power of two (at least 64) of positions whose
    [chunk, V] logits hold at most AUTO_CHUNK_LOGITS values (AUTO_CHUNK_LOGITS_CPU on the CPU). `device`: where
    the logits are made (a torch.device or its name)."""
    if chunk_size > 0:
        return chunk_size
    cap = AUTO_CHUNK_LOGITS_CPU if str(getattr(device, "type", device)).startswith("cpu") else AUTO_CHUNK_LOGITS
    return 1 << max(6, (cap // max(vocab_size, 1)).bit_length() - 1)
