"""How the target writes a batch of continuations (docs/data.md, "Writing"): `write_continuations` and the width of a
written batch (`auto_write_batch`).

Every row of a batch is fed one token per step at the same position; a row still inside its own prompt is fed
its prompt token instead of the target's choice, so prompts of different lengths share a batch without padding
and every row is exactly what the target writes for its prompt alone. Two paths (`data.online.decode`):
transformers' own cache (one prefill of the shortest prompt, then cached steps), or the static decoder
(`dflash.target.static_decode`: preallocated states from position 0, each step one CUDA-graph replay on a GPU).
The online stream (`dflash.data.online`) and the evaluation's ground truth (`dflash.evaluation.ground_truth`)
both write through here.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from dflash.target.cache import cache_kwarg, new_hf_cache
from dflash.target.sampling import GREEDY, Sampling, draw, warp
from dflash.target.model import target_lock

if TYPE_CHECKING:
    from dflash.data.stops import TextEnd

# graph: static states, each token one CUDA-graph replay (dflash.target.static_decode; eager off the GPU);
# static: the same states and step, run op by op; cache: transformers' own cache (the reference path).
DECODE_MODES = ("auto", "graph", "static", "cache")



# CUDA caps a launch grid's 2nd and 3rd dimensions at 65,535 blocks, and FLA's chunked Gated-DeltaNet kernels
# launch (chunks, batch x value heads): at the reference target's 8 value heads a batch of 8,192 rows fails inside
# Triton with "invalid argument" (seen on an H200). Refused up front instead, naming the key.
CUDA_GRID_YZ_MAX = 65_535


# auto write_batch: rows per written batch, at most this many. A decode step's cost grows far slower than its rows:
# transformers' cached step was host-bound at 1,024 rows (~3,600 small ops, RESULTS.md, 2026-12-01), and at 4,096
# rows on an H200 a step takes 11.5 ms (cache) or 9.1 ms (graph), GPU time (benchmarks/gpu/decode_speed.py, 2026-12-01).
AUTO_WRITE_ROWS = 4096
AUTO_WRITE_MEMORY_FRAC = 0.5  # of the GPU memory free when the writer starts, for the batch's caches
CPU_WRITE_ROWS = 1024  # the CPU's auto (the default before auto; not measured there)


def cache_bytes_per_row(target, seq_len: int) -> int:
    """A written row's cache at `seq_len` tokens on the loaded `target` (`cache_row_bytes`)."""
    return cache_row_bytes(_text_config(target), torch.finfo(target.dtype).bits // 8, seq_len)


def cache_row_bytes(cfg, elt: int, seq_len: int) -> int:
    """A written row's cache at `seq_len` tokens for a target of text config `cfg` (attributes as in its
    config.json) whose weights are `elt` bytes each: each Gated-DeltaNet layer's recurrent state (value heads x
    key dim x value dim, float32, counted twice) and conv state, each attention layer's keys and values."""
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    linear, attn = types.count("linear_attention"), len(types) - types.count("linear_attention")
    vh, dk, dv = (int(getattr(cfg, k, 0) or 0) for k in
                  ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    kh, kernel = int(getattr(cfg, "linear_num_key_heads", 0) or 0), int(getattr(cfg, "linear_conv_kernel_dim", 0) or 0)
    # the recurrent state twice: a step computes the new state beside the old before it replaces it (transformers'
    # cache and the static decoder's graph alike)
    gdn = 2 * vh * dk * dv * 4 + (2 * kh * dk + vh * dv) * kernel * elt
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_key_value_heads * head_dim * seq_len * elt
    return linear * gdn + attn * kv


def auto_write_batch(target, seq_len: int) -> int:
    """data.online.write_batch=0: on a GPU the largest power of two of rows, at most AUTO_WRITE_ROWS, whose caches
    fit AUTO_WRITE_MEMORY_FRAC of the free memory and whose chunked kernels fit CUDA's grid; on the CPU
    CPU_WRITE_ROWS. The reference target gets 4,096; a 27B target after its 54 GB of weights, a few dozen."""
    if target.device.type != "cuda":
        return CPU_WRITE_ROWS
    free, _ = torch.cuda.mem_get_info(target.device)
    rows = min(AUTO_WRITE_ROWS, int(AUTO_WRITE_MEMORY_FRAC * free) // max(cache_bytes_per_row(target, seq_len), 1))
    heads = _gdn_value_heads(target)
    if heads:
        rows = min(rows, CUDA_GRID_YZ_MAX // heads)
    return 1 << max(rows, 1).bit_length() - 1


def _text_config(target):
    cfg = target.model.config
    return getattr(cfg, "text_config", None) or cfg


def _gdn_value_heads(target) -> int:
    return int(getattr(_text_config(target), "linear_num_value_heads", 0) or 0)


def check_write_batch(target, write_batch: int) -> None:
    if target.device.type != "cuda":
        return
    heads = _gdn_value_heads(target)
    if heads and write_batch * heads > CUDA_GRID_YZ_MAX:
        raise ValueError(f"data.online.write_batch={write_batch}: x the target's {heads} Gated-DeltaNet value heads "
                         f"exceeds CUDA's grid limit ({CUDA_GRID_YZ_MAX}) of its chunked kernels; use at most "
                         f"{CUDA_GRID_YZ_MAX // heads}")


def _choose(target, last_B1H: torch.Tensor, sampling, gen: torch.Generator | None) -> torch.Tensor:
    """The next token of every row: the target's greedy pick, or a draw from `sampling`'s warped distribution
    (`dflash.target.sampling.warp`: temperature, top_k, top_p). `sampling`: a `Sampling`, or a bare temperature
    (0: greedy; > 0: softmax(logits / T), no top_k / top_p)."""
    s = sampling if isinstance(sampling, Sampling) else Sampling(float(sampling)) if sampling > 0 else GREEDY
    if s.greedy:  # the target's own greedy pick (its chunked LM head, as everywhere else)
        return target.labels_from_hidden(last_B1H, 0)[0][:, -1]
    logits = (last_B1H[:, -1] @ target.lm_head_weight().T).float()
    if s.top_p >= 1.0 and s.top_k <= 0:
        u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp_(1e-20, 1.0)
        return (logits / s.temperature - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max: softmax(logits / T)
    return draw(warp(logits, s), gen)


def resolve_decode(target, mode: str) -> str:
    """data.online.decode → the path that runs: auto is graph on a GPU where the model type has a static decoder
    (`dflash.target.static_decode.STATIC_DECODERS`), else transformers' cache."""
    from dflash.target.static_decode import supports_static
    if mode == "auto":
        return "graph" if target.device.type == "cuda" and supports_static(target) else "cache"
    if mode in ("graph", "static") and not supports_static(target):
        raise ValueError(f"data.online.decode={mode}: no static decoder for model type {target.info.model_type!r}; "
                         f"use cache or auto")
    return mode


@torch.no_grad()
def write_continuations(target, prompts: list[list[int]], seq_len: int, temperature: "float | Sampling" = 0.0,
                        generator: torch.Generator | None = None, decode: str = "auto") -> torch.Tensor:
    """Each prompt continued by the target to exactly `seq_len` tokens: LongTensor [B, seq_len] on the CPU.

    Every row is fed one token per step at the same position; a row still inside its prompt is fed its own
    prompt token, so it sees exactly the tokens it would alone. `temperature`: a `Sampling` setting or a bare
    temperature (0: greedy). Never stops early (an end-of-text token is just another token: readers cut each row
    at its end, `ends_at_stop`). `decode` (DECODE_MODES): the static decoder from position 0, or transformers' cache
    (one prefill of the shortest prompt's length, then cached steps). Takes the target's lock itself."""
    lens = [len(p) for p in prompts]
    if not prompts or min(lens) < 1 or max(lens) >= seq_len:
        raise ValueError(f"write_continuations: need non-empty prompts shorter than seq_len={seq_len} "
                         f"(got lengths {min(lens, default=0)}..{max(lens, default=0)})")
    mode = resolve_decode(target, decode)
    dev = target.device
    # on a GPU the writing runs on its own stream: a writer thread's kernels then interleave with training's
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" and mode != "cache" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        seq = torch.zeros(len(prompts), seq_len, dtype=torch.long)
        for r, p in enumerate(prompts):
            seq[r, :len(p)] = torch.tensor(p, dtype=torch.long)
        seq = seq.to(dev)
        in_prompt_BT = (torch.arange(seq_len)[None] < torch.tensor(lens)[:, None]).to(dev)
        if mode == "cache":
            with target_lock(target):
                _write_cached(target, seq, in_prompt_BT, min(lens), temperature, generator)
        else:
            _write_static(target, seq, in_prompt_BT, min(lens), temperature, generator, graph=mode == "graph")
        return seq.cpu()


def _write_cached(target, seq, in_prompt_BT, p0: int, temperature, generator) -> None:
    B, seq_len = seq.shape
    decoder = target.decoder
    cache, kw = new_hf_cache(decoder), cache_kwarg(decoder)
    pos = torch.arange(p0, device=seq.device)[None].expand(B, -1)
    h = decoder(input_ids=seq[:, :p0], position_ids=pos, use_cache=True, **{kw: cache}).last_hidden_state
    for t in range(p0, seq_len):
        tok = torch.where(in_prompt_BT[:, t], seq[:, t], _choose(target, h[:, -1:], temperature, generator))
        seq[:, t] = tok
        if t + 1 < seq_len:
            pos = torch.full((B, 1), t, device=seq.device, dtype=torch.long)
            h = decoder(input_ids=tok[:, None], position_ids=pos, use_cache=True, **{kw: cache}).last_hidden_state


def _write_static(target, seq, in_prompt_BT, p0: int, temperature, generator, graph: bool) -> None:
    from dflash.target.static_decode import static_decoder
    B, seq_len = seq.shape
    with target_lock(target):  # a build captures the graph: its warm-up steps may autotune Triton kernels
        dec = static_decoder(target, B, seq_len, graph)
    # replays launch no Triton code; an eager step may (FLA's recurrence), so it takes the lock per step
    step_lock = target_lock(target) if dec.graph is None else contextlib.nullcontext()
    with dec.lock:
        dec.reset()
        tok = seq[:, 0]
        for t in range(1, seq_len):
            with step_lock:
                h = dec.step(tok)  # position t - 1
            if t < p0:  # every row still inside its prompt (and no draw: sampling consumes what the cache path does)
                tok = seq[:, t]
                continue
            tok = torch.where(in_prompt_BT[:, t], seq[:, t], _choose(target, h, temperature, generator))
            seq[:, t] = tok


def ends_at_stop(tokens: list[int], start: int, stop_ids, text_end: "TextEnd | None" = None) -> int:
    """The length of `tokens` up to and including its natural end at or after `start` (`first_end`); len(tokens)
    when it has none."""
    return first_end(tokens, start, stop_ids, text_end)[0]


def first_end(tokens: list[int], start: int, stop_ids, text_end: "TextEnd | None" = None) -> tuple[int, str]:
    """(length, why): the one cut of every writer. The first stop token at or after `start` (EOS / end of turn, kept:
    why 'eos'); with `text_end` (a code suite's rule, `dflash.data.stops`), the token completing a stop sequence or
    the dedent below the prompt's body, when it comes before that stop token ('stop' / 'dedent'); else
    (len(tokens), 'length')."""
    stops = set(int(t) for t in stop_ids)
    n, why = len(tokens), "length"
    for i in range(start, len(tokens)):
        if int(tokens[i]) in stops:
            n, why = i + 1, "eos"
            break
    if text_end is not None:  # the text before the stop token: a decoded end token must not read as a dedent
        hit = text_end.cut(tokens[start:n - 1 if why == "eos" else n])
        if hit is not None:
            n, why = start + hit[0], hit[1]
    return n, why
