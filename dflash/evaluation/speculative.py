"""Real speculative decoding on the target (docs/DESIGN.md, "Evaluation and the gate"): draft → verify → commit,
greedy, lossless.

`TargetSession` drives the target's decoder with a Hugging Face cache and can roll it back:

- attention layers: the K/V cache is cropped to the committed length;
- linear-attention layers (Gated DeltaNet conv + recurrent states of hybrid targets such as `qwen3_5` /
  `qwen3_next`): a recurrent state cannot be cropped, so the states are snapshotted before each verify
  forward; after a rejection they are restored, the attention cache is cropped back to the round's start,
  and the accepted tokens are re-advanced through the target in one forward. Rounds where every draft is
  accepted need no re-advance. The scheme is exact: the committed state is the state after exactly the
  committed tokens, as in plain greedy decoding.

It relies on `DynamicCache(config=...)`, a decoder forward with `output_hidden_states`, and the cache's
per-layer attributes `keys`/`values` and `conv_states`/`recurrent_states`
(transformers 5.x; checked on 5.17 and 5.24). A cache of any other layout falls back to a deep-copied
snapshot (exact, slower). The decoder's cache argument is `past_key_values` in 5.17 and `cache` in 5.24
(the old name deprecated); the name is read from the forward's signature.

Numerics: in float32 the loop reproduces greedy decoding token for token (CPU and GPU tests). In bfloat16 a
block-verify forward and a one-token forward round differently, so equality can break at exact or near
ties of the target's logits — a property of the arithmetic, not of the algorithm.

`greedy_decode` is the target's own greedy output (prefill, then one token per forward); the evaluation
ground truth is produced by it, and `speculative_decode` must reproduce it token for token.
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from dflash.drafter.model import DFlashDrafter, greedy_draft
from dflash.target.cache import cache_kwarg, new_hf_cache
from dflash.target.model import target_lock


def drafter_autocast(drafter, enabled: bool | None = None):
    """bf16 autocast for the drafter's body on CUDA (as in training); logits are computed outside it."""
    dev = next(drafter.parameters()).device
    on = dev.type == "cuda" if enabled is None else enabled
    return torch.autocast(dev.type, dtype=torch.bfloat16) if on else nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetSession:
    """One sequence (batch 1) decoded incrementally through the target with a rollback-able cache."""

    def __init__(self, target, need_features: bool = True):
        self.target = target
        self.decoder = target.decoder
        self.device = target.device
        self.need_features = need_features
        self.cache = new_hf_cache(self.decoder)
        self._kw = cache_kwarg(self.decoder)
        self.length = 0  # committed tokens in the cache
        self.forwards = 0
        self._layered = hasattr(self.cache, "layers")
        # One forward at a time per target (Triton's autotuner is not thread-safe).
        self._lock = target_lock(target)

    # -- forward ---------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids_T: torch.Tensor, features: bool | None = None):
        """Feeds tokens at positions length..length+T-1. Returns (features [1,T,L,H] or None,
        greedy labels [T]: label i is the target's token for position length+i+1)."""
        feats, last = self._advance(ids_T, features)
        with self._lock:
            labels, _, _ = self.target.labels_from_hidden(last, 0)
        return feats, labels[0]

    @torch.no_grad()
    def forward_logits(self, ids_T: torch.Tensor, features: bool | None = None):
        """As `forward`, with the target's logits [T, V] (float32) instead of its greedy labels: row i is the
        distribution of the token at position length+i+1 (the sampled loop warps them)."""
        feats, last = self._advance(ids_T, features)
        return feats, (last[0] @ self.target.lm_head_weight().T).float()

    def _advance(self, ids_T: torch.Tensor, features: bool | None):
        want_feats = self.need_features if features is None else features
        ids = ids_T.to(self.device).view(1, -1)
        T = ids.shape[1]
        pos = torch.arange(self.length, self.length + T, device=self.device)[None]
        with self._lock:  # the target's producers may run forwards in other threads (training)
            out = self.decoder(input_ids=ids, position_ids=pos, use_cache=True,
                               output_hidden_states=want_feats, **{self._kw: self.cache})
            feats = None
            if want_feats:
                feats = torch.stack([out.hidden_states[i + 1] for i in self.target.layer_ids], dim=2)
        self.forwards += 1
        self.length += T
        return feats, out.last_hidden_state

    # -- rollback --------------------------------------------------------------------------------
    def _linear_layers(self):
        if not self._layered:
            return []
        return [lay for lay in self.cache.layers
                if isinstance(getattr(lay, "recurrent_states", None), dict)
                or isinstance(getattr(lay, "conv_states", None), dict)]

    @property
    def has_recurrent_state(self) -> bool:
        return (not self._layered) or bool(self._linear_layers())

    def snapshot(self):
        """State to come back to (call before a verify forward). Cheap: linear-attention states only."""
        if not self._layered:
            return ("deepcopy", self.length, copy.deepcopy(self.cache))
        states = []
        for lay in self._linear_layers():
            entry = {}
            for attr in ("conv_states", "recurrent_states"):
                d = getattr(lay, attr, None)
                if isinstance(d, dict):
                    entry[attr] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
            states.append((lay, entry))
        return ("layers", self.length, states)

    def _crop_attention(self, length: int) -> None:
        for lay in self.cache.layers:
            k = getattr(lay, "keys", None)
            if isinstance(k, torch.Tensor) and k.dim() >= 2 and k.shape[-2] > length:
                lay.keys = lay.keys[..., :length, :]
                lay.values = lay.values[..., :length, :]

    def restore(self, snap) -> None:
        kind, length, state = snap
        if kind == "deepcopy":
            self.cache = state
        else:
            for lay, entry in state:
                for attr, saved in entry.items():
                    cur = getattr(lay, attr)
                    for k, v in saved.items():
                        if isinstance(v, torch.Tensor) and isinstance(cur.get(k), torch.Tensor) \
                                and cur[k].shape == v.shape:
                            cur[k].copy_(v)  # in place: keeps any static address
                        else:
                            cur[k] = v
            self._crop_attention(length)
        self.length = length

    def commit(self, snap, block_T: torch.Tensor, keep: int) -> None:
        """After a verify forward of `block_T` started at snapshot `snap`, keep its first `keep` tokens."""
        start = snap[1]
        if keep >= block_T.numel():
            return
        if not self.has_recurrent_state:
            self._crop_attention(start + keep)
            self.length = start + keep
            return
        self.restore(snap)
        self.forward(block_T[:keep], features=False)  # re-advance the states over exactly the committed tokens


# -- decoding loops ---------------------------------------------------------------------------------
@dataclass
class DecodeResult:
    tokens: list[int]
    seconds: float
    target_forwards: int
    taus: list[int] = field(default_factory=list)  # speculative only: τ per round

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def mean_tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else float("nan")


@torch.no_grad()
def greedy_decode(target, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int) -> DecodeResult:
    """The target's own greedy continuation: prefill, then one token per forward (timed, device-synced)."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    sess = TargetSession(target, need_features=False)
    _sync(target.device)
    t0 = time.perf_counter()
    _, labels = sess.forward(prompt)
    tok = labels[-1:]
    out = [tok]
    for _ in range(max_new_tokens - 1):
        _, labels = sess.forward(tok)
        tok = labels[-1:]
        out.append(tok)
    tokens = torch.cat(out).tolist()  # one host sync at the end
    _sync(target.device)
    return DecodeResult(tokens[:max_new_tokens], time.perf_counter() - t0, sess.forwards)


@torch.no_grad()
def speculative_decode(drafter: DFlashDrafter, target, prompt_ids: list[int] | torch.Tensor,
                       max_new_tokens: int, autocast: bool | None = None) -> DecodeResult:
    """Draft (bs−1 argmax tokens from one drafter forward) → verify (one target forward over anchor + drafts)
    → commit the longest matching prefix plus the target's bonus token. The drafter's context features
    are the verify forward's hidden states of the committed tokens. τ per round = accepted + 1, clipped
    exactly as the simulated evaluation clips its last round (so the two agree round for round)."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    P, N, bs = prompt.numel(), max_new_tokens, drafter.block_size
    dev = next(drafter.parameters()).device
    sess = TargetSession(target, need_features=True)
    _sync(target.device)
    t0 = time.perf_counter()
    feats, labels = sess.forward(prompt)
    anchor = labels[-1:]
    dcache = drafter.new_cache()
    with drafter_autocast(drafter, autocast):
        drafter.extend_context(dcache, feats.to(dev), 0)
    pieces, taus, p = [anchor], [], P
    while p - P < N - 1:
        with drafter_autocast(drafter, autocast):
            hidden = drafter.draft_hidden(dcache, anchor.to(dev))
        draft = greedy_draft(drafter, hidden, anchor.to(dev))[0].to(target.device)  # [bs-1] (DFlash 2: its walk)
        block = torch.cat([anchor, draft])
        snap = sess.snapshot()
        feats, labels = sess.forward(block)
        ok = (draft == labels[:bs - 1]).int()
        matched = int(ok.cumprod(0).sum().item())  # the round's one host sync
        a = min(matched, N - 1 - (p - P))
        sess.commit(snap, block, a + 1)
        with drafter_autocast(drafter, autocast):
            drafter.extend_context(dcache, feats[:, :a + 1].to(dev), p)
        pieces += [draft[:a], labels[a:a + 1]]
        anchor = labels[a:a + 1]
        taus.append(a + 1)
        p += a + 1
    tokens = torch.cat(pieces).tolist()[:N]
    _sync(target.device)
    return DecodeResult(tokens, time.perf_counter() - t0, sess.forwards, taus)
