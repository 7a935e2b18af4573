"""Building a prompt pool (`dflash.data.pool.build_prompt_pool`, no cache), old way and new, side by side in one
process, on the machine's own corpus and the run's target tokenizer (the shipped reference target's by default):

    python benchmarks/pool_build.py [overrides ...]        # default: the recipe's pool (+recipe=best_reference)
    python benchmarks/pool_build.py data.pool.size=20000 data.corpus.scope=stdlib

Two ways, each building the same pool from scratch (the second must equal the first, prompt for prompt):
- `1 thread`: what GPU jobs ran until 2026-12-02 (benchmarks/leased_gpu/job_env.sh set TOKENIZERS_PARALLELISM=false);
- `threads`: the Rust tokenizer's own thread pool, as with the variable unset (now).
Prints the seconds of each and their ratio; the corpus load is timed once, outside. (`encode_batch_fast`, which
skips the character offsets, was no faster here: 16.1-16.9 s against 14.9-18.0 s for a 40,000-prompt pool, 2 cores.)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _timed(build, threads: bool):
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"  # read by the Rust side at each call
    try:
        t0 = time.perf_counter()
        pool = build()
        return time.perf_counter() - t0, pool
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def main(argv: list[str]) -> int:
    from dataclasses import replace

    from dflash.data.corpus import load_corpus
    from dflash.data.pool import build_prompt_pool
    from dflash.target.model import Target
    from experiments.config import compose_config
    cfg = compose_config(["+recipe=best_reference", "trainer.device=cpu", *argv])
    pool_cfg = replace(cfg.data.pool, cache_dir="")  # built every time
    tok = Target(cfg.target).tokenizer  # a fast Hugging Face tokenizer (its Rust backend is what is timed)
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.data.corpus)
    print(f"corpus: {len(corpus.train)} train files, loaded in {time.perf_counter() - t0:.1f} s; "
          f"pool size {pool_cfg.size}, headers_frac {pool_cfg.headers_frac}, header_cuts {pool_cfg.header_cuts}; "
          f"{os.cpu_count()} cores")
    rows, first = [], None
    for name, threads in [("1 thread", False), ("threads", True)]:
        s, pool = _timed(lambda: build_prompt_pool(corpus, tok, pool_cfg, "bench"), threads)
        first = first or pool
        same = pool.prompts == first.prompts and pool.kinds == first.kinds
        rows.append((name, s, same))
        if not same:
            print(f"{name}: a different pool", file=sys.stderr)
            return 1
    print(f"\n| way | s | × the first | same pool |\n| --- | --- | --- | --- |")
    for name, s, same in rows:
        print(f"| {name} | {s:.1f} | {rows[0][1] / s:.2f} | {same} |")
    print(f"\n{len(first.prompts)} prompts ({first.stats['header_prompts']} header, "
          f"{first.stats['header_body_prompts']} header_body, {first.stats['chunk_prompts']} chunks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
