"""Target adapter: local checkpoints (incl. *ForConditionalGeneration with a nested text_config), features
at layer ids (+1 offset), labels, top-k, kernel preflight."""
import functools
import importlib
import importlib.util
import inspect
import warnings

import pytest
import torch

from dflash.target.model import Target, TargetConfig, TinyTargetSpec
from dflash.target.kernels import kernel_report, preflight_kernels

SMALL = TinyTargetSpec(hidden_size=64, num_layers=4, intermediate_size=128, head_dim=16, linear_head_dim=16)


def test_features_labels_and_topk_match_the_model():
    t = Target(TargetConfig(random=SMALL, layer_ids=[0, 2]))
    ids = torch.randint(0, 256, (2, 40))
    out = t.forward_features(ids, soft_top_k=5)
    ref = t.model(input_ids=ids, output_hidden_states=True)
    assert torch.allclose(out.features_BTLH[:, :, 0], ref.hidden_states[1], atol=1e-5)
    assert torch.allclose(out.features_BTLH[:, :, 1], ref.hidden_states[3], atol=1e-5)
    assert torch.equal(out.labels_BT, ref.logits.argmax(-1))
    top = ref.logits.topk(5, dim=-1)
    assert torch.allclose(out.soft_vals_BTk, top.values, atol=1e-4) and torch.equal(out.soft_idx_BTk, top.indices)
    assert not any(p.requires_grad for p in t.model.parameters())


def test_conditional_generation_checkpoint_loads_as_text_model(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    full.save_pretrained(tmp_path / "ckpt")
    t = Target(TargetConfig(path=str(tmp_path / "ckpt"), layer_ids=[1, 2], mask_token_id=299, tokenizer="bytes"))
    assert (t.info.num_layers, t.vocab_size, t.hidden_size) == (4, 300, 64)
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        ref = full(input_ids=ids).logits
    assert torch.equal(t.forward_features(ids).labels_BT, ref.argmax(-1))


def test_qwen3_next_tiny_target_runs():
    t = Target(TargetConfig(random=TinyTargetSpec(model_type="qwen3_next", hidden_size=64, num_layers=4,
                                                  intermediate_size=128, head_dim=16, linear_head_dim=16)))
    assert t.forward_features(torch.randint(0, 256, (1, 16))).features_BTLH.shape == (1, 16, 1, 64)


def test_fla_bound_without_cuda_falls_back_to_torch(monkeypatch):
    """With `fla` importable, transformers binds its Triton kernels at import; without CUDA they crash.
    Simulate that binding and check the preflight restores the torch path."""
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    original = mod.torch_chunk_gated_delta_rule

    def fake_fla_kernel(*a, **k):
        raise RuntimeError("Triton: no CUDA driver")
    fake_fla_kernel.__module__ = "fla.ops.gated_delta_rule.chunk"

    def make_wrapper(implementation):
        @functools.wraps(original)
        def wrapped(*a, **k):
            return implementation(*a, **k)
        return wrapped
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", make_wrapper(fake_fla_kernel))
    assert kernel_report("qwen3_5")["chunk_gated_delta_rule"] == "fla"
    report = preflight_kernels("qwen3_5", torch.device("cpu"))
    assert report["chunk_gated_delta_rule"] == "torch"
    Target(TargetConfig(random=SMALL)).forward_features(torch.randint(0, 256, (1, 70)))  # runs, no crash
    # CUDA tensors still reach the fast kernel: a GPU target of the same process keeps it (a CPU target once left
    # every later GPU target on the torch path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no fla short conv here: the slow-path warning for causal_conv1d
        assert preflight_kernels("qwen3_5", torch.device("cuda"))["chunk_gated_delta_rule"] == "fla"
    assert kernel_report("qwen3_5", torch.device("cpu"))["chunk_gated_delta_rule"] == "torch"

    class OnCuda(torch.Tensor):  # stands in for a CUDA tensor on a CPU-only machine
        is_cuda = True
    with pytest.raises(RuntimeError, match="no CUDA driver"):
        mod.torch_chunk_gated_delta_rule(torch.zeros(1).as_subclass(OnCuda))
    Target(TargetConfig(random=SMALL)).forward_features(torch.randint(0, 256, (1, 70)))  # the CPU path still runs


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla installed: no slow path to warn about")
def test_gpu_slow_path_warns(monkeypatch):
    with pytest.warns(RuntimeWarning, match="SLOW PATH"):
        preflight_kernels("qwen3_5", torch.device("cuda"))


def test_torch_gdn_path_is_temporary(monkeypatch):
    from dflash.target.kernels import torch_gdn_path
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    original = mod.torch_chunk_gated_delta_rule

    def fast(*a, **k):
        return original(*a, **k)
    fast._dflash_backend = "fla"
    fast.__wrapped__ = inspect.unwrap(original)
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", fast)
    with torch_gdn_path("qwen3_5") as report:
        assert report["chunk_gated_delta_rule"] == "torch"
    assert mod.torch_chunk_gated_delta_rule is fast


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_target_forward_makes_its_masks_without_a_host_read(model_type, attn):
    """forward_features hands the decoder its causal masks (transformers' own check for packed sequences reads a
    value back to the host on every forward: a sync on CUDA). Same features and labels as the model's own
    forward, with SDPA's causal skip and with eager attention's materialised mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                HostReads.n += 1
            return func(*args, **(kwargs or {}))
    t = Target(TargetConfig(random=TinyTargetSpec(model_type=model_type, hidden_size=64, num_layers=4,
                                                  intermediate_size=128, head_dim=16, linear_head_dim=16),
                            layer_ids=[0, 2]))
    t.model.config._attn_implementation = attn
    ids = torch.randint(0, 256, (3, 24))
    with HostReads():
        out = t.forward_features(ids)
    assert HostReads.n == 0
    ref = t.model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.features_BTLH[:, :, 1], ref.hidden_states[3], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.labels_BT, ref.logits.argmax(-1))


def test_fla_short_conv_keeps_cpu_tensors_on_the_torch_code(monkeypatch):
    """FLA's short convolution goes behind causal_conv1d_fn process-wide for a GPU target; a CPU target of the same
    process still runs transformers' torch code (FLA's Triton kernel would crash on its tensors)."""
    from dflash.target import kernels
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    monkeypatch.setattr(mod, "causal_conv1d_fn", mod.causal_conv1d_fn)  # restored after the test

    def fla_conv(x, weight, bias=None, activation=None):
        raise RuntimeError("Triton: no CUDA driver")
    monkeypatch.setattr(kernels, "_fla_conv1d", lambda: fla_conv)
    assert kernels.use_fla_short_conv("qwen3_5")
    assert kernel_report("qwen3_5")["causal_conv1d_fn"] == "fla"
    x, w = torch.randn(1, 6, 10), torch.randn(6, 4)
    ref = inspect.unwrap(mod.causal_conv1d_fn)
    assert torch.equal(mod.causal_conv1d_fn(x, w, None, activation="silu"), ref(x, w, None, activation="silu"))
    Target(TargetConfig(random=SMALL, device="cpu")).forward_features(torch.randint(0, 256, (1, 40)))  # no crash


def _fla_update_kernel_in_torch(x, cache, residual=None, weight=None, bias=None, activation=None):
    """FLA 0.6's `causal_conv1d_update` (fla/modules/causal_conv1d/ops.py) as torch ops, as its kernel reads: x
    [N, 1, D], cache [N, D, W] made contiguous by its input guard (a copy when strided), cache[w] = cache[w + 1],
    cache[W - 1] = x, y = sum_w cache * weight (+ bias), SiLU; returns (y in x's shape, the cache it stepped)."""
    cache = cache if cache.is_contiguous() else cache.contiguous()
    stepped = torch.cat([cache[:, :, 1:], x.transpose(1, 2).to(cache.dtype)], dim=-1)
    cache.copy_(stepped)
    y = (stepped.float() * weight.float()).sum(-1) + (bias.float() if bias is not None else 0)
    y = torch.nn.functional.silu(y) if activation in ("silu", "swish") else y
    return y[:, None].to(x.dtype), cache


@pytest.mark.parametrize("strided_state", [False, True])
def test_fla_update_step_keeps_transformers_state_and_output(strided_state):
    """FLA's one-token convolution ([B, 1, D], its kernel's semantics as torch ops) behind transformers'
    `causal_conv1d_update` ([B, D, 1]): over several decode steps the outputs and the cache's conv state stay
    transformers' own, also for a strided state (FLA steps a contiguous copy; the cache must keep its tensor)."""
    from dflash.target import kernels
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    reference = kernels._reference(mod.causal_conv1d_update)
    B, D, W = 3, 10, 4
    weight, bias = torch.randn(D, W), torch.randn(D)
    if strided_state:
        ours = torch.randn(B, W, D).transpose(1, 2)
        assert not ours.is_contiguous()
    else:
        ours = torch.randn(B, D, W)
    theirs = ours.clone()
    for _ in range(W + 2):  # past the window: every state slot has been replaced
        x_BD1 = torch.randn(B, 3 * D, 1)[:, D:2 * D]  # a strided slice, as the layer's projection hands it over
        got = kernels.fla_update_step(_fla_update_kernel_in_torch, x_BD1, ours, weight, bias, "silu")
        want = reference(x_BD1, theirs, weight, bias, activation="silu")
        assert got.shape == want.shape == (B, D, 1)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(ours, theirs)


def test_fla_conv_update_is_bound_and_keeps_cpu_steps_on_the_torch_code(monkeypatch):
    """`use_fla_short_conv` binds FLA's step behind `causal_conv1d_update` too (the kernel report says fla, so a GPU
    target no longer warns SLOW PATH for it); CPU tensors, a multi-token step and a longer (recording) state still
    run transformers' torch code, and the kernel is never called for them."""
    from dflash.target import kernels
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    calls = []
    monkeypatch.setattr(kernels, "_fla_conv1d", lambda: lambda *a, **k: calls.append("fn"))
    monkeypatch.setattr(kernels, "_fla_conv1d_update", lambda: lambda *a, **k: calls.append("update"))
    assert kernels.use_fla_short_conv("qwen3_5")
    assert kernel_report("qwen3_5")["causal_conv1d_update"] == "fla"
    ref = kernels._reference(mod.causal_conv1d_update)
    w = torch.randn(6, 4)
    for x, state in ((torch.randn(2, 6, 1), torch.randn(2, 6, 4)), (torch.randn(2, 6, 3), torch.randn(2, 6, 4)),
                     (torch.randn(2, 6, 1), torch.randn(2, 6, 7))):
        s1, s2 = state.clone(), state.clone()
        torch.testing.assert_close(mod.causal_conv1d_update(x, s1, w, None, activation="silu"),
                                   ref(x, s2, w, None, activation="silu"))
        torch.testing.assert_close(s1, s2)
    assert calls == []
    kernels.force_torch_gdn("qwen3_5")  # the side-by-side benchmarks' torch path takes it back off
    assert kernel_report("qwen3_5")["causal_conv1d_update"] == "torch"


def _func_module(func):
    """A function as the `kernels` package's hub-kernel decorator leaves it (transformers 5.25 with `kernels`
    installed): an nn.Module instance whose forward calls the function it closes over."""
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)
    return Func()


def test_a_hub_kernel_func_module_is_seen_through():
    """transformers 5.25 binds every Gated-DeltaNet function as such a module: the kernel report and the torch
    reference look through it (before, every CPU target failed: `Func() is not a Python function`)."""
    from dflash.target import kernels

    def torch_code(x):
        return x + 1
    torch_code.__module__ = "transformers.models.qwen3_5.modeling_qwen3_5"

    def fla_kernel(x):
        return x + 2
    fla_kernel.__module__ = "fla.ops.gated_delta_rule.chunk"

    def with_fallback(implementation):  # transformers' use_kernel_func_from_hub_with_fallback, reduced
        @functools.wraps(torch_code)
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)
        return wrapped
    fast, slow = _func_module(with_fallback(fla_kernel)), _func_module(with_fallback(torch_code))
    assert kernels._implementation(fast) == "fla.ops.gated_delta_rule.chunk" and kernels._is_fast(fast)
    assert kernels._implementation(slow).startswith("transformers") and not kernels._is_fast(slow)
    assert kernels._reference(fast) is torch_code and kernels._reference(slow) is torch_code
    routed = kernels._by_device(fast, kernels._reference(fast))  # a CPU target's binding of the fast one
    assert kernels._reference(routed) is torch_code and routed(torch.zeros(1)).item() == 1.0


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_every_bound_gdn_function_has_transformers_torch_code_behind_it(model_type):
    """Whatever this transformers binds (a function, a wrapper with fallback, a hub-kernel module) and whatever
    an earlier target's preflight rebound, the torch reference a CPU target and `torch_gdn_path` use is
    transformers' own function of the modelling module."""
    from dflash.target.kernels import GDN_FUNCS, _reference, modeling_module
    mod = modeling_module(model_type)
    for name in GDN_FUNCS:
        if hasattr(mod, name):
            ref = _reference(getattr(mod, name))
            assert inspect.isfunction(ref) and ref.__module__ == mod.__name__, (name, ref)
