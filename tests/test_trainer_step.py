"""The trainer's public step API: make_batch / step on device tensors; a composed run's run(final=False,
around_step=...)."""
import contextlib

import torch

from dflash.training.pipeline import Item
from dflash.app.run import TrainingRun
from dflash.training.trainer import StepOutput


def _item(trainer, length=80, seed=0):
    """A buffered item as a producer makes it: the target's features, labels and soft labels of a sequence."""
    ids_T = torch.randint(0, trainer.target.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    out = trainer.target.forward_features(ids_T[None], soft_top_k=trainer.cfg.target.soft_top_k)
    return Item(key=seed, epoch=0, index=seed, tokens_T=ids_T.to(trainer.target.device),
                features_TLH=out.features_BTLH[0], labels_T=out.labels_BT[0],
                soft_vals_Tk=out.soft_vals_BTk[0], soft_idx_Tk=out.soft_idx_BTk[0])


def test_step_api_and_run_hooks(fast_cfg):
    cfg = fast_cfg("+loss=soft_kl", "trainer.max_steps=3", "tracking.enabled=false", "eval.enabled=false")
    run = TrainingRun(cfg)
    trainer = run.trainer

    # One step by hand: a batch from buffered-shaped items, device tensors back, the parameters move.
    batch = trainer.make_batch([_item(trainer, seed=s) for s in range(cfg.trainer.sequences_per_step)])
    before = [p.detach().clone() for p in trainer.drafter.parameters()]
    out = trainer.step(batch)
    assert isinstance(out, StepOutput) and out.loss.dim() == 0 and not out.loss.requires_grad
    assert torch.isfinite(out.loss) and torch.isfinite(out.grad_norm)
    assert set(out.metrics) == {"acc", "acc_per_pos", "streak", "ce"}
    assert out.metrics["acc_per_pos"].shape == (cfg.drafter.block_size - 1,)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.drafter.parameters()))

    entered: list[int] = []

    @contextlib.contextmanager
    def around(step):
        entered.append(step)
        yield

    result = run.run(final=False, around_step=around)
    assert entered == [0, 1, 2]
    assert result.checkpoint is None and not (run.run_dir / "final").exists()
    assert (run.run_dir / "checkpoints").is_dir() and "train/loss" in result.metrics
