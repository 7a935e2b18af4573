"""Score reference-target folders side by side on CPU: `python benchmarks/compare_targets.py DIR [DIR ...]`.

For each folder: perplexity and bits/byte on the probe files (`--probe name=glob`, default the shipped
recipe's), and greedy continuations of the coding10 prompts twice — as the prompts tokenize, and with token
healing (the prompt's last token, when it is whitespace ending a line, is dropped and the first generated token
must start with its text), with the prompt-lookup τ of each. Token healing shows the prompt-boundary effect: a
byte-level BPE whose pre-tokenizer glues a newline to the next line's indentation never sees a bare trailing
`\n` followed by an indented line in training. Writes `--out` (JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash.data.regen import greedy_generate
from dflash.evaluation import load_suite
from dflash.pretrain.evaluate import lookup_tau, perplexity_on_texts, probe_files
from dflash.target.model import Target, TargetConfig, read_target_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.pretrain_target import SHIPPED_PROBES  # noqa: E402


def healed_ids(target, prompt: str, n_new: int) -> tuple[list[int], list[int]]:
    """(prompt ids used, continuation ids) with token healing of a trailing whitespace token."""
    ids = list(target.tokenizer.encode(prompt))
    last = target.tokenizer.decode([ids[-1]])
    if not (last.strip() == "" and "\n" in last):
        return ids, greedy_generate(target, torch.tensor([ids]), n_new)[0].tolist()
    head = ids[:-1]
    vocab = target.tokenizer.convert_ids_to_tokens(list(range(target.vocab_size)))
    allowed = torch.tensor([target.tokenizer.convert_tokens_to_string([t]).startswith(last) if t else False
                            for t in vocab])
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([head])).logits[0, -1]
    first = int(logits.masked_fill(~allowed, float("-inf")).argmax())
    rest = greedy_generate(target, torch.tensor([head + [first]]), n_new - 1)[0].tolist()
    return head, [first] + rest


def score(folder: str, probes: dict[str, str], n_new: int, draft_len: int) -> dict:
    meta = read_target_meta(folder)
    target = Target(TargetConfig(path=folder, mask_token_id=meta["mask_token_id"], layer_ids=[0], device="cpu"))
    tok = target.tokenizer.backend_tokenizer
    res = {"probes": {}, "continuations": {}}
    for name, files in probe_files(probes, False).items():
        res["probes"][name] = perplexity_on_texts(target.model, tok, [t for _, t in files], 512, 8, None,
                                                  torch.device("cpu"))
    for mode in ("plain", "healed"):
        conts = []
        for task in load_suite("coding10"):
            if mode == "plain":
                p_ids = list(target.tokenizer.encode(task.prompt))
                c_ids = greedy_generate(target, torch.tensor([p_ids]), n_new)[0].tolist()
            else:
                p_ids, c_ids = healed_ids(target, task.prompt, n_new)
            conts.append({"name": task.name, "prompt_ids": p_ids, "continuation_ids": c_ids,
                          "continuation": target.tokenizer.decode(c_ids)})
        res["continuations"][mode] = {"items": conts, "lookup_tau": lookup_tau(conts, draft_len)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--probe", action="append", default=[], help="name=glob (default: the shipped probes)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=15)
    ap.add_argument("--out", default="compare_targets.json")
    a = ap.parse_args()
    probes = dict(p.split("=", 1) for p in a.probe) or dict(SHIPPED_PROBES)
    out = {f: score(f, probes, a.new_tokens, a.draft_len) for f in a.folders}
    Path(a.out).write_text(json.dumps(out, indent=1))
    for f, r in out.items():
        print(f)
        for name, p in r["probes"].items():
            print(f"  {name}: ppl {p['ppl']:.2f}, {p['bits_per_byte']:.3f} bits/byte ({p['tokens']} tokens)")
        for mode, c in r["continuations"].items():
            print(f"  coding10 {mode}: prompt-lookup tau {c['lookup_tau']['tau']:.2f}")


if __name__ == "__main__":
    main()
