"""The training mask against the inference path: the most common reason re-implementations train to 98%
accuracy and serve at 10% acceptance is an off-by-one here (DESIGN §1)."""
import pytest
import torch

from dflash.drafter.model import DFlashDrafter, DrafterConfig, training_mask
from dflash.target.model import default_layer_ids


def _drafter(bs=6, hidden=32, L=3, V=50, attn_group=16):
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=bs,
                        attn_group=attn_group)
    d = DFlashDrafter(cfg, hidden, num_target_layers=8, mask_token_id=V - 1, target_layer_ids=list(range(L))).double()
    d.attach_target_head(torch.randn(V, hidden, dtype=torch.float64), torch.randn(V, hidden, dtype=torch.float64))
    return d.eval()


@pytest.mark.parametrize("attn_group", [0, 2])  # one call for all blocks; groups of 2 (3 groups, one padded)
def test_training_logits_equal_inference_logits(attn_group):
    d = _drafter(attn_group=attn_group)
    T, L, H, bs = 40, 3, 32, d.block_size
    feats = torch.randn(1, T, L, H, dtype=torch.float64)
    tokens = torch.randint(0, 49, (1, T))
    anchors = torch.tensor([[1, 7, 8, 20, T - bs + 1]])
    with torch.no_grad():
        train_h = d(feats, anchors, tokens.gather(1, anchors))  # [1, N, bs-1, H]
    for n, a in enumerate(anchors[0].tolist()):
        cache = d.new_cache()
        d.extend_context(cache, feats[:, :a], start=0)  # the committed context: positions < anchor
        infer_h = d.draft_hidden(cache, tokens[:, a])
        assert torch.allclose(d.logits(train_h[:, n]), d.logits(infer_h), atol=1e-9), f"anchor {a}"


def test_incremental_context_equals_one_shot():
    d = _drafter()
    feats = torch.randn(1, 30, 3, 32, dtype=torch.float64)
    c1, c2 = d.new_cache(), d.new_cache()
    d.extend_context(c1, feats[:, :25], 0)
    d.extend_context(c2, feats[:, :10], 0)
    d.extend_context(c2, feats[:, 10:18], 10)
    d.extend_context(c2, feats[:, 14:25], 14)  # overlapping extension crops first (rollback)
    anchor = torch.tensor([5])
    assert torch.allclose(d.draft_hidden(c1, anchor), d.draft_hidden(c2, anchor), atol=1e-10)


def test_blocks_do_not_see_each_other_or_later_context():
    d = _drafter()
    T = 30
    feats = torch.randn(1, T, 3, 32, dtype=torch.float64)
    tokens = torch.randint(0, 49, (1, T))
    anchors = torch.tensor([[4, 12]])
    with torch.no_grad():
        h = d(feats, anchors, tokens.gather(1, anchors))
        feats2 = feats.clone()
        feats2[:, 12:] += 1.0  # context at/after the second anchor, invisible to both blocks' past
        h2 = d(feats2, anchors, tokens.gather(1, anchors))
        tokens3 = tokens.clone()
        tokens3[0, 12] = (tokens[0, 12] + 1) % 49  # second block's anchor token
        h3 = d(feats, anchors, tokens3.gather(1, anchors))
    assert torch.allclose(h, h2)
    assert torch.allclose(h[:, 0], h3[:, 0]) and not torch.allclose(h[:, 1], h3[:, 1])


def test_training_mask_shape_and_content():
    m = training_mask(torch.tensor([[2, 5]]), ctx_len=6, block_size=3)
    assert m.shape == (1, 6, 12)
    assert m[0, 0, :6].tolist() == [True, True, False, False, False, False]
    assert m[0, 3, :6].tolist() == [True] * 5 + [False]
    assert m[0, 0, 6:].tolist() == [True] * 3 + [False] * 3


def test_default_layer_ids():
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("group", [1, 3, 4, 7, 64])
def test_grouped_anchors_equal_one_call_with_gradients(group):
    """Grouping is only a different batching of the same attention: outputs and gradients match."""
    T, N = 48, 7
    feats = torch.randn(2, T, 3, 32, dtype=torch.float64)
    tokens = torch.randint(0, 49, (2, T))
    anchors = torch.stack([torch.randperm(T - 6)[:N].sort().values + 1 for _ in range(2)])
    outs, grads = [], []
    for g in (0, group):
        d = _drafter(attn_group=g).train()
        h = d(feats, anchors, tokens.gather(1, anchors))
        h.pow(2).sum().backward()
        outs.append(h.detach())
        grads.append(torch.cat([p.grad.flatten() for p in d.parameters()]))
    assert outs[1].shape == (2, N, 5, 32)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attn_group", [0, 2])
def test_published_layout_training_logits_equal_inference_logits(attn_group):
    """The published Qwen3.6-27B layout (4 sliding-window layers + 1 full) at tiny width, window 8 < context:
    training's windowed block mask against inference's cropped per-layer caches, float64."""
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=5, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=6,
                        attn_group=attn_group, layer_types=["sliding_attention"] * 4 + ["full_attention"],
                        sliding_window=8)
    d = DFlashDrafter(cfg, 32, num_target_layers=8, mask_token_id=49, target_layer_ids=[0, 1, 2]).double()
    d.attach_target_head(torch.randn(50, 32, dtype=torch.float64), torch.randn(50, 32, dtype=torch.float64))
    d.eval()
    T = 40
    feats = torch.randn(1, T, 3, 32, dtype=torch.float64)
    tokens = torch.randint(0, 49, (1, T))
    anchors = torch.tensor([[1, 7, 8, 20, T - 5]])
    with torch.no_grad():
        train_h = d(feats, anchors, tokens.gather(1, anchors))
    for n, a in enumerate(anchors[0].tolist()):
        cache = d.new_cache()
        d.extend_context(cache, feats[:, :a], start=0)
        assert [k.shape[2] for k in cache.k] == [min(a, 7 + 6)] * 4 + [a]  # window - 1 + one block of slack
        infer_h = d.draft_hidden(cache, tokens[:, a])
        assert torch.allclose(train_h[:, n], infer_h, atol=1e-10), f"anchor {a}"  # hidden: logits are float32


def test_logits_upcast_a_low_precision_head_in_row_chunks():
    """A bf16 head is upcast a few vocabulary rows at a time: the same float32 logits as one product with a float32
    copy of the whole head (ragged last chunk included); a float32 head multiplies directly."""
    d = _drafter(V=50).float()
    d.lm_head_VH = d.lm_head_VH.bfloat16()
    hidden = torch.randn(2, 5, 32)
    want = hidden @ d.lm_head_VH.float().T
    got = d.logits(hidden, rows=7)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 50)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    d.lm_head_VH = d.lm_head_VH.float()
    torch.testing.assert_close(d.logits(hidden), want, rtol=1e-6, atol=1e-6)
