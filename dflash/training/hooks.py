"""What the training loop hands to the layer above it, and what it gets from there.

The loop (dflash/training/trainer.py) trains, checkpoints its own state and stops on a signal; where its metrics
go, what an evaluation is and what happens once it ends belong to the run that composed it (dflash/app/run.py).
As Lightning's callbacks keep checkpoint folders and evaluation out of its fit loop, and torchtitan's `Trainer`
is handed its components, the loop calls these hooks and knows nothing of MLflow, run folders or the gate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LoopHooks:
    """The loop's calls out; every one a no-op here (a benchmark's loop, no tracking)."""

    def on_log(self, trainer, metrics: dict[str, float], step: int) -> None:
        """The interval's metrics (one host sync every tracking.log_every steps); may add to `metrics`."""

    def on_eval(self, trainer, step: int) -> None:
        """Every trainer.eval_every steps (not at the last one): the cheap evaluation, logged by the hook."""

    def on_loop_end(self, trainer, metrics: dict[str, float]) -> None:
        """After the last step's checkpoint, with the producers still up: the final export and evaluation."""


@dataclass
class TrainParts:
    """The components the composing layer builds for a `Trainer` (dflash/app/run.py `build_parts`)."""
    target: Any  # dflash.target.model.Target, frozen
    drafter: Any  # dflash.drafter.model.DFlashDrafter on its device and dtype, the target's head attached
    loss_fn: Any  # dflash.training.losses.build_loss(...)
    noise: Any  # dflash.training.noise.build_noise(...)
    data: Any  # dflash.training.datastream.TrainingData
    data_meter: Any  # dflash.training.datastream.DataMeter over `data`
