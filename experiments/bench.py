"""Throughput at production shapes, side by side in one run:

    python -m experiments.bench +target=qwen3_6_27b_random +drafter=published bench.seq_len=2048 bench.anchors=256

Prints target-only, drafter-only, back-to-back and pipeline tokens/s, FLOPs per token, MFU against a matmul
peak measured on the spot, peak memory and the drafter step's time breakdown; logs them to MLflow (a run
tagged dflash.kind=bench, with the shapes as tags) and appends them with the command line to the results log of
the day, benchmarks/log/YYYY-MM-DD.md (UTC; `results=FILE` appends to FILE instead, `results=` to nothing). The
pipeline's headline is the tokens the drafter trained on per second (`perf/consumed_tok_s` in MLflow); the
figure that credits the buffer's stock is logged as `perf/stock_credited_tok_s`.
`bench.*` keys are this command's own (dflash.bench.BenchConfig); everything else is the run config.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from dflash.bench.runner import BenchConfig, format_table, run_bench
from dflash.config import to_dict
from dflash.overrides import apply_overrides
from dflash.tracking.loggers import MLflowLogger
from dflash.tracking.run_info import flatten_config
from experiments.config import compose_config, exit_on_help, run_cli

LOG_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "log"  # one results file per date


def log_file(now: datetime) -> Path:
    """The day's results log: the date in UTC, so every machine writes an entry to the same file."""
    return LOG_DIR / f"{now.astimezone(timezone.utc):%Y-%m-%d}.md"


def append_entry(path: str | Path, cmd: str, table: str, out: dict, now: datetime) -> None:
    """One entry at the end of `path`: time, command, table and raw JSON. A file the entry starts (the day's first
    log) gets the title the other dated logs have."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = now.astimezone(timezone.utc)
    title = "" if path.exists() and path.stat().st_size else (
        f"# Measured results of {now:%Y-%m-%d}\n\nEach entry gives the command that produced it and its conditions; "
        f"the index and the machines are in\n[RESULTS.md](../RESULTS.md).\n")
    with open(path, "a") as f:
        f.write(f"{title}\n## {now:%Y-%m-%d %H:%M} UTC — bench output\n\n`{cmd}`\n\n```\n{table}\n```\n\n"
                f"<details><summary>raw</summary>\n\n```json\n{json.dumps(out, indent=1, default=str)}\n```\n"
                f"</details>\n")


def parse_bench_args(argv: list[str], now: datetime | None = None) -> tuple[BenchConfig, list[str], str | None]:
    """(bench.* keys, the run config's overrides, the results file or None): `bench.*` tokens go through
    the one override parser (`dflash/overrides.py`) against `BenchConfig`, the rest compose the run config; the
    results file is `results=`'s, else the day's log (`log_file`)."""
    ours = [a for a in argv if a.startswith("bench.")]
    default = str(log_file(now or datetime.now(timezone.utc)))
    results = next((a.partition("=")[2] or None for a in reversed(argv) if a.startswith("results=")), default)
    rest = [a for a in argv if not a.startswith(("bench.", "results="))]
    return apply_overrides(BenchConfig(), ours, prefix="bench."), rest, results


def _flat_numbers(d: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)):
            out[f"perf/bench/{prefix}{k}".replace("perf/bench/perf/", "perf/bench/")] = float(v)
    return out


def headline(out: dict) -> dict[str, float]:
    """What MLflow leads with: tokens trained on per second (and its spread over the windows); the
    stock-credited figure under its own name."""
    p = out.get("pipeline", {})
    if "consumed_tok_s" not in p:
        return {}
    return {"perf/consumed_tok_s": p["consumed_tok_s"], "perf/consumed_tok_s_spread": p["spread"],
            "perf/stock_credited_tok_s": p["stock_credited_tok_s"], **({"perf/mfu": p["mfu"]} if "mfu" in p else {})}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(argv, __doc__, extra={"bench": dataclasses.asdict(BenchConfig())})
    bench, overrides, results = parse_bench_args(argv)
    cfg = compose_config(overrides)
    out = run_bench(cfg, bench)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports for all ranks
        return out
    table = format_table(out)
    print(table, flush=True)
    shapes = {k: str(v) for k, v in out.get("shapes", {}).items()}
    if cfg.tracking.enabled:  # +tracking=off: the table and the results log only, no store touched
        ml = MLflowLogger(cfg.tracking, flatten_config({**to_dict(cfg), "bench": dataclasses.asdict(bench)}),
                          {"dflash.kind": "bench", **shapes, "target": cfg.target.name})
        ml.log({**headline(out), **_flat_numbers(out)}, 0)
        ml.log_dict(out, "bench.json")
        ml.close()
    if results:
        launcher = (f"torchrun --nproc_per_node={os.environ['LOCAL_WORLD_SIZE']} -m" if "LOCAL_WORLD_SIZE" in os.environ
                    else "python -m")
        cmd = f"{launcher} experiments.bench " + " ".join(shlex.quote(a) for a in argv)
        append_entry(results, cmd, table, out, datetime.now(timezone.utc))
    return out


if __name__ == "__main__":
    run_cli(main)
