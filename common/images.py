"""Images of a request: a path, a ``data:image/...;base64,`` URI or a PIL image, read as RGB.

Shared by the generator (``common/tensors/generate.py``, used by the rollout server's engines and by
Stage-B) and the vLLM engine's prompt builder, so that every backend accepts the same references
and refuses a bad one with the same :class:`InputError` naming the request field.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any


class InputError(ValueError):
    """A request item that cannot be served as given (missing image, prompt too long, ...): a 4xx.

    ``field`` is the dotted request path it is about (``items.0.images.1``), or None.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def load_image(ref: Any, field: str | None = None):
    """A PIL RGB image from a path, a ``data:image/...;base64,`` URI or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if not isinstance(ref, str):
        raise InputError(f"an image must be a path or a data URI, got {type(ref).__name__}", field)
    try:
        if ref.startswith("data:"):
            head, _, payload = ref.partition(",")
            if not head.endswith(";base64"):
                raise InputError("a data URI image must be base64 ('data:image/png;base64,...')", field)
            img = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        else:
            if not os.path.isfile(ref):
                raise InputError(
                    f"image file not found on the server: {ref!r} (cwd {os.getcwd()}); "
                    "paths are read by the server process, send a data URI from another host", field)
            img = Image.open(ref)
        img.load()
    except (binascii.Error, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"image data URI is not valid base64: {exc}", field) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise InputError(f"image {ref[:80]!r} cannot be decoded: {exc}", field) from None
    return img.convert("RGB")
