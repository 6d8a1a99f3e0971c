"""Inputs of the hf engine: images from server paths or data URIs, and the processor.

The processor comes from :func:`common.processor.load_processor`, the one loader every process uses
(image-only Qwen-VL processor when torchvision is missing), so server-side prompt ids are the ones
the actor and learner compute.

What this module does not know: prompts, batching or generation (``rollout_server.engines.hf``).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

from common.processor import load_processor  # noqa: F401  (re-exported for the engine)
from rollout_server.engines.base import EngineInputError


def load_image(ref: Any, field: str | None = None):
    """A PIL RGB image from a path, a ``data:image/...;base64,`` URI or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if not isinstance(ref, str):
        raise EngineInputError(f"an image must be a path or a data URI, got {type(ref).__name__}", field)
    try:
        if ref.startswith("data:"):
            head, _, payload = ref.partition(",")
            if not head.endswith(";base64"):
                raise EngineInputError("a data URI image must be base64 ('data:image/png;base64,...')", field)
            img = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        else:
            if not os.path.isfile(ref):
                raise EngineInputError(
                    f"image file not found on the server: {ref!r} (cwd {os.getcwd()}); "
                    "paths are read by the server process, send a data URI from another host", field)
            img = Image.open(ref)
        img.load()
    except (binascii.Error, ValueError) as exc:
        if isinstance(exc, EngineInputError):
            raise
        raise EngineInputError(f"image data URI is not valid base64: {exc}", field) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise EngineInputError(f"image {ref[:80]!r} cannot be decoded: {exc}", field) from None
    return img.convert("RGB")
