"""One way to load a model directory's processor, for every process (actor, learner, rollout server).

``AutoProcessor.from_pretrained`` in transformers 5.x always builds the Qwen2-VL family's *video*
processor, which imports torchvision; tandem never sends videos, and CPU boxes (CI, actors) often
have no torchvision. So: try ``AutoProcessor``; if that fails for want of torchvision and the
processor is a Qwen-VL one, build the same processor class without its video part. Images, the
chat template, image-pad expansion and ``mm_token_type_ids`` are the processor class's own code
either way, so the prompt ids are identical wherever this is called.

# NOTE: huggingface/transformers#48558 (video processor requires torchvision). Drop the fallback
# once AutoProcessor builds image-only Qwen-VL processors without it.

``min_pixels`` / ``max_pixels`` (``data.*`` of the config; None = the model's own) go to the image processor at
load, checked first (:mod:`common.data.image_size`) and read back after, so a processor that ignored them fails here
instead of tokenizing images differently from the other processes.

Importing this module is free; calling :func:`load_processor` imports transformers (and torch).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: The processor classes (``processor_class`` of a model directory) the image-only fallback can build: the
#: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and MoE checkpoints name the same one) processors, whose only
#: torchvision-dependent part is the video processor.
IMAGE_ONLY_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")


def load_processor(model_path: str | os.PathLike[str], *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> Any:
    """The processor of ``model_path`` (tokenizer at ``.tokenizer``), image-only when torchvision is missing, resizing
    images into ``[min_pixels, max_pixels]`` (None = the model's own value). Raises ``ImageSizeError`` naming
    ``data.min_pixels`` / ``data.max_pixels`` when they cannot apply to this model."""
    from common.data import image_size

    path = os.fspath(model_path)
    resolved = image_size.resolve(path, min_pixels, max_pixels)  # the rules that need the patch size, before loading
    kwargs = image_size.overrides(min_pixels, max_pixels, resolved)
    processor = _load(path, kwargs)
    if kwargs:
        got = image_size.processor_pixels(getattr(processor, "image_processor", None))
        given = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        if got is None or any(getattr(got, k) != v for k, v in given.items()):
            raise image_size.ImageSizeError(
                f"{path}: data.{' and data.'.join(given)} = {given} did not reach its image processor (it resizes "
                f"with {got.as_dict() if got else 'no pixel range'}). Fix: use a Qwen-VL family model, or unset "
                f"data.{' and data.'.join(given)}")
    return processor


def _load(path: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    except (ImportError, ValueError) as exc:
        # ImportError from a video processor class; ValueError from the video-processor auto-loader (a checkpoint
        # naming a Fast image processor, as the Qwen3-VL ones do)
        if "torchvision" not in str(exc).lower():
            raise
        cls = _image_only_class(path)
        if cls is None:
            raise
        log.info("%s: torchvision missing, using the image-only %s (videos unsupported)", path, cls.__name__)
        return cls.from_pretrained(path, **kwargs)


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
    if name not in IMAGE_ONLY_PROCESSORS:
        return None
    import transformers

    base = getattr(transformers, name, None)
    if base is None:  # a transformers too old for this family
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
            # Qwen3-VL's processor also keeps the vision start/end tokens (its video prompts use them);
            # set for every family, as attributes nothing else reads they cost nothing.
            self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
            self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{base.__name__}"
    return ImageOnly
