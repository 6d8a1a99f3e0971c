"""Images of a request: a path, a ``data:image/...;base64,`` URI or a PIL image, read as RGB.

Shared by the generator (``common/generation/generator.py``, used by the rollout server's engines and by
Stage-B) and the vLLM engine's prompt builder, so that every backend accepts the same references
and refuses a bad one with the same :class:`InputError` naming the request field.

Sizes are read from the image header before anything is decoded (PIL's ``Image.open`` is lazy), so a
decompression bomb costs a header read, not gigabytes: :func:`image_pixels` is what the rollout
server's pixel limits check before a request is admitted (``rollout_server/guard.py``). PIL's own
bomb check (``Image.MAX_IMAGE_PIXELS``, an error above twice it, ~179 MP) is kept and answered as an
:class:`InputError` with status 413, never an unhandled exception.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any


class InputError(ValueError):
    """A request item that cannot be served as given (missing image, prompt too long, ...): a 4xx.

    ``field`` is the dotted request path it is about (``items.0.images.1``), or None; ``status`` the
    HTTP status (400, or 413 for a request over a size budget: clients split those).
    """

    def __init__(self, message: str, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def _open(ref: Any, field: str | None):
    """The lazily opened PIL image (header read, pixels not decoded)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(ref, str):
        raise InputError(f"an image must be a path or a data URI, got {type(ref).__name__}", field)
    try:
        if ref.startswith("data:"):
            head, _, payload = ref.partition(",")
            if not head.endswith(";base64"):
                raise InputError("a data URI image must be base64 ('data:image/png;base64,...')", field)
            return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        if not os.path.isfile(ref):
            raise InputError(
                f"image file not found on the server: {ref!r} (cwd {os.getcwd()}); "
                "paths are read by the server process, send a data URI from another host", field)
        return Image.open(ref)
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        raise InputError(f"image {ref[:80]!r} is too large to decode: {exc}", field, 413) from None
    except binascii.Error as exc:
        raise InputError(f"image data URI is not valid base64: {exc}", field) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"image {ref[:80]!r} cannot be decoded: {exc}", field) from None


def image_pixels(ref: Any, field: str | None = None) -> int:
    """Width x height of an image from its header only (nothing decoded); InputError if unreadable."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.width * ref.height
    img = _open(ref, field)
    try:
        return img.width * img.height
    finally:
        img.close()


def load_image(ref: Any, field: str | None = None):
    """A PIL RGB image from a path, a ``data:image/...;base64,`` URI or a PIL image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    img = _open(ref, field)
    try:
        img.load()
        return img.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise InputError(f"image {ref[:80]!r} is too large to decode: {exc}", field, 413) from None
    except (ValueError, OSError) as exc:
        raise InputError(f"image {ref[:80]!r} cannot be decoded: {exc}", field) from None
