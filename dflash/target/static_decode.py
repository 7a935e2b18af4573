"""One-token decode steps with every state preallocated, replayed as a CUDA graph (docs/data.md, "Writing").

transformers' cached decode of a hybrid Gated-DeltaNet target runs ~3,600 small ops a step for the reference
target (mask building, cache bookkeeping; host-bound at 1,024 rows, RESULTS.md, 2026-12-01), its caches grow by
concatenation, so no step has the same shapes as the last and nothing can be captured, and its chunked prefill
autotunes Triton kernels per batch shape (62 s before the first 4,096-row batch on an H200). Measured side by
side (`benchmarks/gpu/decode_speed.py`, RESULTS.md, 2026-12-01): at 4,096 rows x 320 tokens this decoder writes
1.26x the tokens per second (9.1 ms a step, GPU time) and its first batch takes 3.4 s.

`StaticDecoder` holds B rows of one decoder's state for up to L positions — each Gated-DeltaNet layer's conv
window [B, C, K] and recurrent state [B, Hv, dk, dv] (float32, as transformers keeps it), each attention layer's
keys and values [B, Hkv, L, d] — and updates all of it in place. Every row is at the same position (the online
writer feeds a row still inside its prompt its own prompt token, `dflash.data.writing.write_continuations`), kept
on the device, so a step is a fixed sequence of kernels on fixed addresses: captured once, replayed per token.

The step is wired from the decoder's own modules (embedding, norms, projections, MLPs, rotary embedding) and
the recurrence function transformers bound (FLA's fused kernel when it imports, else torch's), so it computes
what transformers computes; only the attention over the static keys (masked past the position) and the
short convolution's window are written here. A test holds the tokens equal to transformers' cached decode.

Builders by model type in `STATIC_DECODERS` (`qwen3_5`: Gated DeltaNet + gated attention + dense MLP). A type
without one (`qwen3_next`: fused q/k/v/z projections in another layout, a sparse MoE) decodes through
transformers' cache.
"""
from __future__ import annotations

import logging
import sys
import threading

import torch
import torch.nn.functional as F

from dflash.registry import Registry

log = logging.getLogger(__name__)

STATIC_DECODERS: Registry = Registry("target model type (static decode)")


class StaticDecoder:
    """B rows of a decoder's state up to `max_len` positions; `step(tok_B)` feeds one token per row at the
    current position and returns the decoder's last hidden state [B, 1, H] (a buffer the next step overwrites)."""

    def __init__(self, target, rows: int, max_len: int, graph: bool):
        self.target, self.rows, self.max_len = target, rows, max_len
        self.lock = threading.Lock()  # one batch at a time through these states
        self.decoder = target.decoder
        dev, dt = target.device, target.dtype
        self.layers = list(self.decoder.layers)
        self.modeling = sys.modules[type(self.layers[0]).__module__]
        self.pos = torch.zeros((), dtype=torch.long, device=dev)  # every row's position, on the device
        self.positions_L = torch.arange(max_len, device=dev)
        self.tok_B = torch.zeros(rows, dtype=torch.long, device=dev)
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.layers:
            if hasattr(layer, "linear_attn"):
                m = layer.linear_attn
                conv = torch.zeros(rows, m.conv_dim, m.conv_kernel_size, dtype=dt, device=dev)
                rec = torch.zeros(rows, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32, device=dev)
                self.states.append((conv, rec))
            else:
                a = layer.self_attn
                kv_heads = a.k_proj.out_features // a.head_dim
                shape = (rows, kv_heads, max_len, a.head_dim)
                self.states.append((torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)))
        self.graph = None
        self.hidden_B1H = None
        if graph and dev.type == "cuda":
            self._capture()

    def reset(self) -> None:
        """Back to position 0 with zero states (a new batch of prompts)."""
        self.pos.zero_()
        for a, b in self.states:
            a.zero_()
            b.zero_()

    def step(self, tok_B: torch.Tensor) -> torch.Tensor:
        self.tok_B.copy_(tok_B)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.hidden_B1H = self._forward()
        self.pos.add_(1)
        return self.hidden_B1H

    # -- the step -------------------------------------------------------------------------------------------
    def _forward(self) -> torch.Tensor:
        dec = self.decoder
        h = dec.embed_tokens(self.tok_B[:, None])
        # [3, B, 1]: the text positions of the three rotary sections, as the decoder hands them to its rotary
        # embedding (transformers 5.17 indexes three dims; 5.24 expands a [B, T] to them)
        pos_3B1 = self.pos.view(1, 1, 1).expand(3, self.rows, 1)
        cos, sin = dec.rotary_emb(h, pos_3B1)
        visible_L = self.positions_L <= self.pos  # keys written so far (this step's included)
        for layer, state in zip(self.layers, self.states):
            x = layer.input_layernorm(h)
            if hasattr(layer, "linear_attn"):
                x = self._gdn(layer.linear_attn, x, *state)
            else:
                x = self._attention(layer.self_attn, x, cos, sin, visible_L, *state)
            h = h + x
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return dec.norm(h)

    def _gdn(self, m, x_B1D: torch.Tensor, conv_BCK: torch.Tensor, rec_BHKV: torch.Tensor) -> torch.Tensor:
        """Gated DeltaNet, one token (Yang et al. 2024, as transformers' Qwen3_5GatedDeltaNet decodes it)."""
        B = x_B1D.shape[0]
        window = torch.cat([conv_BCK[:, :, 1:], m.in_proj_qkv(x_B1D).transpose(1, 2)], dim=-1)
        conv_BCK.copy_(window)  # the last K inputs: what the causal convolution sees next step
        w_CK = m.conv1d.weight.squeeze(1)
        mixed = (window.float() * w_CK.float()).sum(-1)
        if m.conv1d.bias is not None:
            mixed = mixed + m.conv1d.bias.float()
        mixed = F.silu(mixed).to(x_B1D.dtype)[:, None]  # [B, 1, C]
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = q.reshape(B, 1, -1, m.head_k_dim), k.reshape(B, 1, -1, m.head_k_dim)
        v = v.reshape(B, 1, -1, m.head_v_dim)
        if m.num_v_heads > m.num_k_heads:  # grouped value heads: each q/k head serves consecutive v heads
            q = q.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)
            k = k.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=2)
        beta = m.in_proj_b(x_B1D).sigmoid()
        g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(x_B1D).float() + m.dt_bias)
        out, final = self.modeling.torch_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=rec_BHKV, output_final_state=True, use_qk_l2norm_in_kernel=True)
        rec_BHKV.copy_(final)
        z = m.in_proj_z(x_B1D).reshape(-1, m.head_v_dim)
        out = m.norm(out.reshape(-1, m.head_v_dim), z).reshape(B, 1, -1)
        return m.out_proj(out)

    def _attention(self, a, x_B1D, cos, sin, visible_L, k_BHLD, v_BHLD) -> torch.Tensor:
        """Qwen3.5's gated attention (output gate, q/k RMSNorm, partial rotary) over the static keys."""
        B, d = x_B1D.shape[0], a.head_dim
        q, gate = torch.chunk(a.q_proj(x_B1D).view(B, 1, -1, 2 * d), 2, dim=-1)
        q = a.q_norm(q).transpose(1, 2)
        k = a.k_norm(a.k_proj(x_B1D).view(B, 1, -1, d)).transpose(1, 2)
        v = a.v_proj(x_B1D).view(B, 1, -1, d).transpose(1, 2)
        q, k = self.modeling.apply_rotary_pos_emb(q, k, cos, sin)
        at = self.pos.view(1)
        k_BHLD.index_copy_(2, at, k)
        v_BHLD.index_copy_(2, at, v)
        out = F.scaled_dot_product_attention(q, k_BHLD, v_BHLD, attn_mask=visible_L.view(1, 1, 1, -1),
                                             scale=a.scaling, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, 1, -1) * torch.sigmoid(gate.reshape(B, 1, -1))
        return a.o_proj(out)

    # -- capture --------------------------------------------------------------------------------------------
    def _capture(self) -> None:
        """Warm-up steps on a side stream (Triton autotuning, lazy inits), then one captured step. A failure
        leaves the eager step in place, logged: slower, same tokens."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.hidden_B1H = self._forward()
            self.graph = graph
            self.reset()
        except Exception as e:  # noqa: BLE001 - any capture failure: decode eagerly instead
            log.warning("static decode: CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
            self.graph, self.hidden_B1H = None, None
            self.reset()


STATIC_DECODERS.register("qwen3_5", StaticDecoder)
STATIC_DECODERS.register("qwen3_5_text", StaticDecoder)


def supports_static(target) -> bool:
    return target.info.model_type in STATIC_DECODERS


_KEEP = 2  # decoders kept per target (the online writer's shape and the eval's): their graphs and states


def static_decoder(target, rows: int, max_len: int, graph: bool) -> StaticDecoder:
    """The target's decoder for (rows, max_len, graph), built once and kept (a capture costs warm-up steps)."""
    cache = target.__dict__.setdefault("_static_decoders", {})
    key = (rows, max_len, graph)
    if key not in cache:
        while len(cache) >= _KEEP:
            cache.pop(next(iter(cache)))
        cache[key] = STATIC_DECODERS[target.info.model_type](target, rows, max_len, graph)
    return cache[key]
