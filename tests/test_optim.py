"""trainer.optimizer: Muon for the 2-D weights at 10 × the AdamW lr, AdamW for the rest, under one LR schedule,
and a run that resumes exactly with it (a DFlash 2 drafter, whose convs and selector add 3-D kernels and
codebooks to the split)."""
import copy
import json
from pathlib import Path

import pytest
import torch

from dflash.app.run import train
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.training.optim import CombinedOptimizer, build_optimizer, muon_parameters
from tests.conftest import interrupted_copy


def _drafter():
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, block_size=4,
                        architecture="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=3)
    return DFlashDrafter(cfg, 16, num_target_layers=4, mask_token_id=0, target_layer_ids=[0, 1], vocab_size=20)


def test_muon_takes_the_weight_matrices_and_adamw_the_rest():
    d = _drafter()
    muon, adamw = muon_parameters(d)
    names = {id(p): n for n, p in d.named_parameters()}
    assert all(p.ndim == 2 for p in muon) and len(muon) + len(adamw) == len(list(d.parameters()))
    assert {names[id(p)] for p in muon} >= {"fc.weight", "layers.0.self_attn.q_proj.weight",
                                           "layers.0.attention_conv.kernel_projection.weight",
                                           "candidate_selector.hidden_projection.weight"}
    assert {names[id(p)] for p in adamw} >= {"candidate_selector.predecessor_codebook",
                                            "layers.0.attention_conv.base_kernel", "norm.weight"}


def test_one_schedule_scales_both_parts_and_keeps_the_ratio():
    d = _drafter()
    opt = build_optimizer("muon", d, 1e-3, 0.0, 10.0, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for p in d.parameters():
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in d.named_parameters()}
    opt.step()
    sched.step()
    assert all(not torch.equal(before[n], p) for n, p in d.named_parameters())  # both parts stepped
    lrs = {name: [g["lr"] for g in part.param_groups] for name, part in opt.parts.items()}
    assert lrs == {"muon": [pytest.approx(5e-3)], "adamw": [pytest.approx(5e-4)]}


def test_state_dict_round_trip_continues_identically():
    def stepped(opt_src=None):
        d = _drafter()
        opt = build_optimizer("muon", d, 1e-3, 0.01, 10.0, torch.device("cpu"))
        if opt_src is not None:
            opt.load_state_dict(opt_src)
        return d, opt

    d1, o1 = stepped()
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g) for p in d1.parameters()] for _ in range(3)]
    for step in grads[:2]:
        for p, gr in zip(d1.parameters(), step):
            p.grad = gr.clone()
        o1.step()
    d2, o2 = stepped(copy.deepcopy(o1.state_dict()))  # as a checkpoint file holds it (no shared buffers)
    d2.load_state_dict(d1.state_dict())
    for d, o in ((d1, o1), (d2, o2)):
        for p, gr in zip(d.parameters(), grads[2]):
            p.grad = gr.clone()
        o.step()
    for a, b in zip(d1.parameters(), d2.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="trainer.optimizer"):
        CombinedOptimizer(o1.parts).load_state_dict({"adamw": {}})


def _losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_muon_run_of_a_dflash2_drafter_resumes_exactly(fast_cfg, tmp_path):
    over = ("+drafter=dflash2", "drafter.num_layers=1", "drafter.layer_types=[sliding_attention]", "drafter.head_dim=16", "drafter.intermediate_size=128",
            "drafter.block_size=8", "trainer.optimizer=muon", "+buffer=deterministic", "buffer.max_depth=4",
            "buffer.min_ready=4", "trainer.tau_probe.sequences=0")
    full = train(fast_cfg(*over, run="full"))
    ref = _losses(full.run_dir)
    part = interrupted_copy(full.run_dir, 3, tmp_path / "part")
    got = _losses(train(fast_cfg(f"resume={part}", run="ignored")).run_dir)
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), (s, got, ref)
