"""The optimizer update of one step: the loss check every rank agrees on, clip, AdamW, LR schedule, or a skip.

    loss of this rank ─► all_reduce(MAX not-finite) ─► clip_and_step (clip, AdamW step, LR step, zero grads)
      ─► OptimizerOutcome (grad norm, skipped?, lr of each parameter group, host seconds)

A non-finite loss on any rank, or a non-finite gradient norm (the same on every rank: learner/model.py
``clip_and_step``), skips the update on every rank: the gradients are dropped, the weights, AdamW state and
LR schedule stay, so no NaN reaches a sync or a checkpoint. The skip is logged here and counted by the caller
(``learner/nonfinite_skipped_total``).

The loss check holds a collective (every rank calls :meth:`OptimizerStep.apply` at the same step).

What this module does not know: metric names (``learner/step_record.py`` names the outcome's entries), the
step's kind, or what the gradients came from.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from learner.model import build_optimizer, clip_and_step
from learner.step_record import OptimizerOutcome

log = logging.getLogger(__name__)


class OptimizerStep:
    """AdamW and its LR schedule over ``model`` (built after wrapping: under fsdp, over the shards)."""

    def __init__(self, model: torch.nn.Module, training: Any, dist: Any) -> None:
        self.model, self.dist, self.max_grad_norm = model, dist, training.max_grad_norm
        self.optimizer, self.scheduler = build_optimizer(model, training)

    def apply(self, loss_total: float, step: int) -> OptimizerOutcome:
        """Update the weights from the accumulated gradients, or skip (see the module docstring)."""
        loss_ok = self._loss_finite(loss_total, step)
        t0 = time.monotonic()
        norm = clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm, loss_finite=loss_ok)
        seconds = time.monotonic() - t0  # on the host under FSDP2 cpu_offload
        skipped = not (loss_ok and math.isfinite(norm))  # the same on every rank (see _loss_finite, clip_and_step)
        if skipped:
            log.error("rank %d step %d: non-finite %s: optimizer step skipped (gradients dropped, weights unchanged; "
                      "learner/nonfinite_skipped_total counts them)", self.dist.rank, step,
                      "loss" if not loss_ok else f"gradient norm ({norm})")
        lrs = self.scheduler.get_last_lr()
        by_group = {}
        if len(self.optimizer.param_groups) > 1:  # training.lr_groups: train/lr_vision, _merger, _llm, _rest
            by_group = {group["name"]: lr for group, lr in zip(self.optimizer.param_groups, lrs)}
        return OptimizerOutcome(grad_norm=norm, skipped=skipped, lr=lrs[0], lr_by_group=by_group, seconds=seconds)

    def _loss_finite(self, loss_total: float, step: int) -> bool:
        """Whether every rank's loss of this step is finite (one all_reduce under DDP, so all ranks agree)."""
        ok = math.isfinite(loss_total)
        if self.dist.world_size > 1:
            ok = self.dist.all_reduce([float(not ok)], "max", f"non-finite loss check at step {step}")[0] == 0
        return ok
