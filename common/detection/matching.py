"""Hungarian matching of predicted boxes to ground truth (Channel-B: docs/actor.md, Data flow).

Boxes are norm1000 bins ``[x1, y1, x2, y2]`` (ints 0..999, as decoded from ``<|coord_k|>``).
A bin ``k`` stands for the continuous coordinate ``k / 999`` (never ``/1000``), and a box covers
the continuous rectangle ``[x1/999, x2/999] x [y1/999, y2/999]``: its area is
``(x2 - x1) * (y2 - y1)`` in those units, so a box with ``x1 == x2`` or ``y1 == y2`` has zero area
and IoU 0 with everything (itself included). IoU is scale-free, so the ``/999`` cancels and the
computation below works on the bins directly.

The origin matched with a mask IoU, rasterising each box on a 256x256 canvas. For axis-aligned
boxes that equals this box IoU up to rasterisation error (a pixel is ~4 bins), so we use the exact
box IoU: no pycocotools, no canvas, and results that do not depend on a resolution knob.

The cost of an assignment is ``sum(1 - IoU)`` over matched pairs ``+ fp_cost`` per unmatched
prediction ``+ fn_cost`` per unmatched GT; :func:`hungarian_match` returns a minimum of that over
all matchings that use only *feasible* pairs (candidate and ``IoU >= gate``).

What this module does not know: tokens, text, or how predictions were parsed. numpy + scipy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

#: Cost of an infeasible pair. Any real assignment costs at most (P + G) * max(fp_cost, fn_cost, 1),
#: so a solution that uses an infeasible pair is never optimal while the costs stay below ~1e5.
INFEASIBLE_COST = 1e6


def _as_boxes(boxes) -> np.ndarray:
    arr = np.asarray(boxes, dtype=np.float64)
    if arr.size == 0:
        return arr.reshape(0, 4)
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(f"boxes must have shape [N, 4], got {arr.shape}")
    return arr


def box_iou(a, b) -> np.ndarray:
    """IoU of every box in ``a`` [N, 4] with every box in ``b`` [M, 4] -> float64 [N, M].

    Continuous-coordinate convention (see the module docstring): area ``(x2-x1)*(y2-y1)``, inverted
    or degenerate boxes have zero area, and a pair whose union is zero has IoU 0.
    """
    a, b = _as_boxes(a), _as_boxes(b)
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    iw = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0])
    ih = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1])
    inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)
    return iou


@dataclass
class MatchResult:
    """Outcome of :func:`hungarian_match`. Indices refer to the input lists."""

    matched_pairs: list[tuple[int, int]]  # (pred, gt), ascending pred index
    fn_gt_indices: list[int]  # GT left unmatched, ascending
    fp_pred_indices: list[int]  # predictions left unmatched, ascending
    gating_rejections: int  # candidate pairs dropped because IoU < gate
    matched_ious: list[float] = field(default_factory=list)  # parallel to matched_pairs
    total_cost: float = 0.0  # sum(1 - IoU) + fp_cost * n_fp + fn_cost * n_fn

    @property
    def n_matched(self) -> int:
        return len(self.matched_pairs)


def _candidates(iou: np.ndarray, pred: np.ndarray, gt: np.ndarray, k: int) -> list[np.ndarray]:
    """Top-k GT per prediction by IoU (ties: lower GT index); by centre distance if all IoU are 0."""
    n_gt = iou.shape[1]
    k = min(max(1, k), n_gt)
    order = np.arange(n_gt)
    out = []
    centre_p = (pred[:, :2] + pred[:, 2:]) / 2
    centre_g = (gt[:, :2] + gt[:, 2:]) / 2
    for i in range(iou.shape[0]):
        if iou[i].max() > 0:
            key = -iou[i]
        else:
            key = ((centre_g - centre_p[i]) ** 2).sum(axis=1)
        out.append(np.lexsort((order, key))[:k])  # lexsort: last key is primary
    return out


def hungarian_match(
    pred_boxes,
    gt_boxes,
    *,
    candidate_top_k: int,
    gate: float,
    fp_cost: float,
    fn_cost: float,
) -> MatchResult:
    """Match predictions to GT with a dummy-padded square assignment (the origin's scheme).

    ``pred_boxes`` [P, 4] and ``gt_boxes`` [G, 4] are norm1000 bins. Each prediction may only be
    matched to one of its ``candidate_top_k`` GT candidates, and only if ``IoU >= gate``; candidate
    pairs below the gate are counted in ``gating_rejections`` (non-candidates are not counted).
    The (P+G) x (P+G) matrix is ``[[cost_pg, fp_cost], [fn_cost, 0]]`` by blocks, so every
    prediction can always fall back to "FP" and every GT to "FN"; an infeasible pair is therefore
    never chosen while ``fp_cost + fn_cost`` is far below :data:`INFEASIBLE_COST`.
    """
    pred, gt = _as_boxes(pred_boxes), _as_boxes(gt_boxes)
    n_p, n_g = pred.shape[0], gt.shape[0]
    if n_p == 0 or n_g == 0:
        return MatchResult(
            matched_pairs=[],
            fn_gt_indices=list(range(n_g)),
            fp_pred_indices=list(range(n_p)),
            gating_rejections=0,
            matched_ious=[],
            total_cost=float(fp_cost * n_p + fn_cost * n_g),
        )

    iou = box_iou(pred, gt)
    cost_pg = np.full((n_p, n_g), INFEASIBLE_COST)
    rejections = 0
    for i, cand in enumerate(_candidates(iou, pred, gt, candidate_top_k)):
        ok = iou[i, cand] >= gate
        rejections += int((~ok).sum())
        cost_pg[i, cand[ok]] = 1.0 - iou[i, cand[ok]]

    n = n_p + n_g
    cost = np.zeros((n, n))
    cost[:n_p, :n_g] = cost_pg
    cost[:n_p, n_g:] = fp_cost  # prediction -> dummy column: false positive
    cost[n_p:, :n_g] = fn_cost  # dummy row -> GT: false negative
    rows, cols = linear_sum_assignment(cost)

    pairs, ious = [], []
    for r, c in zip(rows, cols):
        if r < n_p and c < n_g and cost_pg[r, c] < INFEASIBLE_COST / 2:
            pairs.append((int(r), int(c)))
            ious.append(float(iou[r, c]))
    matched_p = {p for p, _ in pairs}
    matched_g = {g for _, g in pairs}
    fp = [i for i in range(n_p) if i not in matched_p]
    fn = [j for j in range(n_g) if j not in matched_g]
    total = float(sum(1.0 - x for x in ious) + fp_cost * len(fp) + fn_cost * len(fn))
    return MatchResult(pairs, fn, fp, rejections, ious, total)


def precision_recall_f1(n_matched: int, n_pred: int, n_gt: int) -> tuple[float, float, float]:
    """Detection precision, recall and F1 from counts.

    An empty denominator gives 0.0, except that ``n_pred == n_gt == 0`` (nothing to find and
    nothing claimed) is perfect: (1.0, 1.0, 1.0). Aggregate counts first, then call this once;
    averaging per-sample ratios weights small images like large ones.
    """
    if n_pred == 0 and n_gt == 0:
        return 1.0, 1.0, 1.0
    precision = n_matched / n_pred if n_pred else 0.0
    recall = n_matched / n_gt if n_gt else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f1
