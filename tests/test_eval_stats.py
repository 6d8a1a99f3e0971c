"""How sure an evaluation is (common/evaluation/stats.py): the bootstrap interval of F1 over images, the paired
first-vs-last difference the run summary prints, t-intervals over seeds, duplicates and F1 by GT count."""

from __future__ import annotations

import json

from common.data.records import GTObject
from common.evaluation.metrics import ImageResult, Prediction, evaluate_detections
from common.evaluation.stats import (ImageCounts, by_gt_count, f1_interval, paired_f1_difference, paired_t_difference,
                                     pooled_f1, t_interval)


def counts(rows: list[tuple[int, int, int]]) -> ImageCounts:
    m, p, g = zip(*rows)
    return ImageCounts(m, p, g, (0,) * len(rows))


def mix(n_good: int, n_bad: int) -> ImageCounts:
    """Images that are perfect (2 of 2 found, nothing extra) or useless (0 of 2, 2 wrong boxes)."""
    return counts([(2, 2, 2)] * n_good + [(0, 2, 2)] * n_bad)


def test_identical_images_give_a_zero_width_interval_at_the_point_estimate():
    low, high = f1_interval(counts([(1, 2, 2)] * 50))
    assert low == high == 0.5


def test_a_mixed_set_has_an_interval_around_its_f1_that_narrows_like_one_over_root_n():
    small, large = mix(32, 32), mix(128, 128)  # F1 0.5 both; 4x the images
    point = float(pooled_f1(*small.arrays()))
    low, high = f1_interval(small)
    assert point == 0.5 and low < point < high
    # Binomial share of good images: sd 0.5 / sqrt(64) = 0.0625, so the 95 % width is ~0.245
    assert 0.18 < high - low < 0.31, (low, high)
    low4, high4 = f1_interval(large)
    assert 0.35 < (high4 - low4) / (high - low) < 0.65  # ~1/2: the interval shrinks as 1/sqrt(n)


def test_the_interval_is_the_same_on_every_call_and_none_without_images():
    assert f1_interval(mix(20, 12)) == f1_interval(mix(20, 12))
    assert f1_interval(counts([(1, 1, 1)])) == (1.0, 1.0)  # one image: nothing to resample
    assert f1_interval(ImageCounts((), (), (), ())) is None


def test_the_paired_difference_has_the_sign_of_the_change_and_is_outside_the_noise_only_when_large():
    before = mix(32, 32)
    better = mix(48, 16)  # 16 images went from useless to perfect: F1 0.5 -> 0.75
    up = paired_f1_difference(before, better)
    assert up["diff"] == 0.25 and 0 < up["low"] < 0.25 < up["high"] and up["outside_noise"]
    down = paired_f1_difference(better, before)
    assert down["diff"] == -0.25 and down["high"] < 0 and down["outside_noise"]
    slightly = mix(33, 31)  # one image better of 64
    small = paired_f1_difference(before, slightly)
    assert small["diff"] > 0 and small["low"] <= 0 and not small["outside_noise"]
    assert paired_f1_difference(before, mix(3, 3)) is None  # different image sets cannot be paired


def test_t_interval_over_seeds_and_the_paired_difference_across_arms():
    one = t_interval([0.4])
    assert one == {"n": 1, "mean": 0.4, "low": None, "high": None}
    same = t_interval([0.4, 0.4, 0.4])
    assert same["low"] == same["high"] == same["mean"]
    five = t_interval([0.40, 0.42, 0.38, 0.41, 0.39])
    # mean 0.40, sd 0.0158, sem 0.00707, t(0.975, 4) = 2.776 -> half-width 0.0196
    assert abs(five["mean"] - 0.40) < 1e-12 and abs((five["high"] - five["low"]) / 2 - 0.01963) < 1e-4
    base = {0: 0.40, 1: 0.42, 2: 0.38, 3: 0.41}
    other = {0: 0.45, 1: 0.46, 2: 0.44, 3: 0.47, 9: 0.9}  # seed 9 has no partner: left out
    d = paired_t_difference(base, other)
    assert d["seeds"] == [0, 1, 2, 3] and d["mean"] > 0 and d["low"] > 0 and d["outside_noise"] is True
    assert paired_t_difference({0: 0.4}, {0: 0.5})["outside_noise"] is None  # one seed: no interval


def _im(gt: list[tuple[int, int, int, int]], preds: list[tuple[int, int, int, int]], id_: str) -> ImageResult:
    return ImageResult(width=999, height=999, gt=[GTObject("o", b) for b in gt],
                       preds=[Prediction("o", b) for b in preds], id=id_)


def test_a_second_box_on_a_found_object_is_a_duplicate_and_a_near_miss_is_not():
    crowd = [(i * 20, 0, i * 20 + 15, 15) for i in range(12)]  # 12 GT: the 10-19 bucket
    images = [
        _im([(0, 0, 100, 100), (200, 200, 300, 300)],
            [(0, 0, 100, 100), (0, 0, 100, 95),  # hit + a duplicate of it (IoU 0.95)
             (200, 200, 300, 240)], "a"),  # IoU 0.4 with an unfound GT: a miss, not a duplicate
        _im(crowd, crowd[:6] + [crowd[0], crowd[1]], "b"),  # 6 found, 2 repeated
    ]
    r = evaluate_detections(images)
    assert r.n_duplicate == 3 and r.duplicate_rate == 3 / 11
    assert r.image_counts.n_dup == (1, 2) and r.image_counts.n_matched == (1, 6)
    assert set(r.by_gt_count) == {"1_4", "10_19"}
    assert r.by_gt_count["1_4"]["recall"] == 0.5 and r.by_gt_count["10_19"]["recall"] == 0.5
    assert abs(r.by_gt_count["10_19"]["f1"] - 2 * 6 / (8 + 12)) < 1e-12
    assert r.f1_ci_low <= r.f1 <= r.f1_ci_high
    json.dumps(r.as_dict())  # the evaluator writes it to report.json


def test_buckets_leave_images_without_ground_truth_out():
    b = by_gt_count(counts([(0, 3, 0), (40, 40, 40), (3, 5, 5)]))
    assert set(b) == {"40_plus", "5_9"} and b["40_plus"]["f1"] == 1.0 and b["5_9"]["n_images"] == 1


def _eval(step: int, rows: list[tuple[int, int, int]]) -> dict:
    c = counts(rows)
    low, high = f1_interval(c)
    return {"record": "eval", "step": step, "eval/f1": float(pooled_f1(*c.arrays())), "eval/map": 0.1,
            "eval/n_images": len(rows), "eval/f1_ci_low": low, "eval/f1_ci_high": high,
            "eval/image_counts": c.as_dict()}


def test_the_summary_prints_both_intervals_and_says_whether_the_change_is_outside_the_noise():
    from launcher.summary import format_summary, summarize

    steps = [{"step": i, "loss/total": 1.0} for i in range(4)]
    first, last = _eval(0, [(2, 2, 2)] * 32 + [(0, 2, 2)] * 32), _eval(4, [(2, 2, 2)] * 48 + [(0, 2, 2)] * 16)
    s = summarize(steps, evals=[first, last])
    assert s["eval"]["f1_change"]["diff"] == 0.25 and s["eval"]["last"]["f1_ci_high"] > 0.75
    lines = format_summary(s).splitlines()
    ci = next(x for x in lines if x.startswith("val F1@0.5 95 % CI"))
    assert ci.startswith(f"val F1@0.5 95 % CI     first [{first['eval/f1_ci_low']:.3f}, ")
    assert ci.endswith("(bootstrap over 64 images)")
    change = next(x for x in lines if x.startswith("val F1 last − first"))
    assert change.startswith("val F1 last − first   +0.250  95 % CI [+0.") and change.endswith("outside the noise")

    flat = summarize(steps, evals=[first, _eval(4, [(2, 2, 2)] * 33 + [(0, 2, 2)] * 31)])
    assert format_summary(flat).splitlines()[-1].endswith("within the noise")
    old = summarize(steps, evals=[{k: v for k, v in r.items() if k != "eval/image_counts"} for r in (first, last)])
    assert old["eval"]["f1_change"] is None and "last − first" not in format_summary(old)  # runs before the counts
