"""``tandem data convert`` (COCO, LVIS, ODVG) and ``tandem data check|stats`` on what it wrote, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from common.data.records import load_record
from common.data.convert import Options, convert, sanitize_desc, target_size
from tests.data_files import write_coco, write_images

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"
DEADLINE_S = 240


def tandem(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=DEADLINE_S, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_coco_file_converts_without_crowd_and_degenerate_boxes_and_checks_clean(tmp_path, tiny_model_dir):
    ann, images = write_coco(tmp_path / "coco")
    out = tmp_path / "out"
    conv = tandem("data", "convert", "--format", "coco", "--annotations", str(ann), "--images", str(images),
                  "--out", str(out), cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr
    assert "crowd_box 1" in conv.stdout and "degenerate_box 1" in conv.stdout, conv.stdout
    recs = records(out / "train.jsonl")
    assert [r["id"] for r in recs] == ["100", "101", "102"]
    assert [len(r["objects"]) for r in recs] == [2, 1, 2]
    assert all(r["coord_mode"] == "pixel" for r in recs)
    assert recs[0]["objects"][0] == {"desc": "red circle", "bbox_2d": [10.0, 20.0, 50.0, 50.0]}  # xywh -> x1y1x2y2
    assert recs[1]["objects"][0] == {"desc": "blue square", "bbox_2d": [150.0, 10.0, 200.0, 50.0]}  # clipped at W
    assert (out / recs[0]["images"][0]).resolve() == (images / "a.jpg").resolve()  # relative to the JSONL
    meta = json.loads((out / "train.convert.json").read_text())
    assert meta["dropped"] == {"crowd_box": 1, "degenerate_box": 1} and meta["records"] == 3

    check = tandem("data", "check", str(out / "train.jsonl"), "--config", str(CONFIG), f"model.path={tiny_model_dir}",
                   cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "3 records, 3 good, 0 bad" in check.stdout and "tokens per sample" in check.stdout, check.stdout


def test_an_lvis_file_keeps_its_federated_label_sets_and_resized_images_check_clean(tmp_path, tiny_model_dir):
    ann, images = write_coco(tmp_path / "lvis", lvis=True)
    out = tmp_path / "out"
    conv = tandem("data", "convert", "--format", "lvis", "--annotations", str(ann), "--images", str(images),
                  "--out", str(out), "--split", "val", "--max-side", "64", "--multiple-of", "32",
                  "--coords", "norm1000", cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr
    recs = records(out / "val.jsonl")
    assert [len(r["objects"]) for r in recs] == [2, 1, 2]  # LVIS has no crowd; the zero-width box is dropped
    assert recs[0]["not_exhaustive_categories"] == ["blue square"] and recs[0]["neg_categories"] == []
    assert recs[1]["neg_categories"] == ["green triangle"]
    for r in recs:
        with Image.open(out / r["images"][0]) as im:
            assert im.size == (r["width"], r["height"]) and max(im.size) <= 64
            assert im.size[0] % 32 == 0 and im.size[1] % 32 == 0
    # norm1000 bins are the box as a share of the original image: [10, 20, 50, 50] of 160x120
    assert recs[0]["coord_mode"] == "norm1000" and recs[0]["objects"][0]["bbox_2d"] == [62, 166, 312, 416]
    check = tandem("data", "check", str(out / "val.jsonl"), "--config", str(CONFIG), f"model.path={tiny_model_dir}",
                   cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "3 records, 3 good, 0 bad" in check.stdout


def test_an_odvg_file_converts_in_pixels(tmp_path):
    write_images(tmp_path / "images")
    ann = tmp_path / "odvg.jsonl"
    ann.write_text(json.dumps({"filename": "a.jpg", "width": 160, "height": 120, "detection": {"instances": [
        {"bbox": [10, 20, 50, 50], "label": 0, "category": "red circle"},
        {"bbox": [5, 5, 5, 9], "label": 1, "category": "blue_square"}]}}) + "\n")
    path, stats = convert(Options("odvg", ann, tmp_path / "images", tmp_path / "out"))
    (rec,) = records(path)
    assert rec["objects"] == [{"desc": "red circle", "bbox_2d": [10.0, 20.0, 50.0, 50.0]}]
    assert stats.dropped == {"degenerate_box": 1}
    assert load_record(rec).objects[0].bins == (62, 166, 312, 416)


def test_images_with_more_objects_than_max_objects_are_dropped_whole_and_counted(tmp_path):
    ann, images = write_coco(tmp_path / "coco")
    path, stats = convert(Options("coco", ann, images, tmp_path / "out", max_objects=1))
    assert [r["id"] for r in records(path)] == ["101"] and stats.dropped["image_over_max_objects"] == 2


def test_a_wrong_images_folder_is_an_error_naming_the_flag(tmp_path):
    ann, _ = write_coco(tmp_path / "coco")
    (tmp_path / "empty").mkdir()
    proc = tandem("data", "convert", "--format", "coco", "--annotations", str(ann), "--images",
                  str(tmp_path / "empty"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2 and "--images" in proc.stderr and "image_missing" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_check_fails_and_stats_reports_on_bad_records_and_samples_over_the_packing_length(tmp_path, tiny_model_dir):
    ann, images = write_coco(tmp_path / "coco")
    path, _ = convert(Options("coco", ann, images, tmp_path / "out"))
    lines = path.read_text().splitlines()
    bad = json.loads(lines[0])
    bad["objects"][0]["bbox_2d"] = [10, 20, 500, 50]  # past the 160 px width
    missing = json.loads(lines[1])
    missing["images"] = ["nowhere.jpg"]
    path.write_text("\n".join([json.dumps(bad), json.dumps(missing), lines[2]]) + "\n")
    args = [str(path), "--config", str(CONFIG), f"model.path={tiny_model_dir}"]
    check = tandem("data", "check", *args, cwd=tmp_path)
    assert check.returncode == 1
    assert "3 records, 1 good, 2 bad" in check.stdout
    assert "objects[].bbox_2d" in check.stdout and "images[]" in check.stdout and "image not found" in check.stdout
    stats = tandem("data", "stats", *args, cwd=tmp_path)
    assert stats.returncode == 0 and "3 records, 1 good, 2 bad" in stats.stdout
    short = tandem("data", "check", *args, "training.global_max_length=32", cwd=tmp_path)
    assert short.returncode == 1 and "too_long" in short.stdout and "training.global_max_length" in short.stdout


@pytest.mark.parametrize("name, desc", [("traffic_light", "traffic light"), ("bow_(weapon)", "bow (weapon)"),
                                        ("a,  b: c", "a,b:c"), (" tab\tname ", "tab name")])
def test_category_names_are_sanitised_into_descs_the_contract_accepts(name, desc):
    assert sanitize_desc(name) == desc


def test_resizing_keeps_the_longer_side_under_max_side_on_the_patch_grid():
    assert target_size(640, 480, 1024, None) == (640, 480)  # never enlarged
    assert target_size(2048, 1024, 1024, 28) == (1008, 504)  # 1024 -> 1008 = 36 x 28 (never above max-side)
    assert target_size(100, 10, 64, 32) == (64, 32)  # a side never rounds to zero
