"""LVIS-style federated AP (common/evaluation/lvis.py) on a hand-worked case, and the eval set reading its record keys."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from common.data.records import GTObject
from common.evaluation.metrics import ImageResult, Prediction, coco_per_class, evaluate_detections
from common.evaluation.loop import load_eval_set
from common.evaluation.lvis import Federated, lvis_map

BOX, OTHER = (0, 0, 100, 100), (500, 500, 600, 600)


def lvis_case() -> tuple[list[ImageResult], list[Federated | None]]:
    """Image 1: a (not exhaustive), b verified absent; image 2: b and c, an ordinary record (no LVIS keys)."""
    one = ImageResult(width=999, height=999, id="1", gt=[GTObject("a", BOX)], preds=[
        Prediction("a", OTHER, 0.95),  # unmatched a: a is not exhaustive here -> ignored, not a false positive
        Prediction("a", BOX, 0.9),  # matches the a
        Prediction("b", BOX, 0.7),  # b is verified absent here -> a false positive
        Prediction("c", BOX, 0.99),  # c: neither present nor verified absent here -> ignored
    ])
    two = ImageResult(width=999, height=999, id="2", gt=[GTObject("b", BOX), GTObject("c", OTHER)],
                      preds=[Prediction("b", BOX, 0.6), Prediction("c", OTHER, 0.5)])
    return [one, two], [Federated(neg=frozenset({"b"}), not_exhaustive=frozenset({"a"})), None]


def test_federated_ap_ignores_what_nobody_checked_and_counts_verified_absences():
    images, fed = lvis_case()
    # a: its unmatched detection ignored -> TP only: AP 1.  b: FP (0.7, image 1) then TP (0.6): the precision at
    # every recall point is 1/2: AP 0.5.  c: the 0.99 detection on image 1 is ignored -> TP only: AP 1.
    m, m50 = lvis_map(images, fed)
    assert m == pytest.approx((1 + 0.5 + 1) / 3, abs=1e-9) and m50 == pytest.approx(m, abs=1e-9)
    # the same detections under COCO's rules (every category exhaustive everywhere): each class has an FP first
    plain = coco_per_class(images)
    assert [plain.by_class[c]["ap"] for c in "abc"] == pytest.approx([0.5, 0.5, 0.5], abs=1e-9)


def test_the_report_has_lvis_ap_only_when_some_record_carries_lvis_labels():
    images, fed = lvis_case()
    assert evaluate_detections(images, federated=fed).lvis_map == pytest.approx(2.5 / 3, abs=1e-9)
    assert evaluate_detections(images, federated=[None, None]).lvis_map is None
    assert evaluate_detections(images).lvis_map is None


def test_the_eval_set_keeps_each_records_lvis_labels_and_skips_malformed_ones(tmp_path):
    Image.new("RGB", (64, 48)).save(tmp_path / "x.png")
    rec = {"images": ["x.png"], "width": 64, "height": 48, "coord_mode": "pixel",
           "objects": [{"desc": "a", "bbox_2d": [1, 1, 20, 20]}]}
    lines = [rec, {**rec, "neg_categories": ["b"], "not_exhaustive_categories": ["a"]},
             {**rec, "neg_categories": "b"}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    es = load_eval_set(tmp_path / "val.jsonl")
    assert es.federated == [None, Federated(neg=frozenset({"b"}), not_exhaustive=frozenset({"a"}))]
    assert len(es.records) == 2 and "neg_categories: must be a list" in es.skipped[0]
