"""Strict, token-aligned parsing of one rollout response (Channel-B: docs/actor.md, Data flow; as the
origin's parse_rollout_for_matching).

The response is read through the tokenizer's own per-token pieces, never re-tokenised
(:mod:`common.detection.token_text` does the token level); this module scans and validates the text:

    token ids ──stop at <|im_end|>──► pieces (one decode per id, cached) ──join──► text + char offsets
        │                                          (common.detection.token_text.read_tokens)     │
        │                                       scanner: strings, {[ ]} stack, keys, objects,
        │                                       bbox arrays (coord tokens captured by id)
        ▼                                                                          ▼
    prefix_token_ids = the ids up to the `}` of the last complete object ◄── cut char (or after `{`)
                       (the one token the cut falls inside is re-encoded and must decode back;
                        common.detection.token_text.cut_tokens_at_char)

Two answer formats (``data.answer_format``, :data:`common.detection.answer.ANSWER_FORMATS`), one scanner: in
``object_keys`` objects are the values of the top-level ``"object_N"`` keys (their ``{`` opens at container depth
1); in ``objects_array`` they are the elements of the top-level ``"objects"`` array (depth 2), any other top-level
key or non-object element is counted as ``key_invalid``, and the prefix with no complete object is cut back to
``{"objects": [`` instead of ``{``. Everything else (the cut, captures, strict validation, counters) is shared.

Objects are then validated strictly and either kept (``valid_objects``, appearance order) or dropped
into one of :data:`DROP_REASONS`. ``parse_rollout`` never raises on a token sequence: garbage,
truncations, out-of-vocabulary ids and non-integers all come back as a result with counters.

Deviations from the origin, on purpose:
  - ``max_object_index`` is the highest ``object_N`` key anywhere in the kept prefix, valid or not
    (the origin used valid objects only, so appended FN keys could collide).
  - a cut that cannot be reproduced by re-encoding falls back to the previous safe cut instead of
    raising; scanning stops when the top-level object closes (trailing text is ignored); a value at
    top level that is not an object (``"object_2": 5``) is counted as ``key_invalid``.
  - an out-of-vocabulary id ends the usable response like the turn end does (the learner could not
    embed it), and is counted in ``n_out_of_vocab``.
  - a byte-level token that holds part of a multi-byte character decodes alone to U+FFFD; such runs
    are decoded together and the text is given to the token that completes the character, so
    non-ASCII descriptions survive.
  - duplicate ``object_N`` keys are kept as separate objects (matching does not need the key).
  - ``poly`` geometry is dropped as ``unknown_geom`` (bbox-only v1, as origin Stage-2 AB does).

What this module does not know: torch, models, matching, what the objects are used for, or how a
tokenizer is decoded (common.detection.token_text).
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from common.detection.answer import IM_END, OBJECTS_ARRAY_KEY, answer_opening, check_answer_format
from common.data.records import NUM_BINS, parse_coord_token
from common.detection.token_text import cut_tokens_at_char, read_tokens, tokenizer_table

DROP_REASONS = (
    "key_invalid",
    "missing_desc",
    "missing_geom",
    "unknown_geom",
    "wrong_arity",
    "non_coord_token",
    "bbox_invalid",
)
GEOMETRY_KEYS = ("bbox_2d", "poly")

_OBJECT_KEY = re.compile(r"object_(\d+)")
_STRUCTURAL = re.compile(r'[{}\[\]:,"]')
_IN_STRING = re.compile(r'["\\]')
_NON_SPACE = re.compile(r"\S")
_OPENER = {"}": "{", "]": "["}


@dataclass(frozen=True)
class ParsedObject:
    """One valid object. Char spans index ``ParseResult.response_text``; token indices are
    assistant-local (0 = first response token)."""

    index: int  # N of its "object_N" key; objects_array: its 1-based place among the array's object elements
    desc: str  # stripped
    bins: tuple[int, int, int, int]  # x1, y1, x2, y2 read from the coord token ids
    coord_token_indices: tuple[int, ...]  # 4 positions of the coord tokens, box order
    value_span: tuple[int, int]  # [start, end) of the `{...}` value
    desc_span: tuple[int, int]  # [start, end) of the desc characters inside the quotes
    key_span: tuple[int, int]  # [start, end) of the key string, quotes included; objects_array: empty, at the `{`


@dataclass
class ParseResult:
    """Everything the actor needs from one response: objects to match, the prefix to keep, counts."""

    response_token_ids: list[int]  # the response up to (not including) the first turn-end token
    response_text: str  # pieces of the usable response tokens, joined
    token_starts: list[int]  # char start of each usable response token, plus len(response_text)
    prefix_token_ids: list[int]  # ids up to the cut (the last one possibly re-encoded)
    prefix_text: str  # decodes from prefix_token_ids
    valid_objects: list[ParsedObject]  # appearance order
    dropped_by_reason: dict[str, int]  # every key of DROP_REASONS, zeros included
    truncated: bool  # the structure was still open where the usable text ended
    max_object_index: int  # highest N of an "object_N" key in the prefix (objects_array: objects opened); 0: none
    invalid_rollout: bool  # no top-level `{`, or no object completed before the cut
    n_out_of_vocab: int = 0  # ids that are not tokens of this tokenizer (or not integers)
    prefix_reencoded: bool = False  # the cut fell inside a token, which was re-encoded
    answer_format: str = "object_keys"  # the format it was parsed as (targets built on it append in the same one)

    @property
    def n_dropped(self) -> int:
        return sum(self.dropped_by_reason.values())

    @property
    def n_valid(self) -> int:
        return len(self.valid_objects)


# ----------------------------------------------------------------------------------------------
# Scanner


@dataclass
class _RawObject:
    key: str | None
    key_span: tuple[int, int]
    start: int  # char of its `{`
    end: int = -1  # char after its `}`; -1 while open
    desc_span: tuple[int, int] | None = None
    captures: list[list[int]] = field(default_factory=list)  # [open `[` char, close `]` char or -1]
    last_key: str | None = None
    ordinal: int = 0  # objects_array: 1-based place among the array's object elements


@dataclass
class _Scan:
    objects: list[_RawObject] = field(default_factory=list)
    object_keys: list[tuple[int, int]] = field(default_factory=list)  # (N, char after the key)
    bad_values: int = 0  # top-level values that are not objects
    first_open: int = -1  # char after the top-level `{` (objects_array: after the objects array's `[`)
    truncated: bool = True


def _unquote(raw: str) -> str | None:
    if "\\" not in raw:
        return raw
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return None


def _scan(text: str, end: int, array: bool = False) -> _Scan:
    """One pass over ``text[:end]`` visiting only structural characters (regex jumps); ``array``: objects_array."""
    s = _Scan()
    od = 2 if array else 1  # len(stack) where an object's `{` opens: in the top-level `{`, or in its objects `[`
    in_objects = False  # objects_array: the top-level "objects" array is open (stack == ["{", "["])
    seen_objects = False  # objects_array: only the first "objects" array holds objects
    stack: list[str] = []  # open containers, "{" or "["; stack[0] is the top-level "{"
    expecting_key: list[bool] = []  # parallel to stack (meaningful for "{")
    pending_key: tuple[str | None, tuple[int, int]] | None = None
    obj: _RawObject | None = None  # object whose frame is stack[od]
    capture_depth = 0  # len(stack) of the armed geometry array; 0 when not capturing
    pos = 0
    while True:
        m = _STRUCTURAL.search(text, pos, end)
        if m is None:
            break
        c, i = m.group(), m.start()
        pos = i + 1
        depth = len(stack)
        if c == '"':
            j = pos
            while True:
                m2 = _IN_STRING.search(text, j, end)
                if m2 is None:
                    return s  # unterminated string: truncated
                if m2.group() == "\\":
                    j = m2.start() + 2
                    continue
                close = m2.start()
                break
            pos = close + 1
            if depth == 0:
                continue
            if stack[-1] == "{" and expecting_key[-1]:
                key = _unquote(text[i + 1 : close])
                if depth == 1:
                    pending_key = (key, (i, close + 1))
                    km = _OBJECT_KEY.fullmatch(key) if key is not None and not array else None
                    if km:
                        s.object_keys.append((int(km.group(1)), close + 1))
                elif depth == od + 1 and obj is not None:
                    obj.last_key = key
            elif depth == od + 1 and obj is not None and stack[-1] == "{" and obj.last_key == "desc":
                obj.desc_span = (i + 1, close)
        elif c == "{":
            if depth == 0:
                if not array:
                    s.first_open = i + 1
            elif depth == 1 and not array:
                key = pending_key if (pending_key is not None and not expecting_key[0]) else (None, (i, i))
                obj = _RawObject(key=key[0], key_span=key[1], start=i)
                s.objects.append(obj)
                pending_key = None
            elif depth == 2 and in_objects:
                obj = _RawObject(key=None, key_span=(i, i), start=i, ordinal=len(s.objects) + 1)
                s.objects.append(obj)
                s.object_keys.append((obj.ordinal, i))
            stack.append("{")
            expecting_key.append(True)
        elif c == "[":
            if depth == 0:
                continue
            if array and depth == 1 and not seen_objects and not expecting_key[0] and pending_key is not None \
                    and pending_key[0] == OBJECTS_ARRAY_KEY:
                in_objects = seen_objects = True
                s.first_open = i + 1
                s.bad_values += _element_is_not_an_object(text, pos, end)
            if (
                depth == od + 1
                and obj is not None
                and stack[-1] == "{"
                and not expecting_key[-1]
                and obj.last_key in GEOMETRY_KEYS
                and not capture_depth
            ):
                capture_depth = depth + 1
                obj.captures.append([i, -1])
            stack.append("[")
            expecting_key.append(False)
        elif c in "}]":
            opener = _OPENER[c]
            if opener not in stack:
                continue  # a closer with nothing to close: garbage
            while True:  # mismatched closers close the inner containers implicitly
                top = stack.pop()
                expecting_key.pop()
                if top == opener:
                    break
            depth = len(stack)
            if capture_depth and depth < capture_depth:
                obj.captures[-1][1] = i
                capture_depth = 0
            if obj is not None and depth < od + 1:
                if c == "}" and depth == od:
                    obj.end = i + 1
                obj = None
            if in_objects and depth < 2:
                in_objects = False
            if depth == 0:
                s.truncated = False
                return s  # the top-level object closed; trailing text is ignored
        elif c == ":":
            if depth and stack[-1] == "{":
                expecting_key[-1] = False
                if depth == 1:
                    nxt = _NON_SPACE.search(text, pos, end)
                    is_objects = array and not seen_objects and pending_key is not None \
                        and pending_key[0] == OBJECTS_ARRAY_KEY
                    if nxt is not None and nxt.group() != ("[" if is_objects else "{"):
                        s.bad_values += 1
                        pending_key = None
                    elif nxt is not None and array and not is_objects:
                        s.bad_values += 1  # objects_array: a top-level key other than the first "objects"
                        pending_key = None
        elif c == ",":
            if depth and stack[-1] == "{":
                expecting_key[-1] = True
                if depth == 1:
                    pending_key = None
            elif in_objects and depth == 2:
                s.bad_values += _element_is_not_an_object(text, pos, end)
    return s


def _element_is_not_an_object(text: str, pos: int, end: int) -> int:
    """1 if the objects array's next element (after ``[`` or ``,``) is present and not an object, else 0."""
    nxt = _NON_SPACE.search(text, pos, end)
    return int(nxt is not None and nxt.group() not in "{]")


# ----------------------------------------------------------------------------------------------
# Validation


def _validate(raw: _RawObject, text: str, cut: int, coord_idx: list[int], ids: list[int], coord_bin: dict[int, int]):
    """(reason, None) for a dropped object, (None, ParsedObject) for a valid one."""
    if raw.end < 0 or raw.end > cut:
        return "key_invalid", None
    if raw.ordinal:  # an element of the objects array: no key to check
        index = raw.ordinal
    else:
        km = _OBJECT_KEY.fullmatch(raw.key) if raw.key is not None else None
        if km is None:
            return "key_invalid", None
        index = int(km.group(1))
    try:
        value = json.loads(text[raw.start : raw.end])
    except (ValueError, RecursionError):
        return "key_invalid", None
    if not isinstance(value, dict):
        return "key_invalid", None
    geom = [k for k in value if k in GEOMETRY_KEYS]
    if len(geom) > 1:
        return "key_invalid", None
    desc = value.get("desc")
    if not isinstance(desc, str) or not desc.strip():
        return "missing_desc", None
    extra = set(value) - {"desc", *geom}
    if not geom:
        return ("unknown_geom" if extra else "missing_geom"), None
    if extra:
        return "key_invalid", None
    if geom[0] != "bbox_2d":
        return "unknown_geom", None
    box = value["bbox_2d"]
    if not isinstance(box, list) or len(box) != 4:
        return "wrong_arity", None
    text_bins = [parse_coord_token(v) for v in box]
    if None in text_bins:
        return "non_coord_token", None
    # Each value must be exactly one coord token, not the same characters spelled by other tokens.
    if len(coord_idx) != 4 or [coord_bin[ids[t]] for t in coord_idx] != text_bins:
        return "non_coord_token", None
    x1, y1, x2, y2 = text_bins
    if not all(0 <= b < NUM_BINS for b in text_bins) or x2 < x1 or y2 < y1:
        return "bbox_invalid", None
    return None, ParsedObject(
        index=index,
        desc=desc.strip(),
        bins=(x1, y1, x2, y2),
        coord_token_indices=tuple(coord_idx),
        value_span=(raw.start, raw.end),
        desc_span=raw.desc_span or (raw.start, raw.start),
        key_span=raw.key_span,
    )


def _captured(raw: _RawObject, coord_tokens: list[int], coord_starts: list[int]) -> list[int]:
    """Coord tokens that start inside one of the object's geometry arrays (checked at token start)."""
    out = []
    for open_c, close_c in raw.captures:
        lo = bisect.bisect_right(coord_starts, open_c)
        hi = len(coord_starts) if close_c < 0 else bisect.bisect_left(coord_starts, close_c)
        out.extend(coord_tokens[lo:hi])
    return out


# ----------------------------------------------------------------------------------------------
# Entry point


def parse_rollout(
    token_ids: Sequence[int],
    tokenizer: Any,
    *,
    coord_ids: Sequence[int] | None = None,
    im_end_token: str = IM_END,
    answer_format: str = "object_keys",
) -> ParseResult:
    """Parse one response (token ids as generated, prompt excluded) in ``answer_format``. Never raises on the ids.

    ``coord_ids``: the 1000 coord token ids in bin order (``common.detection.coord_tokens.coord_token_ids`` if None;
    a tokenizer without them raises ``CoordTokenError`` - a setup error, not a bad rollout).
    """
    table = tokenizer_table(tokenizer)
    coord_bin = table.coord_bin_of(coord_ids)
    read = read_tokens(table, token_ids, table.token_id(im_end_token))
    ids, pieces, text, starts = read.ids, read.pieces, read.text, read.starts
    usable = len(pieces)
    stop = text.find(im_end_token)  # a turn end spelled by ordinary tokens also ends the turn
    array = check_answer_format(answer_format) == "objects_array"
    scan = _scan(text, len(text) if stop < 0 else stop, array)

    # Cut after the last complete object whose cut reproduces; else right after the top-level `{`.
    cuts = sorted({o.end for o in scan.objects if o.end > 0}, reverse=True)
    if scan.first_open >= 0:
        cuts.append(scan.first_open)
    prefix, cut, reencoded = None, -1, False
    for c in cuts:
        got = cut_tokens_at_char(ids[:usable], pieces, c, tokenizer, starts)
        if got is not None:
            (prefix, reencoded), cut = got, c
            break
    fallback = prefix is None
    if fallback:
        prefix, cut = list(table.encode(answer_opening(answer_format)) if array else table.open_brace_ids), -1
    prefix_text = answer_opening(answer_format) if fallback else text[:cut]

    coord_tokens = [k for k in range(usable) if ids[k] in coord_bin]
    coord_starts = [starts[k] for k in coord_tokens]
    dropped = dict.fromkeys(DROP_REASONS, 0)
    dropped["key_invalid"] += scan.bad_values
    valid = []
    for raw in scan.objects:
        reason, obj = _validate(raw, text, cut, _captured(raw, coord_tokens, coord_starts), ids, coord_bin)
        if reason is None:
            valid.append(obj)
        else:
            dropped[reason] += 1

    max_index = max((n for n, key_end in scan.object_keys if key_end <= cut), default=0)
    any_complete = any(0 < o.end <= cut for o in scan.objects)
    return ParseResult(
        response_token_ids=ids,
        response_text=text,
        token_starts=starts,
        prefix_token_ids=prefix,
        prefix_text=prefix_text,
        valid_objects=valid,
        dropped_by_reason=dropped,
        truncated=True if fallback else scan.truncated,
        max_object_index=max_index,
        invalid_rollout=fallback or not any_complete,
        n_out_of_vocab=read.n_out_of_vocab,
        prefix_reencoded=reencoded,
        answer_format=answer_format,
    )
