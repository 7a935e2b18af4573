"""The online writer's generation speed by decode path, side by side in one process (docs/data.md, "Writing").

    PYTHONPATH=$PWD python benchmarks/gpu/decode_speed.py [rows=4096] [seq_len=320] [modes=cache,graph]
        [corpus=stdlib] [repeats=2] [out=decode_speed.json]

Modes: `data.online.decode`'s (cache, static, graph), and cache_torch_conv: the cache path with transformers' torch
convolution step in place of FLA's (`dflash.target.kernels.use_fla_short_conv` binds FLA's behind
`causal_conv1d_update`), e.g. modes=cache_torch_conv,cache for that kernel's share of a cached decode.

Prompts are the first `rows` of the run's own prompt pool (`+trainer=gpu` data settings, `data.corpus.scope`
= corpus), each continued to `seq_len` tokens as one written batch (`dflash.data.writing.write_continuations`).
Per mode: a first write (kernels, autotuning, the graph's capture), then `repeats` timed writes; written tokens
are those past each prompt. It then compares the modes' tokens: how many written tokens and whole rows agree
with the first mode (greedy bf16 decoding on different kernels may part at a near-tie; after that the rows
differ, each still the target's own greedy text).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time

import torch

from dflash.data.writing import write_continuations
from dflash.target.kernels import torch_gdn_path
from dflash.target.model import Target
from dflash.training.datastream import build_training_data
from dflash.training.distributed import DistInfo
from experiments.config import compose_config


def _sync(target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize()


def timed_write(target, prompts, seq_len: int, mode: str) -> tuple[torch.Tensor, float]:
    torch_conv = mode == "cache_torch_conv"  # the cache path on transformers' torch convolution step
    with torch_gdn_path(target.info.model_type, ("causal_conv1d_update",)) if torch_conv else contextlib.nullcontext():
        _sync(target)
        t0 = time.perf_counter()
        out = write_continuations(target, prompts, seq_len, decode="cache" if torch_conv else mode)
        _sync(target)
        return out, time.perf_counter() - t0


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    rows, seq_len = int(args.get("rows", 4096)), int(args.get("seq_len", 320))
    modes, repeats = args.get("modes", "cache,graph").split(","), int(args.get("repeats", 2))
    cfg = compose_config(["+trainer=gpu", f"data.corpus.scope={args.get('corpus', 'stdlib')}",
                          f"data.max_len={seq_len}", "data.online.shard_dir=",
                          f"data.pool.max_prompt_len={min(192, seq_len // 2)}",
                          f"data.pool.chunk_max_len={min(128, seq_len // 2)}"])
    target = Target(cfg.target)
    data = build_training_data(cfg, target, DistInfo())
    pool = data.writer.pool.prompts
    prompts = [pool[i % len(pool)] for i in range(rows)]
    written = sum(seq_len - len(p) for p in prompts)
    results, outs = [], {}
    for mode in modes:
        t_first = timed_write(target, prompts, seq_len, mode)[1]
        times = []
        for _ in range(repeats):
            outs[mode], s = timed_write(target, prompts, seq_len, mode)
            times.append(s)
        s = statistics.median(times)
        results.append({"mode": mode, "rows": rows, "seq_len": seq_len, "first_write_s": t_first, "write_s": s,
                        "written_tok_s": written / s, "ms_per_step": s / seq_len * 1e3,
                        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if target.device.type == "cuda"
                        else 0.0})
        print(f"{mode}: {written / s:,.0f} written tok/s ({s:.2f} s a batch, first {t_first:.2f} s)", flush=True)
    ref = outs[modes[0]]
    lens = torch.tensor([len(p) for p in prompts])
    mask = torch.arange(seq_len)[None] >= lens[:, None]
    for r in results:
        same = outs[r["mode"]] == ref
        r["tokens_agree"] = float(same[mask].float().mean())
        r["rows_identical"] = float(same.all(1).float().mean())
    print(f"\n| decode ({rows} rows x {seq_len} tokens, {written:,} written) | written tok/s | s a batch | "
          f"ms a step | first write s | peak GB | tokens / rows as {modes[0]} |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {r['written_tok_s']:,.0f} | {r['write_s']:.2f} | {r['ms_per_step']:.2f} | "
              f"{r['first_write_s']:.2f} | {r['peak_mem_gb']:.1f} | {r['tokens_agree']:.4f} / {r['rows_identical']:.4f} |")
    if len(results) > 1:
        print(f"\n{results[-1]['mode']} / {results[0]['mode']}: "
              f"{results[-1]['written_tok_s'] / results[0]['written_tok_s']:.2f}x")
    json.dump(results, open(args.get("out", "decode_speed.json"), "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
