"""The record contract (docs/data.md): JSONL records and the quantisation of their boxes to norm1000 bins.

A record on disk::

    {"id": "synth-000123", "images": ["images/synth-000123.png"], "width": 112, "height": 84,
     "coord_mode": "pixel", "objects": [{"desc": "red circle", "bbox_2d": [10, 4, 52, 40]}]}

becomes a :class:`Record` whose objects carry norm1000 *bins* (``k = clamp(round(999*c), 0, 999)``), each
written in an answer as one coord token ``<|coord_k|>`` (the answer itself: ``common/detection/answer.py``).

Coordinate modes: ``"pixel"`` values are numbers in ``[0, width]`` x ``[0, height]`` (pixel-edge
coordinates, so a box covering the whole image is ``[0, 0, W, H]``), divided by W/H then quantised;
``"norm1000"`` values are already bins: ints 0..999 or ``"<|coord_k|>"`` strings, kept as they are.
The mode is declared, never guessed from the values (a 0..999 pixel box and a bin box look the
same): by the record's own ``coord_mode`` or by the data set's (``data.coord_mode``, passed here as
``coord_mode``). A record with neither is an error naming ``data.coord_mode``; a record whose own
mode disagrees with the data set's is an error too, never a rescale (docs/data.md).

What this module does not know: tokenizers (``common/detection/coord_tokens.py`` checks a tokenizer has the coord
tokens), pixels (``common/data/synthetic.py`` draws them), the answer format or the prompts.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from common.data.jsonl import iter_json_lines

NUM_BINS = 1000
MAX_BIN = NUM_BINS - 1


_COORD_RE = re.compile(r"<\|coord_(\d{1,3})\|>")


def coord_token(k: int) -> str:
    """The token string for bin ``k`` (0..999): ``coord_token(110) == "<|coord_110|>"``."""
    if not (isinstance(k, int) and 0 <= k <= MAX_BIN):
        raise ValueError(f"coord bin must be an int in 0..{MAX_BIN}, got {k!r}")
    return f"<|coord_{k}|>"


#: The 1000 coord token strings in bin order; a tokenizer must map each to exactly one id.
COORD_TOKENS: list[str] = [coord_token(k) for k in range(NUM_BINS)]


def parse_coord_token(s: str) -> int | None:
    """``"<|coord_12|>" -> 12``; ``None`` for anything else (including ``"<|coord_012|>"``)."""
    m = _COORD_RE.fullmatch(s) if isinstance(s, str) else None
    if m is None or (len(m.group(1)) > 1 and m.group(1)[0] == "0"):
        return None
    return int(m.group(1))


def quantize(c: float) -> int:
    """Normalised coordinate in [0, 1] -> bin: ``clamp(round(999*c), 0, 999)`` (never /1000)."""
    return min(MAX_BIN, max(0, round(MAX_BIN * c)))


def dequantize(k: int) -> float:
    """Bin -> normalised coordinate: ``k / 999``, so bins 0 and 999 are the image edges."""
    return k / MAX_BIN


class RecordError(ValueError):
    """A JSONL record breaks the contract; the message names the record, the field and the fix."""

    def __init__(self, where: str, field: str, problem: str, fix: str):
        self.where, self.field, self.problem, self.fix = where, field, problem, fix
        super().__init__(f"{where}: {field}: {problem}; fix: {fix}")


@dataclass(frozen=True)
class GTObject:
    """One ground-truth object: a sanitised description and its box as norm1000 bins."""

    desc: str
    bins: tuple[int, int, int, int]  # x1, y1, x2, y2 in 0..999, x1 <= x2 and y1 <= y2

    def payload(self) -> dict[str, Any]:
        """The value of one ``object_N`` key in the assistant JSON."""
        return {"desc": self.desc, "bbox_2d": [coord_token(k) for k in self.bins]}


@dataclass(frozen=True)
class Record:
    """One validated JSONL record. Image paths are as written (relative to the JSONL's folder
    or an image root); :meth:`image_paths` resolves them."""

    images: tuple[str, ...]
    width: int
    height: int
    objects: tuple[GTObject, ...]
    id: str | None = None

    def image_paths(self, root: str | os.PathLike[str]) -> list[str]:
        """Absolute paths, with relative ones taken from ``root``."""
        return [p if os.path.isabs(p) else os.path.join(os.fspath(root), p) for p in self.images]


def check_desc(desc: Any, where: str = "desc", field: str = "desc") -> str:
    """Return ``desc`` unchanged if it can sit inside the single-line assistant JSON, else raise.

    Rejected: non-strings, empty strings, control characters and any whitespace other than a plain
    space, leading/trailing spaces, double spaces, and the separators ``", "`` and ``": "`` (a
    strict parser that scans the model's answer could split on them).
    """
    fix = 'write a short phrase of words separated by single spaces, e.g. "large red circle"'
    if not isinstance(desc, str) or not desc:
        raise RecordError(where, field, f"must be a non-empty string, got {desc!r}", fix)
    for ch in desc:
        if (ch.isspace() and ch != " ") or unicodedata.category(ch).startswith("C"):
            raise RecordError(where, field, f"contains control/whitespace character {ch!r} in {desc!r}", fix)
    if desc != desc.strip(" "):
        raise RecordError(where, field, f"has leading or trailing spaces: {desc!r}", fix)
    if "  " in desc:
        raise RecordError(where, field, f"has a double space: {desc!r}", fix)
    for sep in (", ", ": "):
        if sep in desc:
            raise RecordError(
                where, field, f"contains {sep!r}, which collides with the JSON separators: {desc!r}", fix
            )
    return desc


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bins_from_bbox(bbox: Any, mode: str, width: int, height: int, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        raise RecordError(where, field, f"must be a list [x1, y1, x2, y2], got {bbox!r}", "give exactly four values")
    if mode == "pixel":
        if not all(_is_number(v) for v in bbox):
            hint = (
                'these look like bins: declare them norm1000 (data.coord_mode: norm1000, or "coord_mode": "norm1000" '
                "in the record)"
                if all(isinstance(v, str) and parse_coord_token(v) is not None for v in bbox)
                else "pixel coordinates are numbers"
            )
            raise RecordError(where, field, f"pixel coordinates must be numbers, got {bbox!r}", hint)
        x1, y1, x2, y2 = (float(v) for v in bbox)
        if not (0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height):
            raise RecordError(
                where,
                field,
                f"{list(bbox)} is not a box inside the {width}x{height} image",
                "pixel boxes need 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height; "
                'if the values are norm1000 bins, declare them (data.coord_mode: norm1000, or "coord_mode": '
                '"norm1000" in the record)',
            )
        return (quantize(x1 / width), quantize(y1 / height), quantize(x2 / width), quantize(y2 / height))
    bins = []
    for v in bbox:
        k = parse_coord_token(v) if isinstance(v, str) else v
        if isinstance(k, float) and k.is_integer():
            k = int(k)
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_BIN):
            raise RecordError(
                where,
                field,
                f"norm1000 coordinates must be ints 0..{MAX_BIN} or '<|coord_k|>' strings, got {v!r}",
                "use bins, or declare pixel coordinates (data.coord_mode: pixel, or \"coord_mode\": \"pixel\" in "
                "the record)",
            )
        bins.append(k)
    if bins[2] < bins[0] or bins[3] < bins[1]:
        raise RecordError(where, field, f"x2 < x1 or y2 < y1 in {bins}", "order the box as [x1, y1, x2, y2]")
    return tuple(bins)


_UNSUPPORTED_GEOMETRY = ("poly", "line", "quad_2d", "point_2d")


COORD_MODES = ("pixel", "norm1000")


def record_coord_mode(record_mode: Any, declared: str | None, where: str) -> str:
    """The mode a record's boxes are read in: its own ``coord_mode`` or the data set's ``declared`` one.

    Neither, or the two disagreeing, raises: the values alone cannot tell pixels from bins.
    """
    if record_mode is not None and record_mode not in COORD_MODES:
        raise RecordError(where, "coord_mode", f"must be 'pixel' or 'norm1000', got {record_mode!r}",
                          "pick one of the two")
    if record_mode is None and declared is None:
        raise RecordError(
            where, "coord_mode",
            "the record has no coord_mode and data.coord_mode is not set (pixel and norm1000 boxes look alike, "
            "so tandem does not guess)",
            "set data.coord_mode: norm1000 (bins 0..999, e.g. the origin's records) or data.coord_mode: pixel "
            "in the config (`tandem data check JSONL --config C data.coord_mode=...`), or add \"coord_mode\" "
            "to every record",
        )
    if record_mode is not None and declared is not None and record_mode != declared:
        raise RecordError(
            where, "coord_mode",
            f"the record says {record_mode!r} but data.coord_mode is {declared!r} (tandem never rescales one into "
            "the other)",
            f"convert the record's boxes to {declared} and drop its coord_mode, or set data.coord_mode: "
            f"{record_mode} if the whole data set is in {record_mode}",
        )
    return record_mode if record_mode is not None else declared  # type: ignore[return-value]


def load_record(obj: Any, *, where: str | None = None, coord_mode: str | None = None) -> Record:
    """Validate one decoded JSONL record and convert its boxes to bins.

    ``coord_mode`` is the data set's declared mode (``data.coord_mode``; None = every record must
    carry its own, see :func:`record_coord_mode`).
    ``where`` labels error messages (e.g. ``"train.jsonl:12"``); the record's ``id`` is added.
    Unknown top-level keys and unknown object keys are ignored, except geometries other than
    ``bbox_2d`` (v1 is bbox-only), which raise.
    """
    where = where or "record"
    if not isinstance(obj, dict):
        raise RecordError(where, "<record>", f"must be a JSON object, got {type(obj).__name__}", "one object per line")
    rid = obj.get("id")
    if rid is not None:
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise RecordError(where, "id", f"must be a string, got {rid!r}", 'use e.g. "id": "img-000001"')
        rid = str(rid)
        where = f"{where} (id {rid})"

    def fail(field: str, problem: str, fix: str) -> RecordError:
        return RecordError(where, field, problem, fix)

    images = obj.get("images")
    if not isinstance(images, list) or not images or not all(isinstance(p, str) and p for p in images):
        raise fail("images", f"must be a non-empty list of paths, got {images!r}", 'e.g. "images": ["img/0001.jpg"]')
    size = {}
    for key in ("width", "height"):
        v = obj.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise fail(key, f"must be a positive int (pixels), got {v!r}", f"give the image {key} in pixels")
        size[key] = v
    mode = record_coord_mode(obj.get("coord_mode"), coord_mode, where)
    objects = obj.get("objects")
    if not isinstance(objects, list):
        raise fail("objects", f"must be a list, got {type(objects).__name__}", 'use "objects": [] for none')
    out = []
    for i, o in enumerate(objects):
        field = f"objects[{i}]"
        if not isinstance(o, dict):
            raise fail(field, f"must be an object, got {o!r}", 'write {"desc": ..., "bbox_2d": [...]}')
        for geom in _UNSUPPORTED_GEOMETRY:
            if geom in o:
                raise fail(f"{field}.{geom}", "only bbox_2d is supported (bbox-only v1)", "convert it to bbox_2d")
        desc = check_desc(o.get("desc"), where, f"{field}.desc")
        if "bbox_2d" not in o:
            raise fail(f"{field}.bbox_2d", "missing", "give the box as [x1, y1, x2, y2]")
        bins = _bins_from_bbox(o["bbox_2d"], mode, size["width"], size["height"], where, f"{field}.bbox_2d")
        out.append(GTObject(desc, bins))  # type: ignore[arg-type]
    return Record(tuple(images), size["width"], size["height"], tuple(out), rid)


def iter_jsonl(path: str | os.PathLike[str], *, coord_mode: str | None = None) -> Iterator[Record]:
    """Records of a JSONL file in order; errors name ``file:line``. Blank lines are skipped."""
    for line in iter_json_lines(path):
        if line.error is not None:
            raise RecordError(line.where, "<line>", line.error, "one object per line")
        yield load_record(line.value, where=line.where, coord_mode=coord_mode)

