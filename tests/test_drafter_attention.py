"""The attention kernels behind `drafter.attn_kernel` are one attention computed three ways: same outputs, same
gradients, same mask (DESIGN §1). CPU, float32, tiny shapes with GQA and lengths that are not tile multiples."""
import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import create_mask

from dflash.drafter.model import DFlashDrafter, DrafterConfig, build_drafter, training_mask
from dflash.drafter.attention import ATTN_KERNELS, FlexKernel, block_mask_mod

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU

HIDDEN, L, V, BS, T = 32, 3, 50, 4, 37


def _drafter(attn_kernel="sdpa", attn_group=16, state=None, num_layers=2, **layout):
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                        block_size=BS, attn_group=attn_group, attn_kernel=attn_kernel, **layout)
    d = DFlashDrafter(cfg, HIDDEN, num_target_layers=8, mask_token_id=V - 1, target_layer_ids=list(range(L)))
    torch.manual_seed(1)
    d.attach_target_head(torch.randn(V, HIDDEN), torch.randn(V, HIDDEN))
    if state is not None:
        d.load_state_dict(state)
    return d


def _batch():
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, T, L, HIDDEN, generator=g)
    tokens = torch.randint(0, V - 1, (2, T), generator=g)
    anchors = torch.tensor([[1, 6, 7, 20, T - 2],  # one near the end: its block runs past the context
                            [3, 9, 15, 16, 30]])
    return feats, tokens, anchors


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """torch's public flex_attention refuses inputs that require grad on CPU (its fused backward is GPU only),
    but the eager higher-order op has a math backward. Lifting that device check lets the test compare
    gradients through our kernel plumbing (GQA, mask_mod, dtypes) on CPU."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *a: None, raising=False)


def _run(d, feats, tokens, anchors):
    d.zero_grad(set_to_none=True)
    h = d(feats, anchors, tokens.gather(1, anchors))
    h.pow(2).sum().backward()
    return h.detach(), {n: p.grad.clone() for n, p in d.named_parameters()}


@pytest.mark.parametrize("kernel,group", [("sdpa", 2), ("sdpa", 3), ("sdpa_expanded", 0), ("sdpa_expanded", 2),
                                          ("flex", 16), ("flex", 2)])
def test_kernels_agree_on_outputs_and_gradients(kernel, group, cpu_flex_backward):
    feats, tokens, anchors = _batch()
    ref = _drafter("sdpa", attn_group=0)
    d = _drafter(kernel, attn_group=group, state=ref.state_dict())
    h_ref, g_ref = _run(ref, feats, tokens, anchors)
    h, g = _run(d, feats, tokens, anchors)
    assert h.shape == (2, 5, BS - 1, HIDDEN)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernel", sorted(ATTN_KERNELS))
def test_training_equals_inference_for_every_kernel(kernel):
    """The mask each kernel builds is what a block sees at inference (mask None: plain SDPA after a cache)."""
    d = _drafter(kernel).eval()
    feats, tokens, anchors = _batch()
    with torch.no_grad():
        train_h = d(feats, anchors, tokens.gather(1, anchors))
        for b in range(2):
            for n, a in enumerate(anchors[b].tolist()):
                cache = d.new_cache()
                d.extend_context(cache, feats[b:b + 1, :a], start=0)
                infer_h = d.draft_hidden(cache, tokens[b:b + 1, a])
                torch.testing.assert_close(train_h[b:b + 1, n], infer_h, rtol=1e-5, atol=1e-5)


def _tiles(m_BQK: torch.Tensor, tile: int = 128):
    """Per 128×128 tile of a bool mask (zero-padded to whole tiles): any visible, all visible."""
    B, Q, K = m_BQK.shape
    nq, nk = -(-Q // tile), -(-K // tile)
    padded = torch.zeros(B, nq * tile, nk * tile, dtype=torch.bool)
    padded[:, :Q, :K] = m_BQK
    t = padded.view(B, nq, tile, nk, tile)
    return t.any(4).any(2), t.all(4).all(2)


@pytest.mark.parametrize("ctx_len,n,bs", [(37, 5, 4), (129, 9, 16), (300, 21, 16), (255, 17, 3)])
def test_flex_block_mask_equals_training_mask(ctx_len, n, bs):
    """Element level: the BlockMask's mask_mod densified is `training_mask`. Tile level: it computes exactly the
    tiles someone sees (and marks as full those everyone sees), at lengths that are not multiples of 128."""
    g = torch.Generator().manual_seed(ctx_len)
    anchors = torch.stack([torch.randperm(ctx_len - 1, generator=g)[:n].sort().values + 1 for _ in range(2)])
    anchors[0, -1] = ctx_len - 1  # near the end
    bm = FlexKernel().mask(anchors, ctx_len, bs)
    Q, K = n * bs, ctx_len + n * bs
    assert bm.shape == (2, 1, Q, K)
    dense = training_mask(anchors, ctx_len, bs)
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, Q, K, device="cpu")[:, 0], dense)
    assert torch.equal(create_mask(block_mask_mod(anchors, ctx_len, bs), 2, 1, Q, K, device="cpu")[:, 0], dense)
    seen, full = _tiles(dense)
    assert torch.equal(bm.to_dense()[:, 0].bool(), seen)
    assert bm.full_kv_num_blocks is not None
    full_only = flex_module._ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices,
                                              bm.full_kv_indices.shape[-1])
    assert torch.equal(full_only[:, 0].bool(), full)


def test_flex_builds_one_block_mask_per_forward(monkeypatch):
    kernel = ATTN_KERNELS["flex"]
    calls = []
    real = kernel.mask
    monkeypatch.setattr(kernel, "mask", lambda *a: calls.append(a) or real(*a))
    d = _drafter("flex", attn_group=2)  # attn_group is for the SDPA kernels: flex takes all anchors at once
    feats, tokens, anchors = _batch()
    with torch.no_grad():
        d(feats, anchors, tokens.gather(1, anchors))
    assert len(calls) == 1 and torch.equal(calls[0][0], anchors)  # one mask for both layers, no groups


def test_flex_runs_under_autocast_with_mixed_input_dtypes():
    """q/k leave the fp32 q_norm/k_norm in fp32 while v is bf16 under autocast; flex (not autocast-aware)
    gets them all in the autocast dtype, as SDPA would."""
    feats, tokens, anchors = _batch()
    ref = _drafter("sdpa")
    d = _drafter("flex", state=ref.state_dict())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = d(feats, anchors, tokens.gather(1, anchors))
        h_ref = ref(feats, anchors, tokens.gather(1, anchors))
    torch.testing.assert_close(h.float(), h_ref.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("build", [
    lambda cfg: build_drafter(cfg, HIDDEN, 8, V - 1, [0, 1, 2]),
    lambda cfg: DFlashDrafter(cfg, HIDDEN, 8, V - 1, [0, 1, 2]),
])
def test_unknown_kernel_is_a_build_time_error(build):
    with pytest.raises(ValueError, match=r"drafter\.attn_kernel.*'flash3'.*flex, sdpa, sdpa_expanded"):
        build(DrafterConfig(attn_kernel="flash3"))


def test_flex_traces_whole_under_an_outer_compile():
    """trainer.compile wraps the drafter in torch.compile: the flex path (block mask, kernel lookup, the
    eager/compiled choice) must trace as one graph, no breaks. aot_eager: inductor's CPU flex is not the point."""
    d = _drafter("flex").eval()
    feats, tokens, anchors = _batch()
    with torch.no_grad():
        ref = d(feats, anchors, tokens.gather(1, anchors))
        out = torch.compile(d, backend="aot_eager", fullgraph=True)(feats, anchors, tokens.gather(1, anchors))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ sliding-window layers (DESIGN §6, the published layout)
WINDOW = 9  # small enough that the window hides context at T = 37, and the cache gets trimmed
MIXED = ["sliding_attention", "full_attention"]


def _windowed(attn_kernel="sdpa", attn_group=16, state=None, layer_types=MIXED, window=WINDOW):
    return _drafter(attn_kernel, attn_group, state, num_layers=len(layer_types), layer_types=layer_types,
                    sliding_window=window)


def test_windowed_training_mask_content():
    """Block of anchor 5 (positions 5..8), window 4: query k sees context j with 5 + k - j < 4 and block 0..k."""
    from dflash.drafter.attention import LayerAttention
    m = training_mask(torch.tensor([[5]]), ctx_len=7, block_size=4, layer=LayerAttention(window=4))[0]
    assert m[0, :7].tolist() == [False, False, True, True, True, False, False]  # j = 2, 3, 4 (< anchor 5)
    assert m[1, :7].tolist() == [False, False, False, True, True, False, False]
    assert m[3, :7].tolist() == [False] * 7  # position 8 sees only its own block, 5..8
    assert m[:, 7:].tolist() == [[k2 <= k for k2 in range(4)] for k in range(4)]  # causal inside the block
    full = training_mask(torch.tensor([[5]]), ctx_len=7, block_size=4)[0]
    assert full[:, :7].sum() == 4 * 5 and full[:, 7:].all()  # full layers: all context before 5, whole block


@pytest.mark.parametrize("kernel", sorted(ATTN_KERNELS))
@pytest.mark.parametrize("layer_types", [MIXED, ["full_attention", "sliding_attention"]])
def test_windowed_training_equals_inference(kernel, layer_types):
    """The train-mask = inference check with windowed layers: inference crops the windowed layers' caches to what
    the window sees and masks the rest; training masks its blocks; both give the same block hidden states."""
    d = _windowed(kernel, layer_types=layer_types).eval()
    feats, tokens, anchors = _batch()
    with torch.no_grad():
        train_h = d(feats, anchors, tokens.gather(1, anchors))
        for b in range(2):
            for n, a in enumerate(anchors[b].tolist()):
                cache = d.new_cache()
                d.extend_context(cache, feats[b:b + 1, :a], start=0)
                w = layer_types.index("sliding_attention")
                assert cache.k[w].shape[2] == min(a, WINDOW - 1 + BS)  # the windowed layer keeps its window only
                infer_h = d.draft_hidden(cache, tokens[b:b + 1, a])
                torch.testing.assert_close(train_h[b:b + 1, n], infer_h, rtol=1e-5, atol=1e-5)


def test_window_changes_what_is_seen():
    """Same weights, windowed vs full: context older than the window changes only the full drafter's output."""
    feats, tokens, anchors = _batch()
    ref = _windowed(layer_types=["full_attention"] * 2, window=0).eval()
    win = _windowed(layer_types=["sliding_attention"] * 2, state=ref.state_dict()).eval()
    far = feats.clone()
    far[:, :5] += 3.0  # positions 0..4: outside a window of 9 for anchors >= 14 (the last two of each row)
    with torch.no_grad():
        h_ref, h_ref_far = ref(feats, anchors, tokens.gather(1, anchors)), ref(far, anchors, tokens.gather(1, anchors))
        h_win, h_win_far = win(feats, anchors, tokens.gather(1, anchors)), win(far, anchors, tokens.gather(1, anchors))
    assert not torch.allclose(h_ref[:, 3:], h_ref_far[:, 3:])
    torch.testing.assert_close(h_win[:, 3:], h_win_far[:, 3:], rtol=0, atol=0)
    assert not torch.allclose(h_win[0, 2], h_win_far[0, 2])  # anchor 7: positions 0..4 inside its window


@pytest.mark.parametrize("kernel,group", [("sdpa", 2), ("sdpa_expanded", 0), ("flex", 16)])
def test_windowed_kernels_agree_on_outputs_and_gradients(kernel, group, cpu_flex_backward):
    feats, tokens, anchors = _batch()
    ref = _windowed("sdpa", attn_group=0)
    d = _windowed(kernel, attn_group=group, state=ref.state_dict())
    h_ref, g_ref = _run(ref, feats, tokens, anchors)
    h, g = _run(d, feats, tokens, anchors)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "whole_block"])  # False: DFlash 2's windows
@pytest.mark.parametrize("ctx_len,n,bs,window", [(37, 5, 4, 9), (300, 21, 16, 64), (255, 17, 3, 130)])
def test_windowed_flex_block_mask_equals_training_mask(ctx_len, n, bs, window, causal):
    from dflash.drafter.attention import LayerAttention
    layer = LayerAttention(window=window, window_causal=causal)
    g = torch.Generator().manual_seed(ctx_len)
    anchors = torch.stack([torch.randperm(ctx_len - 1, generator=g)[:n].sort().values + 1 for _ in range(2)])
    bm = FlexKernel().mask(anchors, ctx_len, bs, layer)
    Q, K = n * bs, ctx_len + n * bs
    dense = training_mask(anchors, ctx_len, bs, layer)
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, Q, K, device="cpu")[:, 0], dense)
    seen, _ = _tiles(dense)
    assert torch.equal(bm.to_dense()[:, 0].bool(), seen)


def test_windowed_flex_builds_one_mask_per_kind(monkeypatch):
    kernel = ATTN_KERNELS["flex"]
    calls = []
    real = kernel.mask
    monkeypatch.setattr(kernel, "mask", lambda *a: calls.append(a) or real(*a))
    d = _windowed("flex", layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    feats, tokens, anchors = _batch()
    with torch.no_grad():
        d(feats, anchors, tokens.gather(1, anchors))
    assert [c[3].window for c in calls] == [WINDOW, None]  # two kinds, three layers


def test_windowed_cache_rollback_within_a_block_and_restart_beyond():
    d = _windowed(layer_types=["sliding_attention"] * 2).eval()
    feats, tokens, _ = _batch()
    one, steps = d.new_cache(), d.new_cache()
    d.extend_context(one, feats[:, :30], 0)
    d.extend_context(steps, feats[:, :20], 0)
    d.extend_context(steps, feats[:, 20:32], 20)
    d.extend_context(steps, feats[:, 32 - BS:30], 32 - BS)  # roll back one block (the slack), then re-extend
    anchor = tokens[:, 30]
    torch.testing.assert_close(d.draft_hidden(one, anchor), d.draft_hidden(steps, anchor), rtol=1e-5, atol=1e-5)
    steps.crop(10)  # further back than the windowed layers keep: the cache starts over ...
    assert steps.length == 0 and all(k is None for k in steps.k)
    with pytest.raises(ValueError, match=r"extend_context\(start=10\): the drafter cache holds 0 positions"):
        d.extend_context(steps, feats[:, 10:30], 10)  # ... and refuses a gap
    d.extend_context(steps, feats[:, :30], steps.length)  # the evaluation's way: extend from cache.length
    torch.testing.assert_close(d.draft_hidden(one, anchor), d.draft_hidden(steps, anchor), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["sliding_attention"]}, r"drafter\.layer_types has 1 entries but drafter\.num_layers=2"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, r"drafter\.layer_types has \['chunked_attention'\]"),
    ({"sliding_window": 2}, r"drafter\.sliding_window=2: sliding_attention layers need a window "
                            r">= drafter\.block_size"),
    ({"layer_types": ["full_attention"] * 2}, r"drafter\.sliding_window=9 is set but no drafter\.layer_types"),
    ({"rope_theta": -1.0}, r"drafter\.rope_theta must be > 0, or 0"),
])
def test_bad_attention_layout_is_a_build_and_config_error(change, match):
    import dataclasses

    from dflash.config import ConfigError, RunConfig, validate
    cfg = dataclasses.replace(_windowed().cfg, **change)
    with pytest.raises(ValueError, match=match):
        DFlashDrafter(cfg, HIDDEN, 8, V - 1, [0, 1, 2])
    with pytest.raises(ConfigError, match=match):
        validate(RunConfig(drafter=cfg))


def test_rope_theta_zero_takes_the_targets():
    import dataclasses
    cfg = _windowed().cfg
    unresolved = dataclasses.replace(cfg, rope_theta=0.0)
    assert unresolved.for_target(1e7).rope_theta == 1e7 and cfg.for_target(1e7).rope_theta == cfg.rope_theta
    d = DFlashDrafter(unresolved, HIDDEN, 8, V - 1, [0, 1, 2])
    feats, tokens, anchors = _batch()
    with pytest.raises(ValueError, match=r"rope_theta=0 \(the target's\) was not resolved"):
        d(feats, anchors, tokens.gather(1, anchors))



def test_evaluation_revisits_earlier_positions_with_a_windowed_drafter():
    """The tree evaluation proposes again from the prompt after the vanilla pass: the windowed cache starts over
    and gives what a fresh cache gives."""
    from dflash.evaluation.acceptance import DrafterProposer
    from dflash.evaluation.ground_truth import TaskTruth
    d = _windowed().eval()
    feats, tokens, _ = _batch()
    truth = TaskTruth("t", tokens[0, :8], tokens[0, 8:], feats[0])
    walked, fresh = DrafterProposer(d), DrafterProposer(d)
    for p in (8, 20, 33):
        walked(truth, p)
    torch.testing.assert_close(walked(truth, 12), fresh(truth, 12), rtol=1e-5, atol=1e-5)
