"""Packed against padded drafter rows on a chat dataset (`data.chat.pack`), side by side in one process.

    nice python benchmarks/packing.py [--items 64] [--spp 2,8] -- <run overrides>

One real run's data (default: the shipped reference target, Qwen3's official template, the project's 200-conversation
sample): the target's features for `items` items, `sequences_per_step` a step, are produced once, through the
run's own buffer and policy (the target runs on each conversation alone either way: its Gated-DeltaNet recurrence
cannot be kept apart inside a shared row). Then two drafters with the same initial weights train on exactly those
steps, one padded row per item and packed rows, alternating which goes first each step. Reported per arm: the
drafter step's consumed tok/s, the same with the target forward's time per token added (the whole loop on one
device), the padding share of the drafter's rows, and the largest difference of the two arms' losses (the packed
math is the padded math: equal losses mean equal training, so τ at equal consumed tokens is equal too).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT = ["+target=reference", "+data=conversations", "data.chat.template=qwen3",
           f"data.path={ROOT / 'benchmarks' / 'data' / 'conversations_sample.jsonl'}", "+eval=off",
           "tracking.console=false", "tracking.system_metrics=false"]


def _arm(overrides: list[str], tmp: Path, name: str, target=None):
    from dflash.app.run import TrainingRun
    from experiments.config import compose_config
    cfg = compose_config([*overrides, f"run_dir={tmp / name}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"])
    return TrainingRun(cfg, target=target)


def measure(overrides: list[str], steps: int, spp: int, tmp: Path) -> dict:
    import torch

    from dflash.training.pipeline import ProducerPool
    over = [*overrides, f"trainer.sequences_per_step={spp}", f"trainer.max_steps={steps}"]
    padded = _arm(over, tmp, f"padded{spp}")
    packed = _arm([*over, "data.chat.pack=true"], tmp, f"packed{spp}", target=padded.target)
    tp, tk = padded.trainer, packed.trainer
    tk.drafter.load_state_dict(tp.drafter.state_dict())  # the same start (setup draws differ: one loads the target)
    top_k = tp.cfg.target.soft_top_k if tp.loss_fn.needs_soft else 0
    producer = ProducerPool(tp.target, tp.buffer, tp.source, 0, top_k, tp.cfg.trainer.producer_batch, inline=True)
    plan = [[producer.next_item() for _ in range(spp)] for _ in range(steps)]
    forwarded, forward_s = tp.target.forward_stats()  # every forward, the buffer's stock included
    tokens = sum(it.tokens_T.numel() for items in plan for it in items)
    target_s = tokens * forward_s / forwarded  # the target's time for the consumed tokens
    out = {arm: {"s": 0.0, "rows": 0, "positions": 0, "losses": []} for arm in ("padded", "packed")}
    for i, items in enumerate(plan):
        arms = [("padded", tp), ("packed", tk)]
        for arm, trainer in arms if i % 2 == 0 else arms[::-1]:
            t = time.perf_counter()
            batch = trainer.make_batch(items)
            loss = trainer.step(batch).loss.item()
            out[arm]["s"] += time.perf_counter() - t
            B, T = batch.features_BTLH.shape[:2]
            out[arm]["rows"] += B
            out[arm]["positions"] += B * T
            out[arm]["losses"].append(loss)
    res = {"sequences_per_step": spp, "steps": steps, "consumed_tokens": tokens, "target_s": target_s,
           "threads": torch.get_num_threads()}
    for arm, o in out.items():
        res[arm] = {"drafter_tok_s": tokens / o["s"], "loop_tok_s": tokens / (o["s"] + target_s),
                    "padding_share": 1 - tokens / o["positions"], "rows_per_step": o["rows"] / steps,
                    "drafter_s": o["s"], "mean_loss": sum(o["losses"]) / steps}
    res["max_loss_diff"] = max(abs(a - b) for a, b in zip(out["padded"]["losses"], out["packed"]["losses"]))
    res["drafter_speedup"] = res["packed"]["drafter_tok_s"] / res["padded"]["drafter_tok_s"]
    res["loop_speedup"] = res["packed"]["loop_tok_s"] / res["padded"]["loop_tok_s"]
    return res


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    ours, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=64, help="items each arm trains on (the same for both)")
    ap.add_argument("--spp", default="2,8", help="sequences per step, comma-separated: one comparison each")
    args = ap.parse_args(ours)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for spp in (int(x) for x in args.spp.split(",")):
            results.append(measure([*DEFAULT, *overrides], args.items // spp, spp, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    for r in results:
        print(f"sequences/step {r['sequences_per_step']}: {r['steps']} steps, {r['consumed_tokens']} consumed tokens; "
              f"padded {r['padded']['drafter_tok_s']:.0f} drafter tok/s ({r['padded']['loop_tok_s']:.0f} with the "
              f"target), padding {r['padded']['padding_share']:.1%}; packed {r['packed']['drafter_tok_s']:.0f} "
              f"({r['packed']['loop_tok_s']:.0f}), padding {r['packed']['padding_share']:.1%}; packed/padded "
              f"{r['drafter_speedup']:.3f} (loop {r['loop_speedup']:.3f}); max |loss diff| {r['max_loss_diff']:.2e}")
    return results


if __name__ == "__main__":
    main()
