"""GPU-only checks (skipped on CPU CI): fast Gated-DeltaNet kernels active and agreeing with the torch path."""
import pytest
import torch

from dflash.target.model import Target, TargetConfig, TinyTargetSpec

pytestmark = pytest.mark.gpu


def test_fla_kernels_active_on_gpu():
    t = Target(TargetConfig(random=TinyTargetSpec(hidden_size=256, num_layers=8), device="cuda"))
    assert t.kernels.get("chunk_gated_delta_rule") == "fla", t.kernels
    assert t.kernels.get("causal_conv1d_fn") in ("fla", "causal_conv1d"), t.kernels


def test_fla_forward_matches_torch_fallback():
    import importlib
    import inspect
    spec = TinyTargetSpec(hidden_size=256, num_layers=8)
    t = Target(TargetConfig(random=spec, device="cuda", dtype="float32"))
    x = torch.randint(0, 256, (2, 300), device="cuda")
    fast = t.forward_features(x).features_BTLH
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    saved = {n: getattr(mod, n) for n in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    try:
        for n, fn in saved.items():
            setattr(mod, n, inspect.unwrap(fn))
        slow = t.forward_features(x).features_BTLH
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)
    assert torch.allclose(fast, slow, atol=2e-2, rtol=2e-2), (fast - slow).abs().max()


def test_gpu_training_steps(fast_cfg, tmp_path):
    from dflash.app.run import train
    from sweeps.support import last_logged
    res = train(fast_cfg("trainer.device=cuda", "target.device=cuda", "+loss=soft_kl"))
    assert res.metrics["train/loss"] == res.metrics["train/loss"]  # not NaN
    # what a campaign cell records of its GPU memory (sweeps/campaign.py: cell.json's gpu_reserved_peak_gb)
    peak = last_logged(tmp_path / "run", "perf/gpu_reserved_peak_gb")
    assert peak is not None and 0 < peak <= torch.cuda.get_device_properties(0).total_memory / 2**30


V, H, B, T, N, bs = 512, 256, 2, 300, 12, 16  # the kernel tests' shapes


def _kernel_matches_default(cfg, kernel: str, compiled: bool):
    """Outputs and fc gradients of `cfg` with `kernel` (compiled or not) agree with eager default SDPA under bf16
    autocast; returns the last drafter and the inputs for further checks."""
    from dflash.drafter.model import DrafterConfig, build_drafter
    feats = torch.randn(B, T, 2, H, device="cuda")
    anchors = torch.stack([torch.randperm(T - bs, device="cuda")[:N].sort().values + 1 for _ in range(B)])
    tokens = torch.randint(0, V, (B, N), device="cuda")
    outs = []
    for c in (cfg, DrafterConfig(**{**cfg.__dict__, "attn_kernel": kernel})):
        torch.manual_seed(1)
        d = build_drafter(c, H, 4, V - 1, [0, 2]).cuda()
        d.attach_target_head(torch.randn(V, H, device="cuda"), torch.randn(V, H, device="cuda"))
        model = torch.compile(d) if compiled and c is not cfg else d
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(feats, anchors, tokens)
        out.float().square().mean().backward()
        outs.append((out.float(), d.fc.weight.grad.clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=3e-2, rtol=5e-2)
    return d, feats, anchors, tokens


@pytest.mark.parametrize("kernel,compiled", [("flex", False), ("sdpa_expanded", False), ("sdpa", True)])
def test_drafter_kernels_and_compile_match_the_default_on_gpu(kernel, compiled):
    """The speed settings measured in benchmarks/RESULTS.md change how the step runs, not what it computes:
    outputs and gradients under bf16 autocast agree with the default SDPA kernel, eager."""
    from dflash.drafter.model import DrafterConfig
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=512, block_size=bs)
    _kernel_matches_default(cfg, kernel, compiled)


@pytest.mark.parametrize("kernel,compiled", [("flex", False), ("sdpa", True)])
def test_windowed_drafter_kernels_and_train_equals_inference_on_gpu(kernel, compiled):
    """The published layout (sliding + full layers, window 64 < T): flex / compiled SDPA agree with eager SDPA
    under bf16 autocast, and training's block equals the inference path's (cropped windowed caches)."""
    from dflash.drafter.model import DrafterConfig
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=512, block_size=bs,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=64)
    d, feats, anchors, tokens = _kernel_matches_default(cfg, kernel, compiled)
    d.eval()
    a = int(anchors[0, -1])
    cache = d.new_cache()
    with torch.no_grad():
        d.extend_context(cache, feats[:1, :a], 0)
        infer = d.draft_hidden(cache, tokens[:1, -1])
        train = d(feats[:1], anchors[:1, -1:], tokens[:1, -1:])[:, 0]
    assert cache.k[0].shape[2] <= 64 - 1 + bs
    torch.testing.assert_close(infer.float(), train.float(), atol=1e-4, rtol=1e-4)


def test_graph_decode_replays_the_eager_static_step_and_writes_the_targets_greedy_text():
    """The online writer's CUDA-graph decode (dflash.target.static_decode): a replay computes what the same
    step computes op by op, bit for bit; in float32 its tokens are transformers' cached decode's."""
    from dflash.data.writing import write_continuations
    spec = TinyTargetSpec(hidden_size=256, num_layers=8)
    t = Target(TargetConfig(random=spec, device="cuda", dtype="float32"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (64,), generator=g)]
    graph = write_continuations(t, prompts, 96, decode="graph")
    assert torch.equal(graph, write_continuations(t, prompts, 96, decode="graph"))  # a second batch, same graph
    assert torch.equal(graph, write_continuations(t, prompts, 96, decode="static"))
    cached = write_continuations(t, prompts, 96, decode="cache")
    assert (graph == cached).float().mean() > 0.99, (graph != cached).sum()  # fp32: kernels differ only in rounding
    from dflash.target.static_decode import static_decoder
    assert static_decoder(t, 64, 96, True).graph is not None  # captured, not the eager fallback


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fla_conv_update_steps_as_transformers_torch_code_on_gpu(dtype, tol):
    """FLA's one-token convolution behind transformers' `causal_conv1d_update` (dflash.target.kernels): the target
    binds it, and over decode steps past the window its outputs and the cache's conv state match transformers' torch
    step, for a contiguous state (the cache's) and a strided one."""
    import importlib
    from dflash.target import kernels
    t = Target(TargetConfig(random=TinyTargetSpec(hidden_size=256, num_layers=8), device="cuda"))
    assert t.kernels.get("causal_conv1d_update") == "fla", t.kernels
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    fast, ref = mod.causal_conv1d_update, kernels._reference(mod.causal_conv1d_update)
    g = torch.Generator(device="cuda").manual_seed(0)
    B, D, W = 16, 1536, 4
    w, b = torch.randn(D, W, device="cuda", dtype=dtype, generator=g), None
    for ours in (torch.randn(B, D, W, device="cuda", dtype=dtype, generator=g),
                 torch.randn(B, W, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)):
        theirs = ours.clone()
        for _ in range(W + 3):
            x = torch.randn(B, 3 * D, 1, device="cuda", dtype=dtype, generator=g)[:, D:2 * D]
            torch.testing.assert_close(fast(x, ours, w, b, activation="silu"), ref(x, theirs, w, b, activation="silu"),
                                       atol=tol, rtol=tol)
            torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


def test_cached_decode_on_the_fla_conv_update_writes_the_torch_steps_tokens_on_gpu():
    """The writer's cache path (transformers' cached decode) with FLA's convolution step and with the torch step:
    in float32 the same greedy text (kernels differ only in rounding)."""
    from dflash.data.writing import write_continuations
    from dflash.target.kernels import torch_gdn_path
    t = Target(TargetConfig(random=TinyTargetSpec(hidden_size=256, num_layers=8), device="cuda", dtype="float32"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (32,), generator=g)]
    fast = write_continuations(t, prompts, 96, decode="cache")
    with torch_gdn_path(t.info.model_type, ("causal_conv1d_update",)) as report:
        assert report["causal_conv1d_update"] == "torch"
        slow = write_continuations(t, prompts, 96, decode="cache")
    assert (fast == slow).float().mean() > 0.99, (fast != slow).sum()
