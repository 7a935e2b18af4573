"""An offline Python-code corpus, its token cache, and the byte-level BPE tokenizer trained on it.

Scope (`CorpusConfig.scope`, a registry of root resolvers, `CORPUS_SCOPES`):
- `stdlib` (default, CPU/CI): the running Python's standard library, `sysconfig.get_paths()["stdlib"]`;
- `installed`: the standard library plus every installed package's `.py` files (the interpreter's
  site-packages / dist-packages folders, `site.getsitepackages()` and the user site);
- `root=<dir>` (any scope): that directory alone.
Every `*.py` file under the roots is read, skipping excluded directory names (`site-packages` inside the
stdlib, tests, IDLE, …), files larger than `max_file_bytes` and files that are not valid UTF-8. A file's
path is relative to its root (`json/decoder.py`, `torch/nn/modules/linear.py`), so a standard-library file
has the same path, hence the same split, in both scopes. With `dedup` (default) a file whose content
(sha256 after newline normalization) was already seen is dropped (`skipped["duplicate"]`): roots are read in
order, stdlib first, each in sorted path order, and the first copy wins, so one content sits in one split
only and a held-out file never has a twin in training. Within a root and across roots, the same relative path
is read once (the first root wins).

Split: file-level and deterministic. A file's bucket is `sha256(salt + relative path) mod 10_000`: below
`heldout_per_10k` it is held out, and held-out files are further split in `val` (model selection, periodic
eval) and `test` (the reported numbers). Held-out files are never trained on — neither by the model nor by
the tokenizer. The split depends on the relative path only, so adding or removing other files never moves
a file between splits.

Fingerprint: sha256 over the settings, the Python version (stdlib scopes) and every (split, path, content
sha256) in order; it identifies the exact training data in caches and in the shipped target's
`dflash_target.json`. `Corpus.stats()` records roots, file counts, bytes and what was skipped.

Token cache: `tokenize_corpus(corpus, tok, cache_dir)` encodes every split once (each file followed by
`<|endoftext|>`) and stores the streams in `cache_dir/<key>.tokens`, key = sha256(corpus fingerprint,
tokenizer fingerprint); written atomically with a checksum (`dflash.atomic.save_checked`), so a second run
— or a resumed pretraining job — reads it back, and a corrupt file is rebuilt.

Tokenizer: `train_tokenizer(texts, vocab_size)` trains a byte-level BPE (the `tokenizers` library; GPT-2
style pre-tokenization, so indentation runs become tokens) with the specials `<|endoftext|>` (document
separator, eos), `<|pad|>` and `<|mask|>` (the drafter's mask token) at ids 0, 1, 2. `save_tokenizer`
writes a Hugging Face `PreTrainedTokenizerFast` folder that `AutoTokenizer.from_pretrained(folder,
local_files_only=True)` loads. Training is deterministic for a given text order (checked across processes).
`tokenizer_sample(corpus, max_bytes)` picks the training files the tokenizer learns from, by path hash, so a
corpus of gigabytes trains its tokenizer on a bounded, deterministic sample of the train split.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import site
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

EOS_TOKEN, PAD_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, MASK_TOKEN]  # ids 0, 1, 2
SPLITS = ("train", "val", "test")


@dataclass
class CorpusConfig:
    root: str = ""  # a directory: its files alone; empty → the roots of `scope`
    scope: str = "stdlib"  # stdlib | installed (stdlib + site-packages), see CORPUS_SCOPES
    exclude_dirs: list[str] = field(default_factory=lambda: [
        "site-packages", "dist-packages", "__pycache__", "idlelib", "test", "tests"])
    max_file_bytes: int = 512_000  # larger files are skipped (pydoc_data/topics.py is one big string)
    heldout_per_10k: int = 1000  # share of files held out, in 1/10,000 (1000 = 10%), half val, half test
    salt: str = "dflash-corpus-v1"
    dedup: bool = True  # drop files whose content was already seen (first copy wins)
    limit_files: int = 0  # > 0: only the first n files in sorted order (tests, smoke runs)


# -- roots: one resolver per scope ----------------------------------------------------------------------
def _stdlib_roots() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def _site_package_dirs() -> list[Path]:
    """Every folder installed packages live in for this interpreter, in a fixed order."""
    cands = [sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib")]
    try:
        cands += list(site.getsitepackages())
    except AttributeError:  # virtualenv's old site.py
        pass
    cands.append(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    cands += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return [Path(p) for p in cands if p]


def _installed_roots() -> list[Path]:
    return _stdlib_roots() + _site_package_dirs()


CORPUS_SCOPES: dict[str, Callable[[], list[Path]]] = {"stdlib": _stdlib_roots, "installed": _installed_roots}


def validate_corpus_config(cfg: CorpusConfig) -> None:
    if cfg.scope not in CORPUS_SCOPES:
        raise ValueError(f"corpus.scope={cfg.scope!r} is unknown; expected one of {sorted(CORPUS_SCOPES)}")
    if not 0 <= cfg.heldout_per_10k < 10_000:
        raise ValueError(f"corpus.heldout_per_10k must lie in [0, 10000), got {cfg.heldout_per_10k}")
    if cfg.max_file_bytes <= 0:
        raise ValueError(f"corpus.max_file_bytes must be > 0, got {cfg.max_file_bytes}")
    if cfg.root and not Path(cfg.root).is_dir():
        raise FileNotFoundError(f"corpus.root={cfg.root!r} is not a directory")


def corpus_roots(cfg: CorpusConfig) -> list[Path]:
    """The folders read, in order, resolved and without repeats (a folder inside another is kept: the walk
    of the outer one excludes `site-packages` / `dist-packages`, and a path is read once anyway)."""
    raw = [Path(cfg.root)] if cfg.root else CORPUS_SCOPES[cfg.scope]()
    out: list[Path] = []
    for p in raw:
        r = p.resolve()
        if r.is_dir() and r not in out:
            out.append(r)
    return out


def corpus_root(cfg: CorpusConfig) -> Path:
    """The first root (the only one for `stdlib` or `root=`)."""
    roots = corpus_roots(cfg)
    if not roots:
        raise FileNotFoundError(f"corpus.root={cfg.root!r} / scope={cfg.scope!r}: no directory to read")
    return roots[0]


def _walk(root: Path, excluded: set[str]) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda x: x[0])
    return out


def list_files(cfg: CorpusConfig) -> list[tuple[str, Path]]:
    """(relative POSIX path, absolute path) of every candidate file: roots in order, each sorted by relative
    path; a relative path already listed from an earlier root is skipped."""
    validate_corpus_config(cfg)
    excluded, seen, out = set(cfg.exclude_dirs), set(), []
    for root in corpus_roots(cfg) or [corpus_root(cfg)]:
        for rel, p in _walk(root, excluded):
            if rel not in seen:
                seen.add(rel)
                out.append((rel, p))
    return out[:cfg.limit_files] if cfg.limit_files > 0 else out


def split_of(rel_path: str, heldout_per_10k: int, salt: str) -> str:
    """'train', 'val' or 'test' for a relative path; a pure function of (salt, path)."""
    h = int.from_bytes(hashlib.sha256(f"{salt}\0{rel_path}".encode()).digest()[:8], "big")
    if h % 10_000 >= heldout_per_10k:
        return "train"
    return "val" if (h // 10_000) % 2 == 0 else "test"


# -- the corpus -------------------------------------------------------------------------------------------
@dataclass
class Document:
    path: str  # relative POSIX path
    text: str


@dataclass
class Corpus:
    root: str
    train: list[Document]
    val: list[Document]
    test: list[Document]
    fingerprint: str
    skipped: dict[str, int] = field(default_factory=dict)
    roots: list[str] = field(default_factory=list)
    scope: str = "stdlib"

    @property
    def heldout(self) -> list[Document]:
        return self.val + self.test

    def texts(self, split: str) -> list[str]:
        return [d.text for d in getattr(self, split)]

    def stats(self) -> dict:
        out = {"root": self.root, "roots": list(self.roots), "scope": self.scope, "fingerprint": self.fingerprint,
               "skipped": dict(self.skipped)}
        for s in SPLITS:
            docs = getattr(self, s)
            out[f"{s}_files"] = len(docs)
            out[f"{s}_bytes"] = sum(len(d.text.encode("utf-8")) for d in docs)
        return out


def _read_text(path: Path, max_bytes: int, skipped: dict[str, int]) -> str | None:
    try:
        if path.stat().st_size > max_bytes:
            skipped["too_large"] += 1
            return None
        raw = path.read_bytes()
    except OSError:
        skipped["unreadable"] += 1
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        skipped["empty"] += 1
        return None
    return text


def _fingerprint_seed(cfg: CorpusConfig) -> "hashlib._Hash":
    h = hashlib.sha256()
    h.update(json.dumps({"cfg": {k: v for k, v in asdict(cfg).items() if k != "root"},
                         "python": platform.python_version() if not cfg.root else ""},
                        sort_keys=True).encode())
    return h


def load_corpus(cfg: CorpusConfig | None = None) -> Corpus:
    cfg = cfg or CorpusConfig()
    files = list_files(cfg)  # validates cfg
    roots = corpus_roots(cfg)
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    skipped = {"too_large": 0, "not_utf8": 0, "unreadable": 0, "empty": 0, "duplicate": 0}
    seen: set[str] = set()
    h = _fingerprint_seed(cfg)
    for rel, path in files:
        text = _read_text(path, cfg.max_file_bytes, skipped)
        if text is None:
            continue
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if cfg.dedup and digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        split = split_of(rel, cfg.heldout_per_10k, cfg.salt)
        splits[split].append(Document(rel, text))
        h.update(f"{split}\0{rel}\0{digest}\n".encode())
    if not splits["train"]:
        raise ValueError(f"corpus: no training files under {[str(r) for r in roots]} (exclude_dirs="
                         f"{cfg.exclude_dirs})")
    for s in SPLITS:  # one order for every scope: sorted by path
        splits[s].sort(key=lambda d: d.path)
    return Corpus(str(roots[0]), splits["train"], splits["val"], splits["test"], h.hexdigest(), skipped,
                  [str(r) for r in roots], "root" if cfg.root else cfg.scope)


# -- tokenizer --------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = 4096, min_frequency: int = 2, split_newlines: bool = False,
                    split_digits: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` with SPECIAL_TOKENS at ids 0..2. Deterministic.

    `split_newlines`: every "\n" is a pre-token of its own. GPT-2's pre-tokenization glues a newline to the
    next line's indentation ("\n   " + " return"), so a prompt that ends with "\n" ends on a token that in
    training only ever precedes column-0 text — the model then starts a new top-level `def` instead of the
    function body (seen in the shipped target's continuations, benchmarks/reference_target.md).

    `split_digits`: every digit is a token of its own ("128" is 1, 2, 8), so arithmetic is learned one digit at a
    time instead of over whatever digit groups the BPE happened to merge (the math target's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"tokenizer vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = ([pre_tokenizers.Split("\n", behavior="isolated")] if split_newlines else []) + \
        ([pre_tokenizers.Digits(individual_digits=True)] if split_digits else [])
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [byte_level]) if splits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_sample(corpus: Corpus, max_bytes: int, salt: str = "dflash-tokenizer-sample") -> list[str]:
    """Train texts for the tokenizer: all of them when they fit in `max_bytes` (0 = no cap), else the files
    first in order of sha256(salt, path) until the cap — deterministic, and spread over every package."""
    docs = corpus.train
    if max_bytes <= 0 or sum(len(d.text) for d in docs) <= max_bytes:
        return [d.text for d in docs]
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"{salt}\0{d.path}".encode()).digest())
    out, total = [], 0
    for d in ranked:
        if total >= max_bytes:
            break
        out.append(d.text)
        total += len(d.text)
    return out


def hf_tokenizer(tok, model_max_length: int = 4096):
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer (no BOS, no added specials on encode)."""
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                 mask_token=MASK_TOKEN, model_max_length=model_max_length,
                                 clean_up_tokenization_spaces=False)
    return hf


def save_tokenizer(tok, folder: str | os.PathLike, model_max_length: int = 4096):
    """Writes tokenizer.json + tokenizer_config.json (+ special tokens) into `folder`; returns the HF tokenizer."""
    hf = hf_tokenizer(tok, model_max_length)
    hf.save_pretrained(str(folder))
    return hf


def tokenizer_fingerprint(tok) -> str:
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def encode_documents(tok, texts: list[str], eos_id: int | None = None) -> list[list[int]]:
    """Token ids of each text (batched in Rust), each followed by `eos_id` when given."""
    if eos_id is None:
        eos_id = tok.token_to_id(EOS_TOKEN)
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids = list(enc.ids)
        if eos_id is not None and eos_id >= 0:
            ids.append(eos_id)
        out.append(ids)
    return out


# -- token cache --------------------------------------------------------------------------------------
TOKENS_MAGIC, TOKENS_FORMAT = b"DFLASH-TOKENS\n", 1


def _encode_stream(tok, texts: list[str], eos_id: int, chunk: int = 2048):
    """One int32 stream of all texts (each followed by eos), encoded in chunks so a corpus of gigabytes
    never holds more than one chunk of Python int lists."""
    import torch
    parts, lengths = [], []
    for i in range(0, len(texts), chunk):
        for ids in encode_documents(tok, texts[i:i + chunk], eos_id):
            parts.append(torch.tensor(ids, dtype=torch.int32))
            lengths.append(len(ids))
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return flat, torch.tensor(lengths, dtype=torch.int64)


def token_cache_key(corpus: Corpus, tok) -> str:
    return hashlib.sha256(f"{TOKENS_FORMAT}\0{corpus.fingerprint}\0{tokenizer_fingerprint(tok)}".encode()).hexdigest()


def tokenize_corpus(corpus: Corpus, tok, cache_dir: str | os.PathLike | None = None,
                    stats: dict | None = None) -> dict:
    """{split: int32 token stream} of every split (files in order, each followed by `<|endoftext|>`), read
    from / written to `cache_dir/<key>.tokens` when `cache_dir` is given. `stats` (when given) receives
    `{split}_tokens`, `{split}_files` and `cache` ('hit' | 'miss' | 'off')."""
    from dflash.atomic import load_checked, save_checked
    key = token_cache_key(corpus, tok)
    path = Path(cache_dir) / f"{key[:32]}.tokens" if cache_dir else None
    data = None
    if path is not None and path.is_file():
        try:
            data = load_checked(path, TOKENS_MAGIC, TOKENS_FORMAT, key)
        except (ValueError, OSError, RuntimeError) as e:
            log.warning("token cache %s unusable (%s): re-encoding", path, e)
    cache = "hit" if data is not None else ("miss" if path is not None else "off")
    if data is None:
        eos_id = tok.token_to_id(EOS_TOKEN)
        data = {}
        for s in SPLITS:
            data[s], data[f"{s}_lengths"] = _encode_stream(tok, corpus.texts(s), eos_id)
        if path is not None:
            save_checked(path, TOKENS_MAGIC, TOKENS_FORMAT, key, data)
    if stats is not None:
        stats.update({f"{s}_tokens": int(data[s].numel()) for s in SPLITS})
        stats.update({f"{s}_files": int(data[f"{s}_lengths"].numel()) for s in SPLITS})
        stats["cache"] = cache
    return {s: data[s] for s in SPLITS}
