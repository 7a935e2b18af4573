"""One training run: `python -m experiments.run [+loss=soft_kl] [+noise=cosine] [key=value ...]`.

Thin on purpose: compose the config, call `dflash.app.run.train`, print the result. Sweeps, tests and
notebooks call the same functions. `--cfg` prints the resolved config and exits; `--help` lists the config
groups, their options and every key. `resume=<run dir>` continues a run from its newest intact checkpoint.
SIGTERM / Ctrl-C: the step finishes, a checkpoint is written, the MLflow run closes KILLED, exit 128 + signal.
"""
from __future__ import annotations

import sys

import yaml

from dflash.config import to_dict
from dflash.app.run import train
from experiments.config import compose_config, exit_on_help, resume_config, run_cli


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(argv, __doc__)
    show = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    resume = next((a.partition("=")[2] for a in overrides if a.startswith("resume=")), "")
    others = [a for a in overrides if not a.startswith("resume=")]
    cfg = resume_config(resume, others) if resume else compose_config(overrides)
    if show:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return {}
    result = train(cfg)
    print(f"run dir: {result.run_dir}\nmlflow run: {result.run_id}\nfinal drafter: {result.checkpoint}")
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
