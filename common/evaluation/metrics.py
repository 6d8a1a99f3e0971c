"""Detection quality of a set of per-image results: matcher P/R/F1@0.5 and COCO mAP (docs/design.md section 13).

    per image: GT (desc, bins) + predictions (desc, bins, score) + how the rollout ended
        │
        ├─► hungarian_match (the training matcher, gate 0.5) ─► counts summed over images ─► P / R / F1
        ├─► pycocotools COCOeval (class-agnostic "object", pixel boxes) ─► mAP@[.5:.95], mAP@.5
        ├─► pycocotools COCOeval (category = GT desc) ─► AP per class, their mean (the COCO-comparable mAP)
        ├─► LVIS records (neg / not-exhaustive categories): federated AP (common/evaluation/lvis.py)
        ├─► per-image counts (common/evaluation/stats.py) ─► F1's bootstrap interval, duplicate rate, F1 by GT count
        └─► rollout health: parse failures, truncations, objects/image, drops by reason

Per-class AP: the categories are the distinct GT descs of the eval set (a converted COCO/LVIS set's
category names); a prediction counts for the category its desc names exactly, and one whose desc is
no category is left out (``n_pred_unknown_desc``), as COCO evaluates only the ground truth's
categories. The class-agnostic mAP ignores descs: it scores localisation alone.

Two detection numbers on purpose. **F1@0.5** is what training optimises against: the same
Hungarian matcher as Channel-B (``common/detection/matching.py``), one-to-one, score-blind, counts aggregated
over images before dividing. **mAP** is the number the field compares: pycocotools' reference
implementation (greedy score-ordered matching per image, 101-point interpolated precision, up to
100 detections per image), never re-implemented here. pycocotools is numpy-only and small; we
picked it over faster-coco-eval (pulls plotting dependencies) and torchmetrics (wraps one of the two).

Boxes go to COCO in pixels (``x = k / 999 * width``), so COCO's absolute area ranges mean what they
say; IoU is scale-free, so pixel or bin space give the same AP. Object ids start at 1 (COCOeval
treats a match with id 0 as no match).

A parse failure is a rollout with nothing complete parsed, except the well-formed empty answer
``{}`` (:func:`parse_failed`); truncation is ``finish_reason == "length"``.

Scores: each prediction carries ``score`` in (0, 1]. With per-token logprobs from the engine it is
``exp(mean logprob of the object's 4 coord tokens)`` (:func:`object_scores`); without, 1.0 for every
object, and COCO's ranking then falls back to input order (its sorts are stable: image order, then
the order objects were generated). ``DetectionReport.score_source`` says which.

What this module does not know: tokenizers, servers, images on disk, torch.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from common.data.records import MAX_BIN, GTObject, Record
from common.evaluation.stats import ImageCounts, by_gt_count, f1_interval
from common.detection.matching import box_iou, hungarian_match, precision_recall_f1
from common.detection.parsing import DROP_REASONS, ParseResult

IOU_THRESHOLD = 0.5
CANDIDATE_TOP_K = 100  # every GT is a candidate on any image we evaluate: matching is not restricted
MIN_SCORE = 1e-12  # a coord logprob of -inf still gives a positive score (ranked last)
SCORE_SOURCES = ("coord_logprob", "constant")


@dataclass(frozen=True)
class Prediction:
    """One valid predicted object."""

    desc: str
    bins: tuple[int, int, int, int]  # x1, y1, x2, y2, norm1000 bins
    score: float = 1.0  # confidence in (0, 1]; 1.0 when the engine gave no logprobs


@dataclass
class ImageResult:
    """One evaluated image (record): its GT, what the model predicted, and how the rollout ended."""

    width: int  # pixels
    height: int
    gt: Sequence[GTObject]
    preds: Sequence[Prediction]
    parse_failed: bool = False  # see parse_failed() below
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None = unknown
    dropped_by_reason: Mapping[str, int] = field(default_factory=dict)
    id: str | None = None
    # Carried for reports and drawing only (the metrics do not read them):
    images: tuple[str, ...] = ()  # absolute image paths
    text: str | None = None  # the response text
    ver: int | None = None  # weight version the rollout was generated under

    @classmethod
    def from_parse(cls, record: Record, parse: ParseResult, scores: Sequence[float], *,
                   finish_reason: str | None, images: Sequence[str] = (), ver: int | None = None) -> ImageResult:
        """The result of ``record`` whose rollout parsed to ``parse``; ``scores`` parallel to its valid objects."""
        if len(scores) != parse.n_valid:
            raise ValueError(f"{len(scores)} scores for {parse.n_valid} valid objects")
        preds = [Prediction(o.desc, o.bins, float(s)) for o, s in zip(parse.valid_objects, scores)]
        return cls(width=record.width, height=record.height, gt=list(record.objects), preds=preds,
                   parse_failed=parse_failed(parse), finish_reason=finish_reason,
                   dropped_by_reason=dict(parse.dropped_by_reason), id=record.id, images=tuple(images),
                   text=parse.response_text, ver=ver)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "images": list(self.images), "width": self.width, "height": self.height, "ver": self.ver,
            "finish_reason": self.finish_reason, "parse_failed": self.parse_failed,
            "gt": [{"desc": g.desc, "bins": list(g.bins)} for g in self.gt],
            "preds": [{"desc": p.desc, "bins": list(p.bins), "score": p.score} for p in self.preds],
            "dropped_by_reason": {k: v for k, v in self.dropped_by_reason.items() if v},
            "text": self.text,
        }


@dataclass
class DetectionReport:
    """Everything :func:`evaluate_detections` measures. ``None`` = undefined here; ``notes`` say why."""

    n_images: int
    n_gt: int
    n_pred: int
    n_matched: int  # matcher pairs with IoU >= iou_threshold
    precision: float | None  # n_matched / n_pred
    recall: float | None  # n_matched / n_gt
    f1: float | None
    map: float | None  # COCO mAP@[.5:.95], area all, 100 detections per image, class-agnostic
    map_50: float | None  # COCO AP@.5, class-agnostic
    mean_matched_iou: float | None  # mean IoU of matcher pairs
    parse_failure_rate: float  # share of rollouts that failed to parse (parse_failed())
    truncated_rate: float  # share of rollouts that ended with finish_reason "length"
    objects_per_image: float  # mean valid predicted objects per image
    gt_per_image: float
    dropped_objects: dict[str, int]  # summed ParseResult.dropped_by_reason, every reason listed
    score_source: str  # "coord_logprob" | "constant"
    iou_threshold: float = IOU_THRESHOLD
    lvis_map: float | None = None  # LVIS federated AP@[.5:.95] (common/evaluation/lvis.py); None: no LVIS records
    lvis_map_50: float | None = None
    map_per_class: float | None = None  # COCO mAP@[.5:.95] with the GT descs as categories (coco_per_class)
    map_50_per_class: float | None = None
    ap_by_class: dict[str, dict[str, Any]] = field(default_factory=dict)  # desc -> {"ap", "ap_50", "n_gt", "n_pred"}
    n_pred_unknown_desc: int = 0  # predictions whose desc is no GT category (in no category's AP)
    f1_ci_low: float | None = None  # 95 % percentile bootstrap over images of f1 (common/evaluation/stats.py)
    f1_ci_high: float | None = None
    n_duplicate: int = 0  # unmatched predictions with IoU >= iou_threshold to a GT another prediction matched
    duplicate_rate: float | None = None  # n_duplicate / n_pred; None without predictions
    by_gt_count: dict[str, dict[str, Any]] = field(default_factory=dict)  # "10_19" -> {n_images, precision, recall, f1}
    image_counts: ImageCounts | None = None  # per image, in order: what the intervals resample
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_failed(parse: ParseResult) -> bool:
    """A rollout failed to parse when nothing complete parsed (``invalid_rollout``), except the
    well-formed empty answer: ``{}`` closed, nothing dropped (a correct answer for an empty image).

    Truncated or garbage text, ``{"object_1": 5}`` and a lone ``{`` fail; a rollout whose objects
    all parsed but were dropped as invalid does not fail here (its drops are counted by reason).
    """
    return parse.invalid_rollout and (parse.truncated or parse.n_dropped > 0)


def object_scores(parse_result: ParseResult, token_logprobs: Sequence[float] | None) -> list[float]:
    """One score per valid object: ``exp(mean logprob of its 4 coord tokens)``, or 1.0 each without logprobs.

    ``token_logprobs`` is parallel to the generated token ids the parse read (``InferOutput.token_ids``;
    ``ParsedObject.coord_token_indices`` index them). Scores are clipped to ``[MIN_SCORE, 1]``.
    Raises ValueError when the logprobs are too short for an object or not numbers (misaligned
    logprobs would silently mis-rank everything).
    """
    if token_logprobs is None:
        return [1.0] * parse_result.n_valid
    scores = []
    for obj in parse_result.valid_objects:
        idx = obj.coord_token_indices
        if not idx or max(idx) >= len(token_logprobs):
            raise ValueError(f"object_{obj.index}: coord token positions {list(idx)} but only "
                             f"{len(token_logprobs)} logprobs; logprobs must be parallel to the generated token ids")
        lps = [float(token_logprobs[i]) for i in idx]
        if any(math.isnan(v) for v in lps):
            raise ValueError(f"object_{obj.index}: NaN logprob among {lps}")
        mean = sum(lps) / len(lps)
        scores.append(max(MIN_SCORE, math.exp(min(0.0, mean))))
    return scores


def pixel_xywh(bins: Sequence[int], width: int, height: int) -> list[float]:
    x1, y1, x2, y2 = (bins[0] / MAX_BIN * width, bins[1] / MAX_BIN * height,
                      bins[2] / MAX_BIN * width, bins[3] / MAX_BIN * height)
    return [x1, y1, max(0.0, x2 - x1), max(0.0, y2 - y1)]


def _coco_eval(images: Sequence[ImageResult], categories: Sequence[str] | None) -> Any:
    """pycocotools' COCOeval over ``images``, evaluated and accumulated. ``categories`` None: class-agnostic
    (one category "object"); else category k + 1 is ``categories[k]`` and a prediction whose desc is none of
    them is left out (COCO evaluates only the ground truth's categories)."""
    from pycocotools.coco import COCO  # deferred: only evaluation needs it
    from pycocotools.cocoeval import COCOeval

    ids = {c: k for k, c in enumerate(categories or ["object"], 1)}

    def cat(desc: str) -> int | None:
        return 1 if categories is None else ids.get(desc)

    imgs, gts, dts = [], [], []
    for i, im in enumerate(images, 1):
        imgs.append({"id": i, "width": im.width, "height": im.height})
        for g in im.gt:
            box = pixel_xywh(g.bins, im.width, im.height)
            gts.append({"id": len(gts) + 1, "image_id": i, "category_id": cat(g.desc), "bbox": box,
                        "area": box[2] * box[3], "iscrowd": 0})
        for p in im.preds:
            if (c := cat(p.desc)) is not None:
                box = pixel_xywh(p.bins, im.width, im.height)
                dts.append({"id": len(dts) + 1, "image_id": i, "category_id": c, "bbox": box,
                            "area": box[2] * box[3], "score": float(p.score)})
    cats = [{"id": k, "name": c} for c, k in ids.items()]
    # Both sides built directly (not COCO.loadRes, which cannot take zero detections); prints silenced.
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt, coco_dt = COCO(), COCO()
        coco_gt.dataset = {"images": imgs, "annotations": gts, "categories": cats}
        coco_dt.dataset = {"images": imgs, "annotations": dts, "categories": cats}
        coco_gt.createIndex()
        coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def coco_map(images: Sequence[ImageResult]) -> tuple[float | None, float | None, str | None]:
    """(mAP@[.5:.95], AP@.5, note) from pycocotools, class-agnostic; (None, None, why) without any GT."""
    if not any(im.gt for im in images):
        return None, None, "mAP undefined: the eval set has no ground-truth objects (COCO reports -1)"
    ev = _coco_eval(images, None)
    m, m50 = float(ev.stats[0]), float(ev.stats[1])
    return (m if m >= 0 else None), (m50 if m50 >= 0 else None), None


@dataclass
class ClassAP:
    """COCO AP per category: the eval set's GT descs are its categories (pycocotools, class-aware)."""

    map: float | None  # COCO mAP@[.5:.95] = the mean of the per-category APs
    map_50: float | None
    by_class: dict[str, dict[str, float | int | None]]  # desc -> {"ap", "ap_50", "n_gt", "n_pred"}
    n_pred_unknown_desc: int  # predictions whose desc is no GT category: in no category's AP


def coco_per_class(images: Sequence[ImageResult]) -> ClassAP | None:
    """Per-category AP (module docstring); None without any GT.

    Per category k, AP is COCO's own summary over its slice of ``COCOeval.eval["precision"]`` ([IoU
    thresholds, 101 recall points, category, area range, max detections]): area "all", 100 detections,
    the mean of the entries > -1, as ``COCOeval.summarize`` averages them over every category.
    """
    categories = sorted({g.desc for im in images for g in im.gt})
    if not categories:
        return None
    ev = _coco_eval(images, categories)
    precision = ev.eval["precision"]  # [T, R, K, A, M]

    def ap(values: Any) -> float | None:
        valid = values[values > -1]
        return float(valid.mean()) if valid.size else None

    n_gt = Counter(g.desc for im in images for g in im.gt)
    n_pred = Counter(p.desc for im in images for p in im.preds)
    by_class = {c: {"ap": ap(precision[:, :, k, 0, -1]), "ap_50": ap(precision[0, :, k, 0, -1]), "n_gt": n_gt[c],
                    "n_pred": n_pred[c]} for k, c in enumerate(categories)}
    m, m50 = float(ev.stats[0]), float(ev.stats[1])
    return ClassAP(map=m if m >= 0 else None, map_50=m50 if m50 >= 0 else None, by_class=by_class,
                   n_pred_unknown_desc=sum(n for c, n in n_pred.items() if c not in n_gt))


def n_duplicates(im: ImageResult, match: Any, iou_threshold: float = IOU_THRESHOLD) -> int:
    """Predictions the matcher left unmatched that overlap an already-matched GT at IoU >= ``iou_threshold``:
    a second box on an object the model had found (what a crowded scene's repeated shapes provoke).
    An unmatched box on an unfound GT is a localisation miss, not a duplicate."""
    matched_gt = [g for _, g in match.matched_pairs]
    if not match.fp_pred_indices or not matched_gt:
        return 0
    iou = box_iou([im.preds[i].bins for i in match.fp_pred_indices], [im.gt[g].bins for g in matched_gt])
    return int((iou >= iou_threshold).any(axis=1).sum())


def evaluate_detections(images: Sequence[ImageResult], *, score_source: str = "constant",
                        iou_threshold: float = IOU_THRESHOLD, federated: Sequence[Any] | None = None) -> DetectionReport:
    """The report of module docstring for ``images``; ValueError for an empty set or a bad score.

    ``federated``: per image, its LVIS labels (``common.evaluation.lvis.Federated``, None for a record without them),
    parallel to ``images``; when any image has them the report adds the LVIS federated AP (``lvis_map``)."""
    if not images:
        raise ValueError("empty eval set: no images to evaluate (check the JSONL and --max-images)")
    if score_source not in SCORE_SOURCES:
        raise ValueError(f"score_source must be one of {SCORE_SOURCES}, got {score_source!r}")
    n_gt = n_pred = n_matched = 0
    ious: list[float] = []
    per_image: list[tuple[int, int, int, int]] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for im in images:
        for p in im.preds:
            if not 0.0 < p.score <= 1.0:
                raise ValueError(f"image {im.id}: prediction score {p.score} is not in (0, 1]")
        match = hungarian_match([p.bins for p in im.preds], [g.bins for g in im.gt], candidate_top_k=CANDIDATE_TOP_K,
                                gate=iou_threshold, fp_cost=1.0, fn_cost=1.0)
        n_gt += len(im.gt)
        n_pred += len(im.preds)
        n_matched += match.n_matched
        ious += match.matched_ious
        per_image.append((match.n_matched, len(im.preds), len(im.gt), n_duplicates(im, match, iou_threshold)))
        for reason, k in im.dropped_by_reason.items():
            dropped[reason] = dropped.get(reason, 0) + int(k)

    notes = []
    if n_pred == 0 and n_gt == 0:
        precision = recall = f1 = None
        notes.append("P/R/F1 undefined: no predictions and no ground truth in the whole eval set")
    else:
        precision, recall, f1 = precision_recall_f1(n_matched, n_pred, n_gt)
    m, m50, why = coco_map(images)
    if why:
        notes.append(why)
    per_class = coco_per_class(images)
    lvis: tuple[float | None, float | None] = (None, None)
    if federated is not None and any(f is not None for f in federated):
        from common.evaluation.lvis import lvis_map

        if len(federated) != len(images):
            raise ValueError(f"{len(federated)} federated labels for {len(images)} images")
        lvis = lvis_map(images, federated)
    if score_source == "constant" and n_pred:
        notes.append("scores are constant (no logprobs): COCO AP ranks ties in input order")
    n = len(images)
    counts = ImageCounts(*(tuple(col) for col in zip(*per_image)))
    ci = f1_interval(counts) if f1 is not None else None
    n_dup = sum(counts.n_dup)
    return DetectionReport(
        n_images=n, n_gt=n_gt, n_pred=n_pred, n_matched=n_matched, precision=precision, recall=recall, f1=f1,
        map=m, map_50=m50, mean_matched_iou=sum(ious) / len(ious) if ious else None,
        parse_failure_rate=sum(im.parse_failed for im in images) / n,
        truncated_rate=sum(im.finish_reason == "length" for im in images) / n,
        objects_per_image=n_pred / n, gt_per_image=n_gt / n, dropped_objects=dropped,
        score_source=score_source, iou_threshold=iou_threshold, notes=notes, lvis_map=lvis[0], lvis_map_50=lvis[1],
        f1_ci_low=ci[0] if ci else None, f1_ci_high=ci[1] if ci else None, n_duplicate=n_dup,
        duplicate_rate=n_dup / n_pred if n_pred else None, by_gt_count=by_gt_count(counts), image_counts=counts,
        **({} if per_class is None else {
            "map_per_class": per_class.map, "map_50_per_class": per_class.map_50, "ap_by_class": per_class.by_class,
            "n_pred_unknown_desc": per_class.n_pred_unknown_desc}),
    )
