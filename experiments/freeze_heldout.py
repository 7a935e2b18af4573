r"""Write the frozen held-out suite, `dflash/evaluation/suites/heldout.json` (`dflash.evaluation.frozen_suite`):

    python -m experiments.freeze_heldout --stdlib <a CPython standard library folder> \
        [--pin <a truth pin of the held-out suite>] [--tokenizer <the pin's target folder>] [--out <file>]

Without `--pin` it cuts the held-out suite from the first `--stdlib` exactly as `eval.heldout.source=corpus` does
on a machine whose standard library that is (the configured selection: 128 prompts, `conf/eval/full.yaml`). With
`--pin` the pin's names are the suite: each is cut from the first `--stdlib` folder whose prompt tokens (through
`--tokenizer`, default the shipped reference target's) have the sha256 the pin records; a name found in none
writes nothing and exits 1. Each task keeps its human continuation, source file and CPython version; the file
carries the licence text (the first folder's `LICENSE.txt`) and is written atomically.

The shipped file was made on 2026-12-06 from the served campaign's T=0 held-out pin (written on the GPU machine's
Python 3.12.3; `benchmarks/ablations/campaign_out.tar.xz`, `campaign_out/served/truth/aff4e25cfb9ca40a86f666ef.json`)
with the standard libraries at hand, all 128 prompts' tokens as pinned:

    python -m experiments.freeze_heldout --stdlib ~/.pyenv/versions/3.12.1/lib/python3.12 \
        --stdlib ~/.pyenv/versions/3.13.0/lib/python3.13 --stdlib ~/.pyenv/versions/3.11.7/lib/python3.11 \
        --pin campaign_out/served/truth/aff4e25cfb9ca40a86f666ef.json

116 prompts come from 3.12.1; 4 of `email/utils.py` from 3.13.0 (the pinning machine's 3.12.3 has the newer
`getaddresses` fix in that file, as 3.13.0 has; 3.12.1 lacks it); 8 of `typing.py` from 3.11.7 (the command
runs under Python 3.11, whose parser cannot read 3.12's `typing.py`). Their human continuations come from those
files; the pin cannot check them (it records prompt hashes only).

Bad input (no such folder, no licence file, an unreadable pin) exits 2 before any work.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

REFERENCE_TOKENIZER = Path(__file__).resolve().parent.parent / "dflash" / "assets" / "reference_target"


def _bad(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _python_version(stdlib: Path) -> str:
    """The standard library's version: its installation's `patchlevel.h` (`<prefix>/include/pythonX.Y/`), or,
    without one, the folder's name (`python3.12` -> `3.12`)."""
    header = stdlib.parent.parent / "include" / stdlib.name / "patchlevel.h"
    if header.is_file():
        m = re.search(r'#define PY_VERSION\s+"([^"]+)"', header.read_text(encoding="utf-8", errors="replace"))
        if m:
            return m.group(1)
    return stdlib.name.removeprefix("python")


def _pinned_prompts(pin: Path) -> dict[str, str]:
    """{task name: sha256 of its prompt tokens} of a pin (a sampled pin's `<name>#s<i>` tasks under their name)."""
    try:
        data = json.loads(pin.read_text(encoding="utf-8"))
        return {t["name"].rsplit("#s", 1)[0]: t["prompt_sha256"] for t in data["tasks"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        _bad(f"--pin {pin}: not a readable truth pin ({type(e).__name__}: {e})")
        raise  # unreachable: _bad exits


def _cut(stdlibs: list[Path], cfg, pinned: dict[str, str] | None, tokenizer: Path):
    """(tasks, each one's (source file, Python version)). Without a pin: the first folder's own selection. With
    one: the pin's names, each cut from the first folder whose prompt tokens the pin records (every candidate of
    a file, not only its first `max_per_file`: the pin already made the selection); SystemExit(1) when a name is
    found in none."""
    from dflash.evaluation.heldout import heldout_pool, select
    versions = [_python_version(d) for d in stdlibs]
    if pinned is None:
        pool = heldout_pool(dataclasses.replace(cfg, corpus_root=str(stdlibs[0])))
        where = {t.name: src for t, src in pool}
        tasks = select([t for t, _ in pool], cfg.num_prompts)
        return tasks, [(where[t.name], versions[0]) for t in tasks]
    from transformers import AutoTokenizer

    from dflash.evaluation.truth_pin import prompt_sha
    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    found: dict[str, tuple] = {}
    for folder, version in zip(stdlibs, versions):
        for t, src in heldout_pool(dataclasses.replace(cfg, corpus_root=str(folder), max_per_file=10**6)):
            if t.name in pinned and t.name not in found and prompt_sha(tok.encode(t.prompt)) == pinned[t.name]:
                found[t.name] = (t, src, version)
    missing = [n for n in pinned if n not in found]
    if missing:
        print(f"{len(missing)} pinned prompts are in none of {[str(d) for d in stdlibs]} with the pinned tokens; "
              f"nothing written:\n  " + "\n  ".join(missing[:20]), file=sys.stderr)
        raise SystemExit(1)
    names = sorted(pinned)
    return [found[n][0] for n in names], [found[n][1:] for n in names]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stdlib", type=Path, action="append", required=True,
                    help="a CPython standard library folder (Lib/); repeat it to look in several, in order")
    ap.add_argument("--pin", type=Path, default=None, help="a truth pin of the held-out suite: its prompts are the suite")
    ap.add_argument("--tokenizer", type=Path, default=REFERENCE_TOKENIZER,
                    help="the target folder whose tokenizer made the pin's prompt hashes")
    ap.add_argument("--out", type=Path, default=None, help="default: dflash/evaluation/suites/heldout.json")
    args = ap.parse_args(argv)
    for d in args.stdlib:
        if not d.is_dir() or not (d / "LICENSE.txt").is_file():
            _bad(f"--stdlib {d}: not a CPython standard library folder (no LICENSE.txt in it)")
    pinned = _pinned_prompts(args.pin) if args.pin else None
    if args.pin and not (args.tokenizer / "tokenizer.json").is_file():
        _bad(f"--tokenizer {args.tokenizer}: no tokenizer.json in it")

    from dflash.atomic import atomic_write_text
    from dflash.data.corpus import CorpusConfig
    from dflash.evaluation.frozen_suite import SELECTION_KEYS, frozen_path, frozen_text
    from experiments.config import compose_config

    cfg = dataclasses.replace(compose_config(["+eval=full"]).eval.heldout, source="corpus")
    tasks, origin = _cut(args.stdlib, cfg, pinned, args.tokenizer)
    versions = sorted({v for _, v in origin})
    corpus = {k: v for k, v in dataclasses.asdict(CorpusConfig()).items() if k != "root"}
    head = {"name": "heldout",
            "source": f"CPython's standard library (Lib/; versions {', '.join(versions)}, each task's own in its "
                      f"'python'): the corpus's held-out split (dflash.data.corpus.split_of), header + docstring "
                      f"prompts, each with the rest of its definition as its human continuation",
            "licence": "PSF-2.0 (Python Software Foundation License Version 2); licence_text is CPython's "
                       "LICENSE.txt, kept with these excerpts as it asks",
            "selection": {k: getattr(cfg, k) for k in (*SELECTION_KEYS, "num_prompts")}, "corpus": corpus,
            "made": "2026-12-06",
            "command": "python -m experiments.freeze_heldout " + " ".join(f"--stdlib <CPython {v} Lib/>"
                                                                         for v in map(_python_version, args.stdlib))
                       + (f" --pin {args.pin.name}" if args.pin else ""),
            "licence_text": (args.stdlib[0] / "LICENSE.txt").read_text(encoding="utf-8")}
    out = args.out or frozen_path()
    atomic_write_text(out, frozen_text(tasks, [s for s, _ in origin], head, [v for _, v in origin]))
    print(f"wrote {out}: {len(tasks)} prompts from CPython {', '.join(versions)}"
          + (f", every prompt's tokens as pinned in {args.pin}" if args.pin else ""))
    return out


if __name__ == "__main__":
    main()
