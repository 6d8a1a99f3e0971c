"""One way to load a model directory's processor, for every process (actor, learner, rollout server).

``AutoProcessor.from_pretrained`` in transformers 5.x always builds the Qwen2-VL family's *video*
processor, which imports torchvision; tandem never sends videos, and CPU boxes (CI, actors) often
have no torchvision. So: try ``AutoProcessor``; if that fails for want of torchvision and the
processor is a Qwen-VL one, build the same processor class without its video part. Images, the
chat template, image-pad expansion and ``mm_token_type_ids`` are the processor class's own code
either way, so the prompt ids are identical wherever this is called.

# NOTE: huggingface/transformers#48558 (video processor requires torchvision). Drop the fallback
# once AutoProcessor builds image-only Qwen-VL processors without it.

Importing this module is free; calling :func:`load_processor` imports transformers (and torch).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def load_processor(model_path: str | os.PathLike[str]) -> Any:
    """The processor of ``model_path`` (tokenizer at ``.tokenizer``), image-only when torchvision is missing."""
    from transformers import AutoProcessor

    path = os.fspath(model_path)
    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
        cls = _image_only_class(path)
        if cls is None:
            raise
        log.info("%s: torchvision missing, using the image-only %s (videos unsupported)", path, cls.__name__)
        return cls.from_pretrained(path)


def _image_only_class(path: str) -> type | None:
    import json
    from pathlib import Path

    from transformers.processing_utils import ProcessorMixin

    name = None
    for fname in ("processor_config.json", "preprocessor_config.json"):
        f = Path(path) / fname
        if f.is_file():
            name = json.loads(f.read_text()).get("processor_class") or name
            if name:
                break
    bases = {}
    try:
        from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

        bases = {"Qwen2_5_VLProcessor": Qwen2_5_VLProcessor, "Qwen2VLProcessor": Qwen2VLProcessor}
    except ImportError:
        return None
    base = bases.get(name or "")
    if base is None:
        return None

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        """``base`` without the video processor (the only part that needs torchvision)."""

        @classmethod
        def get_attributes(cls) -> list[str]:
            return [a for a in super().get_attributes() if a != "video_processor"]

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{base.__name__}"
    return ImageOnly
