"""DFlash draft model for Transformers: `AutoModel.from_pretrained(folder, trust_remote_code=True)`.

The dflash export copies this file, unchanged, into every serving folder it writes (`auto_map` in config.json
points here), so it imports only torch and transformers: never the dflash package that wrote it.

The model (Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036), with the
module names and forward arguments of the reference `DFlashDraftModel` (z-lab/dflash):
- `target_hidden` [B, C, n·H]: the target's hidden states at `dflash_config.target_layer_ids`, concatenated
  on the feature axis; `fc` then `hidden_norm` make the context feature.
- `noise_embedding` [B, Q, H]: the target's embedding of the block (anchor, mask, ..., mask).
- `position_ids` [B, C + Q]: positions of the context tokens, then of the block.
- In every layer Q comes from the block only; K and V from cat(context feature, block) with the same weights.
  Full-attention layers: the block sees all context and itself in both directions. Sliding-attention layers
  (`layer_types`, `sliding_window`): keys with q_pos - k_pos < sliding_window only, causal inside the block
  (as SGLang, vLLM and z-lab run such layers unless `is_causal` says otherwise).
- No embedding or LM head: `compute_logits(hidden, output_head)` applies the target's.
- `spec_generate(target, input_ids, max_new_tokens, ...)`: z-lab's entry point, greedy only, lossless.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("DFlash config has no rope_theta (rope_parameters.rope_theta)")
    return float(theta)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _rotate(x_BhSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    half = x_BhSd.shape[-1] // 2
    rotated = torch.cat([-x_BhSd[..., half:], x_BhSd[..., :half]], dim=-1)
    return x_BhSd * cos_BSd[:, None] + rotated * sin_BSd[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        H, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = sliding if is_causal is None else bool(is_causal)

    def _mask(self, q_pos_BQ: torch.Tensor, k_pos_BK: torch.Tensor) -> torch.Tensor | None:
        if self.sliding_window is None and not self.is_causal:
            return None  # the block sees everything: context and itself, both directions
        diff = q_pos_BQ[:, :, None] - k_pos_BK[:, None, :]
        visible = torch.ones_like(diff, dtype=torch.bool)
        if self.sliding_window is not None:
            visible &= diff < self.sliding_window
            if not self.is_causal:
                visible &= -diff < self.sliding_window
        if self.is_causal:
            visible &= diff >= 0
        return visible[:, None]

    def forward(self, block_BQH, ctx_BCH, cos_BSd, sin_BSd, pos_BS, past_key_values=None):
        B, Q, _ = block_BQH.shape
        kv_in = torch.cat([ctx_BCH, block_BQH], dim=1)
        S = kv_in.shape[1]
        q = self.q_norm(self.q_proj(block_BQH).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _rotate(q, cos_BSd[:, -Q:], sin_BSd[:, -Q:])
        k = _rotate(k, cos_BSd, sin_BSd)
        k_pos = pos_BS
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
            # the cache holds consecutive positions ending with this call's block
            K = k.shape[2]
            k_pos = pos_BS[:, -1:] - (K - 1) + torch.arange(K, device=k.device)
        mask = self._mask(pos_BS[:, -Q:], k_pos)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, h, ctx, cos, sin, pos, past_key_values=None):
        # the context feature does not pass through the input norm (as in the reference implementation)
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, pos, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash.get("target_layer_ids", getattr(config, "target_layer_ids", [])))
        if not self.target_layer_ids:
            raise ValueError("DFlash config must define dflash_config.target_layer_ids")
        self.mask_token_id = dflash.get("mask_token_id", getattr(config, "mask_token_id", None))
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.num_target_layers = getattr(config, "num_target_layers", None)
        H = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.rope_theta = _rope_theta(config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def _rope(self, pos_BS: torch.Tensor, dtype: torch.dtype):
        d = self.layers[0].self_attn.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, device=pos_BS.device,
                                                            dtype=torch.float32) / d))
        freqs = pos_BS.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, position_ids: torch.LongTensor, noise_embedding: torch.Tensor,
                target_hidden: torch.Tensor, attention_mask=None, past_key_values=None, use_cache: bool = False,
                **kwargs) -> torch.Tensor:
        """Final hidden states of the block [B, Q, H]; block position k predicts token anchor + k."""
        if attention_mask is not None:
            raise ValueError("DFlashDraftModel builds its own attention masks; pass attention_mask=None")
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        h = noise_embedding.to(self.fc.weight.dtype)
        cos, sin = self._rope(position_ids, h.dtype)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, position_ids, cache)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor, output_head) -> torch.Tensor:
        """`output_head`: the target's LM head (a module, or its [V, H] weight)."""
        if isinstance(output_head, torch.Tensor):
            return hidden @ output_head.to(hidden.dtype).T
        return output_head(hidden)

    @torch.no_grad()
    def spec_generate(self, target, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0, **kwargs) -> torch.LongTensor:
        """Greedy speculative decoding with `target` (a transformers causal LM): each round drafts block_size - 1
        tokens after the last committed one, the target checks them in one forward, and the longest matching
        prefix plus the target's own next token are committed, so the output is the target's greedy output.
        The target runs over the whole sequence each round (no target cache): simple, and right for hybrid
        targets too, whose recurrent state a cache crop would not roll back. Returns prompt + new tokens."""
        if temperature > 0 or input_ids.shape[0] != 1:
            raise NotImplementedError("spec_generate here is greedy (temperature 0) with one sequence")
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        stops = set(stop_token_ids or [])
        P, bs = input_ids.shape[1], self.block_size

        def verify(seq):
            out = target(seq, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
            return out.logits.argmax(-1)[0], feats

        preds, feats = verify(input_ids)
        seq = torch.cat([input_ids, preds[-1:][None]], dim=1)
        while seq.shape[1] - P < max_new_tokens and int(seq[0, -1]) not in stops:
            L = seq.shape[1]  # the anchor seq[L-1] sits at position L-1; features are known for 0..L-2
            ids = torch.full((1, bs), int(self.mask_token_id), dtype=torch.long, device=seq.device)
            ids[0, 0] = seq[0, -1]
            hidden = self(position_ids=torch.arange(L - 1 + bs, device=seq.device)[None],
                          noise_embedding=F.embedding(ids, embed), target_hidden=feats[:, :L - 1])
            draft = self.compute_logits(hidden[:, 1:], head).argmax(-1)  # [1, bs-1]
            preds, feats = verify(torch.cat([seq, draft], dim=1))
            want = preds[L - 1:]  # the target's next token after the anchor and after each draft token
            m = int((draft[0] == want[:-1]).int().cumprod(0).sum())
            new = torch.cat([draft[0, :m], want[m:m + 1]])
            hit = [k for k, t in enumerate(new.tolist()) if t in stops]
            seq = torch.cat([seq, new[:hit[0] + 1 if hit else None][None]], dim=1)
        return seq[:, :P + max_new_tokens]
