"""LVIS-style federated AP: the lvis-api's rules for a data set whose images are not labelled for every category.

An LVIS image is annotated exhaustively only for some categories. Each record of a converted LVIS set
(``tandem data convert --format lvis``, common/data/convert.py) carries, besides its objects (the
positive categories P of the image):

    "neg_categories":            [names]   N: verified absent from the image
    "not_exhaustive_categories": [names]   E ⊆ P: some instances may be unlabelled

and the AP of category c counts, per image (lvis-api ``LVISEval``):

    c in P or N   its detections are scored (in N every detection is a false positive)
    otherwise     its detections on this image are ignored: nobody checked whether c is there
    c in E        an unmatched detection is ignored, not a false positive (it may be an unlabelled instance)

then, as in LVIS, at most 300 detections per image (the highest scores, all categories together),
AP over IoU .50:.95 and 101 recall points per category, mAP the mean over the categories with GT.

Which implementation: pycocotools' COCOeval (already the project's evaluator; numpy only) with the
two LVIS rules added — detections filtered by P ∪ N before evaluation, and a subclass whose
``evaluateImg`` marks unmatched detections of a not-exhaustive category ignored, the same line
lvis-api's ``evaluate_img`` has. The ``lvis`` package itself is not used: unmaintained since 2020 and
pinned to old releases of its dependencies. Records without either key count as N = E = ∅.

What this module does not know: tokenizers, servers, records on disk (common/evaluation/loop.py reads the keys).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LVIS_MAX_DETS = 300  # detections per image, all categories together (lvis-api Params.max_dets)


@dataclass(frozen=True)
class Federated:
    """An image's federated labels: categories verified absent (neg) and not exhaustively annotated."""

    neg: frozenset[str] = frozenset()
    not_exhaustive: frozenset[str] = frozenset()


def federated_of(raw: Mapping[str, Any]) -> Federated | None:
    """The federated labels of a raw JSONL record; None when it carries neither key (not an LVIS record)."""
    if "neg_categories" not in raw and "not_exhaustive_categories" not in raw:
        return None

    def names(key: str) -> frozenset[str]:
        value = raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key}: must be a list of category names (descs), got {value!r}")
        return frozenset(value)

    return Federated(neg=names("neg_categories"), not_exhaustive=names("not_exhaustive_categories"))


def lvis_map(images: Sequence[Any], federated: Sequence[Federated | None]) -> tuple[float | None, float | None]:
    """(AP@[.5:.95], AP@.5) by the module docstring's rules over ``images`` (``ImageResult``s), parallel to
    ``federated``; (None, None) when no image has GT."""
    from pycocotools.coco import COCO  # deferred: only evaluation needs it

    from common.evaluation.metrics import pixel_xywh

    categories = sorted({g.desc for im in images for g in im.gt} | {c for f in federated if f for c in f.neg})
    if not any(im.gt for im in images):
        return None, None
    ids = {c: k for k, c in enumerate(categories, 1)}
    imgs, gts, dts, not_exhaustive = [], [], [], set()
    for i, (im, fed) in enumerate(zip(images, federated), 1):
        fed = fed or Federated()
        imgs.append({"id": i, "width": im.width, "height": im.height})
        positive = {g.desc for g in im.gt}
        for g in im.gt:
            box = pixel_xywh(g.bins, im.width, im.height)
            gts.append({"id": len(gts) + 1, "image_id": i, "category_id": ids[g.desc], "bbox": box,
                        "area": box[2] * box[3], "iscrowd": 0})
        checked = positive | fed.neg
        scored = [p for p in im.preds if p.desc in checked]  # the rest: nobody checked, ignored
        for p in sorted(scored, key=lambda p: -p.score)[:LVIS_MAX_DETS]:
            box = pixel_xywh(p.bins, im.width, im.height)
            dts.append({"id": len(dts) + 1, "image_id": i, "category_id": ids[p.desc], "bbox": box,
                        "area": box[2] * box[3], "score": float(p.score)})
        not_exhaustive |= {(i, ids[c]) for c in fed.not_exhaustive if c in ids}
    cats = [{"id": k, "name": c} for c, k in ids.items()]
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt, coco_dt = COCO(), COCO()
        for coco, anns in ((coco_gt, gts), (coco_dt, dts)):
            coco.dataset = {"images": imgs, "annotations": anns, "categories": cats}
            coco.createIndex()
        ev = _federated_eval_class()(coco_gt, coco_dt, iouType="bbox")
        ev.not_exhaustive = not_exhaustive
        ev.params.maxDets = [LVIS_MAX_DETS]  # the per-image cap is applied above; this only must not cut more
        ev.evaluate()
        ev.accumulate()
    # COCOeval.summarize's AP@[.5:.95] asks for maxDets=100 by name, so it is read here from the precision array
    # ([IoU thresholds, recall points, category, area range, max detections]): area "all", the only cap.
    precision = ev.eval["precision"][:, :, :, 0, -1]

    def mean(values: Any) -> float | None:
        valid = values[values > -1]
        return float(valid.mean()) if valid.size else None

    return mean(precision), mean(precision[0])


def _federated_eval_class() -> type:
    from pycocotools.cocoeval import COCOeval

    class FederatedEval(COCOeval):
        """COCOeval whose unmatched detections of a not-exhaustive (image, category) are ignored (lvis-api)."""

        not_exhaustive: set[tuple[int, int]] = set()

        def evaluateImg(self, imgId: int, catId: int, aRng: Any, maxDet: int) -> Any:  # noqa: N802 - COCOeval's
            result = super().evaluateImg(imgId, catId, aRng, maxDet)
            if result is not None and (imgId, catId) in self.not_exhaustive:
                result["dtIgnore"] = result["dtIgnore"] | (result["dtMatches"] == 0)
            return result

    return FederatedEval

