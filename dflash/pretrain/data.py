"""What the recipe trains on: the corpus (`dflash.data.corpus`), its BPE tokenizer (trained on the train
split only, or read back from a resume checkpoint), the token streams (encoded once, cached), and the
window sampler over the training stream (resumable: its order is a function of seed and epoch).
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from dataclasses import dataclass

import torch

from dflash.data.corpus import (EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, Corpus, Document, load_corpus, tokenize_corpus,
                                tokenizer_sample, train_tokenizer)
from dflash.pretrain.config import PretrainConfig

log = logging.getLogger(__name__)


@dataclass
class PretrainData:
    corpus: Corpus
    corpus_stats: dict  # Corpus.stats() plus token counts
    tok: object  # tokenizers.Tokenizer
    train: torch.Tensor  # int32 token streams
    val: torch.Tensor
    test: torch.Tensor
    eos_id: int
    pad_id: int
    mask_id: int
    setup: dict  # data/ and setup/ metrics


def load_tokenizer_json(text: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(text)


def math_corpus(cfg: PretrainConfig, code: Corpus) -> Corpus:
    """The code corpus with the word problems of `dflash.data.math_problems` added as documents: training problems
    in train, held-out problems (a hash split the training stream never yields) in val and test. Its fingerprint
    covers the code corpus's and the generator's settings, so the token cache and a resume tell them apart."""
    from dflash.data.math_problems import SPLIT_SALT, heldout_problems, take, training_problems
    train = take(training_problems(cfg.math_seed), cfg.math_problems)
    heldout = take(heldout_problems(cfg.math_seed), 2 * cfg.math_eval_problems)
    docs = {"train": [Document(f"math/train/{i:07d}", p.text) for i, p in enumerate(train)],
            "val": [Document(f"math/val/{i:07d}", p.text) for i, p in enumerate(heldout[0::2])],
            "test": [Document(f"math/test/{i:07d}", p.text) for i, p in enumerate(heldout[1::2])]}
    fingerprint = hashlib.sha256(f"{code.fingerprint}\0math\0{SPLIT_SALT}\0{cfg.math_seed}\0{cfg.math_problems}\0"
                                 f"{cfg.math_eval_problems}".encode()).hexdigest()
    return Corpus(code.root, docs["train"] + code.train, docs["val"] + code.val, docs["test"] + code.test,
                  fingerprint, code.skipped, code.roots, f"{code.scope}+math")


def prepare_data(cfg: PretrainConfig, tokenizer_json: str | None = None) -> PretrainData:
    """Corpus (with the word problems under data=math), tokenizer (`tokenizer_json` from a checkpoint, else trained)
    and the three token streams."""
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.corpus)
    if cfg.data == "math":
        corpus = math_corpus(cfg, corpus)
    cstats = corpus.stats()
    log.info("corpus: %s", {k: v for k, v in cstats.items() if k not in ("fingerprint", "roots")})
    t1 = time.perf_counter()
    if tokenizer_json is None and cfg.tokenizer_file:
        tokenizer_json = Path(cfg.tokenizer_file).read_text(encoding="utf-8")
    if tokenizer_json is not None:
        tok = load_tokenizer_json(tokenizer_json)
    else:
        tok = train_tokenizer(tokenizer_sample(corpus, cfg.tokenizer_sample_bytes), cfg.vocab_size,
                              cfg.tokenizer_min_frequency, cfg.tokenizer_split_newlines, cfg.tokenizer_split_digits)
    t2 = time.perf_counter()
    tstats: dict = {}
    streams = tokenize_corpus(corpus, tok, cfg.token_cache_dir or None, tstats)
    cstats.update({f"{s}_tokens": tstats[f"{s}_tokens"] for s in ("train", "val", "test")})
    train, val, test = streams["train"], streams["val"], streams["test"]
    if test.numel() < 2:  # tiny corpora (tests): fall back to val, then to train's tail
        test = val if val.numel() >= 2 else train[-cfg.seq_len * 4:]
    if val.numel() < 2:
        val = test
    eos_id, pad_id, mask_id = (tok.token_to_id(t) for t in (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN))
    setup = {"setup/corpus_s": t1 - t0, "setup/tokenizer_s": t2 - t1, "setup/encode_s": time.perf_counter() - t2,
             "setup/token_cache_hit": float(tstats["cache"] == "hit"),
             "data/train_files": float(cstats["train_files"]), "data/train_tokens": float(train.numel()),
             "data/val_tokens": float(val.numel()), "data/test_tokens": float(test.numel()),
             "data/vocab_size": float(tok.get_vocab_size())}
    log.info("tokens: train %d, val %d, test %d (vocab %d; token cache %s) after %.1f s", train.numel(),
             val.numel(), test.numel(), tok.get_vocab_size(), tstats["cache"], time.perf_counter() - t0)
    return PretrainData(corpus, cstats, tok, train, val, test, eos_id, pad_id, mask_id, setup)


class WindowSampler:
    """Fixed-length windows over one token stream: each epoch a fresh random offset and window order."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"the training stream holds {tokens.numel()} tokens, fewer than seq_len + 1 = "
                             f"{seq_len + 1}")
        self.tokens, self.T, self.B, self.seed = tokens, seq_len, batch_size, seed
        self.epoch, self.order, self.cursor = 0, None, 0
        self.ar = torch.arange(seq_len, device=tokens.device)

    def _new_epoch(self) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        offset = int(torch.randint(0, self.T, (1,), generator=g)) if self.tokens.numel() >= 2 * self.T else 0
        n = (self.tokens.numel() - offset) // self.T
        starts = offset + torch.arange(n) * self.T
        self.order = starts[torch.randperm(n, generator=g)].to(self.tokens.device)
        self.cursor = 0

    def next(self) -> torch.Tensor:
        rows = []
        need = self.B
        while need:
            if self.order is None or self.cursor >= len(self.order):
                if self.order is not None:
                    self.epoch += 1
                self._new_epoch()
            take = self.order[self.cursor:self.cursor + need]
            self.cursor += len(take)
            need -= len(take)
            rows.append(take)
        starts = torch.cat(rows)
        return self.tokens[starts[:, None] + self.ar].long()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "started": self.order is not None}

    def load_state_dict(self, state: dict) -> None:
        """The epoch's order is a function of (seed, epoch): rebuilding it puts the sampler where it was."""
        self.epoch, self.order = int(state["epoch"]), None
        if state["started"]:
            self._new_epoch()
            self.cursor = int(state["cursor"])

    @property
    def epochs_done(self) -> float:
        n = len(self.order) if self.order is not None else 1
        return self.epoch + self.cursor / max(n, 1)
