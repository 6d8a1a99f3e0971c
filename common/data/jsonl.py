"""JSON Lines read one object per line, each tagged with ``file:line`` for the errors that name it.

The data records (``common/detection/answer.py``), the evaluation set (``common/evaluation/loop.py``) and
Stage-B's tickets (``stage_b/tickets.py``) are JSONL files a user writes by hand or by script; a
bad line must be reported where it is. Each reader decides what a bad line means (fatal for
training data and tickets, skipped and listed for an evaluation set), so this module only reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line: where it is, and its value or why it is not JSON."""

    where: str  # "<file>:<line>" (1-based line)
    value: Any = None
    error: str | None = None  # "invalid JSON (...)" when the line does not parse


def iter_json_lines(path: str | os.PathLike[str], *, full_path: bool = False) -> Iterator[JsonLine]:
    """The non-blank lines of ``path`` in order; ``where`` names the file by its name (its path if ``full_path``)."""
    name = os.fspath(path) if full_path else Path(path).name
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield JsonLine(f"{name}:{lineno}", json.loads(line))
            except json.JSONDecodeError as exc:
                yield JsonLine(f"{name}:{lineno}", error=f"invalid JSON ({exc})")
