"""`dflash.training.topk.top_k_rows`: the two-pass top-k (group maxima, then the best groups' logits) against
torch.topk, with ties, in every dtype the LM-head chunks hold; and where it falls back to torch.topk."""
import pytest
import torch

from dflash.training.topk import GROUPED_MIN_VOCAB, group_size, grouping, top_k_rows


@pytest.mark.parametrize("V,dtype", [(4096, torch.float32), (248320 // 16, torch.bfloat16), (2048, torch.float64),
                                     (1024, torch.float16)])
def test_two_passes_give_torch_topks_values_and_ids_that_hold_them(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(96, V, generator=g).to(dtype)
    x[:4] = x[:4].round()  # rows full of ties
    x[4, : V // 2] = 7.0  # the best logits all in the first groups
    assert group_size(V, 16)  # the two-pass path runs
    vals, ids = top_k_rows(x, 16, grouped=True)
    want = x.topk(16, dim=-1)
    assert torch.equal(vals, want.values)  # sorted, largest first
    assert torch.equal(x.gather(1, ids), vals)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids
    top17 = x.topk(17, dim=-1).values
    no_ties = (top17.diff(dim=-1) != 0).all(-1)  # rows whose 17 largest are distinct: the ids are determined
    assert no_ties.sum() > (10 if dtype in (torch.float32, torch.float64) else -1)  # bf16 / fp16 rows tie often
    assert torch.equal(ids[no_ties], want.indices[no_ties])


def test_rows_it_cannot_split_take_torch_topk_and_the_cpu_does_by_default():
    x = torch.randn(8, 3001)
    assert group_size(3001, 16) == 0 and group_size(256, 16) == 0  # not a multiple; too few groups
    for grouped in (True, None):
        vals, ids = top_k_rows(x, 16, grouped=grouped)
        assert torch.equal(ids, x.topk(16).indices)
    y = torch.randn(8, 4096)
    assert torch.equal(top_k_rows(y, 16)[1], y.topk(16).indices)  # a CPU tensor: torch.topk unless asked


def test_by_default_only_a_gpus_long_rows_take_the_two_passes():
    """Measured in the bench step: faster at V = 248,320, slower at V = 4,096 (module doc)."""
    assert grouping(248320, 16, on_gpu=True) == group_size(248320, 16) > 0
    assert grouping(4096, 16, on_gpu=True) == 0 and 4096 < GROUPED_MIN_VOCAB <= 248320
    assert grouping(248320, 16, on_gpu=False) == 0  # the CPU: torch.topk
    assert grouping(4096, 16, on_gpu=False, grouped=True) == group_size(4096, 16) > 0  # asked for
    assert grouping(248320, 16, on_gpu=True, grouped=False) == 0
