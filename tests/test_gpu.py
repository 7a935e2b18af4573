"""GPU-only checks (skipped on CPU CI): fast Gated-DeltaNet kernels active and agreeing with the torch path."""
import pytest
import torch

from dflash.target import Target, TargetConfig, TinyTargetSpec

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


def test_gpu_training_steps(fast_cfg):
    from dflash.trainer import train
    res = train(fast_cfg("trainer.device=cuda", "target.device=cuda", "+loss=soft_kl"))
    assert res.metrics["train/loss"] == res.metrics["train/loss"]  # not NaN
