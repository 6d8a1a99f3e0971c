"""The A/B schedule (common/packing/schedule.py): exact, resumable, edge cases of the spec scenarios."""

import math
from fractions import Fraction

import pytest

from common.packing.schedule import RealizedRatio, exact_ratio, planned_b_steps, wants_b


def test_b_ratio_half_alternates_a_b_a_b():
    assert [wants_b(s, 0.5) for s in range(4)] == [False, True, False, True]


def test_b_ratio_zero_is_always_a_and_one_is_always_b():
    assert not any(wants_b(s, 0.0) for s in range(10_000))
    assert all(wants_b(s, 1.0) for s in range(10_000))


@pytest.mark.parametrize("b", [0.1, 0.2, 0.3, 0.05, 0.7, 1 / 3, 0.123456789])
def test_schedule_is_exact_against_rational_arithmetic_over_a_million_steps(b):
    frac = Fraction(repr(b))
    n, d = frac.numerator, frac.denominator
    expected_total = 0
    for s in range(0, 1_000_000, 997):  # sample widely, then check the running count exactly
        assert wants_b(s, b) == (math.floor(Fraction(s + 1) * frac) > math.floor(Fraction(s) * frac))
    count = sum(((s + 1) * n) // d - (s * n) // d for s in range(1_000_000))
    expected_total = (1_000_000 * n) // d
    assert count == expected_total == planned_b_steps(1_000_000, b)


def test_float_drift_would_differ_from_the_exact_schedule():
    # 0.1 as a binary float is slightly above 1/10; the exact rule must follow the decimal.
    assert exact_ratio(0.1) == Fraction(1, 10)
    assert planned_b_steps(10**9, 0.1) == 10**8


def test_selection_for_step_s_is_identical_before_and_after_resume():
    b = 0.3
    uninterrupted = [wants_b(s, b) for s in range(200)]
    resumed = [wants_b(s, b) for s in range(120)] + [wants_b(s, b) for s in range(120, 200)]
    assert uninterrupted == resumed


@pytest.mark.parametrize("bad", [-0.1, 1.5, "abc", True, None])
def test_b_ratio_outside_unit_interval_is_rejected(bad):
    with pytest.raises(ValueError):
        exact_ratio(bad)


def test_string_ratio_is_read_as_written():
    assert exact_ratio("0.2") == Fraction(1, 5)
    assert [wants_b(s, "0.25") for s in range(8)] == [False, False, False, True] * 2


def test_realized_ratio_rolls_over_its_window():
    r = RealizedRatio(window=4)
    for kind in [False, True, False, False, True]:
        r.record(kind)
    assert r.value == 0.5
    assert r.cumulative == pytest.approx(2 / 5)
