"""The learner's cumulative counts over a run: steps by kind, updates, skips, forwards, the realized B ratio.

They continue across a resume: ``learner/checkpointer.py`` saves them in ``trainer_state.json`` (``totals``,
``recent_kinds_b``, ``realized_total_steps``, ``realized_total_b``) and :meth:`RunCounters.restore` takes them
back. Each step's record carries them (``learner/*_total``, ``stage2_ab/async/b_ratio_realized*``).

What this module does not know: what a step does, ranks, or files.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from common.packing.schedule import RealizedRatio

REALIZED_WINDOW = 100  # optimizer steps behind stage2_ab/async/b_ratio_realized


@dataclass
class Totals:
    """Cumulative counts of this rank over the run (every rank counts the same steps; rank 0's are written)."""

    steps_a: int = 0
    steps_b: int = 0
    b_skipped_due_to_queue: int = 0  # B steps the schedule wanted and a rank's queue could not fill
    optimizer_updates: int = 0
    forwards: int = 0  # model forwards seen by the hook (learner/rank.py forward_backward)
    nonfinite_skipped: int = 0  # steps whose update was skipped for a non-finite loss or gradient norm

    def entries(self) -> dict[str, int]:
        return {
            "learner/steps_a_total": self.steps_a,
            "learner/steps_b_total": self.steps_b,
            "learner/b_skipped_due_to_queue_total": self.b_skipped_due_to_queue,
            "learner/optimizer_updates_total": self.optimizer_updates,
            "learner/forwards_total": self.forwards,
            "learner/nonfinite_skipped_total": self.nonfinite_skipped,
        }

    def state(self) -> dict[str, int]:
        """trainer_state.json's ``totals``."""
        return asdict(self)


@dataclass
class RunCounters:
    """:class:`Totals` plus the realized B ratio and the recent step kinds that restore it on resume."""

    totals: Totals = field(default_factory=Totals)
    realized: RealizedRatio = field(default_factory=lambda: RealizedRatio(REALIZED_WINDOW))
    recent_kinds: deque[bool] = field(default_factory=lambda: deque(maxlen=REALIZED_WINDOW))

    def count_step(self, *, kind_b: bool, skipped: bool) -> None:
        """One optimizer step done: its kind, and whether its update was skipped."""
        if skipped:
            self.totals.nonfinite_skipped += 1
        else:
            self.totals.optimizer_updates += 1
        if kind_b:
            self.totals.steps_b += 1
        else:
            self.totals.steps_a += 1
        self.realized.record(kind_b)
        self.recent_kinds.append(kind_b)

    def restore(self, totals: dict[str, Any], recent_kinds_b: list[bool], total_steps: int, total_b: int) -> None:
        """A checkpoint's counts (trainer_state.json), taken back on resume."""
        self.totals = Totals(**{**self.totals.state(), **totals})
        for kind_b in recent_kinds_b:
            self.realized.record(kind_b)
            self.recent_kinds.append(kind_b)
        self.realized.total_steps, self.realized.total_b = total_steps, total_b
