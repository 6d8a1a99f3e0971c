"""The step decision at each optimizer-step boundary: policy (rank 0) × feasibility (every rank).

::

    rank 0: wants = wants_b(global_step, b_ratio)          (common.packing.schedule, exact rational)
    ┌► every rank: n_r = queue.eligible()                   (stale packs pruned first)
    │  all_reduce(MIN) over n_r  ──► n_min                  collective 1, every rank, always
    │  rank 0: verdict = B     if wants and n_min >= GA
    │                    WAIT  if wants, n_min < GA and learner.pack_wait_s has not passed (rank 0's clock)
    │                    A     otherwise
    │  broadcast [verdict, wants, n_min] from rank 0        collective 2, every rank, always
    └─ WAIT: sleep poll_s, again (every rank loops the same number of times: the verdict is broadcast)
    B: every rank reserves its GA oldest eligible packs now

The collectives run on every rank whatever the values, so no rank branches around a
collective. With ``pack_wait_s = 0`` (default) there is exactly one round: the learner never
waits for actors. Between ``eligible()`` and ``reserve()`` the eligible count cannot fall: stale drops
happen only on a ver change (the same thread, before the decision) and a drop-oldest push always
adds a pack for the one it removes; ``reserve`` still checks and raises if it ever did.

A B step may mix packs of different vers, each within the version window: feasibility is "GA
eligible packs", not "GA packs of one ver": with frequent syncs few queued packs share one ver, so the
single-ver rule would starve B. Each pack stays version-pure.

What this module does not know: models, sockets, or how packs are trained.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from common.packing.schedule import wants_b
from learner.distributed import Dist
from learner.pack_queue import ReadyPack


class _Queue(Protocol):
    def eligible(self) -> int: ...

    def reserve(self, n: int) -> list[ReadyPack]: ...


@dataclass
class StepDecision:
    """The kind of one optimizer step, identical on every rank, plus this rank's reserved packs."""

    step: int
    policy_wants_b: bool
    kind: str  # "A" or "B", fixed for the whole accumulation window
    min_eligible: int  # the all-reduced MIN of eligible packs over ranks
    local_eligible: int
    packs: list[ReadyPack] = field(default_factory=list)  # GA packs on a B step, else empty

    @property
    def skipped_due_to_queue(self) -> bool:
        """Policy wanted B but some rank held fewer than GA eligible packs."""
        return self.policy_wants_b and self.kind == "A"


_A, _B, _WAIT = 0, 1, 2


def decide_step(
    step: int, b_ratio: Fraction, ga: int, queue: _Queue | None, dist: Dist, *, wait_s: float = 0.0, poll_s: float = 0.02
) -> StepDecision:
    """Run the decision protocol of the module docstring (every rank calls it at every step)."""
    wants = wants_b(step, b_ratio) if dist.is_main else False
    deadline = time.monotonic() + wait_s
    rounds = 0
    while True:
        rounds += 1
        local = queue.eligible() if queue is not None else 0
        (n_min,) = dist.all_reduce([local], "min", f"eligible-pack count (all_reduce MIN) at step {step}, round {rounds}")
        verdict = _A
        if wants and n_min >= ga:
            verdict = _B
        elif wants and time.monotonic() < deadline:
            verdict = _WAIT
        verdict, wants_i, n_min = dist.broadcast(
            [verdict, int(wants), int(n_min)], f"step-kind broadcast from rank 0 at step {step}, round {rounds}"
        )
        if verdict != _WAIT:
            break
        time.sleep(poll_s)
    packs = queue.reserve(ga) if verdict == _B else []  # type: ignore[union-attr]
    return StepDecision(
        step=step, policy_wants_b=bool(wants_i), kind="B" if verdict == _B else "A", min_eligible=int(n_min),
        local_eligible=local, packs=packs,
    )
