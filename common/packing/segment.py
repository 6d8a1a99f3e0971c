"""The unit of training data: a teacher-forced *segment* and a version-pure *pack* of segments.

Both channels produce the same thing. Channel-A (learner, canonical GT targets) and Channel-B
(actor, matched rollout targets) each encode one sample into a :class:`Segment`; the packer
(`common/packing/packer.py`) concatenates segments of one ``ver`` into a :class:`Pack`; a pack is exactly
one packed forward/backward on a learner rank.

Everything here is numpy so that ``common`` stays free of torch; the learner turns a pack into
tensors with ``torch.from_numpy`` (no copy).

Position conventions (all segment-local, 0-based, over ``input_ids``):
  - ``labels[p]`` is the token the model must predict *at* position p, i.e. from the logits at p-1;
    ``-100`` means "no CE here". Coord tokens always carry ``-100`` (they are supervised by geometry).
  - ``weights[p]`` is the CE weight for ``labels[p]`` (0 where ``labels[p] == -100``).
  - ``coord_pos`` lists positions of coord tokens supervised by geometry, in groups of four
    (x1, y1, x2, y2 of one box); ``coord_bins`` are the ground-truth bins 0..999 at those positions.
  - ``position_ids`` are the model's own rope positions for this segment alone ([3, L] for the
    mRoPE Qwen-VL family, [1, L] otherwise); text positions restart at 0 in every segment.

Pixels travel lean: ``pixel_values`` are the resized images' 0..255 values (uint8) in the image
processor's patch layout, and ``pixel_affine`` ([2, D]: scale, offset per column) turns them into the
processor's float input: ``pixel_values * scale + offset`` (:func:`pixel_floats`), which is
``(u8 · rescale_factor − mean[c]) / std[c]`` of the column's channel c. The Qwen-VL processors resize
uint8 images and only then rescale, normalise and patchify, so this is exact up to float32 rounding
(``common.packing.encode.to_uint8_pixels`` checks it per image); the learner applies it on its device.
A quarter of the float32 bytes: 6.4 MB instead of 25.8 MB per 1024-px image (74 × 74 patches of 1,176).

What this module does not know: tokenizers, models, or how targets were chosen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

IGNORE_INDEX = -100

#: Names, dtypes and ranks of the arrays a pack carries on the wire (see ``Pack.tensors``).
PACK_TENSOR_SPECS: dict[str, tuple[str, int]] = {
    "input_ids": ("int64", 1),  # [T]
    "labels": ("int64", 1),  # [T]
    "weights": ("float32", 1),  # [T]
    "position_ids": ("int64", 2),  # [R, T], R = 3 for mRoPE models, 1 otherwise
    "cu_seqlens": ("int32", 1),  # [n_segments + 1], cu_seqlens[0] = 0, cu_seqlens[-1] = T
    "coord_pos": ("int64", 1),  # [M], pack-absolute positions, M % 4 == 0
    "coord_bins": ("int64", 1),  # [M], 0..999
    "pixel_values": ("uint8", 2),  # [P, D] patches of every image in the pack, 0..255 (P may be 0)
    "pixel_affine": ("float32", 2),  # [2, D] per column: scale, offset to the processor's floats (pixel_floats)
    "image_grid_thw": ("int64", 2),  # [I, 3] one row per image, in segment order
}


def pixel_floats(pixel_values: np.ndarray, pixel_affine: np.ndarray) -> np.ndarray:
    """The image processor's float32 ``pixel_values`` from the wire's uint8 ones (the learner does the same on its
    device: ``learner.model.pack_inputs``)."""
    return pixel_values.astype(np.float32) * pixel_affine[0] + pixel_affine[1]


class SegmentError(ValueError):
    """A segment or pack violates the layout contract above."""


#: Why a learner refuses a pack whose layout is sound (:func:`pack_rejection`; ``future_ver`` is the ready
#: queue's own check). One counter per reason: ``rejected_<reason>`` (learner/pack_queue.py).
REJECT_REASONS = ("future_ver", "too_long", "token_id", "nonfinite", "weight", "position", "image", "meta")

#: Bytes per token that a pack frame may carry when no cap is configured (``transport.max_frame_mb``): a legal
#: pack's biggest frame is its ``pixel_values``, at most merge² (4) patches per token of ≤ 1536 uint8
#: (Qwen2/2.5-VL 1176, Qwen3-VL 1536) = 6 KiB; the rest is < 100 bytes per token.
FRAME_BYTES_PER_TOKEN = 8 * 1024


def default_max_frame_bytes(packing_length: int) -> int:
    """The frame cap a learner rank puts on its pack socket unless configured: generous for any legal pack."""
    return int(packing_length) * FRAME_BYTES_PER_TOKEN + (1 << 20)


@dataclass(frozen=True)
class PackLimits:
    """What a learner accepts in a pack beyond its layout: its model's and its config's numbers.

    Example (Qwen2.5-VL, packing length 4096): ``PackLimits(packing_length=4096, vocab_size=151936,
    rope_rows=3, image_token_id=151655, patch_dim=1176, merge_size=2, meta_counts=("n_pred", "n_gt"))``.
    ``None`` switches a check off (a model without a vision tower has no image checks).
    """

    packing_length: int  # tokens of the biggest pack (training.global_max_length)
    vocab_size: int  # ids and CE labels lie in [0, vocab_size)
    rope_rows: int | None = None  # rows of position_ids the model takes (3 mRoPE, 1 otherwise)
    image_token_id: int | None = None  # placeholders in input_ids: exactly Σ t·h·w / merge² of them
    patch_dim: int | None = None  # pixel_values width the vision tower takes
    merge_size: int = 1  # the vision tower merges merge × merge patches into one token
    meta_counts: tuple[str, ...] = ()  # segment meta counters the learner adds up: finite, 0 .. 2**53

    def largest_frame_bytes(self) -> int:
        """The biggest frame a legal pack sends: its ``pixel_values`` or its ``position_ids``."""
        pixels = self.packing_length * self.merge_size ** 2 * (self.patch_dim or 0)  # uint8
        return max(pixels, self.packing_length * 8 * (self.rope_rows or 3))


def pack_rejection(tensors: Mapping[str, np.ndarray], segment_meta: Sequence[Mapping[str, Any]],
                   limits: PackLimits) -> tuple[str, str] | None:
    """``(reason, detail)`` for the first value of a pack that a learner must not train on, None if none.

    ``tensors`` passed :meth:`Pack.from_tensors` (names, dtypes, shapes, ``cu_seqlens``, coords 0..999 are
    sound); this checks what the layout cannot: values against the model and the config. Each reason is
    one of :data:`REJECT_REASONS`; ``detail`` names the array and the offending value.
    """
    ids, labels, weights = tensors["input_ids"], tensors["labels"], tensors["weights"]
    t, v = int(ids.shape[0]), limits.vocab_size
    if t > limits.packing_length:
        return "too_long", f"{t} tokens > packing length {limits.packing_length}"
    if t and (ids.min() < 0 or ids.max() >= v):
        return "token_id", f"input_ids holds {int(ids.min() if ids.min() < 0 else ids.max())}, outside [0, {v})"
    sup = labels[labels != IGNORE_INDEX]
    if sup.size and (sup.min() < 0 or sup.max() >= v):
        return "token_id", f"labels hold {int(sup.min() if sup.min() < 0 else sup.max())}, outside [0, {v}) and not -100"
    for name in ("weights", "pixel_affine"):
        if not np.isfinite(tensors[name]).all():
            return "nonfinite", f"{name} holds NaN or inf"
    if t and weights.min() < 0:
        return "weight", f"weights hold {float(weights.min())} (a CE weight is ≥ 0)"
    pos = tensors["position_ids"]
    if limits.rope_rows is not None and pos.shape[0] != limits.rope_rows:
        return "position", f"position_ids has {pos.shape[0]} rows, the model takes {limits.rope_rows}"
    if t and (pos.min() < 0 or pos.max() > limits.packing_length):
        return "position", f"position_ids hold {int(pos.min())}..{int(pos.max())}, outside 0..{limits.packing_length}"
    problem = _image_problem(ids, tensors["pixel_values"], tensors["image_grid_thw"], limits)
    if problem is not None:
        return "image", problem
    for i, m in enumerate(segment_meta):
        inner = m.get("meta", {}) if isinstance(m, Mapping) else {}
        for key in limits.meta_counts:
            x = inner.get(key, 0)
            if type(x) not in (int, float) or not (math.isfinite(x) and 0 <= x <= 2**53):
                return "meta", f"segment {i} meta[{key!r}] = {x!r} (a count: a finite number 0 .. 2**53)"
    return None


def _image_problem(ids: np.ndarray, pixels: np.ndarray, grid: np.ndarray, limits: PackLimits) -> str | None:
    """What about a pack's images would fail the model's vision path (None: nothing)."""
    m = limits.merge_size
    if grid.size and grid.max() > limits.packing_length * m * m:  # also keeps Σ t·h·w below int64 wrap-around
        return f"image_grid_thw holds {int(grid.max())}: more patches than a pack of {limits.packing_length} tokens holds"
    if grid.size and (grid.min() < 1 or (m > 1 and ((grid[:, 1] % m).any() or (grid[:, 2] % m).any()))):
        return f"image_grid_thw {grid.tolist()[:4]}: sizes must be ≥ 1, h and w multiples of the merge size {m}"
    if limits.patch_dim is not None and pixels.shape[0] and pixels.shape[1] != limits.patch_dim:
        return f"pixel_values rows of width {pixels.shape[1]}, the vision tower takes {limits.patch_dim}"
    if limits.image_token_id is not None:
        want = int(np.prod(grid, axis=1).sum()) // (m * m) if grid.size else 0
        have = int((ids == limits.image_token_id).sum())
        if have != want:
            return f"{have} image placeholder tokens in input_ids, image_grid_thw implies {want}"
    return None


@dataclass
class Segment:
    """One sample, teacher-forced and encoded; atomic (never split across packs)."""

    sample_id: str
    channel: str  # "A" or "B"
    ver: int  # server weight version the rollout ran under (Channel-A: the learner's ver)
    input_ids: np.ndarray
    labels: np.ndarray
    weights: np.ndarray
    position_ids: np.ndarray
    coord_pos: np.ndarray
    coord_bins: np.ndarray
    pixel_values: np.ndarray  # uint8 [P, D]
    image_grid_thw: np.ndarray
    pixel_affine: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.float32))  # [2, D]; [2, 0] no images
    meta: dict[str, Any] = field(default_factory=dict)  # JSON/msgpack-safe counters (parse, match)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def validate(self) -> None:
        """Raise :class:`SegmentError` naming the first broken invariant."""
        n = self.length
        if self.channel not in ("A", "B"):
            raise SegmentError(f"segment {self.sample_id}: channel must be 'A' or 'B', got {self.channel!r}")
        for name in ("labels", "weights"):
            if getattr(self, name).shape != (n,):
                raise SegmentError(f"segment {self.sample_id}: {name} shape {getattr(self, name).shape} != ({n},)")
        if self.position_ids.ndim != 2 or self.position_ids.shape[1] != n:
            raise SegmentError(f"segment {self.sample_id}: position_ids shape {self.position_ids.shape} != (R, {n})")
        if self.coord_pos.shape != self.coord_bins.shape or self.coord_pos.shape[0] % 4:
            raise SegmentError(f"segment {self.sample_id}: coord_pos/coord_bins must be equal length, multiple of 4")
        if self.coord_pos.size and (self.coord_pos.min() < 1 or self.coord_pos.max() >= n):
            raise SegmentError(f"segment {self.sample_id}: coord_pos outside [1, {n})")
        if self.coord_bins.size and (self.coord_bins.min() < 0 or self.coord_bins.max() > 999):
            raise SegmentError(f"segment {self.sample_id}: coord_bins outside 0..999")
        if self.image_grid_thw.ndim != 2 or self.image_grid_thw.shape[1] != 3:
            raise SegmentError(f"segment {self.sample_id}: image_grid_thw must be [I, 3]")
        patches = int(np.prod(self.image_grid_thw, axis=1).sum()) if self.image_grid_thw.size else 0
        if self.pixel_values.shape[0] != patches:
            raise SegmentError(
                f"segment {self.sample_id}: pixel_values has {self.pixel_values.shape[0]} rows, "
                f"image_grid_thw implies {patches}"
            )
        if patches and self.pixel_values.dtype != np.uint8:
            raise SegmentError(f"segment {self.sample_id}: pixel_values are {self.pixel_values.dtype}, the wire takes "
                               "uint8 0..255 with a pixel_affine (common.packing.encode.to_uint8_pixels)")
        if patches and self.pixel_affine.shape != (2, self.pixel_values.shape[1]):
            raise SegmentError(f"segment {self.sample_id}: pixel_affine shape {self.pixel_affine.shape} != "
                               f"(2, {self.pixel_values.shape[1]}) (scale and offset per pixel_values column)")


@dataclass
class Pack:
    """Segments of one ``ver`` concatenated into one row; one forward/backward on the learner."""

    ver: int
    channel: str
    segments: list[Segment]

    @property
    def n_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def tensors(self) -> dict[str, np.ndarray]:
        """Concatenate segment arrays into the wire layout of ``PACK_TENSOR_SPECS``."""
        if not self.segments:
            raise SegmentError("a pack needs at least one segment")
        vers = {s.ver for s in self.segments}
        if vers != {self.ver}:
            raise SegmentError(f"pack ver {self.ver} holds segments of vers {sorted(vers)}: packs are version-pure")
        offsets = np.cumsum([0] + [s.length for s in self.segments])
        widths = {int(s.pixel_values.shape[1]) for s in self.segments if s.pixel_values.size}
        if len(widths) > 1:
            raise SegmentError(f"pack ver {self.ver} mixes pixel_values widths {sorted(widths)}: segments of one pack "
                               "must come from one image processor (same patch size and channels)")
        d = widths.pop() if widths else 0
        with_images = [s for s in self.segments if s.pixel_values.size]
        affine = with_images[0].pixel_affine if with_images else np.zeros((2, 0), np.float32)
        if any(not np.array_equal(s.pixel_affine, affine) for s in with_images):
            raise SegmentError(f"pack ver {self.ver} mixes pixel normalisations (pixel_affine): segments of one pack "
                               "must come from one image processor (same mean, std and rescale factor)")
        if any(s.pixel_values.dtype != np.uint8 for s in with_images):
            raise SegmentError(f"pack ver {self.ver}: pixel_values must be uint8 (Segment.validate says why)")
        return {
            "input_ids": np.concatenate([s.input_ids for s in self.segments]).astype(np.int64, copy=False),
            "labels": np.concatenate([s.labels for s in self.segments]).astype(np.int64, copy=False),
            "weights": np.concatenate([s.weights for s in self.segments]).astype(np.float32, copy=False),
            "position_ids": np.concatenate([s.position_ids for s in self.segments], axis=1).astype(np.int64),
            "cu_seqlens": offsets.astype(np.int32),
            "coord_pos": np.concatenate([s.coord_pos + o for s, o in zip(self.segments, offsets)]).astype(np.int64),
            "coord_bins": np.concatenate([s.coord_bins for s in self.segments]).astype(np.int64),
            "pixel_values": np.concatenate(
                [s.pixel_values.reshape(-1, d) if d else np.zeros((0, 0), np.uint8) for s in self.segments]
            ).astype(np.uint8, copy=False),
            "pixel_affine": np.ascontiguousarray(affine, dtype=np.float32),
            "image_grid_thw": np.concatenate([s.image_grid_thw.reshape(-1, 3) for s in self.segments]).astype(np.int64),
        }

    def segment_meta(self) -> list[dict[str, Any]]:
        """Per-segment bookkeeping that travels with :meth:`tensors` so :meth:`from_tensors` can split it.

        Example: ``[{"sample_id": "coco-17", "length": 612, "n_coord": 8, "n_images": 1, "patches": 1024,
        "meta": {"parse/truncated": 0}}]``
        """
        return [
            {
                "sample_id": s.sample_id,
                "length": s.length,
                "n_coord": int(s.coord_pos.shape[0]),
                "n_images": int(s.image_grid_thw.reshape(-1, 3).shape[0]),
                "patches": int(s.pixel_values.shape[0]),
                "meta": dict(s.meta),
            }
            for s in self.segments
        ]

    @classmethod
    def from_tensors(
        cls, ver: int, channel: str, tensors: Mapping[str, np.ndarray], segment_meta: Sequence[Mapping[str, Any]]
    ) -> Pack:
        """Inverse of :meth:`tensors`: segments become views of the pack arrays (no copy but ``coord_pos``).

        Raises :class:`SegmentError` naming the first inconsistency between names, dtypes, ranks and
        shapes of ``tensors`` (``PACK_TENSOR_SPECS``), ``cu_seqlens`` and ``segment_meta``. An image-less
        segment comes back with ``pixel_values`` of shape ``[0, D]``, D the pack's patch width.
        """
        _check_pack_arrays(tensors)
        t = tensors["input_ids"].shape[0]
        cu = tensors["cu_seqlens"].astype(np.int64)  # no int32 wrap-around in the checks below
        if not isinstance(segment_meta, Sequence):
            raise SegmentError(f"segment meta must be a list, got {type(segment_meta).__name__}")
        if cu.shape != (len(segment_meta) + 1,):
            raise SegmentError(f"cu_seqlens shape {cu.shape} does not match {len(segment_meta)} segments")
        if len(segment_meta) == 0 or cu[0] != 0 or cu[-1] != t or (np.diff(cu) <= 0).any():
            raise SegmentError(f"cu_seqlens must rise strictly from 0 to T={t}, got {cu.tolist()}")
        starts = {"coord": 0, "image": 0, "patch": 0}
        segments = []
        for i, m in enumerate(segment_meta):
            m = _check_segment_meta(m, i)
            a, b = int(cu[i]), int(cu[i + 1])
            if m["length"] != b - a:
                raise SegmentError(f"segment {i} ({m['sample_id']}): length {m['length']} != cu_seqlens span {b - a}")
            c0, i0, p0 = starts["coord"], starts["image"], starts["patch"]
            starts = {"coord": c0 + m["n_coord"], "image": i0 + m["n_images"], "patch": p0 + m["patches"]}
            segment = Segment(
                sample_id=m["sample_id"],
                channel=channel,
                ver=ver,
                input_ids=tensors["input_ids"][a:b],
                labels=tensors["labels"][a:b],
                weights=tensors["weights"][a:b],
                position_ids=tensors["position_ids"][:, a:b],
                coord_pos=tensors["coord_pos"][c0 : starts["coord"]] - a,
                coord_bins=tensors["coord_bins"][c0 : starts["coord"]],
                pixel_values=tensors["pixel_values"][p0 : starts["patch"]],
                image_grid_thw=tensors["image_grid_thw"][i0 : starts["image"]],
                pixel_affine=tensors["pixel_affine"],
                meta=dict(m["meta"]),
            )
            if (segment.coord_pos.shape[0], segment.image_grid_thw.shape[0]) != (m["n_coord"], m["n_images"]):
                raise SegmentError(f"segment {i} ({m['sample_id']}): n_coord/n_images run past the pack arrays")
            segment.validate()
            segments.append(segment)
        ends = (tensors["coord_pos"].shape[0], tensors["image_grid_thw"].shape[0], tensors["pixel_values"].shape[0])
        if (starts["coord"], starts["image"], starts["patch"]) != ends:
            raise SegmentError(
                f"segment meta sums (n_coord, n_images, patches) = {tuple(starts.values())} != pack arrays {ends}"
            )
        return cls(ver=ver, channel=channel, segments=segments)


_SEGMENT_META_TYPES = {"sample_id": str, "length": int, "n_coord": int, "n_images": int, "patches": int, "meta": dict}


def _check_pack_arrays(tensors: Mapping[str, np.ndarray]) -> None:
    missing, extra = set(PACK_TENSOR_SPECS) - set(tensors), set(tensors) - set(PACK_TENSOR_SPECS)
    if missing or extra:
        raise SegmentError(f"pack arrays: missing {sorted(missing)}, unknown {sorted(extra)}")
    for name, (dtype, ndim) in PACK_TENSOR_SPECS.items():
        array = tensors[name]
        if array.dtype != np.dtype(dtype) or array.ndim != ndim:
            raise SegmentError(f"pack array {name!r}: {array.dtype} rank {array.ndim}, expected {dtype} rank {ndim}")
    t = tensors["input_ids"].shape[0]
    for name in ("labels", "weights"):
        if tensors[name].shape != (t,):
            raise SegmentError(f"pack array {name!r}: shape {tensors[name].shape} != input_ids ({t},)")
    if tensors["position_ids"].shape[0] < 1 or tensors["position_ids"].shape[1] != t:
        raise SegmentError(f"pack array 'position_ids': shape {tensors['position_ids'].shape} != (R, {t})")
    pos, bins = tensors["coord_pos"], tensors["coord_bins"]
    if pos.shape != bins.shape:
        raise SegmentError(f"coord_pos {pos.shape} and coord_bins {bins.shape} must have equal length")
    grid = tensors["image_grid_thw"]
    if grid.shape[1] != 3 or (grid < 0).any():
        raise SegmentError(f"image_grid_thw must be [I, 3] of non-negative sizes, got shape {grid.shape}")
    rows, patches = tensors["pixel_values"].shape[0], int(np.prod(grid, axis=1).sum())
    if rows != patches:
        raise SegmentError(f"pixel_values has {rows} rows, image_grid_thw implies {patches}")
    if tensors["pixel_affine"].shape != (2, tensors["pixel_values"].shape[1]):
        raise SegmentError(f"pixel_affine shape {tensors['pixel_affine'].shape} != (2, "
                           f"{tensors['pixel_values'].shape[1]}): a scale and an offset per pixel_values column")


def _check_segment_meta(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, Mapping) or set(m) != set(_SEGMENT_META_TYPES):
        keys = sorted(map(str, m)) if isinstance(m, Mapping) else type(m).__name__
        raise SegmentError(f"segment meta {i}: expected keys {sorted(_SEGMENT_META_TYPES)}, got {keys}")
    for key, kind in _SEGMENT_META_TYPES.items():
        if type(m[key]) is not kind or (kind is int and m[key] < 0):
            expected = "a non-negative int" if kind is int else f"a {kind.__name__}"
            raise SegmentError(f"segment meta {i}: {key!r} must be {expected}, got {m[key]!r}")
    return dict(m)
