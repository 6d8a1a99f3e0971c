"""Token ids ↔ text with character offsets, through the tokenizer's own per-token pieces.

A response is never re-tokenised: each id is decoded once (cached per tokenizer), the pieces are
joined, and every character offset maps back to the token that holds it::

    token ids ──stop at the turn end──► pieces (one decode per id, cached) ──join──► text + token starts
                                                                                       │
    prefix ids ◄── the tokens before a char cut (the one token it falls inside re-encoded) ◄┘

:func:`read_tokens` does the forward direction, :func:`cut_tokens_at_char` the way back;
:func:`tokenizer_table` is the per-tokenizer cache both use (:mod:`common.detection.targets` uses it too).

What the token level decides, on purpose:
  - an id that is not a token of this tokenizer (out of range, undecodable, not an integer) ends the
    usable text like the turn end does (the learner could not embed it), and is counted;
  - a byte-level token that holds part of a multi-byte character decodes alone to U+FFFD; such runs
    are decoded together and the text is given to the token that completes the character (the
    others get the empty piece), so non-ASCII text keeps its characters.

What this module does not know: JSON, objects, coord tokens beyond a cached id → bin table, or what
the text is used for.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from common.data.records import NUM_BINS
from common.detection.coord_tokens import CoordTokenError, coord_token_ids

_MAX_PARTIAL_RUN = 16  # tokens decoded together at most when repairing split multi-byte characters


# ----------------------------------------------------------------------------------------------
# Per-tokenizer decode tables (built lazily; a piece is decoded once per id per tokenizer)


class TokenizerTable:
    """Cached lookups of one tokenizer: the piece of each id, special-token ids, the coord id → bin map."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pieces: dict[int, str | None] = {}  # None: this id does not decode
        try:
            self.vocab_size: int | None = int(len(tokenizer))
        except TypeError:
            self.vocab_size = getattr(tokenizer, "vocab_size", None)
        self.open_brace_ids = [int(t) for t in tokenizer.encode("{", add_special_tokens=False)]
        self.special: dict[str, int | None] = {}
        self.coord_bins: dict[tuple[int, ...] | None, dict[int, int]] = {}
        self._last_coord: tuple[Any, dict[int, int]] | None = None  # (the coord_ids object last asked for, its table)

    def decode(self, ids: Sequence[int]) -> str | None:
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 - a tokenizer may raise anything on an id it does not know
            return None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def token_id(self, token: str) -> int | None:
        if token not in self.special:
            tid = self.tokenizer.convert_tokens_to_ids(token)
            unk_id = getattr(self.tokenizer, "unk_token_id", None)
            is_unk = unk_id is not None and tid == unk_id and token != getattr(self.tokenizer, "unk_token", None)
            self.special[token] = None if tid is None or is_unk else int(tid)
        return self.special[token]

    def coord_bin_of(self, coord_ids: Sequence[int] | None) -> dict[int, int]:
        """id -> bin for the 1000 coord tokens (looked up and checked once per tokenizer)."""
        last = self._last_coord
        if last is not None and last[0] is coord_ids:  # hot path: callers pass the same list every time
            return last[1]
        key = None if coord_ids is None else tuple(int(i) for i in coord_ids)
        if key not in self.coord_bins:
            ids = key if key is not None else coord_token_ids(self.tokenizer)
            if len(ids) != NUM_BINS or len(set(ids)) != NUM_BINS:
                raise CoordTokenError(f"coord_ids must be {NUM_BINS} distinct ids in bin order, got {len(ids)}")
            self.coord_bins[key] = {tid: k for k, tid in enumerate(ids)}
        self._last_coord = (coord_ids, self.coord_bins[key])  # holds coord_ids, so its identity stays unique
        return self.coord_bins[key]

    def pieces_of(self, ids: list[int]) -> list[str | None]:
        missing = {t for t in ids if t not in self.pieces}
        if missing:
            self._fill(missing)
        return [self.pieces[t] for t in ids]

    def _fill(self, missing: set[int]) -> None:
        todo = []
        for t in missing:
            if t < 0 or (self.vocab_size is not None and t >= self.vocab_size):
                self.pieces[t] = None
            else:
                todo.append(t)
        if not todo:
            return
        try:
            texts = self.tokenizer.batch_decode(
                [[t] for t in todo], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            if len(texts) != len(todo):
                raise ValueError("batch_decode returned the wrong number of texts")
        except Exception:  # noqa: BLE001 - fall back to one decode per id, each guarded
            texts = [self.decode([t]) for t in todo]
        for t, text in zip(todo, texts):
            self.pieces[t] = text if isinstance(text, str) else None


_TABLES: "weakref.WeakKeyDictionary[Any, TokenizerTable]" = weakref.WeakKeyDictionary()
_TABLES_BY_ID: dict[int, TokenizerTable] = {}  # tokenizers that cannot be weakly referenced


def tokenizer_table(tokenizer: Any) -> TokenizerTable:
    """The cached decode table of ``tokenizer`` (shared by :mod:`common.detection.parsing` and :mod:`common.detection.targets`)."""
    try:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenizerTable(tokenizer)
        return table
    except TypeError:
        table = _TABLES_BY_ID.get(id(tokenizer))
        if table is None or table.tokenizer is not tokenizer:
            table = _TABLES_BY_ID[id(tokenizer)] = TokenizerTable(tokenizer)
        return table


# ----------------------------------------------------------------------------------------------
# Ids -> text


@dataclass
class TokenText:
    """The usable text of a token sequence and where each token's characters start."""

    ids: list[int]  # the ids up to (not including) the first stop token; anything not an int is -1
    pieces: list[str]  # text of each usable token (the ids before the first out-of-vocabulary one)
    text: str  # the pieces, joined
    starts: list[int]  # char start of each usable token, plus len(text)
    n_out_of_vocab: int  # ids among ``ids`` that are not tokens of this tokenizer (or not integers)


def read_tokens(table: TokenizerTable, token_ids: Any, stop_id: int | None) -> TokenText:
    """``token_ids`` (any int sequence, numpy / torch included) as text; never raises on the ids."""
    ids = _as_ids(token_ids)
    if stop_id is not None and stop_id in ids:
        ids = ids[: ids.index(stop_id)]
    raw_pieces = table.pieces_of(ids)
    n_oov = sum(p is None for p in raw_pieces)
    usable = raw_pieces.index(None) if n_oov else len(ids)
    pieces: list[str] = raw_pieces[:usable]  # type: ignore[assignment]
    if any("\ufffd" in p for p in pieces):
        _repair_split_characters(table, ids, pieces)
    starts = [0, *itertools.accumulate(map(len, pieces))]
    return TokenText(ids=ids, pieces=pieces, text="".join(pieces), starts=starts, n_out_of_vocab=n_oov)


def _as_ids(token_ids: Any) -> list[int]:
    """Integers, with anything that is not one mapped to -1 (out of vocabulary)."""
    if hasattr(token_ids, "tolist"):  # numpy / torch
        token_ids = token_ids.tolist()
    try:
        items = list(token_ids)
    except TypeError:
        return []
    if all(type(t) is int for t in items):
        return items
    out = []
    for t in items:
        try:
            out.append(operator.index(t))
        except TypeError:
            out.append(-1)
    return out


def _repair_split_characters(table: TokenizerTable, ids: list[int], pieces: list[str]) -> None:
    """Give each multi-byte character to the token that completes it (in place).

    A byte-level BPE token can hold part of a UTF-8 character; decoded alone it is U+FFFD. Runs of
    such tokens are decoded incrementally: a token whose running decode still ends in U+FFFD gets
    the empty piece and the next token takes the text.
    """
    n, i = len(pieces), 0
    while i < n:
        if "\ufffd" not in pieces[i]:
            i += 1
            continue
        start, emitted, k, new = i, "", i, {}
        while k < n:
            cur = table.decode(ids[start : k + 1])
            if cur is None or not cur.startswith(emitted):
                new = None
                break
            if cur.endswith("\ufffd") and k + 1 < n and k - start < _MAX_PARTIAL_RUN:
                new[k] = ""
                k += 1
                continue
            new[k], emitted = cur[len(emitted) :], cur
            k += 1
            if cur.endswith("\ufffd") or k >= n or "\ufffd" not in pieces[k]:
                break
        if new is not None and len(new) == k - start:
            for j, p in new.items():
                pieces[j] = p
        i = max(k, i + 1)


# ----------------------------------------------------------------------------------------------
# Text -> ids (a prefix cut)


def cut_tokens_at_char(
    token_ids: Sequence[int],
    pieces: Sequence[str],
    cut: int,
    tokenizer: Any,
    starts: Sequence[int] | None = None,
) -> tuple[list[int], bool] | None:
    """Token ids whose decode is ``"".join(pieces)[:cut]``, or None when that cannot be had.

    Tokens that end at or before ``cut`` are kept verbatim. If ``cut`` falls inside a token (a
    fused ``}},`` or ``},``), only that token is replaced by ``encode(its text before the cut)``,
    which must decode back exactly. Returns (ids, whether a token was re-encoded). ``starts``
    (char start of each piece plus the total length) is computed when not given.
    """
    table = tokenizer_table(tokenizer)
    n = len(pieces)
    if starts is None:
        starts = [0, *itertools.accumulate(len(p) for p in pieces)]
    k = bisect.bisect_right(starts, cut, 1) - 1  # tokens [0, k) end at or before the cut
    pos = starts[k]
    if k >= n and pos < cut:
        return None
    # Empty pieces just before token k hold bytes of the character that token k completes.
    g = k
    while 0 < g and k < n and pieces[g - 1] == "":
        g -= 1
    if pos == cut:
        return list(token_ids[:g]), False
    tail_text = "".join(pieces[g : k + 1])[: cut - pos]
    try:
        tail = table.encode(tail_text)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it is a failed cut
        return None
    if not tail or table.decode(tail) != tail_text:
        return None
    return list(token_ids[:g]) + tail, True
