"""Which token ids are the 1000 coord tokens, and refusing tokenizers that lack them.

Works on any tokenizer-like object with ``convert_tokens_to_ids``, ``encode`` and ``decode``
(HF tokenizers, or a fake in tests); imports neither torch nor transformers.

A tokenizer qualifies when every ``<|coord_k|>`` string encodes to exactly one id and that id
decodes back to the string. The ids need not be contiguous (they are in checkpoints made by
``tools/add_coord_tokens.py`` and ``tools/make_tiny_model.py``); callers that want a fast range
test can use :func:`contiguous_range`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from common.data.records import COORD_TOKENS, NUM_BINS


class CoordTokenError(ValueError):
    """The tokenizer does not have the 1000 coord tokens as single ids."""


def add_coord_tokens_command(model_path: str | os.PathLike[str]) -> str:
    """The command that makes a copy of ``model_path`` with the coord tokens added."""
    src = os.fspath(model_path).rstrip("/")
    return f"python tools/add_coord_tokens.py --model {src} --out {src}-coord"


def coord_token_ids(tokenizer: Any) -> list[int]:
    """The id of ``<|coord_k|>`` for k = 0..999, in bin order; raises :class:`CoordTokenError`.

    Checks each token the way training uses it: ``encode(tok) == [id]`` without special tokens, and
    ``decode([id]) == tok``. Takes a few milliseconds.
    """
    ids = tokenizer.convert_tokens_to_ids(COORD_TOKENS)
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = [t for t, i in zip(COORD_TOKENS, ids) if i is None or (unk is not None and i == unk)]
    if missing:
        raise CoordTokenError(
            f"{len(missing)} of {NUM_BINS} coord tokens are not in the vocabulary (first: {missing[0]})"
        )
    for tok, i in zip(COORD_TOKENS, ids):
        enc = list(tokenizer.encode(tok, add_special_tokens=False))
        if enc != [i]:
            raise CoordTokenError(f"{tok} encodes to {enc}, not to the single id {i}")
        dec = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if dec != tok:
            raise CoordTokenError(f"id {i} decodes to {dec!r}, not {tok!r}")
    if len(set(ids)) != NUM_BINS:
        raise CoordTokenError("two coord tokens share an id")
    return [int(i) for i in ids]


def require_coord_tokens(tokenizer: Any, model_path: str | os.PathLike[str]) -> list[int]:
    """:func:`coord_token_ids`, with an error that says how to fix the checkpoint at ``model_path``."""
    try:
        return coord_token_ids(tokenizer)
    except CoordTokenError as e:
        raise CoordTokenError(
            f"{os.fspath(model_path)}: this tokenizer lacks the {NUM_BINS} <|coord_k|> tokens ({e}); "
            f"add them with `{add_coord_tokens_command(model_path)}` and point model.path at the new directory"
        ) from None


def contiguous_range(ids: Sequence[int]) -> tuple[int, int] | None:
    """``(first, last)`` if ``ids[k] == first + k`` for every bin k, else ``None``."""
    if ids and all(i == ids[0] + k for k, i in enumerate(ids)):
        return ids[0], ids[-1]
    return None
