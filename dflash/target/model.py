"""The frozen target: any local Hugging Face causal LM, or a tiny random hybrid built from config.

Gives the drafter what it trains on (docs/DESIGN.md, "The drafter"): hidden states at `layer_ids` (decoder-layer
*outputs*: HF `hidden_states[id + 1]`), the target's greedy labels, and optionally its top-k logits as soft labels.
Everything runs under `torch.no_grad()` with `requires_grad=False` parameters.

Nothing is ever fetched from a hub: a real target is a local folder (`target.path`), loaded with
`local_files_only=True`. `*ForConditionalGeneration` checkpoints with a nested `text_config`
(Qwen3.5/3.6) load as their text-only causal LM.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, fields as dataclass_fields
from pathlib import Path

import torch

from dflash.devices import resolve_device, resolve_dtype
from dflash.registry import Registry
from dflash.target.assets import ASSETS, asset_folder, shipped_folder  # noqa: F401 - ASSETS: imported from here
from dflash.target.fused import FUSED_OPS, FusedForward, resolve_fused_ops
from dflash.target.kernels import preflight_kernels
from dflash.target.lm_head import resolve_chunk


log = logging.getLogger(__name__)


@dataclass
class TinyTargetSpec:
    """A tiny random hybrid target (Gated DeltaNet : full attention = 3 : 1) for CPU runs and tests."""
    model_type: str = "qwen3_5"  # qwen3_5 | qwen3_next
    vocab_size: int = 260  # bytes 0..255 + bos/eos/pad/mask
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 32
    seed: int = 1234
    # The context length and RoPE base the config records (a random stand-in for a real target records that
    # target's: Qwen3.6-27B 262,144 and 1e7; the drafter's RoPE and its serving context length follow them).
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25  # the attention layers' rotary share (Qwen3.5 / Qwen3-Next: a quarter)


@dataclass
class TargetConfig:
    name: str = "tiny_random"
    path: str = ""  # local checkpoint folder; empty → build `random`
    random: TinyTargetSpec = field(default_factory=TinyTargetSpec)
    layer_ids: list[int] = field(default_factory=list)  # empty → evenly spaced 1 .. n_layers-3
    mask_token_id: int = -1  # -1 → the byte tokenizer's mask token (random targets only)
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    soft_top_k: int = 64  # top-k target logits kept as soft labels (losses that need them)
    tokenizer: str = "auto"  # auto: the checkpoint's tokenizer, else bytes; bytes; or a tokenizer folder (builtin:NAME)
    lm_head_chunk: int = 0  # positions per LM-head chunk when computing labels; 0 = auto (target/lm_head.py)
    fused_ops: str = "auto"  # the producer's forward: compile (fused norms / MLP) | eager | off | auto (compile on CUDA)


class ByteTokenizer:
    """Byte-level tokenizer for the random target: ids 0..255 are bytes, then bos, eos, pad, mask."""
    vocab_size = 260
    bos_token_id, eos_token_id, pad_token_id, mask_token_id = 256, 257, 258, 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


@dataclass
class TargetInfo:
    """What validation needs, read without loading weights."""
    num_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str


def checkpoint_path(cfg: TargetConfig) -> str:
    """`target.path`, with `builtin:NAME` meaning a checkpoint shipped in the package (dflash/assets/NAME, its packed
    weights unpacked once into the user's cache: `dflash.target.assets.shipped_folder`)."""
    if cfg.path.startswith("builtin:"):
        return str(shipped_folder(cfg.path.removeprefix("builtin:")))
    return cfg.path


def tokenizer_path(cfg: TargetConfig) -> str:
    """`target.tokenizer` as a folder (`builtin:NAME`: dflash/assets/NAME), when it names one. The asset folder as
    committed: its tokenizer files are the ones `checkpoint_path` copies beside the unpacked weights, and reading
    them needs no weights unpacked."""
    return str(asset_folder(cfg.tokenizer.removeprefix("builtin:"))) if cfg.tokenizer.startswith("builtin:") \
        else cfg.tokenizer


def text_config_dict(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("text_config") or cfg


def read_target_info(cfg: TargetConfig) -> TargetInfo:
    if not cfg.path:
        r = cfg.random
        return TargetInfo(r.num_layers, r.hidden_size, r.vocab_size, r.model_type)
    path = Path(checkpoint_path(cfg))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path={cfg.path!r}: no config.json there (expected a local "
                                f"Hugging Face checkpoint folder; nothing is downloaded)")
    t = text_config_dict(path)
    return TargetInfo(int(t["num_hidden_layers"]), int(t["hidden_size"]), int(t["vocab_size"]),
                      str(t.get("model_type", "?")))


def default_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """Evenly spaced from layer 1 to n_layers − 3 (Qwen3.6-27B, 64 layers → [1, 16, 31, 46, 61])."""
    lo, hi = 1, num_target_layers - 3
    if hi <= lo:
        return sorted({min(lo, num_target_layers - 1)})
    count = min(count, hi - lo + 1)
    return [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)] if count > 1 else [lo]


def resolve_layer_ids(cfg: TargetConfig, info: TargetInfo) -> list[int]:
    return list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(info.num_layers)


TARGET_META = "dflash_target.json"  # written beside the weights by experiments.pretrain_target


def read_target_meta(path: str | os.PathLike) -> dict:
    """The `dflash_target.json` of a target folder ({} when absent)."""
    p = Path(path) / TARGET_META
    return json.loads(p.read_text()) if p.is_file() else {}


def resolve_mask_token(cfg: TargetConfig) -> int:
    if cfg.mask_token_id >= 0:
        return cfg.mask_token_id
    if cfg.path:
        meta = read_target_meta(checkpoint_path(cfg))
        if meta:
            return int(meta["mask_token_id"])
        raise ValueError("target.mask_token_id must be set (>= 0) for a checkpoint target")
    return ByteTokenizer.mask_token_id


def validate_target_config(cfg: TargetConfig) -> TargetInfo:
    if not cfg.path:
        TINY_TARGETS.check(cfg.random.model_type)
    else:
        from dflash.safe_load import pickled_weights
        pickled = pickled_weights(checkpoint_path(cfg))
        if pickled:
            raise ValueError(f"target.path={cfg.path}: {pickled[0]} holds pickled weights, which dflash never "
                             f"loads (unpickling can run code); dflash reads *.safetensors weights only: "
                             f"convert the checkpoint to safetensors ({', '.join(pickled)})")
    info = read_target_info(cfg)
    ids = resolve_layer_ids(cfg, info)
    bad = [i for i in ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(f"target.layer_ids {bad} lie outside the target's {info.num_layers} layers "
                         f"(valid: 0..{info.num_layers - 1})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target.layer_ids {ids} contain duplicates")
    mask = resolve_mask_token(cfg)
    if not 0 <= mask < info.vocab_size:
        raise ValueError(f"target.mask_token_id={mask} lies outside the vocabulary (size {info.vocab_size})")
    if cfg.tokenizer not in ("auto", "bytes") and not Path(tokenizer_path(cfg)).is_dir():
        raise ValueError(f"target.tokenizer={cfg.tokenizer!r}: expected auto, bytes or a tokenizer folder "
                         f"(builtin:NAME for one shipped in dflash/assets)")
    if cfg.soft_top_k < 0:
        raise ValueError(f"target.soft_top_k must be >= 0, got {cfg.soft_top_k}")
    if cfg.lm_head_chunk < 0:
        raise ValueError(f"target.lm_head_chunk must be >= 1, or 0 for auto; got {cfg.lm_head_chunk}")
    if cfg.fused_ops != "auto":
        FUSED_OPS.check(cfg.fused_ops)
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"target.dtype={cfg.dtype!r}; expected auto, float32, bfloat16 or float16")
    return info


# -- the target ---------------------------------------------------------------------------------
@dataclass
class TargetBatch:
    features_BTLH: torch.Tensor  # hidden states at the selected layers
    labels_BT: torch.Tensor  # target argmax at each position (= its prediction of token t+1)
    soft_vals_BTk: torch.Tensor | None = None  # top-k target logits (float32)
    soft_idx_BTk: torch.Tensor | None = None


def tiny_hf_config(spec: TinyTargetSpec):
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  head_dim=spec.head_dim, linear_num_key_heads=spec.linear_num_key_heads,
                  linear_num_value_heads=spec.linear_num_value_heads,
                  linear_key_head_dim=spec.linear_head_dim, linear_value_head_dim=spec.linear_head_dim,
                  max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta),
                                   "partial_rotary_factor": float(spec.partial_rotary_factor)},
                  bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
                  pad_token_id=ByteTokenizer.pad_token_id)
    return TINY_TARGETS.build(spec.model_type, common)


def _qwen3_5_config(common: dict):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**common)


def _qwen3_next_config(common: dict):
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=64, decoder_sparse_step=1)


# target.random.model_type -> the Hugging Face config of a tiny random target, from the shared fields.
TINY_TARGETS: Registry = Registry("target.random.model_type", {
    "qwen3_5": _qwen3_5_config,
    "qwen3_next": _qwen3_next_config,
})


def build_random_model(spec: TinyTargetSpec, device: torch.device | None = None,
                       dtype: torch.dtype = torch.float32):
    """Random weights built directly on `device` in `dtype` (a 27B-shaped target is 54 GB in bf16: it
    must never pass through host memory in float32). Seeded, so CPU builds are reproducible."""
    from transformers import AutoModelForCausalLM
    hf_cfg = tiny_hf_config(spec)
    device = device or torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(spec.seed)
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)


class _ReleasedLayer(torch.nn.Module):
    """A decoder layer whose weights `Target.release_decoder_layers` freed."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"target decoder layer {self.index} was released (Target.release_decoder_layers): this "
                           f"target serves a drafter-only bench and runs no forward")


class Target:
    def __init__(self, cfg: TargetConfig):
        self.cfg = cfg
        info = validate_target_config(cfg)
        self.info = info
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kernels = preflight_kernels(info.model_type, self.device)
        self.layer_ids = resolve_layer_ids(cfg, info)
        self.mask_token_id = resolve_mask_token(cfg)
        self.model = self._load().to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.decoder = self.model.get_decoder()
        self.fused = FusedForward(self.model, resolve_fused_ops(cfg.fused_ops, self.device))
        self.tokenizer = self._tokenizer()
        self.identity = self._identity()
        self.fingerprint = target_fingerprint(cfg)
        # One forward at a time per target: producers share the device's default stream anyway, and
        # Triton's autotuner (FLA kernels) is not thread-safe — two threads tuning the same kernel race.
        self.lock = threading.Lock()  # taken through `target_lock(target)` by every other forward of it
        self._own_masks_failed = False  # `causal_masks` met a create_causal_mask it cannot call
        self.busy_s, self.tokens_done = 0.0, 0  # forward time and tokens, for perf/target_tok_s
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # GPU forwards not yet timed

    def release_decoder_layers(self) -> float:
        """Frees the decoder layers' weights and keeps the embedding, the final norm and the LM head: all that a
        drafter's training step reads of its target when its features are given (the drafter-only bench,
        dflash/bench/runner.py). A 27B target's layers are 50 GiB of a GPU that the drafter's step then has to
        itself. Any later forward through the decoder raises. Returns the GiB freed."""
        layers = self.decoder.layers
        freed = sum(p.numel() * p.element_size() for p in layers.parameters()) / 2**30
        self.fused.remove()  # its saved forwards hold the layers' modules
        self.fused = FusedForward(self.model, "off")
        for i in range(len(layers)):
            layers[i] = _ReleasedLayer(i)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def set_fused_ops(self, name: str) -> None:
        """`target.fused_ops` changed in place (the bench's before / after on one target's weights)."""
        mode = resolve_fused_ops(name, self.device)
        if mode != self.fused.mode:
            self.fused.remove()
            self.fused = FusedForward(self.model, mode)

    def _load(self):
        if not self.cfg.path:
            return build_random_model(self.cfg.random, self.device, self.dtype)
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(checkpoint_path(self.cfg), local_files_only=True,
                                                    dtype=self.dtype)

    def _tokenizer(self):
        if self.cfg.tokenizer not in ("auto", "bytes"):  # a tokenizer folder of its own (builtin:NAME: shipped)
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(tokenizer_path(self.cfg), local_files_only=True)
            tok.model_max_length = 1 << 30
            return tok
        if self.cfg.path and self.cfg.tokenizer == "auto":
            from transformers import AutoTokenizer
            try:
                tok = AutoTokenizer.from_pretrained(checkpoint_path(self.cfg), local_files_only=True)
                tok.model_max_length = 1 << 30  # whole corpus files are encoded, then cut into sequences
                return tok
            except (OSError, ValueError) as e:
                log.warning("target.path has no usable tokenizer (%s); using bytes", e)
        return ByteTokenizer()

    def _identity(self) -> str:
        """Stable identity for caches and ground-truth keys: each weights file's name, size and content digest
        (`_file_digest`) with the tokenizer's files, or the random spec. Not the folder's path: the same
        checkpoint in another checkout (a GPU machine's copy of the repo, a moved models folder) is the same
        target, and its pinned ground truth and caches must match there (campaign cells of two machines were
        unpaired when keys differed)."""
        if not self.cfg.path:  # a tokenizer folder of its own changes what every prompt's text encodes to
            tok = "" if self.cfg.tokenizer in ("auto", "bytes") else f":tokenizer={self.cfg.tokenizer}"
            return f"random:{self.cfg.random}{tok}"
        folder = Path(checkpoint_path(self.cfg))
        files = sorted(folder.glob("*.safetensors")) + [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
        stamp = [(f.name, f.stat().st_size, _file_digest(f)) for f in files]
        tok = "" if self.cfg.tokenizer in ("auto",) else f":tokenizer={self.cfg.tokenizer}"
        return f"checkpoint:{stamp}{tok}"

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def forward_features(self, input_ids_BT: torch.Tensor, soft_top_k: int = 0) -> TargetBatch:
        """Target forward: selected-layer features, greedy labels and optional top-k soft labels."""
        input_ids_BT = input_ids_BT.to(self.device)
        with self.lock:
            t0 = time.perf_counter()
            cuda = input_ids_BT.is_cuda
            if cuda:  # timed by CUDA events read at the next log interval, not a host sync per forward: a
                # sync here idles the GPU while the host then builds the drafter's batch
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            with self.fused.scope():
                out = self.decoder(input_ids=input_ids_BT, output_hidden_states=True, use_cache=False,
                                   attention_mask=self.causal_masks(input_ids_BT))
            feats = torch.stack([out.hidden_states[i + 1] for i in self.layer_ids], dim=2)
            labels, vals, idx = self.labels_from_hidden(out.last_hidden_state, soft_top_k)
            if cuda:
                end.record()
                self._timings.append((start, end))
                if len(self._timings) > 256:  # long done by now: bound the list where nobody reads it
                    self._resolve_timings(128)
            else:
                self.busy_s += time.perf_counter() - t0
            self.tokens_done += input_ids_BT.numel()
        return TargetBatch(feats, labels, vals, idx)

    def causal_masks(self, input_ids_BT: torch.Tensor) -> dict | None:
        """The decoder's mask mapping for a causal batch without padding, made as transformers makes it but without
        position ids: given them (the decoder makes its own), it checks the batch for packed sequences with an
        `.all()` — a host sync on every target forward, which stalled the inline producer until the drafter's
        queued step had drained (`benchmarks/profile_run.py`). Right-padded rows need no mask: causal."""
        if self._own_masks_failed:
            return None
        from transformers.masking_utils import create_causal_mask
        params = _mask_arg_names()
        shape_only = torch.empty(*input_ids_BT.shape, 0, dtype=self.dtype, device=input_ids_BT.device)
        kw = {"config": self.decoder.config, "attention_mask": None, "position_ids": None,
              ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): shape_only}
        # the cache's one name: transformers 5.25 renamed past_key_values to cache and warns when both are given
        cache_arg = next((name for name in ("cache", "past_key_values") if name in params), None)
        if cache_arg:
            kw[cache_arg] = None
        if "cache_position" in params:
            kw["cache_position"] = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)
        try:
            full = create_causal_mask(**kw)
        except TypeError as e:  # another signature: the decoder makes its own masks (and syncs)
            self._own_masks_failed = True
            log.warning("target masks made by transformers (create_causal_mask(%s): %s)", ", ".join(params), e)
            return None
        return {"full_attention": full, "linear_attention": None}

    def _resolve_timings(self, n: int | None = None) -> None:
        done, self._timings = self._timings[:n], self._timings[len(self._timings[:n]):]
        for start, end in done:
            end.synchronize()
            self.busy_s += start.elapsed_time(end) / 1e3

    def forward_stats(self) -> tuple[int, float]:
        """(tokens, seconds) of `forward_features` so far (GPU time on CUDA; waits for the last forward)."""
        with self.lock:
            self._resolve_timings()
            return self.tokens_done, self.busy_s

    def labels_from_hidden(self, last_BTH: torch.Tensor, soft_top_k: int):
        """LM head in chunks of positions: the full [T, V] logits of a 250k vocabulary never live at once. The argmax
        and top-k read the head's own dtype (bf16 on a GPU): upcasting first gave the same values (bf16 → float32 is
        exact) for a [chunk, V] float32 copy and a float32 read (~1 ms per 2,048 tokens at V = 248,320)."""
        head = self.lm_head_weight()
        B, T, _ = last_BTH.shape
        flat = last_BTH.reshape(B * T, -1)
        k = min(soft_top_k, self.vocab_size)
        labels, vals, idx = [], [], []
        chunk = resolve_chunk(self.cfg.lm_head_chunk, head.shape[0], head.device)
        for s in range(0, B * T, chunk):
            logits = flat[s:s + chunk] @ head.T
            labels.append(logits.argmax(-1))
            if k:
                v, i = logits.topk(k, dim=-1)
                vals.append(v.float())
                idx.append(i)
        lab = torch.cat(labels).view(B, T)
        if not k:
            return lab, None, None
        return lab, torch.cat(vals).view(B, T, k), torch.cat(idx).view(B, T, k)

    def logits(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids_BT.to(self.device)).logits


@functools.cache
def _mask_arg_names() -> tuple[str, ...]:
    """create_causal_mask's argument names, which changed across transformers 5.x (5.17: `past_key_values`,
    5.24: `cache`)."""
    import inspect

    from transformers.masking_utils import create_causal_mask
    return tuple(inspect.signature(create_causal_mask).parameters)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


def _file_digest(path: Path, limit: int = 1 << 20) -> str:
    """Content hash of the first MiB and the size: a changed checkpoint misses caches, a fresh clone
    (new mtimes, same bytes) does not."""
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(limit)).hexdigest()[:16]


def _head_tail_digest(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of the size, the first and the last MiB: cheap on a 50 GB checkpoint, and two trainings of one
    shape (same size, same header) differ in their tensors' bytes at both ends."""
    import hashlib
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        f.seek(max(path.stat().st_size - chunk, 0))
        h.update(f.read(chunk))
    return h.hexdigest()


_LATER_SPEC_FIELDS = ("max_position_embeddings", "rope_theta", "partial_rotary_factor")


def _spec_identity(spec: TinyTargetSpec) -> str:
    """The spec as its dataclass repr, less fields added later while they hold their defaults: a random
    target's fingerprint stays what it was for drafters trained before those fields existed."""
    kept = [f for f in dataclass_fields(spec)
              if not (f.name in _LATER_SPEC_FIELDS and getattr(spec, f.name) == f.default)]
    return f"{type(spec).__name__}(" + ", ".join(f"{f.name}={getattr(spec, f.name)!r}" for f in kept) + ")"


def target_fingerprint(cfg: TargetConfig) -> str:
    """Path-independent identity of the target a drafter learns from (16 hex digits): its weight files, its
    config.json and tokenizer files; for a random target, its spec. Recorded with every trained drafter and
    MLflow run (`dflash.target_fingerprint`), checked when a drafter is evaluated or promoted."""
    import hashlib
    if not cfg.path:
        return hashlib.sha256(f"random:{_spec_identity(cfg.random)}".encode()).hexdigest()[:16]
    folder = Path(checkpoint_path(cfg))
    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    parts = [(f.name, _head_tail_digest(f)) for f in sorted(folder.glob("*.safetensors"))]
    parts += [(n, _head_tail_digest(folder / n)) for n in names if (folder / n).is_file()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def check_drafter_target(recorded: str | None, target: Target, where: str) -> None:
    """Refuses a drafter trained for another target, or one that records none while the target is a checkpoint
    (trained before fingerprints were kept: it cannot be told apart from a drafter of the previous reference
    target). A random target is its spec, which the run's own config carries: nothing to tell apart."""
    if recorded == target.fingerprint or (not recorded and not target.cfg.path):
        return
    if not recorded:
        raise ValueError(f"{where}: the drafter records no target fingerprint (trained before they were kept), "
                         f"so it may be a drafter of another target than {target.cfg.name!r} (fingerprint "
                         f"{target.fingerprint}); retrain it for this target, or pass --allow-other-target")
    raise ValueError(f"{where}: the drafter was trained for target fingerprint {recorded}, but target "
                     f"{target.cfg.name!r} is {target.fingerprint} (the target changed); retrain the drafter for "
                     f"this target, or pass --allow-other-target")


def target_lock(target):
    """The lock every forward of `target` takes (one forward at a time per target: producers share the device's
    default stream anyway, and Triton's autotuner, FLA's kernels, is not thread-safe); a no-op context for an
    object without one (a test's stand-in)."""
    import contextlib
    lock = getattr(target, "lock", None)
    return lock if lock is not None else contextlib.nullcontext()
