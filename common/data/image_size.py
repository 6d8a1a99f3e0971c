"""The image size every process resizes to: ``data.min_pixels`` / ``data.max_pixels`` over the model's own.

The Qwen-VL image processors resize each image, aspect ratio kept, so that both sides are multiples of
``factor = patch_size × merge_size`` (28 for Qwen2/2.5-VL, 32 for Qwen3-VL) and the area lies in
``[min_pixels, max_pixels]``; each ``factor × factor`` block becomes one image token. Example: Qwen2.5-VL
(factor 28) with ``max_pixels = 200_704`` (256 × 28²) turns a 1024 × 768 image into 504 × 364 = 18 × 13 blocks,
234 image tokens (its own 1280 × 28² would keep it at 1036 × 756, 999 tokens).

Who resizes, and must resize alike (else the prompts differ and ``rollout_prefix`` targets would be wrong):

    learner / actor   Encoder ── load_processor(model, min_pixels, max_pixels)
    rollout server    hf engine: the same load_processor; vllm engine: mm_processor_kwargs
                      /health engine_info.image_pixels = what it resizes with
    evaluator         through a rollout server (its own, started with the same config, or --url)

Checked twice: at start the actor and the evaluator compare the server's ``engine_info.image_pixels``
with their own (:func:`mismatch`), and every rollout's prompt ids are compared with the encoder's
(``Encoder.check_server_prompt``). Unset keys keep the model's ``preprocessor_config.json`` values.

What this module does not know: transformers (a model's values come from its JSON file; a loaded
processor is only read), HTTP, or the config loader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The Qwen2-VL image processors' class defaults, for a preprocessor_config.json that leaves a value out.
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS, DEFAULT_PATCH, DEFAULT_MERGE = 56 * 56, 28 * 28 * 1280, 14, 2
KEYS = ("min_pixels", "max_pixels")


class ImageSizeError(ValueError):
    """``data.min_pixels`` / ``data.max_pixels`` that cannot apply to the model; names the key and the fix."""


@dataclass(frozen=True)
class ImagePixels:
    """The pixel range images are resized into and the side multiple (patch_size × merge_size)."""

    min_pixels: int
    max_pixels: int
    multiple_of: int

    def as_dict(self) -> dict[str, int]:
        """JSON form (``/health`` ``engine_info.image_pixels``, report.json, logs)."""
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "multiple_of": self.multiple_of}

    @property
    def max_image_tokens(self) -> int:
        """Image tokens of the largest image (one per multiple_of² block)."""
        return max(1, self.max_pixels // self.multiple_of ** 2)


def model_pixels(model_path: str | os.PathLike[str]) -> ImagePixels | None:
    """The model directory's own values (``preprocessor_config.json``: ``min_pixels``/``max_pixels`` or
    ``size.shortest_edge``/``size.longest_edge``, ``patch_size``, ``merge_size``); None without that file."""
    f = Path(model_path) / "preprocessor_config.json"
    try:
        raw = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    lo = raw.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS
    hi = raw.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
    factor = int(raw.get("patch_size") or DEFAULT_PATCH) * int(raw.get("merge_size") or DEFAULT_MERGE)
    return ImagePixels(int(lo), int(hi), factor)


def problems(min_pixels: int | None, max_pixels: int | None, model: ImagePixels | None,
             model_path: str = "model.path") -> list[tuple[str, Any, str, str]]:
    """``(dotted key, value, problem, fix)`` for each thing wrong with the two keys; ``model`` (its own values)
    adds the rules that need the patch size: at least one merged patch, and the range with the model's value
    for the key left unset."""
    out: list[tuple[str, Any, str, str]] = []
    given = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    for key, value in given.items():
        if isinstance(value, int) and value < 1:
            out.append((f"data.{key}", value, "must be ≥ 1 (a pixel count: width × height)",
                        f"set data.{key} to e.g. {256 * 28 * 28} (256 image tokens at Qwen2.5-VL's 28 px), or null "
                        "for the model's own value"))
    if out:
        return out
    if isinstance(min_pixels, int) and isinstance(max_pixels, int) and min_pixels > max_pixels:
        out.append(("data.min_pixels", min_pixels, f"above data.max_pixels = {max_pixels}",
                    "set data.min_pixels ≤ data.max_pixels"))
        return out
    if model is None:
        return out
    lo, hi, f = min_pixels or model.min_pixels, max_pixels or model.max_pixels, model.multiple_of
    if max_pixels is not None and max_pixels < f * f:
        out.append(("data.max_pixels", max_pixels, f"below one merged patch of {model_path} ({f} × {f} = {f * f} px: "
                    f"patch_size × merge_size = {f}); the processor would still make every image {f} × {f}",
                    f"set data.max_pixels ≥ {f * f}"))
    elif lo > hi and min_pixels is None:
        out.append(("data.max_pixels", max_pixels, f"below the model's own min_pixels = {lo} "
                    f"({model_path}/preprocessor_config.json)",
                    f"also set data.min_pixels ≤ {max_pixels} (e.g. {f * f}), or raise data.max_pixels to ≥ {lo}"))
    elif lo > hi:
        out.append(("data.min_pixels", min_pixels, f"above the model's own max_pixels = {hi} "
                    f"({model_path}/preprocessor_config.json)",
                    f"also set data.max_pixels ≥ {min_pixels}, or lower data.min_pixels to ≤ {hi}"))
    return out


def resolve(model_path: str | os.PathLike[str], min_pixels: int | None = None,
            max_pixels: int | None = None) -> ImagePixels | None:
    """The values a processor of ``model_path`` resizes with under these keys (None: no preprocessor_config.json).
    Raises ImageSizeError naming the key and the fix when they cannot apply."""
    model = model_pixels(model_path)
    bad = problems(min_pixels, max_pixels, model, os.fspath(model_path))
    if bad:
        raise ImageSizeError("; ".join(f"{k} = {v!r}: {why}. Fix: {fix}" for k, v, why, fix in bad))
    if model is None:
        return None
    return ImagePixels(min_pixels or model.min_pixels, max_pixels or model.max_pixels, model.multiple_of)


def overrides(min_pixels: int | None, max_pixels: int | None, resolved: ImagePixels | None) -> dict[str, Any]:
    """Processor keyword arguments for ``from_pretrained(path, **overrides)`` and vLLM's ``mm_processor_kwargs``
    ({} when neither key is set): the whole ``size`` range (``resolved``: :func:`resolve`), the form transformers 5
    reads (``min_pixels`` / ``max_pixels`` given to a processor warn as deprecated on every call); the bare keys
    only for a model without a preprocessor_config.json to resolve against."""
    if min_pixels is None and max_pixels is None:
        return {}
    if resolved is None:
        return {k: int(v) for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    return {"size": {"shortest_edge": resolved.min_pixels, "longest_edge": resolved.max_pixels}}


def for_engine(model_path: str | os.PathLike[str], min_pixels: int | None,
               max_pixels: int | None) -> tuple[ImagePixels | None, dict[str, Any]]:
    """An engine that cannot hand us its processor (vLLM): the values it will resize with (its ``/health``) and its
    ``mm_processor_kwargs``; raises ImageSizeError before the engine spends a minute starting."""
    resolved = resolve(model_path, min_pixels, max_pixels)
    return resolved, overrides(min_pixels, max_pixels, resolved)


def processor_pixels(image_processor: Any) -> ImagePixels | None:
    """What a loaded image processor resizes with (``size.shortest_edge/longest_edge`` in transformers 5,
    ``min_pixels/max_pixels`` before); None when it has neither (not a Qwen-VL style processor)."""
    size = getattr(image_processor, "size", None)
    get = (lambda k: size.get(k)) if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    lo = getattr(image_processor, "min_pixels", None) or get("shortest_edge")
    hi = getattr(image_processor, "max_pixels", None) or get("longest_edge")
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    if not (lo and hi and patch and merge):
        return None
    return ImagePixels(int(lo), int(hi), int(patch) * int(merge))


def mismatch(server: dict[str, Any] | None, ours: ImagePixels | None, *, url: str,
             config: str = "CONFIG") -> str | None:
    """Why the server at ``url`` (its ``/health`` ``engine_info.image_pixels``) would tokenize images differently
    from us; None when it resizes alike, or when either side cannot say."""
    if not server or ours is None:
        return None
    theirs = {k: server.get(k) for k in KEYS}
    if all(theirs[k] == getattr(ours, k) for k in KEYS):
        return None
    return (f"the rollout server at {url} resizes images to min_pixels {theirs['min_pixels']}, max_pixels "
            f"{theirs['max_pixels']}, this process to {ours.min_pixels}, {ours.max_pixels}: its prompts would carry "
            "a different number of image tokens than the learner trains on. Fix: give the server and this process "
            f"the same data.min_pixels / data.max_pixels (restart the server with python -m rollout_server --config "
            f"{config}, or pass data.max_pixels=... to both)")
