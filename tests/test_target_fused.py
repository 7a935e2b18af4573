"""`target.fused_ops`: the fused norms and MLP of the producer's forward against transformers' own modules."""
import threading

import pytest
import torch

from dflash.target.fused import FUSED_OPS, FusedForward, resolve_fused_ops
from dflash.target.model import Target, TargetConfig, TinyTargetSpec


def _spec(model_type):
    return TinyTargetSpec(model_type=model_type, hidden_size=64, num_layers=4, intermediate_size=128, head_dim=16,
                          linear_head_dim=16)


def _count(model, names):
    return sum(type(m).__name__ in names for m in model.modules())


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_eager_fused_forward_is_transformers_math_exactly(model_type):
    off = Target(TargetConfig(random=_spec(model_type), layer_ids=[0, 2, 3], fused_ops="off"))
    fused = Target(TargetConfig(random=_spec(model_type), layer_ids=[0, 2, 3], fused_ops="eager"))
    assert off.fused.patched == 0
    norms = _count(fused.model, {"Qwen3_5RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5RMSNormGated", "Qwen3NextRMSNormGated"})
    mlps = _count(fused.model, {"Qwen3_5MLP", "Qwen3NextMLP"})  # qwen3_next's MoE experts keep their own code
    attention = _count(fused.model, {"Qwen3_5Attention", "Qwen3NextAttention"})
    assert norms > 0 and attention > 0 and fused.fused.patched == norms + mlps + attention
    ids = torch.randint(0, 256, (2, 40))
    a, b = off.forward_features(ids, soft_top_k=4), fused.forward_features(ids, soft_top_k=4)
    assert torch.equal(a.features_BTLH, b.features_BTLH) and torch.equal(a.labels_BT, b.labels_BT)
    assert torch.equal(a.soft_vals_BTk, b.soft_vals_BTk)


def test_fused_forwards_run_only_inside_the_scope_and_come_off():
    t = Target(TargetConfig(random=_spec("qwen3_5"), fused_ops="off"))
    calls = []
    spy = lambda fn: lambda *a: calls.append(fn.__name__) or fn(*a)  # noqa: E731
    FUSED_OPS.register("spy", spy)
    try:
        t.set_fused_ops("spy")
        ids = torch.randint(0, 256, (1, 12), device=t.device)
        t.model(input_ids=ids)  # evaluation's own forward: transformers' code
        assert calls == []
        t.forward_features(ids)
        assert set(calls) == {"zero_centered_rms_norm", "gated_rms_norm", "silu_mul", "attention_qk", "sigmoid_gate"}
        calls.clear()
        worker = threading.Thread(target=lambda: t.model(input_ids=ids))
        with t.fused.scope():  # entered on this thread only
            worker.start()
            worker.join()
        assert calls == []
        t.set_fused_ops("off")
        assert all("forward" not in m.__dict__ for m in t.model.modules())
        t.forward_features(ids)
        assert calls == []
    finally:
        FUSED_OPS.pop("spy")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_fused_forward_matches(device):
    """`compile` traces each piece as one graph (fullgraph: a graph break would raise) and keeps the values: float32
    on the CPU to 1e-4; bf16 on a GPU to bf16's own rounding (the fused kernels round once where the chains of
    kernels rounded after every op)."""
    torch._dynamo.reset()
    off = Target(TargetConfig(random=_spec("qwen3_5"), layer_ids=[1, 3], fused_ops="off", device=device))
    comp = Target(TargetConfig(random=_spec("qwen3_5"), layer_ids=[1, 3], fused_ops="compile", device=device))
    ids = torch.randint(0, 256, (2, 24), device=off.device)
    from torch._dynamo.utils import counters
    counters.clear()
    a, b = off.forward_features(ids), comp.forward_features(ids)
    assert counters["stats"]["unique_graphs"] >= 3  # the pieces (fullgraph: no graph breaks)
    if device == "cpu":
        torch.testing.assert_close(b.features_BTLH, a.features_BTLH, rtol=1e-4, atol=1e-4)
        assert (a.labels_BT == b.labels_BT).float().mean() > 0.99
    else:
        rel = ((b.features_BTLH.float() - a.features_BTLH.float()).norm() / a.features_BTLH.float().norm()).item()
        assert rel < 2e-2, rel
        assert (a.labels_BT == b.labels_BT).float().mean() > 0.9
    torch._dynamo.reset()


def test_auto_compiles_on_cuda_only_and_bad_names_are_refused():
    assert resolve_fused_ops("auto", torch.device("cpu")) == "off"
    assert resolve_fused_ops("auto", torch.device("cuda")) == "compile"
    with pytest.raises(ValueError, match=r"target\.fused_ops='nope' is unknown"):
        resolve_fused_ops("nope", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"target\.fused_ops"):
        FusedForward(torch.nn.Linear(2, 2), "nope")
