"""The detection report: COCO mAP (pycocotools) against hand-worked AP, matcher F1, undefined cases, scores."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from common.data.records import GTObject
from common.evaluation.metrics import ImageResult, Prediction, coco_map, evaluate_detections, object_scores
from common.detection.parsing import DROP_REASONS, ParsedObject, ParseResult

# 999 x 999 images: a bin k is pixel k/999*999 = k, so the boxes below read the same in both spaces.
A1, A2, B1 = (0, 0, 100, 100), (200, 200, 300, 300), (0, 0, 100, 100)


def hand_case() -> list[ImageResult]:
    """2 images, 3 GT, 4 predictions with distinct scores: a hit, a duplicate, an IoU-0.4 miss, an IoU-0.82 hit."""
    image_a = ImageResult(
        width=999, height=999, gt=[GTObject("a", A1), GTObject("b", A2)], id="A",
        preds=[
            Prediction("a", (0, 0, 100, 100), 0.9),  # p1: exact a1 -> TP at every threshold
            Prediction("a", (0, 0, 100, 90), 0.8),  # p2: duplicate of a1 (IoU 0.9) -> FP (a1 taken by p1)
            Prediction("b", (200, 200, 300, 282), 0.6),  # p4: IoU 8200/10000 = 0.82 with a2 -> TP for t <= 0.80
        ],
    )
    image_b = ImageResult(
        width=999, height=999, gt=[GTObject("c", B1)], id="B",
        preds=[Prediction("c", (0, 0, 100, 40), 0.7)],  # p3: IoU 4000/10000 = 0.4 with b1 -> FP everywhere
    )
    return [image_a, image_b]


def test_coco_ap_matches_the_hand_worked_101_point_interpolation():
    # COCO ranks all detections by score: p1 (TP), p2 (FP), p3 (FP), p4 (TP); 3 GT.
    #   At IoU 0.5 .. 0.80 (7 thresholds):
    #     cumulative TP 1,1,1,2   FP 0,1,2,2
    #     recall     1/3, 1/3, 1/3, 2/3
    #     precision  1,   1/2, 1/3, 1/2  -> made non-increasing from the right: 1, 1/2, 1/2, 1/2
    #     101 recall points r = 0, .01, .., 1; precision at the first rank whose recall >= r:
    #       r <= 1/3 (r = 0 .. .33, 34 points) -> 1;  1/3 < r <= 2/3 (.34 .. .66, 33 points) -> 1/2;
    #       r > 2/3 (.67 .. 1, 34 points) -> 0
    #     AP = (34 * 1 + 33 * 0.5) / 101 = 50.5 / 101 = 0.5
    #   At IoU 0.85, 0.90, 0.95 (3 thresholds) p4 misses too: TP 1,1,1,1 FP 0,1,2,3, recall 1/3 throughout,
    #     interpolated precision 1, 1/2, 1/3, 1/4 -> r <= 1/3 (34 points) -> 1, else 0: AP = 34 / 101
    #   mAP@[.5:.95] = (7 * 0.5 + 3 * 34/101) / 10
    m, m50, note = coco_map(hand_case())
    assert note is None
    assert m50 == pytest.approx(50.5 / 101, abs=1e-6)
    assert m == pytest.approx((7 * 0.5 + 3 * 34 / 101) / 10, abs=1e-6)


def test_the_matcher_f1_on_the_hand_case_counts_one_to_one_pairs_above_the_gate():
    # Hungarian at gate 0.5: p1-a1 (IoU 1) and p4-a2 (0.82); p2 loses a1 to p1; p3 (0.4) is below the gate.
    # TP 2 of 4 predictions and 3 GT: P = 1/2, R = 2/3, F1 = 2 * (1/2)(2/3) / (1/2 + 2/3) = 4/7.
    report = evaluate_detections(hand_case())
    assert (report.n_pred, report.n_gt, report.n_matched) == (4, 3, 2)
    assert report.precision == pytest.approx(0.5)
    assert report.recall == pytest.approx(2 / 3)
    assert report.f1 == pytest.approx(4 / 7)
    assert report.mean_matched_iou == pytest.approx((1.0 + 0.82) / 2)
    assert report.objects_per_image == 2.0 and report.gt_per_image == 1.5


def test_perfect_predictions_give_map_one_and_no_predictions_give_zero():
    gt = [GTObject("x", (10, 20, 300, 400)), GTObject("y", (500, 500, 900, 990))]
    perfect = [ImageResult(width=84, height=56, gt=gt, preds=[Prediction(g.desc, g.bins) for g in gt])]
    report = evaluate_detections(perfect)
    assert report.map == pytest.approx(1.0) and report.map_50 == pytest.approx(1.0)
    assert report.f1 == pytest.approx(1.0)

    empty = [ImageResult(width=84, height=56, gt=gt, preds=[], parse_failed=True, finish_reason="length")]
    report = evaluate_detections(empty)
    assert report.map == 0.0 and report.map_50 == 0.0
    assert (report.precision, report.recall, report.f1) == (0.0, 0.0, 0.0)
    assert report.parse_failure_rate == 1.0 and report.truncated_rate == 1.0
    assert report.mean_matched_iou is None


def test_no_predictions_and_no_ground_truth_is_reported_as_undefined_not_perfect():
    images = [ImageResult(width=56, height=56, gt=[], preds=[], parse_failed=True) for _ in range(3)]
    report = evaluate_detections(images)
    assert report.precision is None and report.recall is None and report.f1 is None
    assert report.map is None and report.map_50 is None
    assert any("no predictions and no ground truth" in n for n in report.notes)
    assert any("no ground-truth objects" in n for n in report.notes)


def test_an_empty_eval_set_is_an_error():
    with pytest.raises(ValueError, match="empty eval set"):
        evaluate_detections([])


def test_scores_outside_zero_one_are_refused_and_drops_are_summed_by_reason():
    bad = [ImageResult(width=56, height=56, gt=[], preds=[Prediction("x", (0, 0, 5, 5), 0.0)])]
    with pytest.raises(ValueError, match="not in \\(0, 1\\]"):
        evaluate_detections(bad)
    drops = dict.fromkeys(DROP_REASONS, 0) | {"wrong_arity": 2, "missing_desc": 1}
    images = [ImageResult(width=56, height=56, gt=[], preds=[], dropped_by_reason=drops) for _ in range(2)]
    report = evaluate_detections(images)
    assert report.dropped_objects["wrong_arity"] == 4 and report.dropped_objects["missing_desc"] == 2
    assert set(report.dropped_objects) == set(DROP_REASONS)


def _parse_with(objects: list[ParsedObject]) -> ParseResult:
    return ParseResult(response_token_ids=[], response_text="", token_starts=[0], prefix_token_ids=[],
                       prefix_text="", valid_objects=objects, dropped_by_reason=dict.fromkeys(DROP_REASONS, 0),
                       truncated=False, max_object_index=len(objects), invalid_rollout=not objects)


def _obj(index: int, coord_positions: tuple[int, ...]) -> ParsedObject:
    return ParsedObject(index=index, desc="x", bins=(0, 0, 1, 1), coord_token_indices=coord_positions,
                        value_span=(0, 0), desc_span=(0, 0), key_span=(0, 0))


def test_object_scores_are_exp_of_the_mean_coord_logprob_or_constant_without_logprobs():
    parse = _parse_with([_obj(1, (2, 3, 4, 5)), _obj(2, (8, 9, 10, 11))])
    logprobs = [-9.0] * 12
    logprobs[2:6] = [-0.1, -0.2, -0.3, -0.4]
    logprobs[8:12] = [0.0, -math.inf, 0.0, 0.0]
    scores = object_scores(parse, logprobs)
    assert scores[0] == pytest.approx(math.exp(-0.25))
    assert 0.0 < scores[1] < 1e-9  # -inf ranks last but stays a valid (positive) score
    assert object_scores(parse, None) == [1.0, 1.0]
    with pytest.raises(ValueError, match="parallel to the generated token ids"):
        object_scores(parse, logprobs[:10])


def test_the_library_imports_without_torch():
    code = ("import sys, common.evaluation.metrics, common.evaluation.loop; "
            "bad = [m for m in ('torch', 'vllm', 'fastapi', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_per_class_ap_equals_pycocotools_run_one_category_at_a_time_from_files(tmp_path):
    """The per-class AP against an independent pycocotools path: a GT annotation file and loadRes results, as
    the COCO tools are used on disk, evaluated with params.catIds = [one category] for each category."""
    import contextlib
    import io
    import json

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from common.evaluation.metrics import coco_per_class

    images = hand_case() + [ImageResult(
        width=500, height=400, id="C", gt=[GTObject("a", (100, 100, 600, 600)), GTObject("c", (700, 700, 900, 950))],
        preds=[Prediction("c", (690, 700, 900, 940), 0.95), Prediction("a", (100, 120, 600, 600), 0.5),
               Prediction("a", (0, 0, 50, 50), 0.85), Prediction("zebra", (1, 1, 50, 50), 0.99)])]
    got = coco_per_class(images)
    assert sorted(got.by_class) == ["a", "b", "c"] and got.n_pred_unknown_desc == 1

    names = ["a", "b", "c"]
    gt = {"images": [], "annotations": [], "categories": [{"id": i + 1, "name": n} for i, n in enumerate(names)]}
    results = []
    for i, im in enumerate(images, 1):
        gt["images"].append({"id": i, "width": im.width, "height": im.height})

        def xywh(b, im=im):
            x1, y1, x2, y2 = b[0] / 999 * im.width, b[1] / 999 * im.height, b[2] / 999 * im.width, b[3] / 999 * im.height
            return [x1, y1, x2 - x1, y2 - y1]

        for g in im.gt:
            box = xywh(g.bins)
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": i, "bbox": box, "iscrowd": 0,
                                      "area": box[2] * box[3], "category_id": names.index(g.desc) + 1})
        results += [{"image_id": i, "category_id": names.index(p.desc) + 1, "bbox": xywh(p.bins), "score": p.score}
                    for p in im.preds if p.desc in names]
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(tmp_path / "gt.json"))
        coco_dt = coco_gt.loadRes(results)
        for k, name in enumerate(names, 1):
            ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
            ev.params.catIds = [k]
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            assert got.by_class[name]["ap"] == pytest.approx(ev.stats[0], abs=1e-9), name
            assert got.by_class[name]["ap_50"] == pytest.approx(ev.stats[1], abs=1e-9), name
    assert got.map == pytest.approx(sum(c["ap"] for c in got.by_class.values()) / 3, abs=1e-9)
    assert 0 < got.by_class["c"]["ap"] < got.by_class["a"]["ap"] < 1  # the case separates the classes
