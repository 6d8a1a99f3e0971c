"""The training loss of both channels (design section 3; origin semantics 4.2-4.3).

For one pack, with ``labels[p]`` predicted from the logits at ``p - 1``:

- **CE** on every position with ``labels[p] != -100`` (coord tokens never carry a label),
  weighted by ``weights[p]`` (desc tokens carry ``desc_ce_weight``): ``Σ ce_p · w_p``.
- **Geometry** on every coord slot ``p`` of ``coord_pos``: the logits at ``p - 1`` restricted to
  the 1000 coord ids decode to ``c = Σ_k softmax(z/τ)_k · k/999``; groups of four are one box
  (x1, y1, x2, y2) compared with ``coord_bins / 999`` by SmoothL1 (β = 1, per coordinate) and
  ``1 - CIoU`` (per box).
- **Coord CE** (Stage-1 warm start only, ``LossWeights.coord_ce > 0``): cross-entropy over the
  FULL vocabulary at every coord slot, target the coord token of ``coord_bins``, per coord slot
  (``4 × boxes``). This is what teaches a model that never emitted ``<|coord_k|>`` to emit them;
  Stage-2 (the origin's semantics) leaves it at 0, and the learner never applies it to B packs.

Every term is a *sum* divided by a denominator fixed for the whole optimizer step
(:class:`Normaliser`): the CE-supervised token count and the box count over all micro-steps and
all ranks. So a pack's loss is exactly the sum of its segments' losses, A and B steps of different
fill weigh the same per supervised token, and summing the per-pack values of one step gives the
step's loss. ``Normaliser.scale`` (the world size) undoes DDP's gradient averaging, so the
all-reduced gradient is the gradient of the global loss.

What this module does not know: models, packs on the wire, or ranks (the caller all-reduces the
counts before building the :class:`Normaliser`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_COORD_BINS = 1000
IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossWeights:
    """Weights of the geometry terms and the decode temperature (``stage2_ab.*``)."""

    smoothl1: float = 1.0
    ciou: float = 1.0
    temperature: float = 1.0
    coord_ce: float = 0.0  # Stage-1: full-vocabulary CE on coord slots (stage2_ab.coord_ce_weight)


@dataclass(frozen=True)
class Normaliser:
    """Denominators fixed for one optimizer step.

    ``ce_tokens``: positions with ``labels != -100`` over every pack of the step on every rank.
    ``boxes``: coord groups (4 slots each) over the same packs. ``scale``: multiplies the loss that
    is back-propagated (the world size under DDP, whose all-reduce averages). A zero count makes
    its term 0 (nothing to supervise), never NaN.
    """

    ce_tokens: float
    boxes: float
    scale: float = 1.0


@dataclass
class LossTerms:
    """One pack's contribution; add them over packs to get the step's loss."""

    backward: torch.Tensor  # what is back-propagated: the weighted total × Normaliser.scale
    total: float  # the weighted total, unscaled (the logged loss/total)
    ce: float
    bbox_smoothl1: float
    bbox_ciou: float
    coord_ce: float = 0.0


@dataclass(frozen=True)
class Rows:
    """Which logits rows the loss needs, pack-absolute: ``ce_src`` (p - 1 of CE labels) then ``coord_src``."""

    ce_src: torch.Tensor  # [Nc] int64
    ce_targets: torch.Tensor  # [Nc] int64
    ce_weights: torch.Tensor  # [Nc] float32
    coord_src: torch.Tensor  # [Nk] int64, Nk % 4 == 0
    coord_bins: torch.Tensor  # [Nk] int64, 0..999

    @property
    def all_src(self) -> torch.Tensor:
        """The positions whose logits the model must produce, CE rows first."""
        return torch.cat([self.ce_src, self.coord_src])

    @property
    def n_ce(self) -> int:
        return int(self.ce_src.shape[0])

    @property
    def n_boxes(self) -> int:
        return int(self.coord_src.shape[0]) // 4


def supervised_rows(labels: torch.Tensor, coord_pos: torch.Tensor, coord_bins: torch.Tensor, weights: torch.Tensor) -> Rows:
    """Rows of a pack (1-D tensors over its T tokens) the loss reads; position 0 of a pack is never supervised.

    A label at a segment's first token would read the previous segment's last logits; segments
    put ``-100`` there (``common.segment``), and ``p = 0`` is dropped here as a guard.
    """
    pos = torch.nonzero(labels != IGNORE_INDEX, as_tuple=False).flatten()
    pos = pos[pos > 0]
    return Rows(
        ce_src=pos - 1,
        ce_targets=labels[pos],
        ce_weights=weights[pos].float(),
        coord_src=coord_pos.long() - 1,
        coord_bins=coord_bins.long(),
    )


def expected_coords(coord_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``c = Σ_k softmax(z/τ)_k · k/999`` over the last dimension (1000 coord logits) -> values in [0, 1]."""
    bins = torch.arange(NUM_COORD_BINS, device=coord_logits.device, dtype=torch.float32) / (NUM_COORD_BINS - 1)
    probs = torch.softmax(coord_logits.float() / temperature, dim=-1)
    return probs @ bins


def ciou_loss(pred: torch.Tensor, gt: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Per-box ``1 - CIoU`` for boxes ``[N, 4]`` (x1, y1, x2, y2) in [0, 1].

    Boxes are canonicalised (min/max) and clipped to [0, 1] first, as in the origin.
    ``α = v / (1 - IoU + v)`` is treated as a constant in backward, as torchvision's
    ``complete_box_iou_loss`` and the CIoU paper do. Returns ``[N]``; NaN/inf become 0.
    """
    def canon(b: torch.Tensor) -> torch.Tensor:
        x1, x2 = torch.minimum(b[:, 0], b[:, 2]), torch.maximum(b[:, 0], b[:, 2])
        y1, y2 = torch.minimum(b[:, 1], b[:, 3]), torch.maximum(b[:, 1], b[:, 3])
        return torch.stack([x1, y1, x2, y2], dim=1).clamp(0.0, 1.0)

    p, g = canon(pred.float()), canon(gt.float())
    pw, ph = p[:, 2] - p[:, 0], p[:, 3] - p[:, 1]
    gw, gh = g[:, 2] - g[:, 0], g[:, 3] - g[:, 1]
    iw = (torch.minimum(p[:, 2], g[:, 2]) - torch.maximum(p[:, 0], g[:, 0])).clamp(min=0)
    ih = (torch.minimum(p[:, 3], g[:, 3]) - torch.maximum(p[:, 1], g[:, 1])).clamp(min=0)
    inter = iw * ih
    union = pw * ph + gw * gh - inter
    iou = inter / (union + eps)
    cw = torch.maximum(p[:, 2], g[:, 2]) - torch.minimum(p[:, 0], g[:, 0])
    ch = torch.maximum(p[:, 3], g[:, 3]) - torch.minimum(p[:, 1], g[:, 1])
    c2 = cw**2 + ch**2 + eps
    rho2 = ((p[:, 0] + p[:, 2] - g[:, 0] - g[:, 2]) ** 2 + (p[:, 1] + p[:, 3] - g[:, 1] - g[:, 3]) ** 2) / 4
    v = (4 / math.pi**2) * (torch.atan(gw / (gh + eps)) - torch.atan(pw / (ph + eps))) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    loss = 1 - (iou - rho2 / c2 - alpha * v)
    return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)


def pack_loss(
    logits: torch.Tensor, rows: Rows, coord_ids: torch.Tensor, norm: Normaliser, weights: LossWeights
) -> LossTerms:
    """Loss of one pack from ``logits [len(rows.all_src), V]`` (the rows :meth:`Rows.all_src` asked for)."""
    nc = rows.n_ce
    ce_logits, coord_logits = logits[:nc], logits[nc:]
    zero = logits.sum() * 0.0  # keeps the graph connected when a term has nothing to supervise
    if nc and norm.ce_tokens > 0:
        ce_tok = F.cross_entropy(ce_logits.float(), rows.ce_targets, reduction="none")
        ce = (ce_tok * rows.ce_weights.to(ce_tok.device)).sum() / norm.ce_tokens
    else:
        ce = zero
    if rows.n_boxes and norm.boxes > 0:
        pred = expected_coords(coord_logits.index_select(-1, coord_ids), weights.temperature)
        gt = rows.coord_bins.to(pred.device).float() / (NUM_COORD_BINS - 1)
        sl1 = torch.nan_to_num(F.smooth_l1_loss(pred, gt, reduction="sum", beta=1.0)) / (4 * norm.boxes)
        ciou = ciou_loss(pred.view(-1, 4), gt.view(-1, 4)).sum() / norm.boxes
    else:
        sl1 = ciou = zero
    if weights.coord_ce > 0 and rows.n_boxes and norm.boxes > 0:
        targets = coord_ids.to(coord_logits.device)[rows.coord_bins.to(coord_logits.device)]
        coord_ce = F.cross_entropy(coord_logits.float(), targets, reduction="sum") / (4 * norm.boxes)
    else:
        coord_ce = zero
    total = ce + weights.smoothl1 * sl1 + weights.ciou * ciou + weights.coord_ce * coord_ce
    return LossTerms(
        backward=total * norm.scale,
        total=float(total.detach()),
        ce=float(ce.detach()),
        bbox_smoothl1=float(sl1.detach()),
        bbox_ciou=float(ciou.detach()),
        coord_ce=float(coord_ce.detach()),
    )
