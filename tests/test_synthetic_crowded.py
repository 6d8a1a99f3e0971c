"""The crowded synthetic scenes (``tandem data synth --crowded``, issue 34): 10..40 small, overlapping shapes
with near-duplicates, and the evaluation's crowded-scene numbers (duplicates, F1 by GT count) on them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common.data.records import load_record
from common.evaluation.metrics import ImageResult, Prediction, evaluate_detections
from common.detection.matching import box_iou

REPO = Path(__file__).resolve().parents[1]


def test_crowded_scenes_hold_10_to_40_small_overlapping_shapes_whose_descs_recur(tmp_path):
    out = tmp_path / "crowded"
    r = subprocess.run([sys.executable, "-m", "tandem", "data", "synth", "--crowded", "--out", str(out), "--split",
                        "10/4", "--seed", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    params = json.loads((out / "manifest.json").read_text())["params"]
    assert params["min_objects"] == 10 and params["max_objects"] == 40 and params["near_duplicate_p"] == 0.35
    records = [json.loads(line) for split in ("train", "val")
               for line in (out / f"{split}.jsonl").read_text().splitlines()]
    assert len(records) == 14
    overlapping = repeated = 0
    for rec in records:
        objs = rec["objects"]
        assert 10 <= len(objs) <= 40, len(objs)
        boxes = np.array([o["bbox_2d"] for o in objs], float)
        side = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
        assert side.min() < 0.1 * min(rec["width"], rec["height"])  # small objects
        iou = box_iou(boxes, boxes)
        overlapping += bool((iou[np.triu_indices(len(objs), 1)] > 0).any())
        repeated += max(Counter(o["desc"] for o in objs).values()) >= 2
        load_record(rec, where="crowded")  # the data contract holds
    assert overlapping == len(records) and repeated >= len(records) - 1, (overlapping, repeated)


def test_on_a_crowded_image_repeated_boxes_count_as_duplicates_and_land_in_their_gt_bucket(tmp_path):
    from common.data.synthetic import CROWDED, render_record

    _, rec = render_record(0, 5, **CROWDED)
    r = load_record({**rec, "images": ["x.png"]}, where="crowded")
    gt = list(r.objects)
    half = [Prediction(g.desc, g.bins) for g in gt[: len(gt) // 2]]
    image = ImageResult(width=r.width, height=r.height, gt=gt, preds=half + half[:3], id="c")
    report = evaluate_detections([image])
    assert report.n_matched == len(half) and report.n_duplicate == 3
    assert abs(report.recall - len(half) / len(gt)) < 1e-12
    bucket = "10_19" if len(gt) < 20 else "20_39" if len(gt) < 40 else "40_plus"
    assert list(report.by_gt_count) == [bucket] and report.by_gt_count[bucket]["f1"] == report.f1


def test_sides_given_with_crowded_replace_its_sides_and_keep_the_rest_of_the_preset(tmp_path):
    out = tmp_path / "crowded336"
    r = subprocess.run([sys.executable, "-m", "tandem", "data", "synth", "--crowded", "--sides", "336", "--out",
                        str(out), "--split", "2/1", "--seed", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    params = json.loads((out / "manifest.json").read_text())["params"]
    assert params["sides"] == [336] and (params["min_objects"], params["max_objects"]) == (10, 40)
    records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert all((rec["width"], rec["height"]) == (336, 336) and len(rec["objects"]) >= 10 for rec in records)


def test_drawing_in_worker_processes_writes_byte_identical_files(tmp_path):
    # record i depends on (seed, i) only: a pool of spawned workers over index ranges must not change a byte
    from common.data.synthetic import CROWDED, POOL_MIN_RECORDS, generate, resolve_workers

    one = generate(tmp_path / "one", seed=5, split=(10, 3), workers=1, **CROWDED).parent
    pooled = tmp_path / "pooled"
    r = subprocess.run([sys.executable, "-m", "tandem", "data", "synth", "--crowded", "--workers", "3", "--out",
                        str(pooled), "--split", "10/3", "--seed", "5"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    names = sorted(str(p.relative_to(one)) for p in one.rglob("*") if p.is_file())
    assert len(names) == 13 + 3 and names == sorted(str(p.relative_to(pooled)) for p in pooled.rglob("*") if p.is_file())
    assert all((one / n).read_bytes() == (pooled / n).read_bytes() for n in names)
    assert resolve_workers(None, POOL_MIN_RECORDS - 1) == 1 and resolve_workers(None, POOL_MIN_RECORDS) >= 1
    with pytest.raises(ValueError, match="workers must be >= 1"):
        resolve_workers(0, 10)
