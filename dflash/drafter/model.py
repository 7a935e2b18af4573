"""The DFlash drafter (docs/DESIGN.md, "The drafter"; Chen et al., "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036).

- Context feature: target hidden states at `target_layer_ids`, concatenated on the feature axis,
  `fc` (n·H → H, no bias) then `hidden_norm` (RMSNorm).
- Qwen3-style decoder layers. In every layer Q comes only from the block tokens; K and V are projected
  from cat(context feature, block hidden) with the same weights (KV injection), q_norm/k_norm per head.
  The context feature does not pass through the layer's input norm (as in the reference implementation).
- RoPE with absolute positions: context token j sits at position j, block token k of anchor a at a + k.
- No embedding or LM head of its own: the target's, frozen, are attached as non-persistent buffers.
- Training attention runs through a kernel chosen by `attn_kernel` (dflash/drafter/attention.py: SDPA with a
  bool mask, or FlexAttention with a block-sparse mask); inference is plain SDPA (no mask in full layers).
- Per-layer attention (`layer_types`, `sliding_window`): "full_attention" or "sliding_attention" (window W,
  causal inside the block, as SGLang / vLLM / z-lab run such layers). The published Qwen3.6-27B drafter: 4
  sliding (2,048) + 1 full. At inference a windowed layer's cache keeps only the context its next blocks can see.

Module and parameter names follow the reference `DFlashDraftModel` (z-lab/dflash `dflash/model.py`), so
the serving export is a plain state-dict save.

`drafter.architecture=dflash2` (docs/dflash2.md) adds DFlash 2's pieces to the same layers: two
`GroupedDynamicCausalConv` per layer (dflash/drafter/conv.py: `attention_conv` around attention, `mlp_conv` around
the MLP, each block convolved on its own), a `CandidateSelector` (dflash/drafter/selector.py) that picks each
position's draft token among the unary top-k (`draft`), logits scaled by `output_multiplier` and soft-capped at
`final_logit_softcapping`, and windowed layers that see their whole block (`sliding_causal: false`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.conv import GroupedDynamicCausalConv
from dflash.drafter.selector import CandidateSelector, SelectorWalk
from dflash.registry import Registry
from dflash.drafter.attention import (  # noqa: F401 (training_mask: re-export)
    ATTN_KERNELS,
    FULL_ATTENTION,
    KernelMask,
    LayerAttention,
    attention_kernel,
    training_mask,
)

LOGITS_HEAD_ROWS = 32_768  # head rows upcast at a time by `DFlashDrafter.logits` (640 MB of float32 at H = 5,120)
LAYER_TYPES = ("full_attention", "sliding_attention")  # the names config.json's `layer_types` uses
# drafter.architecture → the serving class its folder names (config.json `architectures`)
ARCHITECTURES: Registry[str] = Registry("drafter.architecture", {"dflash": "DFlashDraftModel",
                                                                 "dflash2": "DFlash2DraftModel"})


@dataclass
class DrafterConfig:
    num_layers: int = 2  # published drafters: 5
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # 0: the target's (its config.json rope_theta), resolved by `for_target`
    init_std: float = 0.02
    # Training only: anchors per attention call. A group's block queries attend to the context and their own
    # blocks' keys, not to every block of the sequence (all hidden by the mask anyway): at 256 anchors, 2,048
    # tokens and groups of 16 that is 2,304 keys per query instead of 6,144. 0: one call for all anchors.
    attn_group: int = 16
    # Training only: attention kernel (dflash/drafter/attention.py). "sdpa": SDPA, bool mask, anchor groups,
    # enable_gqa; "sdpa_expanded": the same with K/V heads copied out (for SDPA builds without masked GQA);
    # "flex": FlexAttention, one call over all anchors with a block-sparse mask, native GQA.
    attn_kernel: str = "sdpa"
    # One entry per layer, "full_attention" or "sliding_attention" (empty: all full). Sliding layers see context
    # positions p - j < sliding_window and are causal inside the block (as the serving engines run them).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0  # the window of the sliding layers (0: none)
    # Sliding layers causal inside the block (DFlash 1 as the engines serve it); DFlash 2: false (is_causal: false)
    sliding_causal: bool = True
    # "dflash" (DFlash 1) or "dflash2": the dynamic convolutions and the candidate selector (the keys below are
    # read by dflash2 only; docs/dflash2.md)
    architecture: str = "dflash"
    conv_kernel_size: int = 2  # taps K of each GroupedDynamicCausalConv
    conv_group_size: int = 16  # channels G sharing one dynamic kernel value
    selector_rank: int = 256  # r of the selector's codebooks
    selector_top_k: int = 16  # unary candidates per position the selector chooses among
    output_multiplier: float = 1.0  # logits = softcap(output_multiplier · h · W)
    final_logit_softcapping: float = 0.0  # c · tanh(logits / c); 0: none (training needs 0: the block losses'
    # fused LM-head path computes plain logits)

    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's `LayerAttention` (what its block queries see)."""
        types = self.layer_types or ["full_attention"] * self.num_layers
        return [LayerAttention(self.sliding_window, self.sliding_causal) if t == "sliding_attention"
                else FULL_ATTENTION for t in types]

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "dflash2"

    def for_target(self, target_rope_theta: float) -> "DrafterConfig":
        """This config with rope_theta = 0 replaced by the target's (the published drafters use their target's)."""
        return self if self.rope_theta > 0 else dataclasses.replace(self, rope_theta=float(target_rope_theta))


def validate_drafter_config(cfg: DrafterConfig) -> None:
    """The drafter's own checks; ValueError naming the key (dflash.config turns it into a ConfigError)."""
    if cfg.attn_kernel not in ATTN_KERNELS:
        raise ValueError(f"drafter.attn_kernel={cfg.attn_kernel!r} is not a known attention kernel; "
                         f"known: {', '.join(sorted(ATTN_KERNELS))}")
    ARCHITECTURES.check(cfg.architecture)
    if cfg.is_dflash2:
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(cfg, key) < 1:
                raise ValueError(f"drafter.{key}={getattr(cfg, key)} must be >= 1 for drafter.architecture=dflash2")
        if cfg.output_multiplier <= 0 or cfg.final_logit_softcapping < 0:
            raise ValueError(f"drafter.output_multiplier={cfg.output_multiplier} must be > 0 and "
                             f"drafter.final_logit_softcapping={cfg.final_logit_softcapping} >= 0 (0: no cap)")
    if cfg.rope_theta < 0:
        raise ValueError(f"drafter.rope_theta must be > 0, or 0 for the target's; got {cfg.rope_theta}")
    bad = [t for t in cfg.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"drafter.layer_types has {bad}; each entry must be one of {list(LAYER_TYPES)}")
    if cfg.layer_types and len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"drafter.layer_types has {len(cfg.layer_types)} entries but drafter.num_layers="
                         f"{cfg.num_layers}: one entry per layer (or none: all full_attention)")
    sliding = "sliding_attention" in cfg.layer_types
    if sliding and cfg.sliding_window < cfg.block_size:
        raise ValueError(f"drafter.sliding_window={cfg.sliding_window}: sliding_attention layers need a window "
                         f">= drafter.block_size={cfg.block_size}")
    if not sliding and cfg.sliding_window:
        raise ValueError(f"drafter.sliding_window={cfg.sliding_window} is set but no drafter.layer_types entry is "
                         f"\"sliding_attention\" (set 0, or name the windowed layers)")


def check_drafter_for_target(cfg: DrafterConfig, target_hidden_size: int, target_vocab_size: int) -> None:
    """The drafter keys whose valid values depend on the target's shapes (read from its config.json, no weights):
    ValueError naming the key before any work, where building the drafter would fail minutes later. The drafter's
    width is the target's hidden size."""
    if not cfg.is_dflash2:
        return
    if target_hidden_size % cfg.conv_group_size:
        raise ValueError(f"drafter.conv_group_size={cfg.conv_group_size} must divide the drafter's width, the "
                         f"target's hidden size {target_hidden_size} (channels share one dynamic kernel value per "
                         f"group)")
    if cfg.conv_kernel_size > cfg.block_size:
        raise ValueError(f"drafter.conv_kernel_size={cfg.conv_kernel_size} must be <= drafter.block_size="
                         f"{cfg.block_size} (a tap reaches back only inside its block)")
    if cfg.selector_top_k > target_vocab_size:
        raise ValueError(f"drafter.selector_top_k={cfg.selector_top_k} must be <= the target's vocabulary size "
                         f"{target_vocab_size}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [*positions.shape, head_dim] (Qwen3 / NeoX half-rotation layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                              dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BhSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BSd[:, None], sin_BSd[:, None]
    half = x_BhSd.shape[-1] // 2
    rotated = torch.cat([-x_BhSd[..., half:], x_BhSd[..., :half]], dim=-1)
    return x_BhSd * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, hidden: int, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(hidden, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_kv(self, x_BSH: torch.Tensor, cos, sin):
        """K (normed, rotated) and V of shape [B, kv_heads, S, d]."""
        B, S, _ = x_BSH.shape
        k = self.k_norm(self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, block_BQH, q_cos, q_sin, ctx_k, ctx_v, blk_cos, blk_sin, mask: KernelMask | None):
        """Block queries attend to [context K/V, block K/V]. `mask`: the training kernel with its mask, or None
        at inference (one block after the cache, sees everything)."""
        B, Q, _ = block_BQH.shape
        q = self.q_norm(self.q_proj(block_BQH).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, q_cos, q_sin)
        blk_k, blk_v = self.project_kv(block_BQH, blk_cos, blk_sin)
        k = torch.cat([ctx_k, blk_k], dim=2)
        v = torch.cat([ctx_v, blk_v], dim=2)
        if mask is None:  # no mask: SDPA's flash kernel takes GQA natively, whatever the training kernel
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out = mask.kernel.attend(q, k, v, mask.mask, self.num_heads, self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, hidden: int, cfg: DrafterConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(hidden, cfg)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(hidden, cfg.intermediate_size)
        if cfg.is_dflash2:  # DFlash 2: a dynamic causal conv around each sublayer (dflash/drafter/conv.py)
            self.attention_conv = GroupedDynamicCausalConv(hidden, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(hidden, cfg.conv_kernel_size, cfg.conv_group_size)

    def _around(self, conv: GroupedDynamicCausalConv | None, sublayer, x_BQH, stream_BQH):
        """stream + sublayer(x), or conv.finish(sublayer(conv.prepare(x)), stream) with every block of bs positions
        on its own (the finishing convolution adds the stream in its own pass)."""
        if conv is None:
            return stream_BQH + sublayer(x_BQH)
        B, Q, H = x_BQH.shape
        x_BnbH = x_BQH.view(B, Q // self.block_size, self.block_size, H)
        prepared, dyn = conv.prepare(x_BnbH)
        y_BQH = sublayer(prepared.reshape(B, Q, H))
        return conv.finish(y_BQH.view_as(x_BnbH), dyn, stream_BQH.view_as(x_BnbH)).reshape(B, Q, H)

    def forward(self, block_BQH, rope, ctx_kv, mask):
        q_cos, q_sin = rope
        attend = lambda x: self.self_attn(x, q_cos, q_sin, *ctx_kv, q_cos, q_sin, mask)  # noqa: E731
        h = self._around(getattr(self, "attention_conv", None), attend, self.input_layernorm(block_BQH), block_BQH)
        return self._around(getattr(self, "mlp_conv", None), self.mlp, self.post_attention_layernorm(h), h)


class DrafterCache:
    """Per-layer K/V of the context features only (block K/V are never cached: each round's block is new).

    At inference the context features are computed once per committed token and kept here; after a
    round, `crop(n)` drops whatever lies beyond the committed length. A windowed layer (window W) keeps only
    the last W - 1 + `slack` positions: its next block's anchor sees W - 1 of them, and `slack` (one block) is
    room for a rollback. `first[i]` is the position of layer i's oldest kept entry.
    """

    def __init__(self, num_layers: int, windows: list[int | None] | None = None, slack: int = 0):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.windows = list(windows) if windows is not None else [None] * num_layers
        self.first = [0] * num_layers
        self.slack = slack
        self.length = 0  # committed context positions (all layers)

    def append(self, layer: int, k, v):
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=2)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def crop(self, length: int) -> None:
        """Keep positions < length. A rollback past what a windowed layer still keeps empties the cache
        (length 0): the caller extends again from `length` (the evaluation revisits earlier positions so)."""
        length = min(length, self.length)
        if any(w is not None and self.first[i] > max(0, length - (w - 1)) for i, w in enumerate(self.windows)):
            self.k, self.v = [None] * len(self.k), [None] * len(self.v)
            self.first, self.length = [0] * len(self.k), 0
            return
        for i in range(len(self.k)):
            if self.k[i] is not None:
                keep = length - self.first[i]
                self.k[i], self.v[i] = self.k[i][:, :, :keep], self.v[i][:, :, :keep]
        self.length = length

    def trim(self) -> None:
        """Drop what no later block of a windowed layer can see (memory: the window, not the whole context)."""
        for i, w in enumerate(self.windows):
            drop = self.length - (w - 1 + self.slack) - self.first[i] if w is not None else 0
            if drop > 0 and self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][:, :, drop:], self.v[i][:, :, drop:]
                self.first[i] += drop


def _per_group(x_BhTd: torch.Tensor, G: int) -> torch.Tensor:
    """[B, ...] → [B·G, ...], each batch row repeated for its G anchor groups (row b·G + g)."""
    B = x_BhTd.shape[0]
    return x_BhTd[:, None].expand(B, G, *x_BhTd.shape[1:]).reshape(B * G, *x_BhTd.shape[1:])


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, hidden_size: int, num_target_layers: int, mask_token_id: int,
                 target_layer_ids: list[int], vocab_size: int | None = None):
        """`vocab_size`: the target's; DFlash 2 needs it (the selector's codebooks have a row per token)."""
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.block_size = cfg.block_size
        self.mask_token_id = mask_token_id
        self.target_layer_ids = list(target_layer_ids)
        self.num_target_layers = num_target_layers
        validate_drafter_config(cfg)  # unknown kernel, bad layer_types: ValueError here, at build time
        self.attn_kernel = attention_kernel(cfg.attn_kernel)
        self.layer_attention = cfg.layer_attention()
        self.fc = nn.Linear(len(target_layer_ids) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(hidden_size, cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.candidate_selector: CandidateSelector | None = None
        if cfg.is_dflash2:
            if not vocab_size:
                raise ValueError("drafter.architecture=dflash2 needs the target's vocab_size (the selector's "
                                 "codebooks have one row per token)")
            self.candidate_selector = CandidateSelector(hidden_size, vocab_size, cfg.selector_rank,
                                                        cfg.selector_top_k, cfg.init_std)
        self.register_buffer("embed_VH", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_VH", torch.empty(0), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.cfg.init_std)
        for m in self.modules():  # DFlash 2: the convs start as the identity, the selector's own init
            if isinstance(m, (GroupedDynamicCausalConv, CandidateSelector)):
                m.reset_parameters()

    def attach_target_head(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """Share the target's frozen embedding and LM head (no copy when on the same device)."""
        dev = self.fc.weight.device
        self.embed_VH = embed_VH.detach().to(dev)
        self.lm_head_VH = lm_head_VH.detach().to(dev)

    # -- shared pieces ---------------------------------------------------------------------------
    def context(self, features_BTLH: torch.Tensor) -> torch.Tensor:
        """[B, T, L, H] target features → fused context [B, T, H]."""
        B, T, L, H = features_BTLH.shape
        return self.hidden_norm(self.fc(features_BTLH.reshape(B, T, L * H).to(self.fc.weight.dtype)))

    def block_embeddings(self, anchor_tokens_BN: torch.Tensor) -> torch.Tensor:
        """[B, N] anchor tokens → [B, N·bs, H] embeddings of (anchor, mask, …, mask)."""
        B, N = anchor_tokens_BN.shape
        ids = torch.full((B, N, self.block_size), self.mask_token_id, dtype=torch.long,
                         device=anchor_tokens_BN.device)
        ids[:, :, 0] = anchor_tokens_BN
        return F.embedding(ids.view(B, -1), self.embed_VH).to(self.fc.weight.dtype)

    def _rope(self, positions_BS: torch.Tensor, dtype):
        if self.cfg.rope_theta <= 0:  # trainer, eval and export resolve it before building; a bare build may not
            raise ValueError("drafter.rope_theta=0 (the target's) was not resolved: build the drafter from "
                             "cfg.for_target(target_rope_theta)")
        return rope_cos_sin(positions_BS, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def _run_layers(self, block_BQH, blk_pos_BQ, ctx_kv_per_layer, masks):
        """`masks`: one per layer (a KernelMask, or None: no mask, the whole context and block visible)."""
        rope = self._rope(blk_pos_BQ, block_BQH.dtype)
        h = block_BQH
        for layer, ctx_kv, mask in zip(self.layers, ctx_kv_per_layer, masks):
            h = layer(h, rope, ctx_kv, mask)
        return self.norm(h)

    # -- training --------------------------------------------------------------------------------
    def forward(self, features_BTLH: torch.Tensor, anchors_BN: torch.Tensor,
                anchor_tokens_BN: torch.Tensor) -> torch.Tensor:
        """Training forward over N blocks per sequence at once. Returns the final hidden states of block
        positions 1..bs-1, shape [B, N, bs-1, H]; position k predicts token anchor + k.

        With a kernel that groups anchors (SDPA), anchors run in G groups of g (`attn_group`) as a batch of
        B·G: each group gets the whole context's K/V and its own blocks. Same result as one call over all N
        blocks (tested), less attention work. A block-sparse kernel (flex) skips the unseen tiles itself and
        takes all N in one call. The mask is built once here for each distinct layer attention (full,
        windowed) and shared by the layers that have it."""
        B, T = features_BTLH.shape[:2]
        N, bs = anchors_BN.shape[1], self.block_size
        ctx = self.context(features_BTLH)
        ctx_pos = torch.arange(T, device=ctx.device).expand(B, T)
        ctx_cos, ctx_sin = self._rope(ctx_pos, ctx.dtype)
        ctx_kv = [layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin) for layer in self.layers]
        grouped = self.attn_kernel.groups_anchors and 0 < self.cfg.attn_group < N
        g = self.cfg.attn_group if grouped else N
        G = -(-N // g)
        if G * g != N:  # pad with copies of the last anchor; their outputs are dropped below
            pad_BP = anchors_BN[:, -1:].expand(B, G * g - N)
            anchors_BN = torch.cat([anchors_BN, pad_BP], dim=1)
            anchor_tokens_BN = torch.cat([anchor_tokens_BN, anchor_tokens_BN[:, -1:].expand_as(pad_BP)], dim=1)
        if G > 1:
            ctx_kv = [(_per_group(k, G), _per_group(v, G)) for k, v in ctx_kv]
        anchors_Mg = anchors_BN.reshape(B * G, g)  # M = B·G attention batches
        blk_pos = (anchors_Mg[:, :, None] + torch.arange(bs, device=ctx.device)).view(B * G, g * bs)
        kinds = {a: KernelMask(self.attn_kernel, self.attn_kernel.mask(anchors_Mg, T, bs, a))
                 for a in dict.fromkeys(self.layer_attention)}  # one mask per kind, in layer order
        masks = [kinds[a] for a in self.layer_attention]
        h = self._run_layers(self.block_embeddings(anchor_tokens_BN.reshape(B * G, g)), blk_pos, ctx_kv, masks)
        return h.view(B, G * g, bs, -1)[:, :N, 1:]

    # -- inference -------------------------------------------------------------------------------
    def new_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers), [a.window for a in self.layer_attention], slack=self.block_size)

    @torch.no_grad()
    def extend_context(self, cache: DrafterCache, features_BTLH: torch.Tensor, start: int) -> None:
        """Append context features for positions start..start+T-1 to the cache (after cropping to start)."""
        cache.crop(start)
        if cache.length != start:  # a gap, or a rollback that emptied the cache: positions would be wrong
            raise ValueError(f"extend_context(start={start}): the drafter cache holds {cache.length} positions; "
                             f"extend from cache.length")
        B, T = features_BTLH.shape[:2]
        ctx = self.context(features_BTLH)
        pos = torch.arange(start, start + T, device=ctx.device).expand(B, T)
        cos, sin = self._rope(pos, ctx.dtype)
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.self_attn.project_kv(ctx, cos, sin))
        cache.length = start + T
        cache.trim()

    def _inference_masks(self, cache: DrafterCache, B: int, device) -> list[KernelMask | None]:
        """Full layers: None (plain SDPA, nothing hidden). Windowed layers: their one block's training mask over
        the positions their cache keeps, through the "sdpa" kernel (so training and inference share one mask)."""
        anchors_B1 = torch.full((B, 1), cache.length, device=device)
        built: dict[tuple, KernelMask] = {}  # windowed layers with one window keep the same positions: one mask
        masks: list[KernelMask | None] = []
        for a, first in zip(self.layer_attention, cache.first):
            if a.window is not None and (a, first) not in built:
                m = training_mask(anchors_B1, cache.length - first, self.block_size, a, first)
                built[a, first] = KernelMask(ATTN_KERNELS["sdpa"], m[:, None])
            masks.append(None if a.window is None else built[a, first])
        return masks

    @torch.no_grad()
    def draft_hidden(self, cache: DrafterCache, anchor_tokens_B: torch.Tensor) -> torch.Tensor:
        """One block after the cached context: anchor at position cache.length. Returns [B, bs-1, H]."""
        B, bs = anchor_tokens_B.shape[0], self.block_size
        start = cache.length
        blk_pos = torch.arange(start, start + bs, device=anchor_tokens_B.device).expand(B, bs)
        ctx_kv = list(zip(cache.k, cache.v))
        masks = self._inference_masks(cache, B, anchor_tokens_B.device)
        h = self._run_layers(self.block_embeddings(anchor_tokens_B[:, None]), blk_pos, ctx_kv, masks)
        return h[:, 1:]

    def logits(self, hidden_BKH: torch.Tensor, rows: int = LOGITS_HEAD_ROWS) -> torch.Tensor:
        """float32 logits [..., V] (the evaluation's and the serving bench's proposals). A low-precision head is
        upcast `rows` vocabulary rows at a time: a float32 product as before, without a float32 copy of the whole
        head on every draft (5 GB at V = 248,320, H = 5,120)."""
        hidden, head_VH = hidden_BKH.float(), self.lm_head_VH
        if head_VH.dtype == torch.float32:
            return self.shape_logits(hidden @ head_VH.T)
        out = hidden.new_empty(*hidden.shape[:-1], head_VH.shape[0])
        for v in range(0, head_VH.shape[0], rows):
            out[..., v:v + rows] = hidden @ head_VH[v:v + rows].float().T
        return self.shape_logits(out)

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """DFlash 2's output_multiplier and tanh soft cap (DFlash 1: 1 and none, the logits unchanged)."""
        c = self.cfg
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping > 0:
            logits = c.final_logit_softcapping * torch.tanh(logits / c.final_logit_softcapping)
        return logits

    @torch.no_grad()
    def draft(self, hidden_SKH: torch.Tensor, anchor_S: torch.Tensor, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> SelectorWalk | torch.Tensor:
        """The draft tokens [..., K] of blocks whose final hidden states are `hidden` and anchors `anchor`:
        DFlash 1 the argmax of each position's logits; DFlash 2 the selector's walk (a `SelectorWalk`, whose
        candidates and scores give q over the k candidates; greedy at temperature 0)."""
        logits = self.logits(hidden_SKH)
        if self.candidate_selector is None:
            return logits.argmax(-1)
        return self.candidate_selector.walk(hidden_SKH, logits, anchor_S.to(logits.device), temperature, generator)

    def draft_tokens(self, hidden_SKH: torch.Tensor, anchor_S: torch.Tensor) -> torch.Tensor:
        """The greedy draft [..., K] (what greedy verification checks), DFlash 1 or 2."""
        out = self.draft(hidden_SKH, anchor_S)
        return out.tokens if isinstance(out, SelectorWalk) else out


def greedy_draft(drafter, hidden_SKH: torch.Tensor, anchor_S: torch.Tensor) -> torch.Tensor:
    """The greedy draft [..., K] of any drafter with `logits` (tests' oracles too): the argmax per position, or a
    DFlash 2 drafter's selector walk."""
    if getattr(drafter, "candidate_selector", None) is not None:
        return drafter.draft_tokens(hidden_SKH, anchor_S)
    return drafter.logits(hidden_SKH).argmax(-1)


def build_drafter(cfg: DrafterConfig, hidden_size: int, num_target_layers: int, mask_token_id: int,
                  target_layer_ids: list[int], vocab_size: int | None = None) -> DFlashDrafter:
    return DFlashDrafter(cfg, hidden_size, num_target_layers, mask_token_id, target_layer_ids, vocab_size)
