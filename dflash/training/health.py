"""A dead drafter: loss at ln V (uniform logits over the vocabulary) and a zero gradient, so nothing can change.

Seen with `trainer.lr=1e6`: the loss sat at ln 4096 with grad norm 0 for the whole run, which
FINISHED and scored τ 1.00. Nothing more can be learnt once the gradient is exactly zero, so the run stops at the
first metric read that shows it and ends FAILED (the promotion gate refuses FAILED runs).
"""
from __future__ import annotations

import logging
import math
import warnings

log = logging.getLogger(__name__)

# |loss − ln V| within this fraction of ln V counts as "at ln V"; a gradient norm at or below ZERO_GRAD is zero
# (a live drafter's is orders of magnitude above it in fp32 and bf16).
LN_V_TOLERANCE = 0.02
ZERO_GRAD = 1e-12


class DeadDrafterError(RuntimeError):
    run_status = "FAILED"


def is_dead(loss: float, grad_norm: float, vocab_size: int) -> bool:
    if vocab_size < 2 or not math.isfinite(loss):
        return False
    ln_v = math.log(vocab_size)
    return grad_norm <= ZERO_GRAD and abs(loss - ln_v) <= LN_V_TOLERANCE * ln_v


def check_alive(metrics: dict[str, float], vocab_size: int, step: int) -> None:
    """Raises DeadDrafterError (after a warning) when the interval's mean loss sits at ln V with a zero gradient."""
    loss, grad = metrics.get("train/loss"), metrics.get("train/grad_norm")
    if loss is None or grad is None or not is_dead(loss, grad, vocab_size):
        return
    msg = (f"dead drafter at step {step}: loss {loss:.4f} ≈ ln V = {math.log(vocab_size):.4f} (V = {vocab_size}) "
           f"with gradient norm {grad:.3g}: it predicts a uniform distribution and can no longer learn "
           f"(learning rate too high?). The run ends FAILED")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    log.error(msg)
    raise DeadDrafterError(msg)
