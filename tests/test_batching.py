"""Fixed-shape batches (trainer.pad_multiple, fixed anchors for a compiled drafter) change no result."""
import torch

from dflash.training.batching import make_batch
from dflash.drafter.model import DrafterConfig, build_drafter
from dflash.training.losses import LossConfig, build_loss, compute_position_stats
from dflash.training.noise import NoiseConfig, build_noise
from dflash.training.pipeline import Item

V, H, L, BS = 50, 16, 2, 4


def _items(lengths):
    g = torch.Generator().manual_seed(0)
    return [Item(i, 0, i, torch.randint(0, V, (n,), generator=g), torch.randn(n, L, H, generator=g),
                 torch.randint(0, V, (n,), generator=g), None, None) for i, n in enumerate(lengths)]


def _loss(batch, drafter):
    hidden = drafter(batch.features_BTLH, batch.anchors_BN, batch.anchor_tokens_BN)
    B, N, K, D = hidden.shape
    labels = batch.labels_BNK.reshape(B * N, K)
    stats = compute_position_stats(hidden.reshape(B * N, K, D), drafter.lm_head_VH, labels)
    return build_loss(LossConfig(name="streak")).reduce(stats, labels != -100)


def test_padding_to_a_multiple_and_fixed_anchors_leave_the_loss_and_grads_unchanged():
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                                          block_size=BS, attn_group=2), H, 4, V - 1, [0, 2])
    drafter.attach_target_head(torch.randn(V, H), torch.randn(V, H))
    items, noise = _items([23, 9]), build_noise(NoiseConfig(), 10)
    common = dict(block_size=BS, num_anchors=8, seed=3, noise=noise, sigma=0.0, device=torch.device("cpu"))
    pairs = [(make_batch(items, **common), make_batch(items, **common, pad_multiple=16, fixed_anchors=True)),
             (make_batch(items[1:], **common), make_batch(items[1:], **common, fixed_anchors=True))]
    assert [b.features_BTLH.shape[1] for pair in pairs for b in pair] == [23, 32, 9, 9]
    assert [b.anchors_BN.shape[1] for pair in pairs for b in pair] == [8, 8, 6, 8]  # 9 tokens: 6 anchor slots
    for pair in pairs:
        got = []
        for batch in pair:
            drafter.zero_grad()
            loss = _loss(batch, drafter)
            loss.backward()
            got.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
        torch.testing.assert_close(got[0][0], got[1][0])
        for a, b in zip(got[0][1], got[1][1]):
            torch.testing.assert_close(a, b)
        assert pair[0].num_tokens == pair[1].num_tokens


def test_the_drafter_compiles_as_one_graph_with_the_same_result():
    """trainer.compile: no graph break in the drafter's forward (aot_eager: the trace, without inductor's
    minutes of CPU codegen), and the compiled forward and backward equal eager."""
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32,
                                          block_size=BS, attn_group=2), H, 4, V - 1, [0, 2])
    drafter.attach_target_head(torch.randn(V, H), torch.randn(V, H))
    batch = make_batch(_items([23, 9]), block_size=BS, num_anchors=8, seed=3, noise=build_noise(NoiseConfig(), 10),
                       sigma=0.0, device=torch.device("cpu"), pad_multiple=16, fixed_anchors=True)
    compiled = torch.compile(drafter, backend="aot_eager", fullgraph=True)
    got = []
    for model in (drafter, compiled):
        drafter.zero_grad()
        out = model(batch.features_BTLH, batch.anchors_BN, batch.anchor_tokens_BN)
        out.square().mean().backward()
        got.append((out.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(got[0][0], got[1][0])
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b)


def test_trainer_compile_runs_padded_fixed_shape_steps(fast_cfg, monkeypatch):
    import functools

    from dflash.app.run import train
    from dflash.training import trainer as trainer_mod
    seen = []
    real_make_batch = trainer_mod.make_batch

    def spy(*a, **k):
        batch = real_make_batch(*a, **k)
        seen.append(tuple(batch.anchors_BN.shape) + (batch.features_BTLH.shape[1],))
        return batch
    monkeypatch.setattr(trainer_mod, "make_batch", spy)
    monkeypatch.setattr(trainer_mod.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    res = train(fast_cfg("trainer.compile=true", "trainer.pad_multiple=32"))
    assert (res.run_dir / "final" / "model.safetensors").is_file()
    assert all(n == 4 and t % 32 == 0 for _, n, t in seen) and len(seen) == 6
