"""``doc``: a config dataclass field with its documentation attached (shared by every schema module).

``docs/config.md`` is generated from these docs (``python -m common.config.docs --markdown``).

What this module does not know: any section of the schema.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

REQUIRED = dataclasses.MISSING


def doc(text: str, default: Any = REQUIRED, *, factory: Any = None) -> Any:
    """A dataclass field with its documentation attached (read by the config reference)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    if default is REQUIRED:
        return field(metadata={"doc": text, "required": True})
    return field(default=default, metadata={"doc": text})
