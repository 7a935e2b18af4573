"""An offline Python-code corpus, and the byte-level BPE tokenizer trained on it.

Corpus: every `*.py` file under a root (default: the running Python's standard library,
`sysconfig.get_paths()["stdlib"]`), skipping excluded directory names (`site-packages`, tests, IDLE, …),
files larger than `max_file_bytes` and files that are not valid UTF-8. Files are listed in sorted order of
their relative POSIX path, so the corpus is the same on every run of the same Python.

Split: file-level and deterministic. A file's bucket is `sha256(salt + relative path) mod 10_000`: below
`heldout_per_10k` it is held out, and held-out files are further split in `val` (model selection, periodic
eval) and `test` (the reported numbers). Held-out files are never trained on — neither by the model nor by
the tokenizer. The split depends on the relative path only, so adding or removing other files never moves
a file between splits.

Fingerprint: sha256 over the settings, the root's Python version and every (split, path, content sha256);
it identifies the exact training data in caches and in the shipped target's `dflash_target.json`.

Tokenizer: `train_tokenizer(texts, vocab_size)` trains a byte-level BPE (the `tokenizers` library; GPT-2
style pre-tokenization, so indentation runs become tokens) with the specials `<|endoftext|>` (document
separator, eos), `<|pad|>` and `<|mask|>` (the drafter's mask token) at ids 0, 1, 2. `save_tokenizer`
writes a Hugging Face `PreTrainedTokenizerFast` folder that `AutoTokenizer.from_pretrained(folder,
local_files_only=True)` loads. Training is deterministic for a given text order (checked across processes).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

EOS_TOKEN, PAD_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, MASK_TOKEN]  # ids 0, 1, 2


@dataclass
class CorpusConfig:
    root: str = ""  # empty → the running Python's standard library
    exclude_dirs: list[str] = field(default_factory=lambda: [
        "site-packages", "dist-packages", "__pycache__", "idlelib", "test", "tests"])
    max_file_bytes: int = 512_000  # larger files are skipped (pydoc_data/topics.py is one big string)
    heldout_per_10k: int = 1000  # share of files held out, in 1/10,000 (1000 = 10%), half val, half test
    salt: str = "dflash-corpus-v1"
    limit_files: int = 0  # > 0: only the first n files in sorted order (tests, smoke runs)


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

    @property
    def heldout(self) -> list[Document]:
        return self.val + self.test

    def texts(self, split: str) -> list[str]:
        return [d.text for d in getattr(self, split)]

    def stats(self) -> dict:
        out = {"root": self.root, "fingerprint": self.fingerprint, "skipped": dict(self.skipped)}
        for s in ("train", "val", "test"):
            docs = getattr(self, s)
            out[f"{s}_files"] = len(docs)
            out[f"{s}_bytes"] = sum(len(d.text.encode("utf-8")) for d in docs)
        return out


def corpus_root(cfg: CorpusConfig) -> Path:
    return Path(cfg.root or sysconfig.get_paths()["stdlib"]).resolve()


def list_files(cfg: CorpusConfig) -> list[tuple[str, Path]]:
    """(relative POSIX path, absolute path) of every candidate file, sorted by relative path."""
    root = corpus_root(cfg)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus.root={str(root)!r} is not a directory")
    excluded = set(cfg.exclude_dirs)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda x: x[0])
    return out[:cfg.limit_files] if cfg.limit_files > 0 else out


def split_of(rel_path: str, heldout_per_10k: int, salt: str) -> str:
    """'train', 'val' or 'test' for a relative path; a pure function of (salt, path)."""
    h = int.from_bytes(hashlib.sha256(f"{salt}\0{rel_path}".encode()).digest()[:8], "big")
    if h % 10_000 >= heldout_per_10k:
        return "train"
    return "val" if (h // 10_000) % 2 == 0 else "test"


def load_corpus(cfg: CorpusConfig | None = None) -> Corpus:
    cfg = cfg or CorpusConfig()
    if not 0 <= cfg.heldout_per_10k < 10_000:
        raise ValueError(f"corpus.heldout_per_10k must lie in [0, 10000), got {cfg.heldout_per_10k}")
    root = corpus_root(cfg)
    splits: dict[str, list[Document]] = {"train": [], "val": [], "test": []}
    skipped = {"too_large": 0, "not_utf8": 0, "empty": 0}
    h = hashlib.sha256()
    h.update(json.dumps({"cfg": {k: v for k, v in asdict(cfg).items() if k != "root"},
                         "python": platform.python_version() if not cfg.root else ""},
                        sort_keys=True).encode())
    for rel, path in list_files(cfg):
        try:
            if path.stat().st_size > cfg.max_file_bytes:
                skipped["too_large"] += 1
                continue
            raw = path.read_bytes()
        except OSError:
            skipped["not_utf8"] += 1  # unreadable counts with undecodable
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if not text.strip():
            skipped["empty"] += 1
            continue
        split = split_of(rel, cfg.heldout_per_10k, cfg.salt)
        splits[split].append(Document(rel, text))
        h.update(f"{split}\0{rel}\0{hashlib.sha256(text.encode('utf-8')).hexdigest()}\n".encode())
    if not splits["train"]:
        raise ValueError(f"corpus: no training files under {str(root)!r} (exclude_dirs={cfg.exclude_dirs})")
    return Corpus(str(root), splits["train"], splits["val"], splits["test"], h.hexdigest(), skipped)


# -- tokenizer --------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = 4096, min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` with SPECIAL_TOKENS at ids 0..2. Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"tokenizer vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


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
