"""COCO, LVIS and ODVG annotations -> JSONL records of the tandem contract (docs/data.md).

    tandem data convert --format coco --annotations instances_val2017.json --images val2017/ --out data/coco
        [--max-side 1024 --multiple-of 28] [--max-objects 60] [--coords pixel|norm1000] [--split val]

writes ``<out>/<split>.jsonl`` (and, when resizing, ``<out>/images/<split>/<file>``). Per image:

- COCO and LVIS are read with pycocotools (``COCO``: its index of images, annotations and categories);
  boxes ``[x, y, w, h]`` become ``[x1, y1, x2, y2]`` clipped to the image. Crowd regions
  (``iscrowd: 1``: one box around many objects) and degenerate boxes (no width or height once clipped)
  are dropped and counted, never trained on. LVIS v1 images name their file by ``coco_url``.
- ODVG (the JSONL of GroundingDINO-style detection sets: ``filename``, ``width``, ``height``,
  ``detection.instances[].bbox`` in pixel ``x1y1x2y2`` and ``category``) is read line by line.
- The category name is the ``desc``, sanitised as the contract requires (``_`` and runs of white space
  become one space; ``", "`` and ``": "`` lose their space): LVIS ``bow_(weapon)`` -> ``bow (weapon)``.
- LVIS ``not_exhaustive_category_ids`` and ``neg_category_ids`` are kept in the record as category names
  (``not_exhaustive_categories``, ``neg_categories``) for federated evaluation; training ignores them.
- An image with more than ``--max-objects`` objects is dropped whole and counted: a record with part of
  its objects would teach the model to stop early and punish it for finding the rest.
- ``--max-side`` (and ``--multiple-of``) resize the image (longer side <= max-side, each side rounded to a
  multiple, the Qwen-VL patch grid; written to ``<out>/images/<split>/<file name as annotated>``) and scale
  its boxes by the same factors; without them the records point at the original images by a path
  relative to ``--out``.
- Every record carries its ``coord_mode`` (``--coords``), so no config has to declare one; every record
  is read back with :func:`common.detection.answer.load_record` before it is written.

What this module does not know: tokenizers, models, or the packing length (``tandem data check`` does).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.data.records import RecordError, check_desc, load_record, quantize

FORMATS = ("coco", "lvis", "odvg")


@dataclass(frozen=True)
class Options:
    """``tandem data convert``'s flags."""

    fmt: str
    annotations: Path
    images: Path
    out: Path
    split: str = "train"
    coords: str = "pixel"
    max_side: int | None = None
    multiple_of: int | None = None
    max_objects: int | None = None


@dataclass
class Stats:
    """What a conversion kept and dropped (printed, and written to ``<split>.convert.json``)."""

    images: int = 0
    records: int = 0
    objects: int = 0
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> objects or images

    def summary(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        return f"{self.images} images -> {self.records} records with {self.objects} objects; dropped: {drops}"


@dataclass
class _Image:
    """One source image and its boxes in pixels (x1, y1, x2, y2), before resizing."""

    id: str
    name: str  # the file's path under --images, as the annotations write it
    file: Path
    width: int
    height: int
    objects: list[tuple[str, tuple[float, float, float, float]]]
    extra: dict[str, Any] = field(default_factory=dict)


class ConvertError(ValueError):
    """The input cannot be converted; the message names the file, the field and the fix."""


def sanitize_desc(name: str) -> str:
    """A category name as a contract ``desc``: ``"traffic_light "`` -> ``"traffic light"``."""
    desc = re.sub(r"[\s_]+", " ", str(name)).strip()
    return desc.replace(", ", ",").replace(": ", ":")


def _clip_box(x1: float, y1: float, x2: float, y2: float, w: int, h: int) -> tuple[float, float, float, float]:
    return max(0.0, min(x1, w)), max(0.0, min(y1, h)), max(0.0, min(x2, w)), max(0.0, min(y2, h))


def _add_box(img: _Image, desc: str, box: tuple[float, float, float, float], stats: Stats) -> None:
    x1, y1, x2, y2 = _clip_box(*box, img.width, img.height)
    if x2 <= x1 or y2 <= y1:
        stats.dropped["degenerate_box"] += 1
        return
    img.objects.append((desc, (x1, y1, x2, y2)))


def _coco_images(opts: Options, stats: Stats) -> Iterator[_Image]:
    from pycocotools.coco import COCO  # the maintained reader of both formats (LVIS is COCO-shaped)

    with contextlib.redirect_stdout(io.StringIO()):  # COCO() prints progress lines
        try:
            coco = COCO(str(opts.annotations))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConvertError(f"--annotations {opts.annotations}: not a {opts.fmt.upper()} annotation file ({exc}). "
                               "Fix: pass the instances JSON (images, annotations, categories)") from None
    if "images" not in coco.dataset or "categories" not in coco.dataset:
        raise ConvertError(f"--annotations {opts.annotations}: no 'images' or 'categories' list. Fix: pass a "
                           f"{opts.fmt.upper()} instances file")
    names = {c["id"]: sanitize_desc(c["name"]) for c in coco.loadCats(coco.getCatIds())}
    for cid, desc in names.items():
        try:
            check_desc(desc)
        except RecordError as exc:
            raise ConvertError(f"--annotations {opts.annotations}: category {cid} name {desc!r} cannot be a desc "
                               f"({exc.problem}). Fix: rename the category") from None
    for image_id in sorted(coco.getImgIds()):
        info = coco.imgs[image_id]
        fname = info.get("file_name") or os.path.basename(str(info.get("coco_url", "")))
        if not fname:
            raise ConvertError(f"--annotations {opts.annotations}: image {image_id} has neither file_name nor "
                               "coco_url. Fix: add file_name")
        img = _Image(str(image_id), fname, opts.images / fname, int(info["width"]), int(info["height"]), [])
        if opts.fmt == "lvis":
            img.extra = {key: sorted(names[c] for c in info.get(src, []) if c in names)
                         for key, src in (("not_exhaustive_categories", "not_exhaustive_category_ids"),
                                          ("neg_categories", "neg_category_ids"))}
        for ann in coco.loadAnns(coco.getAnnIds(imgIds=[image_id], iscrowd=None)):
            if ann.get("iscrowd", 0):
                stats.dropped["crowd_box"] += 1
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            _add_box(img, names[ann["category_id"]], (x, y, x + w, y + h), stats)
        yield img


def _odvg_images(opts: Options, stats: Stats) -> Iterator[_Image]:
    from common.data.jsonl import iter_json_lines

    for line in iter_json_lines(opts.annotations):
        if line.error is not None:
            raise ConvertError(f"{line.where}: {line.error}. Fix: one ODVG object per line")
        rec = line.value
        det = rec.get("detection") if isinstance(rec, dict) else None
        if not isinstance(det, dict) or not isinstance(det.get("instances"), list):
            raise ConvertError(f"{line.where}: no detection.instances list (a grounding record?). Fix: convert "
                               "detection records only ({\"filename\", \"width\", \"height\", \"detection\": "
                               "{\"instances\": [{\"bbox\", \"category\"}]}})")
        img = _Image(str(rec.get("id", Path(rec["filename"]).stem)), rec["filename"], opts.images / rec["filename"],
                     int(rec["width"]), int(rec["height"]), [])
        for inst in det["instances"]:
            desc = sanitize_desc(inst.get("category", inst.get("label", "")))
            try:
                check_desc(desc)
            except RecordError as exc:
                raise ConvertError(f"{line.where}: category {desc!r} cannot be a desc ({exc.problem}). "
                                   "Fix: give every instance a category name") from None
            _add_box(img, desc, tuple(float(v) for v in inst["bbox"]), stats)  # type: ignore[arg-type]
        yield img


def target_size(width: int, height: int, max_side: int | None, multiple_of: int | None) -> tuple[int, int]:
    """The resized (width, height): longer side <= ``max_side``, each side a multiple of ``multiple_of`` (>= one)."""
    scale = min(1.0, max_side / max(width, height)) if max_side else 1.0
    w, h = width * scale, height * scale
    if multiple_of:
        limit = max_side // multiple_of * multiple_of if max_side else None

        def snap(v: float) -> int:
            k = max(multiple_of, round(v / multiple_of) * multiple_of)
            return min(k, limit) if limit and limit >= multiple_of else k

        return snap(w), snap(h)
    return max(1, round(w)), max(1, round(h))


def _record(img: _Image, opts: Options, out_dir: Path) -> dict[str, Any]:
    resize = opts.max_side is not None or opts.multiple_of is not None
    if resize:
        from PIL import Image

        w, h = target_size(img.width, img.height, opts.max_side, opts.multiple_of)
        rel = Path("images") / opts.split / img.name  # sub-folders kept: two folders may hold the same file name
        dest = out_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(img.file) as im:
            if im.size != (img.width, img.height):
                raise ConvertError(f"{img.file}: the annotations say {img.width}x{img.height} but the image is "
                                   f"{im.size[0]}x{im.size[1]}. Fix: use the annotation file of these images")
            # quality: PIL's JPEG default (75) would add visible artefacts to every resized photo; PNG ignores it
            (im if im.size == (w, h) else im.resize((w, h), Image.Resampling.BICUBIC)).save(dest, quality=95)
        path = rel.as_posix()
    else:
        w, h = img.width, img.height
        path = os.path.relpath(img.file.resolve(), out_dir.resolve())
    sx, sy = w / img.width, h / img.height
    objects = []
    for desc, (x1, y1, x2, y2) in img.objects:
        if opts.coords == "norm1000":
            box: list[float | int] = [quantize(x1 / img.width), quantize(y1 / img.height),
                                      quantize(x2 / img.width), quantize(y2 / img.height)]
        else:  # pixel: scaled with the image, 2 decimals are far below a bin (1/999 of a side)
            box = [round(min(x1 * sx, w), 2), round(min(y1 * sy, h), 2), round(min(x2 * sx, w), 2),
                   round(min(y2 * sy, h), 2)]
        objects.append({"desc": desc, "bbox_2d": box})
    return {"id": img.id, "images": [path], "width": w, "height": h, "coord_mode": opts.coords,
            "objects": objects, **img.extra}


def convert(opts: Options) -> tuple[Path, Stats]:
    """Write ``<out>/<split>.jsonl`` (+ resized images) and ``<split>.convert.json``; the JSONL path and counts."""
    if opts.fmt not in FORMATS:
        raise ConvertError(f"--format {opts.fmt}: unknown. Fix: use one of {', '.join(FORMATS)}")
    if not opts.annotations.is_file():
        raise ConvertError(f"--annotations {opts.annotations}: no such file. Fix: pass the annotation file")
    if not opts.images.is_dir():
        raise ConvertError(f"--images {opts.images}: no such directory. Fix: pass the folder the file names are in")
    opts.out.mkdir(parents=True, exist_ok=True)
    stats = Stats()
    source = _odvg_images(opts, stats) if opts.fmt == "odvg" else _coco_images(opts, stats)
    out_path = opts.out / f"{opts.split}.jsonl"
    tmp = out_path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for img in source:
            stats.images += 1
            if not img.file.is_file():
                stats.dropped["image_missing"] += 1
                continue
            if opts.max_objects is not None and len(img.objects) > opts.max_objects:
                stats.dropped["image_over_max_objects"] += 1
                continue
            rec = _record(img, opts, opts.out)
            load_record(rec, where=f"{out_path.name} (image {img.id})")  # the contract holds for what we write
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            stats.records += 1
            stats.objects += len(rec["objects"])
    if stats.records == 0:
        tmp.unlink()
        raise ConvertError(f"--annotations {opts.annotations}: no record written of {stats.images} images "
                           f"(dropped: {dict(stats.dropped)}). Fix: check --images (file names resolve against it) "
                           "and --max-objects")
    tmp.replace(out_path)  # a half-written file never has the final name
    meta = {"format": opts.fmt, "annotations": str(opts.annotations.resolve()), "images": str(opts.images.resolve()),
            "split": opts.split, "coords": opts.coords, "max_side": opts.max_side, "multiple_of": opts.multiple_of,
            "max_objects": opts.max_objects, "images_read": stats.images, "records": stats.records,
            "objects": stats.objects, "dropped": dict(stats.dropped)}
    (opts.out / f"{opts.split}.convert.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out_path, stats
