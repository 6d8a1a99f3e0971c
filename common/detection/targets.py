"""Teacher-forced targets for Channel-A and Channel-B, at the token level (Channel-B: docs/actor.md, Data flow).

A :class:`TargetSpec` describes the assistant span only (index 0 = first assistant token); the
encoder that adds the chat template and images shifts every position by the prompt length.

    channel_a_target      GT in canonical order, serialised            (all groups geometry, "fn")
    reordered_gt_target   matched GT in predicted order + FN in GT order, renumbered object_1..K
                          (the origin's reordered_gt_sft: true: first n_matched groups "prefix", the rest "fn")
    rollout_prefix_target rollout prefix ids verbatim + FN appended before the closing `}`,
                          numbered after the highest object_N key in the prefix  (the origin's reordered_gt_sft: false)

Each target is written in one answer format (``data.answer_format``: ``object_keys`` or ``objects_array``,
common/detection/answer.py); the two Channel-B targets take it from the parse they are built on, so a rollout is
never completed in the other format. In ``objects_array`` the FN objects go before the closing ``]}`` and have
no numbers.

Supervision rules shared by all three (the origin's):
  - coord tokens are never CE-supervised; they are supervised by geometry at ``coord_positions``
    (groups of four: x1, y1, x2, y2) against ``coord_bins``;
  - desc value tokens (any token overlapping the characters inside ``"desc": "..."``) get
    ``desc_ce_weight``; matched objects of ``reordered_gt`` may get ``desc_ce_weight_matched``;
  - other supervised tokens get weight 1, and the turn-end token is appended and supervised.

Positions are found by parsing the target's own token ids with :func:`common.detection.parsing.parse_rollout`
(per-token pieces, no re-tokenisation beyond the one ``encode`` of the serialised or appended
text), so targets and rollouts share one definition of "where the desc and coords are".

What this module does not know: chat templates, images, torch, or how the loss weighs groups.
"""

from __future__ import annotations

import bisect
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from common.detection.answer import IM_END, check_answer_format, serialize_objects
from common.data.records import GTObject
from common.detection.matching import MatchResult
from common.detection.parsing import ParseResult, ParsedObject, parse_rollout
from common.detection.token_text import tokenizer_table


class TargetError(ValueError):
    """The serialised target did not read back as the objects it was built from (a bug or a
    tokenizer that does not round-trip the text)."""


@dataclass
class TargetSpec:
    """Supervision of one assistant span; every array is indexed by assistant-local position."""

    token_ids: np.ndarray  # int64 [L], ends with the turn-end token
    labels_mask: np.ndarray  # bool [L], True where token p is a CE target (predicted at p - 1)
    ce_weights: np.ndarray  # float32 [L], 0 where labels_mask is False
    coord_positions: np.ndarray  # int64 [4M], positions of geometry-supervised coord tokens
    coord_bins: np.ndarray  # int64 [4M], GT bins 0..999 at those positions
    n_matched: int  # objects whose geometry comes from a matched prediction (groups first)
    n_fn: int  # GT objects appended because nothing matched them
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def coord_groups(self) -> np.ndarray:
        return self.coord_positions.reshape(-1, 4)


def _gt_bins(obj: GTObject) -> tuple[int, ...]:
    return tuple(int(b) for b in obj.bins)


def _entry_text(n: int, obj: GTObject, answer_format: str = "object_keys") -> str:
    """One ``"object_n": {...}`` entry (objects_array: one ``{...}`` element), as ``serialize_objects`` writes it."""
    if answer_format == "objects_array":
        return json.dumps(obj.payload(), ensure_ascii=False, separators=(", ", ": "))
    return json.dumps({f"object_{n}": obj.payload()}, ensure_ascii=False, separators=(", ", ": "))[1:-1]


def _tokens_overlapping(starts: Sequence[int], span: tuple[int, int]) -> range:
    """Token indices whose characters overlap ``[span)``; ``starts`` has one extra end entry.

    Empty-piece tokens at the span start are included: they hold the first bytes of a multi-byte
    character that the next token completes (see ``common.detection.token_text``).
    """
    lo, hi = span
    if hi <= lo:
        return range(0)
    first = bisect.bisect_left(starts, lo)
    if first >= len(starts) or starts[first] > lo:
        first -= 1  # the token that contains lo starts before it
    last = bisect.bisect_left(starts, hi) - 1  # the last token that starts before hi
    return range(max(first, 0), min(last, len(starts) - 2) + 1)


class _Builder:
    """Accumulates masks, weights and geometry over the assistant ids (turn end added last)."""

    def __init__(self, ids: list[int], tokenizer: Any, coord_ids: Sequence[int] | None, im_end_token: str,
                 answer_format: str = "object_keys"):
        table = tokenizer_table(tokenizer)
        im_end = table.token_id(im_end_token)
        if im_end is None:
            raise ValueError(f"the tokenizer has no {im_end_token!r} token; pass im_end_token= its turn-end token")
        self.coord_bin = table.coord_bin_of(coord_ids)
        self.ids = list(ids) + [im_end]
        n = len(self.ids)
        self.mask = np.zeros(n, dtype=bool)
        self.weights = np.zeros(n, dtype=np.float32)
        self.is_coord = np.array([t in self.coord_bin for t in self.ids], dtype=bool)
        self.positions: list[int] = []
        self.bins: list[int] = []
        self.parse = parse_rollout(ids, tokenizer, coord_ids=coord_ids, im_end_token=im_end_token,
                                   answer_format=answer_format)
        if self.parse.truncated:
            raise TargetError(f"target text does not close: {self.parse.response_text[-80:]!r}")

    def supervise_from(self, lo: int) -> None:
        """CE with weight 1 on every non-coord token from ``lo`` on (the turn end included)."""
        self.mask[lo:] = ~self.is_coord[lo:]
        self.weights[lo:] = self.mask[lo:]

    def weigh_desc(self, obj: ParsedObject, weight: float) -> None:
        toks = [k for k in _tokens_overlapping(self.parse.token_starts, obj.desc_span) if self.mask[k]]
        self.weights[toks] = weight

    def add_group(self, token_indices: Sequence[int], bins: Sequence[int]) -> None:
        for k, b in zip(token_indices, bins, strict=True):
            if not self.is_coord[k]:
                raise TargetError(f"position {k} holds token {self.ids[k]}, not a coord token")
            self.positions.append(int(k))
            self.bins.append(int(b))

    def done(self, n_matched: int, n_fn: int, meta: dict[str, Any]) -> TargetSpec:
        if not self.mask[-1]:
            raise TargetError("the turn-end token must be supervised")
        return TargetSpec(
            token_ids=np.asarray(self.ids, dtype=np.int64),
            labels_mask=self.mask,
            ce_weights=np.where(self.mask, self.weights, 0).astype(np.float32),
            coord_positions=np.asarray(self.positions, dtype=np.int64),
            coord_bins=np.asarray(self.bins, dtype=np.int64),
            n_matched=n_matched,
            n_fn=n_fn,
            meta=meta,
        )


def _check_read_back(parsed: Sequence[ParsedObject], objects: Sequence[GTObject], what: str) -> None:
    # Descs compare after NFKC: a tokenizer's normaliser may recompose characters, which is no bug.
    got = [(unicodedata.normalize("NFKC", o.desc), o.bins) for o in parsed]
    want = [(unicodedata.normalize("NFKC", o.desc.strip()), _gt_bins(o)) for o in objects]
    if got != want:
        raise TargetError(f"{what}: serialised objects read back as {got[:3]}..., expected {want[:3]}...")


def _serialised_target(
    objects: Sequence[GTObject],
    desc_weights: Sequence[float],
    tokenizer: Any,
    coord_ids: Sequence[int] | None,
    im_end_token: str,
    answer_format: str,
) -> _Builder:
    """Serialise ``objects`` (object_1..K, or the objects array), supervise everything, set desc weights and geometry."""
    text = serialize_objects(list(objects), answer_format)
    b = _Builder(tokenizer_table(tokenizer).encode(text), tokenizer, coord_ids, im_end_token, answer_format)
    parsed = b.parse.valid_objects
    _check_read_back(parsed, objects, "serialised GT")
    b.supervise_from(0)
    for obj, gt, w in zip(parsed, objects, desc_weights):
        b.weigh_desc(obj, w)
        b.add_group(obj.coord_token_indices, _gt_bins(gt))
    return b


def channel_a_target(
    gt_objects: Sequence[GTObject],
    tokenizer: Any,
    *,
    desc_ce_weight: float = 1.0,
    coord_ids: Sequence[int] | None = None,
    im_end_token: str = IM_END,
    answer_format: str = "object_keys",
) -> TargetSpec:
    """GT as given (the caller passes canonical order) in ``answer_format``; every box is geometry-supervised.

    As in the origin's Channel-A, all groups are "fn" groups (there is no rollout prefix).
    """
    n = len(gt_objects)
    b = _serialised_target(gt_objects, [desc_ce_weight] * n, tokenizer, coord_ids, im_end_token, answer_format)
    meta = {"channel": "A", "target": "gt", "prefix_len": 0, "bbox_groups_prefix": [], "bbox_groups_fn": list(range(n))}
    return b.done(0, n, meta)


def reordered_gt_target(
    parse: ParseResult,
    match: MatchResult,
    gt_objects: Sequence[GTObject],
    tokenizer: Any,
    *,
    desc_ce_weight: float = 1.0,
    desc_ce_weight_matched: float | None = None,
    coord_ids: Sequence[int] | None = None,
    im_end_token: str = IM_END,
) -> TargetSpec:
    """Matched GT in predicted order, then FN in GT order, renumbered object_1..K (the origin's
    ``reordered_gt_sft: true``).

    No rollout token is kept. Geometry is supervised on every group, matched and FN alike, under
    GT context; meta ``bbox_groups_prefix`` (the first ``n_matched`` groups, the matched ones) and
    ``bbox_groups_fn`` let the loss weigh or drop either set. With no valid prediction every GT is
    FN and the target equals :func:`channel_a_target` of the same GT.
    """
    matched_gt = [g for _, g in sorted(match.matched_pairs)]
    order = matched_gt + sorted(match.fn_gt_indices)  # every GT exactly once
    objects = [gt_objects[g] for g in order]
    n_m = len(matched_gt)
    w_matched = desc_ce_weight if desc_ce_weight_matched is None else desc_ce_weight_matched
    weights = [w_matched] * n_m + [desc_ce_weight] * (len(objects) - n_m)
    b = _serialised_target(objects, weights, tokenizer, coord_ids, im_end_token, parse.answer_format)
    meta = {
        "channel": "B",
        "target": "reordered_gt",
        "prefix_len": 0,
        "gt_order": order,
        "bbox_groups_prefix": list(range(n_m)),
        "bbox_groups_fn": list(range(n_m, len(objects))),
        "n_valid_pred": parse.n_valid,
        "invalid_rollout": parse.invalid_rollout,
    }
    return b.done(n_m, len(objects) - n_m, meta)


def rollout_prefix_target(
    parse: ParseResult,
    match: MatchResult,
    gt_objects: Sequence[GTObject],
    tokenizer: Any,
    *,
    desc_ce_weight: float = 1.0,
    fn_geometry: bool = True,
    supervise_prefix_structure: bool = False,
    coord_ids: Sequence[int] | None = None,
    im_end_token: str = IM_END,
) -> TargetSpec:
    """The rollout prefix kept verbatim, FN objects appended before the closing ``}`` (the origin's
    ``reordered_gt_sft: false``).

    - FN keys start at ``parse.max_object_index + 1``, so they never repeat an ``object_N`` key
      present in the prefix, valid or not. A ``", "`` separator leads when the prefix ends in ``}``.
    - Matched objects are geometry-supervised at their rollout coord positions with the matched GT
      bins (true self-context); FP objects get nothing.
    - Prefix tokens are not CE-supervised (origin). With ``supervise_prefix_structure`` the
      non-desc, non-coord tokens lying wholly inside a matched object's entry (key to closing
      brace) are; FP objects, separators and text before the first ``{`` stay unsupervised.
    - ``fn_geometry`` (default True) also supervises the appended FN boxes. The origin at 622c7e4
      left them out, its later "unified Channel-B" put them back; FN boxes are teacher-forced GT
      exactly as in Channel-A, where geometry is always on, so we keep the signal by default.
      Either way they are listed in meta ``bbox_groups_fn`` only when supervised.
    """
    fmt = check_answer_format(parse.answer_format)
    prefix = list(parse.prefix_token_ids)
    tail = parse.prefix_text.rstrip()[-1:]
    opener = "[" if fmt == "objects_array" else "{"  # what the prefix ends in when it holds no complete object
    if tail not in (opener, "}", ","):
        raise TargetError(f"the prefix must end in {opener!r}, '}}' or ',', got {parse.prefix_text[-20:]!r}")
    fn_gt = sorted(match.fn_gt_indices)
    if tail == "," and not fn_gt:
        raise TargetError("a prefix ending in ',' needs at least one FN object to follow it")
    first = parse.max_object_index + 1
    entries = ", ".join(_entry_text(first + i, gt_objects[g], fmt) for i, g in enumerate(fn_gt))
    append = (", " if tail == "}" and entries else "") + entries + ("]}" if fmt == "objects_array" else "}")
    table = tokenizer_table(tokenizer)
    b = _Builder(prefix + table.encode(append), tokenizer, coord_ids, im_end_token, fmt)

    # Objects that start after the prefix are the appended FN objects, in order.
    appended = [o for o in b.parse.valid_objects if o.value_span[0] >= len(parse.prefix_text)]
    _check_read_back(appended, [gt_objects[g] for g in fn_gt], "appended FN objects")
    b.supervise_from(len(prefix))
    for obj in appended:
        b.weigh_desc(obj, desc_ce_weight)

    pairs = sorted(match.matched_pairs)
    for p, g in pairs:
        b.add_group(parse.valid_objects[p].coord_token_indices, _gt_bins(gt_objects[g]))
    if fn_geometry:
        for obj, g in zip(appended, fn_gt):
            b.add_group(obj.coord_token_indices, _gt_bins(gt_objects[g]))
    if supervise_prefix_structure:
        _supervise_matched_structure(b, [parse.valid_objects[p] for p, _ in pairs])

    meta = {
        "channel": "B",
        "target": "rollout_prefix",
        "prefix_len": len(prefix),
        "fn_first_index": first,
        "fn_gt_indices": fn_gt,
        "bbox_groups_prefix": list(range(len(pairs))),
        "bbox_groups_fn": list(range(len(pairs), len(pairs) + len(fn_gt))) if fn_geometry else [],
        "n_valid_pred": parse.n_valid,
        "invalid_rollout": parse.invalid_rollout,
        "supervise_prefix_structure": supervise_prefix_structure,
    }
    return b.done(len(pairs), len(fn_gt), meta)


def _supervise_matched_structure(b: _Builder, matched: Sequence[ParsedObject]) -> None:
    """CE on the non-desc, non-coord tokens wholly inside each matched entry (key to closing brace)."""
    starts = b.parse.token_starts
    for obj in matched:
        lo, hi = obj.key_span[0], obj.value_span[1]
        desc = set(_tokens_overlapping(starts, obj.desc_span))
        for k in _tokens_overlapping(starts, (lo, hi)):
            if starts[k] >= lo and starts[k + 1] <= hi and k not in desc and not b.is_coord[k]:
                b.mask[k] = True
                b.weights[k] = 1.0
