"""Scoring the model: next-token NLL on token windows, a unigram baseline, bits per byte, held-out probes
(perplexity on files outside the corpus), greedy continuations through the shipped-target loading path and
the prompt-lookup τ of those continuations (how much of what the target writes is copying).
"""
from __future__ import annotations

import glob
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from dflash.data.corpus import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN
from dflash.evaluation.stats import pooled_ci


def eval_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
    """Non-overlapping windows (the last one may be shorter, >= 2 tokens) covering up to `max_tokens`."""
    out, pos = [], 0
    while pos + 1 < tokens.numel() and (max_tokens <= 0 or pos < max_tokens):
        w = tokens[pos:pos + seq_len]
        if w.numel() >= 2:
            out.append(w.long())
        pos += seq_len
    return out


# -- loss / eval --------------------------------------------------------------------------------------
def _amp(device: torch.device, amp_dtype):
    return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()


def lm_loss(model, ids_BT: torch.Tensor, amp_dtype) -> torch.Tensor:
    with _amp(ids_BT.device, amp_dtype):
        logits = model(input_ids=ids_BT, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids_BT[:, 1:].reshape(-1))


@torch.no_grad()
def window_nlls(model, windows: list[torch.Tensor], batch_size: int, amp_dtype,
                device: torch.device) -> list[tuple[float, int]]:
    """(sum of next-token NLL in nats, predicted tokens) of each window, in the order given."""
    was_training = model.training
    model.eval()
    out: list[tuple[float, int] | None] = [None] * len(windows)
    full = [i for i, w in enumerate(windows) if w.numel() == windows[0].numel()] if windows else []
    rest = [i for i, w in enumerate(windows) if w.numel() != windows[0].numel()] if windows else []
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[i] for i in rest]
    for grp in groups:
        ids = torch.stack([windows[i] for i in grp]).to(device)
        with _amp(device, amp_dtype):
            logits = model(input_ids=ids, use_cache=False).logits
        nll_B = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none").sum(1)
        for i, v in zip(grp, nll_B.tolist()):  # one host read per batch
            out[i] = (v, windows[i].numel() - 1)
    model.train(was_training)
    return [o for o in out if o is not None]


def evaluate_nll(model, windows: list[torch.Tensor], batch_size: int, amp_dtype,
                 device: torch.device) -> tuple[float, int]:
    """(sum of next-token NLL in nats, number of predicted tokens) over the windows."""
    per = window_nlls(model, windows, batch_size, amp_dtype, device)
    return sum(s for s, _ in per), sum(n for _, n in per)


def unigram_nll(train_tokens: torch.Tensor, windows: list[torch.Tensor], vocab_size: int) -> tuple[float, int]:
    """Add-one smoothed unigram model of the training tokens, scored on the same targets as the model."""
    counts = torch.bincount(train_tokens.long().cpu(), minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    total, count = 0.0, 0
    for w in windows:
        tgt = w[1:].long().cpu()
        total -= float(logp[tgt].sum())
        count += tgt.numel()
    return total, count


def token_byte_lengths(tok) -> torch.Tensor:
    """Bytes each token stands for (byte-level BPE; special tokens count 0)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    char_to_byte = {chr(c): b for b, c in zip(bs, cs)}
    vocab = tok.get_vocab()
    out = torch.zeros(max(vocab.values()) + 1, dtype=torch.long)
    specials = {EOS_TOKEN, PAD_TOKEN, MASK_TOKEN}
    for s, i in vocab.items():
        out[i] = 0 if s in specials else sum(1 for ch in s if ch in char_to_byte)
    return out


# -- probes: perplexity on named file sets -----------------------------------------------------------
def probe_files(probes: dict[str, str], stdlib_v1: bool) -> dict[str, list[tuple[str, str]]]:
    """{probe name: [(path, text)]}. `stdlib_v1_test`: the test split of the running standard library under
    the first reference target's corpus settings (no dedup, same salt) — on Python 3.12 the 28 files that
    target reported on. Globs that match nothing are skipped with no entry."""
    from dflash.data.corpus import CorpusConfig, load_corpus
    out: dict[str, list[tuple[str, str]]] = {}
    if stdlib_v1:
        c = load_corpus(CorpusConfig(scope="stdlib", dedup=False))
        out["stdlib_v1_test"] = [(d.path, d.text) for d in c.test]
    for name, pattern in probes.items():
        paths = sorted(glob.glob(pattern, recursive=True))
        files = [(p, open(p, encoding="utf-8").read()) for p in paths if os.path.isfile(p)]
        if files:
            out[name] = files
    return out


PPL_CI_LEVEL = 0.95


def perplexity_on_texts(model, tok, texts: list[str], seq_len: int, batch_size: int, amp_dtype,
                        device: torch.device) -> dict:
    """Loss, perplexity and bits/byte of `model` on `texts` (each followed by eos, as in training), with a
    percentile-bootstrap interval of the perplexity over the `seq_len`-token windows (`ppl_ci`, 95%)."""
    from dflash.data.corpus import encode_documents
    ids = [t for doc in encode_documents(tok, texts) for t in doc]
    windows = eval_windows(torch.tensor(ids, dtype=torch.long), seq_len, 0)
    per = window_nlls(model, windows, batch_size, amp_dtype, device)
    s, n = sum(v for v, _ in per), sum(c for _, c in per)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    loss = s / max(n, 1)
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": n, "windows": len(per),
           "bits_per_byte": s / math.log(2) / max(nbytes, 1), "files": len(texts), "bytes": nbytes}
    if len(per) >= 2:  # windows of one file are correlated: an interval over windows is on the narrow side
        ci = pooled_ci([v for v, _ in per], [c for _, c in per], PPL_CI_LEVEL)
        out["ppl_ci"] = [math.exp(min(ci.low, 50.0)), math.exp(min(ci.high, 50.0))]
    return out


# -- continuations and prompt-lookup τ ----------------------------------------------------------------
def prompt_lookup_steps(context: list[int], continuation: list[int], draft_len: int,
                        max_ngram: int = 3) -> int:
    """Target forwards a prompt-lookup decoder needs to produce `continuation` after `context` (greedy, so
    the output is the same): each step matches the longest suffix n-gram (n = max_ngram..1) of what is
    written so far against its latest earlier occurrence, proposes the `draft_len` tokens that followed it,
    accepts the agreeing prefix and adds the target's own next token. τ = len(continuation) / steps."""
    seq, pos, steps = list(context), 0, 0
    while pos < len(continuation):
        draft: list[int] = []
        for n in range(min(max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    draft = seq[start + n:start + n + draft_len]
                    break
            if draft:
                break
        accepted = 0
        while accepted < len(draft) and pos + accepted < len(continuation) and \
                draft[accepted] == continuation[pos + accepted]:
            accepted += 1
        take = min(accepted + 1, len(continuation) - pos)
        seq += continuation[pos:pos + take]
        pos += take
        steps += 1
    return steps


def generate_continuations(folder: str | os.PathLike, meta: dict, prompts: list[tuple[str, str]],
                           max_new_tokens: int, device: str, force_torch: bool = False) -> tuple[list[dict], dict]:
    """Loads the written folder through `dflash.target.model.Target` and decodes each prompt greedily. Returns the
    continuations and the Gated-DeltaNet kernels they ran with (`force_torch`: transformers' torch functions)."""
    from dflash.data.regen import greedy_generate
    from dflash.target.kernels import force_torch_gdn, kernel_report
    from dflash.target.model import Target, TargetConfig
    target = Target(TargetConfig(name="reference_target", path=str(folder), mask_token_id=meta["mask_token_id"],
                                 layer_ids=list(meta["layer_ids"]), device=device))
    if force_torch:  # after the Target's own kernel set-up: its forward reads the module's functions per call
        force_torch_gdn(target.info.model_type)
    report = kernel_report(target.info.model_type)
    out = []
    for name, prompt in prompts:
        ids = list(target.tokenizer.encode(prompt))
        t0 = time.perf_counter()
        cont = greedy_generate(target, torch.tensor([ids]), max_new_tokens)[0].tolist()
        out.append({"name": name, "prompt": prompt, "prompt_tokens": len(ids), "continuation_ids": cont,
                    "continuation": target.tokenizer.decode(cont), "seconds": time.perf_counter() - t0,
                    "prompt_ids": ids})
    return out, report


def lookup_tau(continuations: list[dict], draft_len: int) -> dict:
    """Prompt-lookup τ per continuation and over all of them (tokens / target forwards)."""
    per, tokens, steps = {}, 0, 0
    for c in continuations:
        n = len(c["continuation_ids"])
        s = prompt_lookup_steps(c["prompt_ids"], c["continuation_ids"], draft_len) if n else 0
        per[c["name"]] = n / s if s else 0.0
        tokens, steps = tokens + n, steps + s
    from dflash.evaluation.prompt_lookup import COPY_NGRAM, copy_rate
    rates = [r for c in continuations if c["continuation_ids"]
             and (r := copy_rate(c["prompt_ids"] + c["continuation_ids"], len(c["prompt_ids"]))) == r]  # not NaN
    return {"per_prompt": per, "tau": tokens / steps if steps else 0.0, "draft_len": draft_len,
            "proposer": "n-gram copy simulation (dflash.pretrain.evaluate.prompt_lookup_steps, n<=3)",
            "copy_rate": sum(rates) / len(rates) if rates else float("nan"), "copy_ngram": COPY_NGRAM}
