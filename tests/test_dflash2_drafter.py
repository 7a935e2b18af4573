"""DFlash 2's pieces against plain references: the grouped dynamic causal convolution per position, taps that
never cross a block boundary (training's packed blocks against one block at inference), the selector's walk."""
import pytest
import torch

from dflash.drafter.conv import GroupedDynamicCausalConv
from dflash.drafter.model import DFlashDrafter, DrafterConfig


def _randomise(conv: GroupedDynamicCausalConv) -> GroupedDynamicCausalConv:
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.3)
    return conv


def _reference_conv(conv, x_bH, y_bH):
    """One block, position by position and channel by channel: the kernels from x_t, zero before the block."""
    bs, H = x_bH.shape
    K, G = conv.kernel_size, conv.group_size
    W = conv.kernel_projection.weight  # [2·K·H/G, H]
    prep, fin = torch.zeros_like(x_bH), torch.zeros_like(y_bH)
    for t in range(bs):
        dyn = (W @ x_bH[t]).view(2, K, H // G)
        for c in range(H):
            for j in range(K):
                src = t - j  # tap j: j positions back (tap 0 the position itself, z-lab's order)
                if src < 0:
                    continue
                prep[t, c] += (conv.base_kernel[0, j, c] + dyn[0, j, c // G]) * x_bH[src, c]
                fin[t, c] += (conv.base_kernel[1, j, c] + dyn[1, j, c // G]) * y_bH[src, c]
    return prep, fin


@pytest.mark.parametrize("K", [2, 3])
def test_conv_matches_a_plain_per_position_reference(K):
    torch.manual_seed(0)
    conv = _randomise(GroupedDynamicCausalConv(8, kernel_size=K, group_size=4)).double()
    x, y = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    prepared, kernels = conv.prepare(x)
    finished = conv.finish(y, kernels)
    for n in range(3):
        ref_p, ref_f = _reference_conv(conv, x[n], y[n])
        torch.testing.assert_close(prepared[n], ref_p, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(finished[n], ref_f, rtol=1e-12, atol=1e-12)


def test_conv_starts_as_the_identity():
    conv = GroupedDynamicCausalConv(8, 2, 4)
    x = torch.randn(2, 4, 8)
    prepared, kernels = conv.prepare(x)
    assert torch.equal(prepared, x) and torch.equal(conv.finish(x, kernels), x)


def test_conv_taps_stay_inside_each_block():
    """Blocks on the block axis are convolved on their own: block 0 changes nothing in block 1."""
    torch.manual_seed(0)
    conv = _randomise(GroupedDynamicCausalConv(8, 2, 4)).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    x2 = x.clone()
    x2[0] += 1.0
    a, _ = conv.prepare(x)
    b, _ = conv.prepare(x2)
    assert torch.equal(a[1], b[1]) and not torch.allclose(a[0], b[0])


def _dflash2(bs=6, attn_group=16, sliding=False, V=50, H=32):
    torch.manual_seed(0)
    extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8) if sliding else {}
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=bs,
                        attn_group=attn_group, architecture="dflash2", conv_group_size=4, selector_rank=8,
                        selector_top_k=4, sliding_causal=False, output_multiplier=0.5, final_logit_softcapping=3.0,
                        **extra)
    d = DFlashDrafter(cfg, H, num_target_layers=8, mask_token_id=V - 1, target_layer_ids=[0, 1, 2],
                      vocab_size=V).double()
    for layer in d.layers:  # away from the identity start, so the taps matter
        _randomise(layer.attention_conv), _randomise(layer.mlp_conv)
    d.attach_target_head(torch.randn(V, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64))
    return d.eval()


@pytest.mark.parametrize("attn_group,sliding", [(0, False), (2, False), (2, True)])
def test_packed_training_blocks_equal_one_block_at_inference(attn_group, sliding):
    """Adjacent and overlapping anchors in one training forward against each block drafted alone: the taps reset
    at every anchor block (a tap into the previous block would change the packed result)."""
    d = _dflash2(attn_group=attn_group, sliding=sliding)
    T = 40
    feats = torch.randn(1, T, 3, 32, dtype=torch.float64)
    tokens = torch.randint(0, 49, (1, T))
    anchors = torch.tensor([[1, 7, 13, 14, 20, T - 5]])  # 7 → 13: adjacent blocks; 13, 14: overlapping
    with torch.no_grad():
        train_h = d(feats, anchors, tokens.gather(1, anchors))
    for n, a in enumerate(anchors[0].tolist()):
        cache = d.new_cache()
        d.extend_context(cache, feats[:, :a], start=0)
        assert torch.allclose(train_h[:, n], d.draft_hidden(cache, tokens[:, a]), atol=1e-10), f"anchor {a}"


def test_windowed_layers_of_dflash2_see_their_whole_block():
    """sliding_causal=false: a later block position changes an earlier one's output (DFlash 1's windowed layers:
    it does not)."""
    outs = []
    for causal in (True, False):
        d = _dflash2(sliding=True)
        d.cfg.sliding_causal = causal
        d.layer_attention = d.cfg.layer_attention()
        d.layers = d.layers[:1]  # the windowed layer alone
        x = torch.randn(1, 6, 32, dtype=torch.float64)
        ctx = d.layers[0].self_attn.project_kv(torch.randn(1, 4, 32, dtype=torch.float64),
                                               *d._rope(torch.arange(4)[None], torch.float64))
        from dflash.drafter.attention import ATTN_KERNELS, KernelMask, training_mask
        mask = KernelMask(ATTN_KERNELS["sdpa"], training_mask(torch.tensor([[4]]), 4, 6, d.layer_attention[0])[:, None])
        x2 = x.clone()
        x2[0, 5] += 1.0
        rope = d._rope(torch.arange(4, 10)[None], torch.float64)
        outs.append((d.layers[0](x, rope, ctx, mask), d.layers[0](x2, rope, ctx, mask)))
    (c1, c2), (n1, n2) = outs
    assert torch.allclose(c1[0, :5], c2[0, :5]) and not torch.allclose(n1[0, :5], n2[0, :5])


@torch.no_grad()
def _reference_walk(d, hidden_KH, logits_KV, anchor):
    """The walk written out: position by position, candidate by candidate, score = unary + <pred ⊙ hP, succ>."""
    s = d.candidate_selector
    prev, tokens = int(anchor), []
    for t in range(hidden_KH.shape[0]):
        unary, cand = logits_KV[t].topk(s.top_k)
        scores = [float(unary[i]) + float((s.predecessor_codebook[prev] * (hidden_KH[t] @ s.hidden_projection.weight.T)
                                           * s.successor_codebook[int(b)]).sum()) for i, b in enumerate(cand)]
        prev = int(cand[max(range(len(scores)), key=scores.__getitem__)])
        tokens.append(prev)
    return tokens


def test_selector_walk_matches_a_plain_reference_and_q_is_softmax_of_scores():
    d = _dflash2()
    with torch.no_grad():
        for p in d.candidate_selector.parameters():
            p.normal_()  # pair scores as large as the unary ones: the walk must differ from the argmax
    hidden = torch.randn(3, 5, 32, dtype=torch.float64)
    anchors = torch.tensor([3, 7, 11])
    walk = d.draft(hidden, anchors)
    logits = d.logits(hidden)
    for n in range(3):
        assert walk.tokens[n].tolist() == _reference_walk(d, hidden[n], logits[n], anchors[n])
    assert not torch.equal(walk.tokens, logits.argmax(-1))
    q = walk.q()
    assert torch.allclose(q.sum(-1), torch.ones(3, 5, dtype=q.dtype))
    assert (walk.candidates.gather(-1, walk.scores.argmax(-1, keepdim=True))[..., 0] == walk.tokens).all()
    torch.manual_seed(1)
    sampled = d.draft(hidden, anchors, temperature=1.0)
    assert torch.isin(sampled.tokens, sampled.candidates.flatten()).all()


def test_logits_are_scaled_then_soft_capped():
    d = _dflash2()
    h = torch.randn(2, 32, dtype=torch.float64)
    raw = h @ d.lm_head_VH.T
    torch.testing.assert_close(d.logits(h), (3.0 * torch.tanh(0.5 * raw / 3.0)).float())


def test_path_probs_are_the_sampled_walks_q_along_its_own_path():
    d = _dflash2()
    with torch.no_grad():
        for p in d.candidate_selector.parameters():
            p.normal_()
    hidden = torch.randn(3, 5, 32, dtype=torch.float64)
    anchors = torch.tensor([3, 7, 11])
    walk = d.draft(hidden, anchors, temperature=0.8, generator=torch.Generator().manual_seed(0))
    got = d.candidate_selector.path_probs(hidden, d.logits(hidden), anchors, walk.tokens, temperature=0.8)
    want = walk.q(0.8).gather(-1, (walk.candidates == walk.tokens[..., None]).int().argmax(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(got, want)
    off = walk.tokens.clone()
    outside = ~torch.isin(torch.arange(50), walk.candidates[:, 0].flatten())
    off[:, 0] = int(outside.int().argmax())  # a token none of the rows has among its first candidates
    assert (d.candidate_selector.path_probs(hidden, d.logits(hidden), anchors, off, 0.8)[:, 0] == 0).all()
