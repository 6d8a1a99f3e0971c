"""The A/B step schedule: which optimizer steps *want* Channel-B.

B at optimizer step ``s`` (0-based, steps completed so far) iff ``floor((s+1)·b) > floor(s·b)``.
``b`` is taken as the exact rational of the decimal written in the YAML (``0.2`` is 1/5, not the
binary float 0.2000000000000000111), so the sequence never drifts, however many steps run, and a
resumed run that restores ``s`` continues the same sequence.

This module knows nothing about queues: whether a wanted B step can run is the learner's
feasibility gate (``learner/decision.py``).
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction
from numbers import Rational


def exact_ratio(b_ratio: float | int | str | Fraction) -> Fraction:
    """The exact rational for ``b_ratio`` as a human wrote it.

    A float is read through its shortest round-trip repr (``repr(0.2) == '0.2'``), which is the
    decimal that was in the YAML. Raises ``ValueError`` outside [0, 1].
    """
    if isinstance(b_ratio, bool):
        raise ValueError(f"b_ratio must be a number in [0, 1], got {b_ratio!r}")
    if isinstance(b_ratio, Rational):
        frac = Fraction(b_ratio)
    elif isinstance(b_ratio, float):
        frac = Fraction(repr(b_ratio))
    elif isinstance(b_ratio, str):
        frac = Fraction(b_ratio.strip())
    else:
        raise ValueError(f"b_ratio must be a number in [0, 1], got {b_ratio!r}")
    if not 0 <= frac <= 1:
        raise ValueError(f"b_ratio must be in [0, 1], got {b_ratio!r}")
    return frac


def wants_b(step: int, b_ratio: float | int | str | Fraction) -> bool:
    """True iff the policy wants a Channel-B step at optimizer step ``step`` (0-based)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    frac = b_ratio if isinstance(b_ratio, Fraction) else exact_ratio(b_ratio)
    num, den = frac.numerator, frac.denominator
    return ((step + 1) * num) // den > (step * num) // den


def planned_b_steps(n_steps: int, b_ratio: float | int | str | Fraction) -> int:
    """How many of steps ``0..n_steps-1`` want B: exactly ``floor(n_steps · b)``."""
    frac = b_ratio if isinstance(b_ratio, Fraction) else exact_ratio(b_ratio)
    return (n_steps * frac.numerator) // frac.denominator


class RealizedRatio:
    """Rolling share of optimizer steps that actually ran Channel-B.

    Capacity rule: the last ``window`` steps; ``value`` over fewer steps until it fills.
    Example: window=4, kinds A,B,A,A,B → value = 2/4 over the last four.
    """

    def __init__(self, window: int = 100) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._kinds: deque[bool] = deque(maxlen=window)
        self.total_steps = 0
        self.total_b = 0

    def record(self, ran_b: bool) -> None:
        self._kinds.append(bool(ran_b))
        self.total_steps += 1
        self.total_b += int(bool(ran_b))

    @property
    def value(self) -> float:
        return sum(self._kinds) / len(self._kinds) if self._kinds else 0.0

    @property
    def cumulative(self) -> float:
        return self.total_b / self.total_steps if self.total_steps else 0.0
