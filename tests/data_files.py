"""Small annotation files built in tests: COCO- and LVIS-shaped instances JSON over a few PIL images."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

#: (file, width, height); the boxes below are drawn as filled shapes on each
IMAGES = [("a.jpg", 160, 120), ("b.png", 200, 100), ("c.jpg", 96, 96)]
#: 3 categories; "blue_square" becomes desc "blue square" (LVIS-style underscores)
CATEGORIES = [{"id": 1, "name": "red circle"}, {"id": 2, "name": "blue_square"}, {"id": 7, "name": "green triangle"}]
#: (image index, category id, [x, y, w, h], iscrowd)
ANNOTATIONS = [
    (0, 1, [10, 20, 40, 30], 0),
    (0, 2, [90, 50, 50, 60], 0),  # y + h = 110 <= 120: inside
    (0, 7, [0, 0, 160, 120], 1),  # crowd: dropped
    (1, 2, [150, 10, 70, 40], 0),  # runs 20 px past the right edge: clipped to x2 = 200
    (1, 1, [30, 30, 0, 20], 0),  # zero width: degenerate, dropped
    (2, 7, [8, 8, 60, 70], 0),
    (2, 1, [50.5, 40.25, 20, 20], 0),
]


def write_images(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, w, h) in enumerate(IMAGES):
        im = Image.new("RGB", (w, h), (120 + 20 * i, 130, 140))
        draw = ImageDraw.Draw(im)
        for img, _cat, (x, y, bw, bh), _crowd in ANNOTATIONS:
            if img == i and bw > 0 and bh > 0:
                draw.rectangle([x, y, x + bw - 1, y + bh - 1], fill=(200, 40, 40))
        im.save(folder / name)


def coco_dict(lvis: bool = False) -> dict:
    images = []
    for i, (name, w, h) in enumerate(IMAGES):
        entry = {"id": 100 + i, "width": w, "height": h}
        if lvis:  # LVIS v1 names the file by its COCO URL and lists the federated label sets
            entry.update(coco_url=f"http://images.cocodataset.org/train2017/{name}",
                         not_exhaustive_category_ids=[2] if i == 0 else [], neg_category_ids=[7] if i == 1 else [])
        else:
            entry["file_name"] = name
        images.append(entry)
    anns = []
    for k, (img, cat, box, crowd) in enumerate(ANNOTATIONS):
        if lvis and crowd:
            continue  # LVIS has no crowd regions
        ann = {"id": k + 1, "image_id": 100 + img, "category_id": cat, "bbox": box, "area": box[2] * box[3]}
        if not lvis:
            ann["iscrowd"] = crowd
        anns.append(ann)
    return {"images": images, "annotations": anns, "categories": CATEGORIES}


def write_coco(root: Path, lvis: bool = False) -> tuple[Path, Path]:
    """``root/images/*`` and ``root/instances.json``; returns (annotations, images folder)."""
    write_images(root / "images")
    ann = root / ("lvis.json" if lvis else "instances.json")
    ann.write_text(json.dumps(coco_dict(lvis)))
    return ann, root / "images"
