"""Hungarian matching: optimality against brute force, trivial cases, and IoU against rasterisation."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from common.detection.matching import box_iou, hungarian_match, precision_recall_f1


def random_box(rng: random.Random, hi: int) -> list[int]:
    x1, x2 = sorted(rng.randint(0, hi) for _ in range(2))
    y1, y2 = sorted(rng.randint(0, hi) for _ in range(2))
    return [x1, y1, x2, y2]


def raster_iou(a, b, size: int = 1000) -> float:
    """IoU by counting unit cells [i, i+1) x [j, j+1) inside each box on a size x size grid."""
    def mask(box):
        m = np.zeros((size, size), dtype=bool)
        m[box[1] : box[3], box[0] : box[2]] = True
        return m

    ma, mb = mask(a), mask(b)
    union = (ma | mb).sum()
    return float((ma & mb).sum() / union) if union else 0.0


def feasible_pairs(pred, gt, top_k, gate):
    """Independent restatement of the candidate + gate rule: {(i, j): iou} of allowed pairs."""
    out = {}
    for i, p in enumerate(pred):
        ious = [raster_iou(p, g, size=64) for g in gt]
        if max(ious) > 0:
            order = sorted(range(len(gt)), key=lambda j: (-ious[j], j))
        else:
            cp = ((p[0] + p[2]) / 2, (p[1] + p[3]) / 2)
            dist = [((g[0] + g[2]) / 2 - cp[0]) ** 2 + ((g[1] + g[3]) / 2 - cp[1]) ** 2 for g in gt]
            order = sorted(range(len(gt)), key=lambda j: (dist[j], j))
        for j in order[: max(1, top_k)]:
            if ious[j] >= gate:
                out[(i, j)] = ious[j]
    return out


def brute_force_cost(n_p, n_g, pairs, fp_cost, fn_cost) -> float:
    """Minimum over every injective partial matching that uses only feasible pairs."""
    best = float("inf")
    options = [None] + list(range(n_g))
    for choice in itertools.product(options, repeat=n_p):
        used = [j for j in choice if j is not None]
        if len(used) != len(set(used)):
            continue
        if any(j is not None and (i, j) not in pairs for i, j in enumerate(choice)):
            continue
        cost = sum(1 - pairs[(i, j)] for i, j in enumerate(choice) if j is not None)
        cost += fp_cost * (n_p - len(used)) + fn_cost * (n_g - len(used))
        best = min(best, cost)
    return best


def test_total_cost_equals_brute_force_optimum_on_random_small_cases():
    rng = random.Random(1234)
    n_cases = 3000
    n_gated = 0
    for _ in range(n_cases):
        n_p, n_g = rng.randint(0, 4), rng.randint(0, 4)
        hi = rng.choice([10, 20, 63])  # small grids make overlaps, near-misses and ties common
        pred = [random_box(rng, hi) for _ in range(n_p)]
        gt = [random_box(rng, hi) for _ in range(n_g)]
        top_k = rng.randint(1, 4)
        gate = rng.choice([0.0, 0.1, 0.3, 0.5])
        fp_cost, fn_cost = rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]), rng.choice([0.0, 0.5, 1.0, 2.0])
        res = hungarian_match(pred, gt, candidate_top_k=top_k, gate=gate, fp_cost=fp_cost, fn_cost=fn_cost)
        n_gated += res.gating_rejections

        pairs = feasible_pairs(pred, gt, top_k, gate) if n_p and n_g else {}
        expected = brute_force_cost(n_p, n_g, pairs, fp_cost, fn_cost)
        assert res.total_cost == pytest.approx(expected, abs=1e-9), (pred, gt, top_k, gate, fp_cost, fn_cost)

        # The result is a consistent partition and only uses feasible pairs.
        assert sorted([p for p, _ in res.matched_pairs] + res.fp_pred_indices) == list(range(n_p))
        assert sorted([g for _, g in res.matched_pairs] + res.fn_gt_indices) == list(range(n_g))
        for (p, g), iou in zip(res.matched_pairs, res.matched_ious):
            assert (p, g) in pairs
            assert iou == pytest.approx(pairs[(p, g)])
    assert n_gated > 0, "the random cases never exercised the gate"


def test_no_predictions_make_every_gt_a_false_negative():
    res = hungarian_match([], [[0, 0, 10, 10], [5, 5, 9, 9]], candidate_top_k=5, gate=0.3, fp_cost=0.5, fn_cost=2.0)
    assert res.matched_pairs == [] and res.fp_pred_indices == []
    assert res.fn_gt_indices == [0, 1]
    assert res.total_cost == pytest.approx(4.0)


def test_no_gt_makes_every_prediction_a_false_positive():
    res = hungarian_match([[0, 0, 10, 10]] * 3, [], candidate_top_k=5, gate=0.3, fp_cost=0.5, fn_cost=2.0)
    assert res.matched_pairs == [] and res.fn_gt_indices == []
    assert res.fp_pred_indices == [0, 1, 2]
    assert res.total_cost == pytest.approx(1.5)


def test_pairs_below_the_gate_are_rejected_and_counted():
    pred = [[0, 0, 100, 100]]
    gt = [[50, 50, 150, 150]]  # IoU = 2500 / 17500 = 1/7
    res = hungarian_match(pred, gt, candidate_top_k=1, gate=0.3, fp_cost=1.0, fn_cost=1.0)
    assert res.matched_pairs == [] and res.gating_rejections == 1
    res = hungarian_match(pred, gt, candidate_top_k=1, gate=0.1, fp_cost=1.0, fn_cost=1.0)
    assert res.matched_pairs == [(0, 0)] and res.matched_ious == [pytest.approx(1 / 7)]


def test_disjoint_prediction_falls_back_to_the_nearest_centre_candidate():
    pred = [[0, 0, 10, 10]]
    gt = [[900, 900, 999, 999], [20, 20, 30, 30], [500, 0, 520, 10]]
    res = hungarian_match(pred, gt, candidate_top_k=1, gate=0.0, fp_cost=5.0, fn_cost=5.0)
    assert res.matched_pairs == [(0, 1)] and res.matched_ious == [0.0]


def test_box_iou_matches_hand_computed_values():
    a = [[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [3, 3, 3, 9], [0, 0, 10, 10]]
    b = [[0, 0, 10, 10], [5, 0, 15, 10], [10, 10, 20, 20], [3, 3, 3, 9], [2, 2, 4, 4]]
    got = np.diag(box_iou(a, b))
    np.testing.assert_allclose(got, [1.0, 50 / 150, 0.0, 0.0, 4 / 100])


def test_box_iou_matches_an_independent_rasterised_iou():
    rng = random.Random(7)
    a = [random_box(rng, 999) for _ in range(12)]
    b = [random_box(rng, 999) for _ in range(12)] + a[:3]
    got = box_iou(a, b)
    assert got.shape == (12, 15)
    for i in range(12):
        for j in range(15):
            assert got[i, j] == pytest.approx(raster_iou(a[i], b[j]), abs=1e-12)


def test_box_iou_of_empty_inputs_has_the_right_shape():
    assert box_iou([], [[0, 0, 1, 1]]).shape == (0, 1)
    assert box_iou([[0, 0, 1, 1]], np.zeros((0, 4))).shape == (1, 0)


def test_precision_recall_f1_handles_empty_denominators():
    assert precision_recall_f1(2, 4, 2) == pytest.approx((0.5, 1.0, 2 / 3))
    assert precision_recall_f1(0, 0, 3) == (0.0, 0.0, 0.0)
    assert precision_recall_f1(0, 3, 0) == (0.0, 0.0, 0.0)
    assert precision_recall_f1(0, 0, 0) == (1.0, 1.0, 1.0)
