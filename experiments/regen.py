r"""Write the target's responses to a conversation dataset ahead of training, as the shards a run reads, or as a new
conversation file:

    python -m experiments.regen +target=... +data=conversations data.path=chats.jsonl \
        data.conversations.responses=target [data.online.temperature=0.7] [regen.train_world=1] [regen.epochs=1]
    torchrun --nproc-per-node 8 -m experiments.regen ...        # the work split over 8 GPUs
    python -m experiments.regen ... backend=openai url=http://host:8000/v1 [server.concurrency=64]  # a vLLM / SGLang /
                                                                  # transformers serve endpoint writes the responses
    python -m experiments.regen +target=... +data=conversations data.path=chats.jsonl out=chats_regen.jsonl \
        [backend=openai url=http://host:8000/v1] [regen.turn_tokens=2048]   # a conversation file, turn by turn

Shards: every assistant turn of the dataset's TRAIN split becomes a prompt (the conversation before it, through the
target's chat template) that the target continues to data.online.seq_len tokens; the written batches are saved
under data.online.shard_dir exactly as a training run with the same settings would write them (and reads them
instead of writing). Killed, it resumes where it stopped (a shard on disk is skipped). A progress bar shows the
written tokens per second and the ETA. With `backend=openai` an inference server serving the
same target writes them (dflash/data/responders.py; docs/conversations.md).

`out=FILE.jsonl`: every conversation with each trained assistant turn rewritten, turn by turn, each turn ending at
the target's end of turn (or regen.turn_tokens), its reasoning and tool calls split into their fields; resumable
after a kill (dflash/app/regen_turns.py). Train on it with +data=conversations data.path=FILE.jsonl.

`regen.*` keys are this command's own (dflash.app.regen_shards.RegenConfig; `backend=`, `url=`, `server.*`, `out=`
are short for regen.backend, regen.server.*, regen.turns_out); everything else is the run config. Bad input exits 2.
"""
from __future__ import annotations

import dataclasses
import sys

from dflash.app.regen_shards import RegenConfig, regen_config_from, run_regen
from experiments.config import compose_config, exit_on_help, run_cli


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(argv, __doc__, extra={"regen": dataclasses.asdict(RegenConfig())})
    regen, overrides = regen_config_from(argv)
    stats = run_regen(compose_config(overrides), regen)
    print(" ".join(f"{k}={v:.6g}" for k, v in stats.items()), flush=True)
    return stats


if __name__ == "__main__":
    run_cli(main)
