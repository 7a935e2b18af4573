"""Profile a real training run's loop (dflash.bench.loop_profile): where its wall time goes between the inline
producer's share (`dflash.next_items`), the training step and the rest, the GPU's busy fraction, and the
costliest host ops of each part.

    python benchmarks/profile_run.py [--start 30] [--steps 8] [--out profile.json] -- <run overrides>

e.g. `python benchmarks/profile_run.py -- +trainer=gpu drafter.num_layers=5 +eval=off data.online.shard_dir=DIR`.
The run trains `start + steps` steps (trainer.max_steps is set to that) and writes no final drafter.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def profile_run(overrides: list[str], start: int, steps: int) -> dict:
    from dflash.bench.loop_profile import LoopProfiler
    from dflash.app.run import TrainingRun
    from experiments.config import compose_config
    cfg = compose_config(overrides)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, max_steps=start + steps, checkpoint_every=10**9, eval_every=0, time_budget_s=0.0))
    run = TrainingRun(cfg)
    prof = LoopProfiler(run.trainer.device, start, steps)
    run.run(final=False, around_step=prof.around_step)
    return {"overrides": overrides, "start": start, **prof.result}


def print_breakdown(r: dict) -> None:
    print(f"loop profile: {r['steps']} steps from step {r['start']}; wall {r['wall_ms_per_step']:.2f} ms/step, "
          f"GPU busy {r['gpu_busy_frac']:.0%}")
    for name in ("dflash.next_items", "dflash.train_step"):
        print(f"  {name}: {r[name + '_ms_per_step']:.2f} ms/step; top host ops (self ms/step): "
              + ", ".join(f"{o['op']} {o['ms_per_step']:.2f}" for o in r[name + "_top_ops"]))
    print(f"  other (metrics, logging): {r['other_ms_per_step']:.2f} ms/step")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", type=int, default=30, help="first profiled loop step (after compiles)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="", help="write the breakdown as JSON here too")
    a = p.parse_args(ours)
    r = profile_run(overrides, a.start, a.steps)
    print_breakdown(r)
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
