"""``training.max_train_seconds``: the run ends after the step that spends its training-time budget.

Training time is ``time/step`` summed over this process's steps after its first: the first carries start-up
(the start-up sync, CUDA initialisation), not training, so a resumed run is not charged for starting again.
Rank 0's clock decides for every rank (:meth:`TimeBudget.check` broadcasts it), so every rank stops after the
same step.

What this module does not know: what a step does, or the step limit (``training.max_steps``).
"""

from __future__ import annotations

from typing import Any


class TimeBudget:
    """This process's training seconds against ``training.max_train_seconds`` (None: no budget); ``dist``: the
    learner's ranks (None: this process alone)."""

    def __init__(self, max_train_seconds: float | None, dist: Any) -> None:
        self.limit, self.dist = max_train_seconds, dist
        self.train_seconds = 0.0
        self.out_of_time = False  # identical on every rank after check()
        self._counting = False  # from the process's second step on

    def add(self, step_seconds: float) -> None:
        """One step done on this rank, ``step_seconds`` long (its ``time/step``)."""
        if self._counting:
            self.train_seconds += step_seconds
        self._counting = True

    def check(self, step: int) -> None:
        """Collective when a budget is set (a tiny broadcast per step): adopt rank 0's verdict on every rank. Without
        a ``dist`` (a process outside torchrun) its own verdict."""
        if self.limit is not None:
            verdict = [int(self.train_seconds >= self.limit)]
            if self.dist is not None:
                verdict = self.dist.broadcast(verdict, f"time-budget broadcast at step {step}")
            self.out_of_time = bool(verdict[0])
