"""How big a drafter is before it trains: trainable parameters by part and the memory of its training state.

    python -m experiments.size [+target=qwen3_6_27b_random] [+drafter=dflash2_qwen3_6_27b] [any run override ...]

Built on the meta device from the target's config alone (`dflash.training.state_size`): no weights are read or
allocated, so a 27B-shape drafter is counted on any machine. Prints each part's parameters and the bytes that
the weights, gradients and each optimizer's state (`trainer.optimizer=adamw|muon`) take; activations are the
bench's to measure (`experiments.bench`, a step's peak memory).
"""
from __future__ import annotations

import sys

from dflash.training.state_size import drafter_size, meta_drafter
from experiments.config import compose_config, exit_on_help, run_cli


def _bytes(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def report(argv: list[str]) -> str:
    cfg = compose_config(argv)
    size = drafter_size(meta_drafter(cfg))
    d = cfg.drafter
    rows = [f"drafter {d.architecture}: {d.num_layers} layers, block {d.block_size}, on the target "
            f"{cfg.target.name or cfg.target.path}",
            "| part | trainable parameters |", "|---|---|"]
    rows += [f"| {part} | {n / 1e6:,.2f} M |" for part, n in size.parameters.items()]
    rows += [f"| **total** | **{size.total / 1e6:,.2f} M** |", "",
             "| optimizer | weights + gradients + optimizer state |", "|---|---|"]
    rows += [f"| {name}{' (trainer.optimizer)' if name == cfg.trainer.optimizer else ''} | {_bytes(b)} |"
             for name, b in size.state_bytes.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(argv, __doc__)
    text = report(argv)
    print(text)
    return text


if __name__ == "__main__":
    run_cli(main)
