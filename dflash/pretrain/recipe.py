"""Pretraining the shipped reference target: a small `qwen3_5` hybrid code model (issue 4).

`pretrain(cfg, prompts)` runs the whole recipe in one process:

1. corpus (`dflash.data.corpus`: the running Python's standard library, file-level train / val / test split);
2. byte-level BPE tokenizer trained on the train split only (`<|endoftext|>`, `<|pad|>`, `<|mask|>` at 0..2);
3. a `Qwen3_5ForCausalLM` (Gated DeltaNet : full attention = 3 : 1 — transformers' default layer types put
   full attention on every 4th layer), checked to stay under `max_bf16_bytes` before any training;
4. training: token streams of whole files (each followed by `<|endoftext|>`) packed into fixed-length
   windows (a fresh random offset and order every epoch), AdamW + linear warmup + cosine, bf16 autocast
   on GPU, gradient clipping. The cosine runs on `progress = max(step / max_steps, elapsed / train time)`,
   so a wall-clock budget still ends with a decayed learning rate; the budget is a hard stop that leaves
   `finalize_reserve_s` for the final eval, the save and the continuations;
5. periodic eval on the `val` files; the best `val` snapshot is kept (the corpus is small: later epochs can
   overfit) and reported on the `test` files, next to a unigram model's perplexity on the same tokens;
6. the Hugging Face folder (bf16 safetensors, config, tokenizer, `dflash_target.json` with the mask token,
   layer ids, recipe, corpus fingerprint and held-out metrics), written to a temp dir then renamed;
7. greedy continuations of the eval prompts, produced by loading that folder through `dflash.target.model.Target`
   exactly as every run will, written with the numbers to a results markdown (`results_path`).

Gated-DeltaNet kernels on CUDA (DESIGN §7): FLA's backward is wrong or refused on Hopper with Triton
< 3.7.1. With `gdn_kernels=auto`, the model's loss and gradients on a batch of the training shape are
computed once with the bound kernels (FLA) and once with transformers' pure-torch functions; FLA trains
only if it runs and agrees (relative gradient error ≤ `grad_check_tol` overall and ≤ 4× that for every
parameter with a non-negligible gradient). Otherwise the torch functions train. The module's functions
are restored afterwards, so the target itself still runs forward with FLA. The choice is recorded. The short
convolution always trains on transformers' torch path (cuDNN conv1d); FLA's Triton short convolution, which
`dflash.target.model` installs when it loads a target on CUDA, is used forward-only.

Logs to MLflow through `dflash.tracking.loggers.build_loggers` (kind tag `pretrain_target`) like every run.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import logging
import math
import os
import platform
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from dflash.data.corpus import (
    EOS_TOKEN,
    MASK_TOKEN,
    PAD_TOKEN,
    CorpusConfig,
    encode_documents,
    load_corpus,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)
from dflash.serving.export import write_dir_atomically
from dflash.target.model import TARGET_META
from dflash.devices import resolve_device
from dflash.tracking.loggers import TrackingConfig, build_loggers, default_run_name, git_sha
from dflash.training.trainer import warmup_cosine

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class PretrainConfig:
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    # tokenizer
    vocab_size: int = 4096  # including the 3 special tokens
    tokenizer_min_frequency: int = 2
    # model: Qwen3.5 text config (every 4th layer full attention, the rest Gated DeltaNet)
    hidden_size: int = 384
    num_layers: int = 8
    intermediate_size: int = 1024
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False  # untied, like Qwen3.6-27B
    max_position_embeddings: int = 4096
    max_bf16_bytes: int = 40_000_000  # the shipped weights must stay under this
    # training
    seq_len: int = 512
    batch_size: int = 32
    max_steps: int = 20000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    time_budget_s: float = 0.0  # wall clock for all of pretrain() (setup included); 0 = none
    finalize_reserve_s: float = 90.0  # training stops this long before the budget ends (final eval, save,
    # loading the folder back and the continuations, incl. any kernel compilation they need)
    eval_every: int = 200  # steps between val evals (0 = only at the end)
    eval_tokens: int = 131072  # val tokens per eval (cap)
    final_eval_tokens: int = 2_000_000  # test tokens for the final numbers (cap)
    keep_best: bool = True  # ship the best-val snapshot rather than the last step
    log_every: int = 50  # steps between metric logs (the loop's only host sync)
    device: str = "auto"
    autocast: str = "auto"  # auto: bf16 on CUDA, off on CPU; or bfloat16 / off
    gdn_kernels: str = "auto"  # auto (measure), torch, fla
    grad_check_tol: float = 0.05
    seed: int = 0
    # outputs
    out_dir: str = "dflash/assets/reference_target"
    run_dir: str = ""  # metrics.jsonl / params; empty → runs/<timestamp>-pretrain_target
    results_path: str = ""  # results markdown; empty → none
    max_new_tokens: int = 64  # greedy continuation length for the eval prompts
    layer_ids: list[int] = field(default_factory=list)  # recorded for the drafter; empty → default
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def validate_pretrain_config(cfg: PretrainConfig) -> None:
    for k in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
              "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_head_dim", "seq_len",
              "batch_size", "max_steps", "lr", "log_every"):
        if getattr(cfg, k) <= 0:
            raise ValueError(f"pretrain.{k} must be > 0, got {getattr(cfg, k)}")
    if cfg.seq_len < 2:
        raise ValueError("pretrain.seq_len must be >= 2")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError("pretrain.num_heads must be a multiple of num_kv_heads")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError("pretrain.linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.gdn_kernels not in ("auto", "torch", "fla"):
        raise ValueError(f"pretrain.gdn_kernels={cfg.gdn_kernels!r}; expected auto, torch or fla")
    if cfg.autocast not in ("auto", "bfloat16", "off"):
        raise ValueError(f"pretrain.autocast={cfg.autocast!r}; expected auto, bfloat16 or off")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError("pretrain.min_lr_ratio must lie in [0, 1]")
    if cfg.time_budget_s < 0 or cfg.finalize_reserve_s < 0:
        raise ValueError("pretrain.time_budget_s and finalize_reserve_s must be >= 0")


# -- model ------------------------------------------------------------------------------------------
def build_hf_config(cfg: PretrainConfig, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_head_dim, linear_value_head_dim=cfg.linear_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=eos_id, pad_token_id=pad_id,
        bos_token_id=None,
    )  # RoPE: the config's defaults (partial rotary, as in Qwen3.5)


def build_model(hf_cfg, seed: int):
    from transformers import AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_cfg)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def bf16_bytes(model) -> int:
    return 2 * count_params(model)


def estimate_bf16_bytes(cfg: PretrainConfig, vocab_size: int | None = None) -> int:
    """bf16 size of the model `cfg` describes, built on the meta device (no memory, no time)."""
    hf_cfg = build_hf_config(cfg, vocab_size or cfg.vocab_size, 0, 1)
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf_cfg)
    return bf16_bytes(m)


# -- Gated-DeltaNet kernel selection ---------------------------------------------------------------------
class GdnKernels:
    """Swaps transformers' module-level Gated-DeltaNet functions between what import bound (FLA when
    importable) and the pure-torch originals; `restore()` puts the bound ones back."""

    def __init__(self, model_type: str):
        from dflash.target.kernels import _GDN_FUNCS, _modeling_module
        self.model_type = model_type
        self.mod = _modeling_module(model_type)
        self.bound = {n: getattr(self.mod, n) for n in _GDN_FUNCS if self.mod is not None and hasattr(self.mod, n)}

    def use_torch(self) -> None:
        for n, fn in self.bound.items():
            setattr(self.mod, n, inspect.unwrap(fn))

    def restore(self) -> None:
        for n, fn in self.bound.items():
            setattr(self.mod, n, fn)

    def report(self) -> dict[str, str]:
        from dflash.target.kernels import kernel_report
        return kernel_report(self.model_type)


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def triton_known_bad(device: torch.device) -> tuple[bool, str]:
    """(FLA's GDN backward is known wrong here, triton version): Hopper with 3.4.0 <= Triton < 3.7.1."""
    try:
        import triton
        ver = triton.__version__
    except Exception:
        return False, "none"
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return hopper and (3, 4, 0) <= _version_tuple(ver) < (3, 7, 1), ver


def loss_and_grads(model, ids_BT: torch.Tensor, amp_dtype) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, ids_BT, amp_dtype)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def compare_grads(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict:
    """Global and worst per-parameter relative L2 error of `other` against `ref`."""
    num, den, worst, worst_name = 0.0, 0.0, 0.0, ""
    norms = {n: float(g.norm()) for n, g in ref.items()}
    total = math.sqrt(sum(v * v for v in norms.values()))
    finite = True
    for n, g in ref.items():
        o = other.get(n)
        if o is None or not bool(torch.isfinite(o).all()):
            finite = False
            continue
        d = float((o - g).norm())
        num += d * d
        den += norms[n] ** 2
        if norms[n] >= 1e-4 * total:
            rel = d / max(norms[n], 1e-12)
            if rel > worst:
                worst, worst_name = rel, n
    missing = sorted(set(ref) ^ set(other))
    return {"global_rel_err": math.sqrt(num) / max(math.sqrt(den), 1e-12), "worst_rel_err": worst,
            "worst_param": worst_name, "finite": finite and not missing, "missing": missing[:5]}


def select_gdn_kernels(model, device: torch.device, cfg: PretrainConfig, amp_dtype,
                       model_type: str) -> tuple[str, dict, GdnKernels]:
    """Chooses the kernels to train with; returns (choice 'fla' | 'torch', details, swapper)."""
    sw = GdnKernels(model_type)
    bound = sw.report()
    details: dict = {"bound": bound, "fla_importable": importlib.util.find_spec("fla") is not None}
    bad, tver = triton_known_bad(device) if device.type == "cuda" else (False, "n/a")
    details.update(triton=tver, triton_known_bad=bad)
    uses_fla = any(v == "fla" for v in bound.values())
    if device.type != "cuda" or not uses_fla or cfg.gdn_kernels == "torch":
        sw.use_torch()
        details["reason"] = ("not CUDA" if device.type != "cuda" else
                             "FLA not bound by transformers" if not uses_fla else "gdn_kernels=torch")
        return "torch", details, sw
    if cfg.gdn_kernels == "fla":
        details["reason"] = "gdn_kernels=fla (no check)"
        return "fla", details, sw
    # auto: measure FLA against torch on a batch of the training shape
    g = torch.Generator().manual_seed(cfg.seed + 7)
    B = max(1, min(cfg.batch_size, 4))
    ids = torch.randint(3, model.config.vocab_size, (B, cfg.seq_len), generator=g).to(device)
    try:
        sw.use_torch()
        loss_t, grads_t = loss_and_grads(model, ids, amp_dtype)
    except Exception as e:  # nothing to compare against: train on the torch functions
        model.zero_grad(set_to_none=True)
        details["reason"] = f"torch reference step raised {type(e).__name__}: {str(e)[:300]}"
        return "torch", details, sw
    sw.restore()
    try:
        loss_f, grads_f = loss_and_grads(model, ids, amp_dtype)
    except Exception as e:  # FLA refuses (e.g. its Hopper/Triton guard) or crashes
        model.zero_grad(set_to_none=True)
        sw.use_torch()
        details.update(reason=f"FLA forward+backward raised {type(e).__name__}: {str(e)[:300]}",
                       loss_torch=loss_t)
        return "torch", details, sw
    del ids
    cmp = compare_grads(grads_t, grads_f)
    ok = (cmp["finite"] and math.isfinite(loss_f) and abs(loss_f - loss_t) <= 1e-2 * max(abs(loss_t), 1)
          and cmp["global_rel_err"] <= cfg.grad_check_tol and cmp["worst_rel_err"] <= 4 * cfg.grad_check_tol)
    details.update(grad_check=cmp, loss_torch=loss_t, loss_fla=loss_f, grad_check_shape=[B, cfg.seq_len])
    if ok:
        details["reason"] = "FLA gradients agree with torch"
        return "fla", details, sw
    sw.use_torch()
    details["reason"] = "FLA gradients disagree with torch"
    return "torch", details, sw


# -- data ---------------------------------------------------------------------------------------------
def stream(docs_ids: list[list[int]]) -> torch.Tensor:
    flat = [t for ids in docs_ids for t in ids]
    return torch.tensor(flat, dtype=torch.int32)


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

    @property
    def epochs_done(self) -> float:
        n = len(self.order) if self.order is not None else 1
        return self.epoch + self.cursor / max(n, 1)


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
def evaluate_nll(model, windows: list[torch.Tensor], batch_size: int, amp_dtype,
                 device: torch.device) -> tuple[float, int]:
    """(sum of next-token NLL in nats, number of predicted tokens) over the windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    full = [w for w in windows if w.numel() == windows[0].numel()] if windows else []
    rest = [w for w in windows if w.numel() != windows[0].numel()] if windows else []
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in rest]
    for grp in groups:
        ids = torch.stack(grp).to(device)
        with _amp(device, amp_dtype):
            logits = model(input_ids=ids, use_cache=False).logits
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                              reduction="sum")
        total += float(nll)
        count += ids[:, 1:].numel()
    model.train(was_training)
    return total, count


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


# -- schedule -----------------------------------------------------------------------------------------
def lr_at(cfg: PretrainConfig, step: int, time_frac: float) -> float:
    """The trainer's warmup + cosine, whose progress is also pushed on by the wall clock (`time_frac`)."""
    return cfg.lr * warmup_cosine(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, time_frac)


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# -- saving -------------------------------------------------------------------------------------------
def write_folder_atomically(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temp folder next to `out_dir`, which then replaces `out_dir` whole; temp folders
    a killed earlier run left behind are cleared first."""
    out = Path(out_dir).resolve()
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return write_dir_atomically(out, write)


def _fix_tokenizer_config(folder: Path) -> None:
    """Name the long-standing class (transformers 4.x and 5.x both load it) and write the special-token map."""
    p = folder / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}, indent=2) + "\n")


# -- prompts / results --------------------------------------------------------------------------------
PromptArg = Sequence | Callable[[], Sequence] | None


def normalize_prompts(prompts: PromptArg) -> list[tuple[str, str]]:
    """A list of strings, (name, prompt) pairs or objects with .name/.prompt — or a callable giving one."""
    if callable(prompts):
        prompts = prompts()
    out = []
    for i, p in enumerate(prompts or []):
        if isinstance(p, str):
            out.append((f"prompt{i}", p))
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            out.append((str(p[0]), str(p[1])))
        elif hasattr(p, "prompt"):
            out.append((str(getattr(p, "name", f"prompt{i}")), str(p.prompt)))
        elif isinstance(p, dict):
            out.append((str(p.get("name", f"prompt{i}")), str(p["prompt"])))
        else:
            raise TypeError(f"prompt {i}: expected a string, (name, prompt) or an object with .prompt")
    return out


def generate_continuations(folder: str | os.PathLike, meta: dict, prompts: list[tuple[str, str]],
                           max_new_tokens: int, device: str, force_torch: bool = False) -> tuple[list[dict], dict]:
    """Loads the written folder through `dflash.target.model.Target` and decodes each prompt greedily. Returns the
    continuations and the Gated-DeltaNet kernels they ran with (`force_torch`: transformers' torch functions)."""
    from dflash.data.regen import greedy_generate
    from dflash.target.model import Target, TargetConfig
    from dflash.target.kernels import force_torch_gdn, kernel_report
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
                    "continuation": target.tokenizer.decode(cont), "seconds": time.perf_counter() - t0})
    return out, report


def _fmt(v, nd=3):
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def results_markdown(result: dict, command: str = "") -> str:
    m, meta = result["metrics"], result["meta"]
    lines = ["# Reference target: pretraining results", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += [
        f"- written: `{result['out_dir']}` ({meta.get('created', '')}, git {meta.get('git_sha', '?')}, "
        f"python {meta['env']['python']}, torch {meta['env']['torch']}, transformers {meta['env']['transformers']})",
        f"- device: {meta['env']['device']}; Gated-DeltaNet kernels for training: **{meta['gdn_kernels']['choice']}** "
        f"({meta['gdn_kernels'].get('reason', '')})",
        f"- model: `qwen3_5` text, {meta['model']['num_layers']} layers ({meta['model']['layer_types']}), hidden "
        f"{meta['model']['hidden_size']}, vocab {meta['model']['vocab_size']}; {m['params']:,} parameters, "
        f"{m['bf16_bytes'] / 1e6:.2f} MB in bf16 (safetensors on disk: {m['safetensors_bytes'] / 1e6:.2f} MB)",
        f"- corpus: {meta['corpus']['train_files']} train / {meta['corpus']['val_files']} val / "
        f"{meta['corpus']['test_files']} test files of `{meta['corpus']['root']}`; "
        f"{m['train_tokens']:,} train tokens; fingerprint `{meta['corpus']['fingerprint'][:16]}`",
        f"- training: {m['steps']} steps × {meta['recipe']['batch_size']} × {meta['recipe']['seq_len']} tokens = "
        f"{m['tokens_seen']:,} tokens ({m['epochs']:.1f} epochs) in {m['train_seconds']:.0f} s, "
        f"**{m['tokens_per_s']:,.0f} tok/s**; stopped by {m['stop_reason']}; shipped step {m['best_step']} "
        f"({'best val' if meta['recipe']['keep_best'] else 'last'}); total wall {m['wall_seconds']:.0f} s",
        "",
        "| held-out (test files) | loss (nats/token) | perplexity | bits/byte |",
        "| --- | --- | --- | --- |",
        f"| target | {_fmt(m['test_loss'])} | {_fmt(m['test_ppl'], 2)} | {_fmt(m['test_bits_per_byte'])} |",
        f"| unigram (train counts, add-one) | {_fmt(m['unigram_loss'])} | {_fmt(m['unigram_ppl'], 2)} | "
        f"{_fmt(m['unigram_bits_per_byte'])} |",
        "",
        f"Test tokens scored: {m['test_tokens']:,}; best val loss {_fmt(m['val_loss'])} "
        f"(ppl {_fmt(m['val_ppl'], 2)}).",
        "",
        f"## Greedy continuations ({meta['recipe']['max_new_tokens']} tokens, loaded through `dflash.target.model.Target`)",
        "",
    ]
    if result.get("continuations_note"):
        lines += [f"Gated-DeltaNet kernels for generation: {result['continuations_note']}.", ""]
    for c in result.get("continuations", []):
        lines += [f"### {c['name']}", "", f"Prompt ({c['prompt_tokens']} tokens):", "", "```python",
                  c["prompt"].rstrip("\n"), "```", "",
                  f"Target's greedy continuation ({len(c['continuation_ids'])} tokens):", "", "```python", c["continuation"].replace("```", "ʼʼʼ"), "```", ""]
    return "\n".join(lines) + "\n"


# -- the recipe ---------------------------------------------------------------------------------------
def _env(device: torch.device) -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
    try:
        import tokenizers
        env["tokenizers"] = tokenizers.__version__
    except Exception:
        pass
    return env


def pretrain(cfg: PretrainConfig, prompts: PromptArg = None, command: str = "") -> dict:
    """Runs the recipe (module docstring). Returns {"metrics", "meta", "out_dir", "continuations", "run_dir"}."""
    t_start = time.perf_counter()
    validate_pretrain_config(cfg)
    device = resolve_device(cfg.device)
    amp_dtype = (torch.bfloat16 if (cfg.autocast == "bfloat16" or (cfg.autocast == "auto" and device.type == "cuda"))
                 else None)
    deadline = t_start + cfg.time_budget_s if cfg.time_budget_s > 0 else math.inf
    train_deadline = deadline - cfg.finalize_reserve_s
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)

    run_dir = Path(cfg.run_dir or f"runs/{default_run_name()}-pretrain_target")
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = build_loggers(cfg.tracking, run_dir, asdict(cfg), {"dflash.kind": "pretrain_target"},
                           cfg.max_steps if cfg.time_budget_s <= 0 else None)
    with logger:
        # 1-2. corpus and tokenizer
        corpus = load_corpus(cfg.corpus)
        cstats = corpus.stats()
        log.info("corpus: %s", {k: v for k, v in cstats.items() if k != "fingerprint"})
        tok = train_tokenizer(corpus.texts("train"), cfg.vocab_size, cfg.tokenizer_min_frequency)
        vocab = tok.get_vocab_size()
        eos_id, pad_id, mask_id = (tok.token_to_id(t) for t in (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN))
        train_tokens = stream(encode_documents(tok, corpus.texts("train"), eos_id))
        val_tokens = stream(encode_documents(tok, corpus.texts("val"), eos_id))
        test_tokens = stream(encode_documents(tok, corpus.texts("test"), eos_id))
        if test_tokens.numel() < 2:  # tiny corpora (tests): fall back to val, then to train's tail
            test_tokens = val_tokens if val_tokens.numel() >= 2 else train_tokens[-cfg.seq_len * 4:]
        if val_tokens.numel() < 2:
            val_tokens = test_tokens
        setup = {"setup/corpus_tokenizer_s": time.perf_counter() - t_start,
                 "data/train_tokens": float(train_tokens.numel()), "data/val_tokens": float(val_tokens.numel()),
                 "data/test_tokens": float(test_tokens.numel()), "data/vocab_size": float(vocab)}
        log.info("tokens: train %d, val %d, test %d (vocab %d) after %.1f s", train_tokens.numel(),
                 val_tokens.numel(), test_tokens.numel(), vocab, setup["setup/corpus_tokenizer_s"])

        # 3. model
        hf_cfg = build_hf_config(cfg, vocab, eos_id, pad_id)
        model = build_model(hf_cfg, cfg.seed)
        n_params, nbytes = count_params(model), bf16_bytes(model)
        if nbytes >= cfg.max_bf16_bytes:
            raise ValueError(f"the model holds {n_params:,} parameters = {nbytes / 1e6:.1f} MB in bf16, over "
                             f"max_bf16_bytes={cfg.max_bf16_bytes / 1e6:.1f} MB: shrink it")
        model.to(device).train()
        choice, kdetails, kernels = select_gdn_kernels(model, device, cfg, amp_dtype, hf_cfg.model_type)
        kdetails["choice"] = choice
        log.info("Gated-DeltaNet kernels for training: %s (%s)", choice, kdetails.get("reason"))
        logger.set_tags({"gdn_kernels": choice})

        try:
            result = _train_and_finish(cfg, device, amp_dtype, logger, model, tok, corpus, cstats, train_tokens,
                                       val_tokens, test_tokens, eos_id, pad_id, mask_id, n_params, nbytes,
                                       kdetails, kernels, setup, t_start, train_deadline, prompts, command,
                                       run_dir)
        finally:
            kernels.restore()
        return result


def _train_and_finish(cfg, device, amp_dtype, logger, model, tok, corpus, cstats, train_tokens, val_tokens,
                      test_tokens, eos_id, pad_id, mask_id, n_params, nbytes, kdetails, kernels, setup,
                      t_start, train_deadline, prompts, command, run_dir) -> dict:
    from dflash.target.model import default_layer_ids
    byte_len = token_byte_lengths(tok)
    sampler = WindowSampler(train_tokens.to(device), cfg.seq_len, cfg.batch_size, cfg.seed)
    val_windows = eval_windows(val_tokens, cfg.seq_len, cfg.eval_tokens)
    opt_kw = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=1e-8, **opt_kw)
    logger.log(setup, 0)

    best = {"loss": math.inf, "step": 0, "state": None}

    def run_val(step: int) -> float:
        s, n = evaluate_nll(model, val_windows, cfg.batch_size, amp_dtype, device)
        loss = s / max(n, 1)
        if cfg.keep_best and loss < best["loss"]:
            best.update(loss=loss, step=step,
                        state={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        elif not cfg.keep_best:
            best.update(loss=loss, step=step)
        return loss

    if cfg.eval_every:  # the untrained model's val loss: the start of the curve
        vl = run_val(0)
        logger.log({"eval/val_loss": vl, "eval/val_ppl": math.exp(min(vl, 50))}, 0)
    train_t0 = time.perf_counter()
    train_time_budget = max(train_deadline - train_t0, 1e-6)
    eval_seconds, step, stop_reason = 0.0, 0, "max_steps"
    tokens_per_step = cfg.batch_size * cfg.seq_len
    loss_acc = torch.zeros((), device=device)
    acc_n, last_log_t, last_log_step = 0, time.perf_counter(), 0
    lr = cfg.lr
    while step < cfg.max_steps:
        now = time.perf_counter()
        if now >= train_deadline:
            stop_reason = "time budget"
            break
        time_frac = (now - train_t0) / train_time_budget if math.isfinite(train_deadline) else 0.0
        lr = lr_at(cfg, step, time_frac)
        for gr in opt.param_groups:
            gr["lr"] = lr
        ids = sampler.next()
        loss = lm_loss(model, ids, amp_dtype)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_acc += loss.detach()
        acc_n += 1
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            t = time.perf_counter()
            if not math.isfinite(float(loss_acc)):  # the only host sync of the loop, every log_every steps
                stop_reason = f"non-finite loss by step {step}"
                log.error("training stopped: %s (the best val snapshot is shipped)", stop_reason)
                break
            m = {"train/loss": float(loss_acc) / acc_n, "train/lr": lr, "train/grad_norm": float(gnorm),
                 "train/epoch": sampler.epochs_done,
                 "perf/tok_s": (step - last_log_step) * tokens_per_step / max(t - last_log_t, 1e-9)}
            if cfg.tracking.system_metrics:
                from dflash.tracking.sysmetrics import system_metrics
                m.update(system_metrics())
            logger.log(m, step)
            loss_acc.zero_()
            acc_n, last_log_t, last_log_step = 0, time.perf_counter(), step
        if cfg.eval_every and step % cfg.eval_every == 0:
            t = time.perf_counter()
            vl = run_val(step)
            dt = time.perf_counter() - t
            eval_seconds += dt
            last_log_t += dt
            logger.log({"eval/val_loss": vl, "eval/val_ppl": math.exp(min(vl, 50))}, step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_seconds = time.perf_counter() - train_t0 - eval_seconds
    if step > 0 and (best["step"] != step or not cfg.keep_best):
        vl = run_val(step)
        logger.log({"eval/val_loss": vl, "eval/val_ppl": math.exp(min(vl, 50))}, step)
    if cfg.keep_best and best["state"] is not None:
        model.load_state_dict(best["state"])
    val_loss = best["loss"] if step > 0 else run_val(0)

    # the shipped weights are bf16: score exactly those values
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    test_windows = eval_windows(test_tokens, cfg.seq_len, cfg.final_eval_tokens)
    s, n = evaluate_nll(model, test_windows, cfg.batch_size, amp_dtype, device)
    us, un = unigram_nll(train_tokens, test_windows, model.config.vocab_size)
    test_bytes = int(sum(int(byte_len[w[1:].long()].sum()) for w in test_windows))
    tokens_seen = step * tokens_per_step
    metrics = {
        "params": n_params, "bf16_bytes": nbytes, "steps": step, "best_step": best["step"] if cfg.keep_best else step,
        "tokens_seen": tokens_seen, "epochs": tokens_seen / max(train_tokens.numel(), 1),
        "train_seconds": train_seconds, "tokens_per_s": tokens_seen / max(train_seconds, 1e-9),
        "stop_reason": stop_reason, "train_tokens": int(train_tokens.numel()),
        "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50)),
        "test_loss": s / max(n, 1), "test_ppl": math.exp(min(s / max(n, 1), 50)), "test_tokens": n,
        "test_bits_per_byte": s / math.log(2) / max(test_bytes, 1),
        "unigram_loss": us / max(un, 1), "unigram_ppl": math.exp(min(us / max(un, 1), 50)),
        "unigram_bits_per_byte": us / math.log(2) / max(test_bytes, 1),
    }
    if device.type == "cuda":
        metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    log.info("held-out test: loss %.4f ppl %.2f (unigram ppl %.1f), %d steps, %.0f tok/s", metrics["test_loss"],
             metrics["test_ppl"], metrics["unigram_ppl"], step, metrics["tokens_per_s"])

    # 6. the folder
    layer_ids = list(cfg.layer_ids) or default_layer_ids(cfg.num_layers)
    hf_cfg = model.config
    meta = {
        "format": FORMAT_VERSION, "name": "reference_target", "mask_token_id": mask_id, "eos_token_id": eos_id,
        "pad_token_id": pad_id, "layer_ids": layer_ids,
        "model": {"model_type": hf_cfg.model_type, "num_layers": hf_cfg.num_hidden_layers,
                  "hidden_size": hf_cfg.hidden_size, "vocab_size": hf_cfg.vocab_size,
                  "layer_types": "".join("A" if t == "full_attention" else "L" for t in hf_cfg.layer_types),
                  "params": n_params, "bf16_bytes": nbytes},
        "corpus": cstats, "tokenizer": {"fingerprint": tokenizer_fingerprint(tok), "vocab_size": tok.get_vocab_size(),
                                        "special_tokens": {EOS_TOKEN: eos_id, PAD_TOKEN: pad_id, MASK_TOKEN: mask_id}},
        "recipe": asdict(cfg), "metrics": metrics, "gdn_kernels": kdetails, "env": _env(device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": git_sha(), "command": command,
    }
    meta["recipe"]["tracking"] = {k: v for k, v in meta["recipe"]["tracking"].items() if k != "tracking_uri"}

    save_model = copy.deepcopy(model).to("cpu", torch.bfloat16)
    save_model.config.dtype = torch.bfloat16
    gc = getattr(save_model, "generation_config", None)
    if gc is not None:
        gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = eos_id, pad_id, None

    def write(tmp: Path) -> None:
        save_model.save_pretrained(str(tmp))
        save_tokenizer(tok, tmp, cfg.max_position_embeddings)
        _fix_tokenizer_config(tmp)
        metrics["safetensors_bytes"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        (tmp / TARGET_META).write_text(json.dumps(meta, indent=1, default=str) + "\n")

    out = write_folder_atomically(cfg.out_dir, write)
    log.info("wrote %s", out)

    # 7. continuations through the shipped-target loading path (module kernels restored first)
    continuations, gen_note = [], ""
    plist = normalize_prompts(prompts)
    if plist:  # the weights are on disk already: a failure here costs the continuations, not the model
        kernels.restore()  # the target runs forward with the kernels transformers bound (FLA on GPU)
        try:
            continuations, rep = generate_continuations(out, meta, plist, cfg.max_new_tokens, str(device))
            gen_note = ", ".join(f"{k}={v}" for k, v in rep.items())
        except Exception as e:
            log.exception("continuations with the target's kernels failed; retrying with the torch functions")
            gen_note = f"the target's kernels failed ({type(e).__name__}: {str(e)[:200]}); "
            try:
                continuations, rep = generate_continuations(out, meta, plist, cfg.max_new_tokens, str(device),
                                                            force_torch=True)
                gen_note += "generated with " + ", ".join(f"{k}={v}" for k, v in rep.items())
            except Exception as e2:
                log.exception("continuations failed")
                gen_note += f"torch functions failed too ({type(e2).__name__}: {str(e2)[:200]})"
            finally:
                kernels.restore()
    metrics["wall_seconds"] = time.perf_counter() - t_start
    final = {f"final/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    logger.log(final, step)
    result = {"metrics": metrics, "meta": meta, "out_dir": str(out), "continuations": continuations,
              "continuations_note": gen_note, "run_dir": str(run_dir)}
    (run_dir / "pretrain_result.json").write_text(json.dumps(
        {k: v for k, v in result.items() if k != "meta"}, indent=1, default=str))
    if cfg.results_path:
        md = results_markdown(result, command)
        Path(cfg.results_path).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.results_path).write_text(md)
        logger.log_text(md, "reference_target.md")
    logger.log_dict({k: v for k, v in meta.items() if k != "recipe"}, TARGET_META)
    return result
