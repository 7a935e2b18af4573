"""Export a drafter to the serving format (docs/serving.md) that z-lab / SGLang / vLLM load.

    python -m experiments.export runs/<run> --out exported/my-drafter [--dtype bfloat16]
    python -m experiments.export runs/<run>/checkpoints/step_00001000.pt --out exported/step1000

The source is a run directory (its `final/` serving folder, else its latest checkpoint), a serving
folder, or a trainer checkpoint `.pt`. The folder is written beside `--out` and swapped in whole: an
interrupted export never leaves a half folder where a previous export was. Read one back with
`dflash.serving.export.load_drafter(DIR)` (also works for published DFlash drafters).

The folder records what the engines read from the target (context length, mask token string, RoPE) and
carries `modeling_dflash.py` for `AutoModel.from_pretrained(DIR, trust_remote_code=True)`. A DFlash 2 drafter
(`drafter.architecture=dflash2`) is written as a `DFlash2DraftModel` folder (no modelling file: the engines' own
class serves it; docs/dflash2.md). A run knows its
target; for a source that does not (a bare folder), name the target folder: `--target /models/Qwen3.6-27B`.
Serving commands (SGLang, vLLM): docs/serving.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dflash.app.export import export_drafter
from dflash.serving.export import read_serving_config
from experiments.config import ArgParser


def build_parser() -> ArgParser:
    p = ArgParser(prog="python -m experiments.export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="run directory, serving folder, or checkpoint .pt")
    p.add_argument("--out", required=True, help="serving folder to write (replaced whole if it exists)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weight dtype in the folder (default %(default)s)")
    p.add_argument("--target", default=None,
                   help="local target folder (config.json + tokenizer) whose facts the folder records; "
                        "default: the source's own (its run's target)")
    return p


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    try:
        out = export_drafter(args.source, args.out, args.dtype, target=args.target)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    cfg = read_serving_config(out)
    d = cfg["dflash_config"]
    print(f"wrote {out}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, block {cfg['block_size']}, "
          f"target layers {d['target_layer_ids']} of {cfg['num_target_layers']}, mask {d['mask_token_id']}, "
          f"vocab {cfg['vocab_size']}, {cfg['torch_dtype']}, context {cfg['max_position_embeddings']}"
          + ("" if "auto_map" in cfg or "eagle_aux_hidden_state_layer_ids" in cfg
             else " (bare: no target facts, no modeling_dflash.py; pass --target)"))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
