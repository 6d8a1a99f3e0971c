"""The training loss of both channels (docs/design.md section 3).

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

Two heads compute the same terms (``training.loss_head``):

- ``plain`` (:func:`pack_loss`): from the logits ``[N, V]`` of the N supervised rows, as the model's
  LM head returns them (model dtype), upcast to float32 for the softmax.
- ``chunked`` (:func:`head_loss`): from the hidden states ``[N, H]`` of those rows and the LM head
  weight ``[V, H]``. The full-vocabulary cross-entropies (CE, coord CE) go through
  :func:`linear_cross_entropy`, which walks the vocabulary in slices and recomputes each slice's
  logits in backward, so at most ``[N, slice]`` float logits exist at a time (never ``[N, V]``: at
  V = 151,936 and N = 4,000 rows the plain head keeps 2.4 GB of float32 log-probabilities for backward,
  beside the model-dtype logits, and makes as much again for their gradient). The
  geometry terms read only the 1000 coord columns, ``hidden @ W[coord_ids].T`` (``[Nk, 1000]``),
  so the coord-bin expectation is the same arithmetic as the plain head's.

What this module does not know: models, packs on the wire, or ranks (the caller all-reduces the
counts before building the :class:`Normaliser`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
    put ``-100`` there (``common.packing.segment``), and ``p = 0`` is dropped here as a guard.
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
    ce = coord_ce = None
    if nc and norm.ce_tokens > 0:
        ce_tok = F.cross_entropy(ce_logits.float(), rows.ce_targets, reduction="none")
        ce = (ce_tok * rows.ce_weights.to(ce_tok.device)).sum() / norm.ce_tokens
    if _coord_ce_on(rows, norm, weights):
        targets = coord_ids.to(coord_logits.device)[rows.coord_bins.to(coord_logits.device)]
        coord_ce = F.cross_entropy(coord_logits.float(), targets, reduction="sum") / (4 * norm.boxes)
    coord_sel = coord_logits.index_select(-1, coord_ids) if _geometry_on(rows, norm) else None
    return _terms(ce, coord_sel, coord_ce, zero, rows, norm, weights)


def head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, rows: Rows, coord_ids: torch.Tensor, norm: Normaliser,
    weights: LossWeights, *, chunk_bytes: int | None = None,
) -> LossTerms:
    """:func:`pack_loss` of the logits ``hidden @ weight.T`` without making them (the ``chunked`` head).

    ``hidden [len(rows.all_src), H]``: the final hidden states at :meth:`Rows.all_src` (what the LM head
    would project); ``weight [V, H]``: the LM head weight (the tied input embedding where the model ties
    them), both in the model's dtype. ``chunk_bytes``: see :func:`linear_cross_entropy`.
    """
    nc = rows.n_ce
    h_ce, h_coord = hidden[:nc], hidden[nc:]
    zero = (hidden.sum() + weight[0].sum()) * 0.0  # as pack_loss's: every input gets a (zero) gradient
    ce = coord_ce = None
    if nc and norm.ce_tokens > 0:
        ce_tok = linear_cross_entropy(h_ce, weight, rows.ce_targets, chunk_bytes=chunk_bytes)
        ce = (ce_tok * rows.ce_weights.to(ce_tok.device)).sum() / norm.ce_tokens
    coord_ids = coord_ids.to(weight.device)
    if _coord_ce_on(rows, norm, weights):
        targets = coord_ids[rows.coord_bins.to(weight.device)]
        coord_ce = linear_cross_entropy(h_coord, weight, targets, chunk_bytes=chunk_bytes).sum() / (4 * norm.boxes)
    # [Nk, 1000]: all the geometry reads, the same numbers as the plain head's columns at coord_ids
    coord_sel = h_coord @ weight.index_select(0, coord_ids).T if _geometry_on(rows, norm) else None
    return _terms(ce, coord_sel, coord_ce, zero, rows, norm, weights)


def _geometry_on(rows: Rows, norm: Normaliser) -> bool:
    return bool(rows.n_boxes) and norm.boxes > 0


def _coord_ce_on(rows: Rows, norm: Normaliser, weights: LossWeights) -> bool:
    return weights.coord_ce > 0 and _geometry_on(rows, norm)


def _terms(ce: torch.Tensor | None, coord_logits: torch.Tensor | None, coord_ce: torch.Tensor | None,
           zero: torch.Tensor, rows: Rows, norm: Normaliser, weights: LossWeights) -> LossTerms:
    """The geometry terms from the coord rows' 1000 coord logits, and the weighted total (None: nothing there)."""
    ce = zero if ce is None else ce
    coord_ce = zero if coord_ce is None else coord_ce
    if coord_logits is not None:
        pred = expected_coords(coord_logits, weights.temperature)
        gt = rows.coord_bins.to(pred.device).float() / (NUM_COORD_BINS - 1)
        sl1 = torch.nan_to_num(F.smooth_l1_loss(pred, gt, reduction="sum", beta=1.0)) / (4 * norm.boxes)
        ciou = ciou_loss(pred.view(-1, 4), gt.view(-1, 4)).sum() / norm.boxes
    else:
        sl1 = ciou = zero
    total = ce + weights.smoothl1 * sl1 + weights.ciou * ciou + weights.coord_ce * coord_ce
    return LossTerms(
        backward=total * norm.scale,
        total=float(total.detach()),
        ce=float(ce.detach()),
        bbox_smoothl1=float(sl1.detach()),
        bbox_ciou=float(ciou.detach()),
        coord_ce=float(coord_ce.detach()),
    )


# --------------------------------------------------------------------------------------------- chunked CE

#: What one vocabulary slice of :func:`linear_cross_entropy` may hold as float32 logits ``[N, slice]``. The
#: slice's transient working set is ~4x that (model-dtype logits, float32 copy, softmax, its gradient).
CHUNK_BYTES = 256 * 2**20


def vocab_slice(n_rows: int, vocab: int, chunk_bytes: int | None = None) -> int:
    """Vocabulary columns per slice for ``n_rows`` rows: the whole vocabulary if it fits ``chunk_bytes``, else what
    fits, rounded down to a multiple of 256 from 2,048 up (matmul-friendly). Example: 4,000 rows, V = 151,936,
    256 MiB -> 16,640 columns, 10 slices."""
    budget = CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    cols = max(1, min(vocab, budget // (4 * max(1, n_rows))))
    return cols - cols % 256 if 2048 <= cols < vocab else cols


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, chunk_bytes: int | None = None) -> torch.Tensor:
    """Per-row ``cross_entropy(hidden @ weight.T, targets)`` as float32 ``[N]`` (0 where ``targets == ignore_index``),
    never holding more than one vocabulary slice of logits (:func:`vocab_slice`).

    Forward keeps each row's log-sum-exp (``[N]``); backward recomputes each slice's logits, so the gradient of
    ``weight`` is one matmul per slice (no accumulation across slices) and that of ``hidden`` a float32 ``[N, H]``
    sum over slices. The logits are rounded to the model dtype before the float32 softmax, as the plain head's are.
    """
    return _LinearCrossEntropy.apply(hidden, weight, targets, int(ignore_index),
                                     vocab_slice(hidden.shape[0], weight.shape[0], chunk_bytes))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                cols: int) -> torch.Tensor:
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        n = hidden.shape[0]
        lse = torch.full((n,), -math.inf, device=hidden.device, dtype=torch.float32)
        picked = torch.zeros(n, device=hidden.device, dtype=torch.float32)
        for lo in range(0, weight.shape[0], cols):
            z = (hidden @ weight[lo : lo + cols].T).float()
            lse = torch.logaddexp(lse, torch.logsumexp(z, dim=1))
            here = (safe >= lo) & (safe < lo + z.shape[1])
            local = (safe - lo).clamp(0, z.shape[1] - 1)
            picked += torch.where(here, z.gather(1, local[:, None])[:, 0], 0.0)
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.cols = cols
        return torch.where(valid, lse - picked, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe, valid, lse = ctx.saved_tensors
        cols = ctx.cols
        g = torch.where(valid, grad_loss.float(), 0.0)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        for lo in range(0, weight.shape[0], cols):
            w = weight[lo : lo + cols]
            z = (hidden @ w.T).float()
            dz = torch.exp(z - lse[:, None]) * g[:, None]  # softmax · dL/dloss
            here = valid & (safe >= lo) & (safe < lo + z.shape[1])
            dz[rows[here], safe[here] - lo] -= g[here]  # minus the one-hot target
            dz = dz.to(hidden.dtype)  # the plain head's logits gradient is cast back to the model dtype too
            if want_h:
                grad_h += (dz @ w).float()
            if want_w:
                grad_w[lo : lo + cols] = dz.T @ hidden
        return (grad_h.to(hidden.dtype) if want_h else None), grad_w, None, None, None
