"""The base of every HTTP message model (:mod:`common.wire.http`, :mod:`common.weight_sync.messages`), and the
text rule every one of them keeps: strings are valid Unicode.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``); Python decodes it into a ``str`` that no
tokenizer, encoder or socket can take (``TypeError: TextEncodeInput must be ...``, ``UnicodeEncodeError``).
:meth:`Message._valid_unicode` refuses it where the message is validated, for every field of every
model, with the dotted path of the string inside the field, so no such text gets past the boundary.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

_NUMBERS = (int, float, bool)


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path (relative to ``value``, ``""`` = the value itself) of the first string in ``value``
    (a str, or lists / dicts of them, keys included) that holds a lone surrogate; None when all are valid.

    Lists that open with a number are taken as numeric and skipped (a 1 M-id prompt is not walked):
    a string among them fails the field's own number validation anyway."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and lone_surrogate(k) is not None:
                return where
            if (found := lone_surrogate(v, where)) is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], _NUMBERS):
            return None
        for i, v in enumerate(value):
            if (found := lone_surrogate(v, f"{path}.{i}" if path else str(i))) is not None:
                return found
    return None


class TextError(ValueError):
    """A string that is not valid Unicode; ``where`` is its dotted path inside the field that holds it."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{'text at ' + where if where else 'text'} holds a lone UTF-16 surrogate (a "
                         "\\ud800-\\udfff escape without its pair): not valid Unicode; send UTF-8 text")
        self.where = where


class ContentError(ValueError):
    """A rule between fields that JSON Schema cannot state (parallel lists of one length, as many images as
    image slots): a request that breaks it fits the published schema, so the server answers 400, not the
    422 of a schema violation (rollout_server/app.py). Each such rule is written in its model's docstring,
    which is the schema's description."""


def content_only(errors: list[dict[str, Any]]) -> bool:
    """Whether every pydantic error is a :class:`ContentError`: the body fits its schema (a 400, not a 422)."""
    return bool(errors) and all(isinstance((e.get("ctx") or {}).get("error"), ContentError) for e in errors)


def error_location(error: dict[str, Any]) -> list[str]:
    """The dotted location of one pydantic error (``ValidationError.errors()`` entry), down to the string
    itself for a :class:`TextError` (whose own ``loc`` stops at the field)."""
    loc = [str(p) for p in error.get("loc", ())]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, TextError) and cause.where:
        loc += cause.where.split(".")
    return loc


class Message(BaseModel):
    """Unknown fields are refused (a typo is a 4xx naming the field); field docstrings become the
    OpenAPI descriptions; NaN and inf are rejected everywhere; text must be valid Unicode."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if (where := lone_surrogate(value)) is not None:
            raise TextError(where)
        return value
