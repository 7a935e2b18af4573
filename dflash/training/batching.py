"""Turn buffered items into one drafter training batch (docs/DESIGN.md, "The drafter": random anchors per sequence).

Everything random here (anchors, feature noise) is drawn from generators seeded by
(run seed, epoch, sequence index): anchors are re-drawn every epoch, and a resumed run draws exactly
what the uninterrupted run drew, whatever order the buffer hands items out in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.training.lm_head_loss import IGNORE_INDEX
from dflash.training.noise import NoiseSchedule
from dflash.training.pipeline import Item


@dataclass
class DrafterBatch:
    features_BTLH: torch.Tensor
    anchors_BN: torch.Tensor
    anchor_tokens_BN: torch.Tensor
    labels_BNK: torch.Tensor  # IGNORE_INDEX where the block is padding
    soft_vals_BNKk: torch.Tensor | None
    soft_idx_BNKk: torch.Tensor | None
    num_tokens: int  # data tokens in the batch (host int, no sync)


def item_seed(seed: int, epoch: int, index: int) -> int:
    return (seed * 1_000_003 + epoch) * 1_000_033 + index


def draw_anchors(length: int, block_size: int, num_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors a ∈ [1, length − block_size + 1]: at least one context token before the anchor, and the
    target's labels for positions a .. a+bs−2 exist."""
    hi = length - block_size + 1
    if hi < 1:
        return torch.empty(0, dtype=torch.long)
    perm = torch.randperm(hi, generator=gen)[:num_anchors] + 1
    return perm.sort().values


def masked_tokens(items) -> int | None:
    """The items' tokens inside their loss masks (a conversation's assistant tokens; an item without a mask
    counts whole), for `data/trained_tokens`; None when no item has a mask. The masks live on the host: no
    device sync."""
    if all(it.loss_mask_T is None for it in items):
        return None
    return sum(int(it.loss_mask_T.sum()) if it.loss_mask_T is not None else int(it.tokens_T.numel())
               for it in items)


def label_mask(loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Label position p (the target's prediction of token p + 1) is trained iff token p + 1 is: [L] bool."""
    return torch.cat([loss_mask_T[1:].bool(), torch.zeros(1, dtype=torch.bool)])


def draw_masked_anchors(loss_mask_T: torch.Tensor, num_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors of a sequence trained only where `loss_mask_T` is True (a conversation's assistant tokens): every
    anchor a in [1, length - 2] whose first prediction, token a + 1, is trained. A block may run past the
    sequence's end or out of its span; those positions carry no label (`label_mask`). Same RNG use as
    `draw_anchors`: one permutation per item and epoch."""
    ok = label_mask(loss_mask_T)
    ok[0] = False  # at least one context token before the anchor
    allowed = ok.nonzero().flatten()
    if allowed.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    perm = torch.randperm(allowed.numel(), generator=gen)[:num_anchors]
    return allowed[perm].sort().values


def make_batch(items: list[Item], *, block_size: int, num_anchors: int, seed: int,
               noise: NoiseSchedule, sigma: float, device: torch.device, pad_multiple: int = 1,
               fixed_anchors: bool = False) -> DrafterBatch:
    """`pad_multiple` rounds the batch length up and `fixed_anchors` gives every batch `num_anchors` blocks
    (the extra ones are padding, labels IGNORE_INDEX), so a compiled drafter sees few distinct shapes. Exact: the
    padded context lies past every real anchor, where the block mask hides it."""
    B = len(items)
    T = max(it.tokens_T.numel() for it in items)
    T = -(-T // pad_multiple) * pad_multiple
    L, H = items[0].features_TLH.shape[-2:]
    K = block_size - 1
    anchors = [_anchors(it, block_size, num_anchors, torch.Generator().manual_seed(item_seed(seed, it.epoch, it.index)))
               for it in items]
    N = num_anchors if fixed_anchors else max(max(a.numel() for a in anchors), 1)
    feats = torch.zeros(B, T, L, H, dtype=items[0].features_TLH.dtype, device=device)
    anchors_BN = torch.ones(B, N, dtype=torch.long)
    valid_BN = torch.zeros(B, N, dtype=torch.bool)
    for b, (it, a) in enumerate(zip(items, anchors)):
        f = it.features_TLH.to(device, non_blocking=True)
        if sigma > 0:  # re-seeded per item: the noise of an item never depends on what came before it
            f = noise.add(f, sigma, _noise_generator(device).manual_seed(item_seed(seed, it.epoch, it.index) + 7))
        feats[b, : f.shape[0]] = f
        anchors_BN[b, : a.numel()] = a
        valid_BN[b, : a.numel()] = True
    anchors_BN, valid_BN = _to_device(anchors_BN, device), _to_device(valid_BN, device)
    pos_BNK = anchors_BN[:, :, None] + torch.arange(K, device=device)  # label positions a .. a+K-1
    tokens = torch.stack([_pad(it.tokens_T.to(device), T) for it in items])
    labels = torch.stack([_pad(it.labels_T.to(device), T) for it in items])
    b_idx = torch.arange(B, device=device)[:, None, None]
    pos_c = pos_BNK.clamp(max=T - 1)
    labels_BNK = labels[b_idx, pos_c].masked_fill(~valid_BN[:, :, None], IGNORE_INDEX)
    if any(it.loss_mask_T is not None for it in items):  # only the trained tokens carry a label
        trained_BT = _to_device(torch.stack([_pad(_label_mask_of(it), T) for it in items]), device)
        trained_BNK = trained_BT[b_idx, pos_c] & (pos_BNK < T)
        labels_BNK = labels_BNK.masked_fill(~trained_BNK, IGNORE_INDEX)
    soft_vals = soft_idx = None
    if items[0].soft_vals_Tk is not None:
        vals = torch.stack([_pad(it.soft_vals_Tk.to(device), T) for it in items])
        idx = torch.stack([_pad(it.soft_idx_Tk.to(device), T) for it in items])
        soft_vals, soft_idx = vals[b_idx, pos_c], idx[b_idx, pos_c]
    anchor_tokens = tokens.gather(1, anchors_BN)
    return DrafterBatch(feats, anchors_BN, anchor_tokens, labels_BNK, soft_vals, soft_idx,
                        sum(it.tokens_T.numel() for it in items))


def _anchors(item: Item, block_size: int, num_anchors: int, gen: torch.Generator) -> torch.Tensor:
    if item.loss_mask_T is None:
        return draw_anchors(item.tokens_T.numel(), block_size, num_anchors, gen)
    return draw_masked_anchors(item.loss_mask_T, num_anchors, gen)


def _label_mask_of(item: Item) -> torch.Tensor:
    if item.loss_mask_T is None:
        return torch.ones(item.tokens_T.numel(), dtype=torch.bool)
    return label_mask(item.loss_mask_T)


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _noise_generator(device: torch.device) -> torch.Generator:
    """One generator per device, made once: constructing a CUDA generator allocates its state on the GPU,
    which is not free to do every step (the consumer thread alone calls this)."""
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device=device)
    return _GENERATORS[device]


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → GPU without a host sync: a plain copy from pageable memory waits for the whole stream."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _pad(x: torch.Tensor, T: int) -> torch.Tensor:
    if x.shape[0] == T:
        return x
    pad = torch.zeros((T - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])
