"""The target's sampling setting (temperature / top_p / top_k) and the distribution it samples from.

A setting is what a serving engine is asked for: `eval.sampling` (the setting τ is measured at) and
`data.online.sampling` (the setting training data is written at) are `SamplingConfig`s whose unset fields (-1)
come from the target's `generation_config.json`, as Hugging Face's `generate` reads them: `do_sample` false or
absent means greedy; with `do_sample` true, an absent temperature is 1.0, an absent top_p 1.0 (off), an absent
top_k 50 (transformers' default; 0 turns it off). A target folder without the file (a random test target)
is greedy.

`warp(logits, s)` is the distribution a token is drawn from under setting `s`: softmax(logits / T) restricted
to the top_k most likely tokens and to the smallest set whose probability reaches top_p (both renormalized),
as transformers' TopK and TopP warpers keep them. Greedy (T = 0) is the point mass on the argmax. The same
warp gives the target's p and the drafter's q in speculative sampling (`dflash.evaluation.rejection`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

FROM_TARGET = -1  # a SamplingConfig field left to the target's generation_config.json
HF_DEFAULT_TOP_K = 50  # transformers' GenerationConfig default when do_sample is on and top_k is absent


@dataclass
class SamplingConfig:
    """A sampling setting; -1 in a field: the target's generation_config.json (module doc)."""
    temperature: float = FROM_TARGET  # 0: greedy
    top_p: float = FROM_TARGET  # 1.0: off
    top_k: int = FROM_TARGET  # 0: off


@dataclass(frozen=True)
class Sampling:
    """A resolved setting (no field left to the target)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def label(self) -> str:
        """The setting in metric names: `t0` (greedy), `t1`, `t0.7`, `t1_p0.95_k20` (top_p / top_k when on)."""
        if self.greedy:
            return "t0"
        out = f"t{self.temperature:g}"
        if self.top_p < 1.0:
            out += f"_p{self.top_p:g}"
        if self.top_k > 0:
            out += f"_k{self.top_k}"
        return out

    def describe(self) -> str:
        if self.greedy:
            return "greedy (T=0)"
        return f"sampled at T={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k or 'off'}"

    def as_dict(self) -> dict:
        return {"temperature": float(self.temperature), "top_p": float(self.top_p), "top_k": int(self.top_k)}


GREEDY = Sampling()


def validate_sampling_config(cfg: SamplingConfig, key: str) -> None:
    """Raises ValueError naming `key` (e.g. `eval.sampling`)."""
    t, p, k = cfg.temperature, cfg.top_p, cfg.top_k
    if not (t == FROM_TARGET or (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0)):
        raise ValueError(f"{key}.temperature must be >= 0 (0: greedy), or -1 for the target's "
                         f"generation_config.json; got {t!r}")
    if not (p == FROM_TARGET or (isinstance(p, (int, float)) and 0 < p <= 1)):
        raise ValueError(f"{key}.top_p must be in (0, 1] (1: off), or -1 for the target's; got {p!r}")
    if not (k == FROM_TARGET or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)):
        raise ValueError(f"{key}.top_k must be an integer >= 0 (0: off), or -1 for the target's; got {k!r}")


def read_generation_config(folder: str | Path | None) -> Sampling:
    """The setting a target folder's generation_config.json recommends (module doc); greedy without one.
    Raises ValueError naming the file when it is not a JSON object or holds values out of range."""
    if not folder:
        return GREEDY
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return GREEDY
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e}); expected a JSON object") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if not data.get("do_sample", False):
        return GREEDY
    t, p, k = data.get("temperature", 1.0), data.get("top_p", 1.0), data.get("top_k", HF_DEFAULT_TOP_K)
    s = SamplingConfig(float(t), float(p), int(k) if k is not None else 0)
    try:
        validate_sampling_config(s, str(path))
    except ValueError as e:
        raise ValueError(f"{e}") from None
    return Sampling(s.temperature, s.top_p, s.top_k)


def resolve_sampling(cfg: SamplingConfig, folder: str | Path | None) -> Sampling:
    """`cfg` with its -1 fields taken from the target folder's generation_config.json (`folder`: the
    checkpoint folder; empty for a random target, whose recommendation is greedy)."""
    rec = read_generation_config(folder)
    t = rec.temperature if cfg.temperature == FROM_TARGET else float(cfg.temperature)
    p = rec.top_p if cfg.top_p == FROM_TARGET else float(cfg.top_p)
    k = rec.top_k if cfg.top_k == FROM_TARGET else int(cfg.top_k)
    return Sampling(t, p, k) if t > 0 else GREEDY


def target_folder(target) -> str:
    """The checkpoint folder of a `Target` ('' for a random one)."""
    cfg = getattr(target, "cfg", None)
    if cfg is None or not getattr(cfg, "path", ""):
        return ""
    from dflash.target.model import checkpoint_path
    return checkpoint_path(cfg)


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities [..., V] (float32) of drawing each token from `logits` [..., V] under `s` (module doc)."""
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    z = logits / s.temperature
    if 0 < s.top_k < z.shape[-1]:
        kth = z.topk(s.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    probs = torch.softmax(z, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token in the sorted order
        drop_sorted = before >= s.top_p  # the smallest prefix reaching top_p is kept (the first token always)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [..., V] (long [...]), from `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
