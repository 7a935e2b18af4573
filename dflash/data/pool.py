"""The training prompt pool (docs/data.md, "Prompt pool"): prompts like the ones users evaluate on, from the TRAIN
split only.

Two kinds, mixed by `data.pool.headers_frac`:
- `header`: a function or class header with its docstring (`dflash.data.prompts.header_prompts`, found with
  `ast`), the shape of the eval suites' prompts, so the eval prompts are in the training distribution without
  being in the training data;
- `header_body` (`header_cuts` > 0): the same header and docstring followed by the first lines of its body, cut at
  `header_cuts` evenly spaced points (`dflash.data.prompts.body_cuts`): more eval-shaped prompts per definition,
  each continued into a distinct sequence; they count as headers in `headers_frac`;
- `chunk`: a plain chunk of a training file, starting at a line start drawn from a seeded generator, of
  `chunk_min_len..chunk_max_len` tokens.

With `data.pool.source=math` (conf/data/math.yaml, the math target's task) the pool is instead the word problems of
the math generator's TRAIN stream (`dflash.data.math_problems.training_problems`, held-out problems never among
them), each its "Problem: …\nSolution:\n" prompt (kind `math`): the target writes the worked solution, as a served
model answers a user's question, so the drafter trains on the target's own answers to the task it is evaluated on.
Without it, a run on the math target with online data would train on the math target's continuations of Python
code (a 2026-12-06 campaign did: every drafter below prompt lookup on the math suite).

A prompt is a token list of at most `max_prompt_len` tokens (longer header prompts are left out: a cut
docstring is not an eval-shaped prompt). The pool is deterministic for (corpus, tokenizer, settings); its
fingerprint keys every cache built on it (the online writer's shards). Building it reads only the train
split's text (headers parsed per file, chunks tokenized from a window of their file), and the result is cached
under `cache_dir` by fingerprint, written atomically and checksummed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash.atomic import load_checked, save_checked
from dflash.errors import ConfigError
from dflash.data.corpus import Corpus
from dflash.data.prompts import CUT_MARK, parallel_header_prompts

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"DFLASH-POOL\n"
KINDS = ("header", "header_body", "chunk", "math")
POOL_SOURCES = ("corpus", "math")
MATH_POOL_SIZE = 50_000  # `size` 0 with source math: distinct problems enough for 12 M written tokens at reuse 2


@dataclass
class PoolConfig:
    headers_frac: float = 0.5  # share of the pool that is header + docstring prompts; the rest file chunks
    size: int = 0  # prompts in the pool; 0: every header prompt of the train split plus chunks to the mix
    max_prompt_len: int = 192  # tokens; longer header prompts are left out
    chunk_min_len: int = 16  # tokens of a plain file-chunk prompt, drawn uniformly in [min, max]
    chunk_max_len: int = 128
    seed: int = 0  # chunk positions and the selection when `size` is below what the corpus offers
    # > 0: up to this many more prompts per header prompt, its body cut after evenly spaced lines (`header_body`):
    # the stdlib train split has 5,148 header prompts, 4.6% of a 112,000-prompt pool (benchmarks/ABLATIONS.md)
    header_cuts: int = 0
    cache_dir: str = ".cache/dflash/pool"  # empty: no disk cache
    # corpus: the code corpus's train split (the kinds above); math: the math generator's training problems
    source: str = "corpus"


def validate_pool_config(cfg: PoolConfig) -> None:
    if cfg.source not in POOL_SOURCES:
        raise ValueError(f"data.pool.source must be one of {', '.join(POOL_SOURCES)}, got {cfg.source!r}")
    if not 0.0 <= cfg.headers_frac <= 1.0:
        raise ValueError(f"data.pool.headers_frac must lie in [0, 1], got {cfg.headers_frac}")
    if cfg.headers_frac == 0.0 and cfg.size <= 0:
        raise ValueError("data.pool.size must be > 0 when data.pool.headers_frac is 0 (chunks only: how many?)")
    if isinstance(cfg.header_cuts, bool) or not isinstance(cfg.header_cuts, int) or cfg.header_cuts < 0:
        raise ValueError(f"data.pool.header_cuts must be an integer >= 0 (0: none), got {cfg.header_cuts!r}")
    if cfg.size < 0:
        raise ValueError(f"data.pool.size must be >= 0 (0: derived from the corpus), got {cfg.size}")
    if cfg.max_prompt_len < 1:
        raise ValueError(f"data.pool.max_prompt_len must be >= 1, got {cfg.max_prompt_len}")
    if cfg.source == "corpus" and not 1 <= cfg.chunk_min_len <= cfg.chunk_max_len <= cfg.max_prompt_len:
        raise ValueError(f"data.pool: need 1 <= chunk_min_len <= chunk_max_len <= max_prompt_len, got "
                         f"{cfg.chunk_min_len} / {cfg.chunk_max_len} / {cfg.max_prompt_len}")


class TokenLists(Sequence):
    """Token lists kept as one flat int32 tensor and their offsets; item i is a fresh list[int]. As a list of
    Python lists, each token is an int object and a pointer (36 bytes, not 4): the installed corpus's 190,140
    prompts (13.5 M tokens) cost every online run, sweep worker and write-ahead a few hundred MiB."""

    def __init__(self, flat: torch.Tensor, lengths: Sequence[int]):
        self.flat = flat.to(torch.int32).contiguous()
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                                  torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)])
        if int(self.offsets[-1]) != self.flat.numel():
            raise ValueError(f"TokenLists: lengths sum to {int(self.offsets[-1])}, the tokens are {self.flat.numel()}")

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]]) -> "TokenLists":
        return cls(torch.tensor([t for x in lists for t in x], dtype=torch.int32), [len(x) for x in lists])

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        return self.flat[int(self.offsets[i]):int(self.offsets[i + 1])].tolist()

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenLists):
            return torch.equal(self.offsets, other.offsets) and torch.equal(self.flat, other.flat)
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal by content, like a list

    def lengths(self) -> list[int]:
        return self.offsets.diff().tolist()


@dataclass
class PromptPool:
    prompts: Sequence[list[int]]  # TokenLists when built here
    kinds: list[str]  # "header" | "header_body" | "chunk", one per prompt
    fingerprint: str
    corpus_fingerprint: str
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, batched where the tokenizer can (a fast HF tokenizer encodes in Rust)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast HF tokenizer's Rust tokenizer: the same ids
    if backend is not None:  # without transformers' per-text conversion (1.47x on the installed pool's texts, 2 cores)
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # a Hugging Face tokenizer
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [list(tokenizer.encode(t)) for t in texts]


def pool_fingerprint(corpus_fingerprint: str, tokenizer_identity: str, cfg: PoolConfig) -> str:
    # header_cuts and source only when set: a pool without them keeps the fingerprint (and shards) it had before
    skip = {"cache_dir"} | ({"header_cuts"} if not cfg.header_cuts else set()) | (
        {"source"} if cfg.source == "corpus" else set())
    payload = {"format": FORMAT_VERSION, "corpus": corpus_fingerprint, "tokenizer": tokenizer_identity,
               "cfg": {k: v for k, v in asdict(cfg).items() if k not in skip}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _header_prompts(corpus: Corpus, tokenizer, cfg: PoolConfig) -> tuple[list[list[int]], list[str]]:
    """The header (and, with `header_cuts`, header_body) prompts of the train split and their kinds."""
    named = parallel_header_prompts([(doc.text, doc.path + ":") for doc in corpus.train], cuts=cfg.header_cuts)
    ids = encode_many(tokenizer, [p for _, p in named])
    keep = [i for i, x in enumerate(ids) if 0 < len(x) <= cfg.max_prompt_len]
    return [ids[i] for i in keep], ["header_body" if CUT_MARK in named[i][0] else "header" for i in keep]


def _chunk_prompts(corpus: Corpus, tokenizer, n: int, cfg: PoolConfig) -> list[list[int]]:
    """`n` chunks, each from a seeded train file at a seeded line start; a chunk that comes out shorter than
    `chunk_min_len` (the file ends) is drawn again elsewhere."""
    rng = random.Random(cfg.seed * 1_000_003 + 17)
    docs = [d for d in corpus.train if d.text.strip()]
    out: list[list[int]] = []
    for _ in range(20):  # rounds of redraws for the chunks that came out short
        if len(out) >= n:
            break
        want = [(rng.choice(docs), rng.randint(cfg.chunk_min_len, cfg.chunk_max_len)) for _ in range(n - len(out))]
        windows = []
        for doc, length in want:
            s = doc.text.find("\n", rng.randrange(len(doc.text))) + 1  # the next line start (0: wraps)
            windows.append(doc.text[s:s + 8 * length + 64])  # ample characters for `length` tokens
        for ids, (_, length) in zip(encode_many(tokenizer, windows), want):
            if len(ids) >= max(length, cfg.chunk_min_len):
                out.append(ids[:length])
    if len(out) < n:
        raise ConfigError(f"data.pool: could draw only {len(out)} of {n} file-chunk prompts of >= "
                         f"{cfg.chunk_min_len} tokens from the train split")
    return out


def _mix(headers: list[list[int]], kinds: list[str], cfg: PoolConfig, corpus: Corpus,
         tokenizer) -> tuple[list, list]:
    rng = random.Random(cfg.seed * 1_000_003 + 5)
    f = cfg.headers_frac
    if cfg.size > 0:
        n_h = min(round(cfg.size * f), len(headers))
        n_c = cfg.size - n_h if f < 1.0 else 0
        if n_h < len(headers):
            picked = sorted(rng.sample(range(len(headers)), n_h))
            headers, kinds = [headers[i] for i in picked], [kinds[i] for i in picked]
    else:
        n_c = round(len(headers) * (1 - f) / f)
    if f > 0 and not headers:
        raise ConfigError("data.pool.max_prompt_len: the train split has no function / class with a docstring of <= "
                         f"{cfg.max_prompt_len} tokens (headers_frac={f} asks for them)")
    chunks = _chunk_prompts(corpus, tokenizer, n_c, cfg) if n_c else []
    return headers + chunks, kinds + ["chunk"] * len(chunks)


def math_generator_fingerprint(seed: int, n: int = 64) -> str:
    """The math generator's identity: a hash of its first `n` training prompts (a change to how problems are
    written changes it, so a pool cached from the old generator is not reused)."""
    from dflash.data.math_problems import take, training_problems
    text = "\0".join(p.prompt for p in take(training_problems(seed), n))
    return "math:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _math_prompts(tokenizer, cfg: PoolConfig) -> tuple[list[list[int]], list[str]]:
    from dflash.data.math_problems import take, training_problems
    ids = encode_many(tokenizer, [p.prompt for p in take(training_problems(cfg.seed), cfg.size or MATH_POOL_SIZE)])
    keep = [x for x in ids if 0 < len(x) <= cfg.max_prompt_len]
    if not keep:
        raise ConfigError(f"data.pool.max_prompt_len={cfg.max_prompt_len}: no math problem's prompt is that short")
    return keep, ["math"] * len(keep)


def pool_for(data_cfg, tokenizer, tokenizer_identity: str) -> PromptPool:
    """The online writer's pool for a run's `data` config: the code corpus's (loaded here) or the math
    generator's (`data.pool.source`)."""
    if data_cfg.pool.source == "math":
        return build_prompt_pool(None, tokenizer, data_cfg.pool, tokenizer_identity)
    from dflash.data.corpus import load_corpus
    return build_prompt_pool(load_corpus(data_cfg.corpus), tokenizer, data_cfg.pool, tokenizer_identity)


def build_prompt_pool(corpus: Corpus | None, tokenizer, cfg: PoolConfig, tokenizer_identity: str) -> PromptPool:
    """The pool for `corpus`'s TRAIN split (held-out files never reach it), or with `cfg.source` math the math
    generator's training problems (`corpus` unused), cached by fingerprint."""
    validate_pool_config(cfg)
    math = cfg.source == "math"
    if not math and corpus is None:
        raise ValueError("build_prompt_pool: data.pool.source=corpus needs a corpus")
    source_fp = math_generator_fingerprint(cfg.seed) if math else corpus.fingerprint
    key = pool_fingerprint(source_fp, tokenizer_identity, cfg)
    path = Path(cfg.cache_dir) / f"pool-{key[:32]}.pt" if cfg.cache_dir else None
    if path is not None and path.is_file():
        try:
            data = load_checked(path, _MAGIC, FORMAT_VERSION, key)
            prompts = TokenLists(data["tokens"], [int(n) for n in data["lengths"]])
            return PromptPool(prompts, list(data["kinds"]), key, source_fp, dict(data["stats"]))
        except Exception as e:  # noqa: BLE001 - torn, corrupt or foreign: rebuild
            log.warning("prompt pool: cache file %s unusable (%s); rebuilding", path, e)
    if math:
        prompts, kinds = _math_prompts(tokenizer, cfg)
    else:
        headers, header_kinds = _header_prompts(corpus, tokenizer, cfg)
        prompts, kinds = _mix(headers, header_kinds, cfg, corpus, tokenizer)
    stats = {"prompts": len(prompts), "header_prompts": kinds.count("header"),
             "header_body_prompts": kinds.count("header_body"),
             "chunk_prompts": kinds.count("chunk"), "math_prompts": kinds.count("math"),
             "train_files": 0 if math else len(corpus.train),
             "mean_prompt_len": sum(map(len, prompts)) / max(len(prompts), 1)}
    prompts = TokenLists.from_lists(prompts)
    if path is not None:  # int64 on disk, as before: existing caches stay valid
        save_checked(path, _MAGIC, FORMAT_VERSION, key, {"lengths": prompts.lengths(),
                                                         "tokens": prompts.flat.to(torch.int64),
                                                         "kinds": kinds, "stats": stats})
    if math:
        log.info("prompt pool: %d math problems of the generator's training stream", len(prompts))
    else:
        log.info("prompt pool: %d prompts (%d header + docstring, %d more cut into their body, %d file chunks) from "
                 "%d train files", len(prompts), stats["header_prompts"], stats["header_body_prompts"],
                 stats["chunk_prompts"], len(corpus.train))
    return PromptPool(prompts, kinds, key, source_fp, stats)
