"""`dflash.training.state_size` / `experiments.size`: a drafter's trainable parameters by part and its training
state's bytes, counted on the meta device, against what a real drafter and a real optimizer step hold."""
import pytest
import torch

from dflash.drafter.model import build_drafter
from dflash.target.model import read_target_info, resolve_layer_ids
from dflash.training.optim import build_optimizer
from dflash.training.state_size import drafter_size, meta_drafter, part_of
from experiments.config import compose_config

TINY = ["+target=tiny_random", "drafter.num_layers=2", "drafter.num_heads=4", "drafter.num_kv_heads=2",
        "drafter.head_dim=16", "drafter.intermediate_size=96"]


def _real_drafter(cfg):
    info = read_target_info(cfg.target)
    torch.manual_seed(0)
    return build_drafter(cfg.drafter, info.hidden_size, info.num_layers, max(cfg.target.mask_token_id, 0),
                         resolve_layer_ids(cfg.target, info), info.vocab_size)


def _held_bytes(model, opt) -> int:
    """What the step left in memory: trainable weights, their gradients and every per-parameter state tensor
    (the optimizer's 0-dim step counters aside)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    parts = getattr(opt, "parts", {"": opt}).values()  # CombinedOptimizer (muon): each part keeps its own state
    state = sum(t.numel() * t.element_size() for o in parts for s in o.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return sum(2 * p.numel() * p.element_size() for p in trainable) + state


@pytest.mark.parametrize("drafter", [[], ["+drafter=dflash2"]], ids=["dflash1", "dflash2"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_counted_state_is_what_a_real_optimizer_step_holds(drafter, optimizer):
    cfg = compose_config([*TINY, *drafter, f"trainer.optimizer={optimizer}"])
    size = drafter_size(meta_drafter(cfg))
    model = _real_drafter(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert size.total == sum(p.numel() for p in trainable)
    opt = build_optimizer(optimizer, model, 1e-3, 0.0, 10.0, torch.device("cpu"))
    for p in trainable:
        p.grad = torch.randn_like(p)
    opt.step()
    assert size.state_bytes[optimizer] == _held_bytes(model, opt)


def test_dflash2_adds_exactly_its_convolutions_and_selector():
    one = drafter_size(meta_drafter(compose_config(TINY)))
    two = drafter_size(meta_drafter(compose_config([*TINY, "+drafter=dflash2"])))
    cfg = compose_config([*TINY, "+drafter=dflash2"])
    d, info = cfg.drafter, read_target_info(cfg.target)
    H, K, G, r, V = info.hidden_size, d.conv_kernel_size, d.conv_group_size, d.selector_rank, info.vocab_size
    # two convolutions a layer: base kernel [2, K, H] and a bias-free projection H -> 2·K·H/G
    assert two.parameters["convolutions"] == d.num_layers * 2 * (2 * K * H + H * 2 * K * H // G)
    # two codebooks [V, r] and the hidden projection H -> r
    assert two.parameters["selector"] == 2 * V * r + H * r
    assert {k: v for k, v in two.parameters.items() if k not in ("convolutions", "selector")} == one.parameters
    assert [part_of(n) for n in ("candidate_selector.successor_codebook", "layers.3.mlp_conv.base_kernel",
                                 "layers.0.self_attn.q_proj.weight", "fc.weight")] == \
        ["selector", "convolutions", "layers", "fc and norms"]


def test_the_27b_shape_is_counted_without_allocating_it(capsys):
    from experiments.size import main
    text = main(["+target=qwen3_6_27b_random", "+drafter=dflash2_qwen3_6_27b", "trainer.optimizer=muon"])
    assert "| **total** | **1,924.40 M** |" in text and "| selector | 128.45 M |" in text
    assert "muon (trainer.optimizer)" in text and text == capsys.readouterr().out.strip()
