"""Teacher-forced encoding: a record's prompt (chat template + images) plus a target's assistant ids → a Segment.

    record ── build_messages ──► chat template (add_generation_prompt) ──► text ─┐
    images ── PIL RGB ───────────────────────────────────────────────────────────┴► processor
        ► prompt ids (image pads expanded), pixel_values, image_grid_thw, mm_token_type_ids
        ► pixel_values back to the resized images' uint8 values + a per-column affine (to_uint8_pixels)
    TargetSpec.token_ids (assistant span, turn end included) appended after the prompt
        ► labels / weights / coord_pos shifted by the prompt length P
        ► position_ids from the model's OWN rope-index function over the whole segment

The same prompt goes to the rollout server (:meth:`Encoder.prompt_for_rollout` sends the same
messages and image paths), so the server's ``prompt_token_ids`` must equal :meth:`Encoder.prompt`'s
ids; :meth:`Encoder.check_server_prompt` verifies it and counts mismatches (the ``rollout_prefix``
target splices rollout ids after *our* prompt, so a mismatch there would be silent corruption).

Position ids: for the mRoPE Qwen-VL family the rope index is computed by the model class's own
``get_rope_index`` on an instance built from the config on the ``meta`` device — no weights, no
memory, but exactly the model's arithmetic. Models without it get ``arange(L)``.

Never truncate: a segment longer than ``packing_length`` returns None, is counted in
``counters["too_long_dropped"]`` and logged with the fix.

Used by the actor (Channel-B) and by the learner (Channel-A). What this module does not know:
parsing, matching, packing, or sockets.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from common.detection.answer import DEFAULT_PROMPTS, Prompts, build_messages
from common.data.records import Record
from common.evaluation.loop import rollout_item
from common.wire.http import InferItem
from common.packing.segment import IGNORE_INDEX, Segment
from common.detection.targets import TargetSpec
from common.detection.coord_tokens import require_coord_tokens

log = logging.getLogger(__name__)

_TOO_LONG_FIX = (
    "raise training.global_max_length (= packing_length), lower rollout_matching.decoding.max_new_tokens, "
    "or set a smaller data.max_pixels (fewer image tokens; docs/data.md, Image size)"
)


class Encoder:
    """Loads the processor/tokenizer and the model config of ``model_path`` (no weights).

    Not thread-safe (the processor is not): one Encoder per worker.
    """

    def __init__(self, model_path: str | os.PathLike[str], packing_length: int, *, image_root: str | None = None,
                 check_coord_tokens: bool = True, prompts: Prompts = DEFAULT_PROMPTS, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        from transformers import AutoConfig  # deferred: heavy import

        from common.data.image_size import processor_pixels
        from common.data.processor import load_processor

        self.model_path = os.fspath(model_path)
        self.packing_length = int(packing_length)
        self.image_root = image_root
        self.prompts = prompts
        self.processor = load_processor(self.model_path, min_pixels=min_pixels, max_pixels=max_pixels)
        #: What images are resized with (data.min_pixels / data.max_pixels over the model's own); None: no image
        #: processor.
        self.image_pixels = processor_pixels(getattr(self.processor, "image_processor", None))
        self.tokenizer = self.processor.tokenizer
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.coord_ids = require_coord_tokens(self.tokenizer, self.model_path) if check_coord_tokens else None
        self._rope_model = _meta_rope_model(self.config)
        self.counters: dict[str, int] = {
            "encoded": 0,
            "too_long_dropped": 0,
            "prompt_checked": 0,
            "prompt_mismatch": 0,
        }

    # -- prompts --------------------------------------------------------------------------------

    def image_paths(self, record: Record, root: str | os.PathLike[str] | None = None) -> list[str]:
        """The record's images as absolute paths (``image_root`` or ``root`` for relative ones)."""
        base = self.image_root if self.image_root is not None else (root if root is not None else ".")
        return [os.path.abspath(p) for p in record.image_paths(base)]

    def messages(self, record: Record, image_paths: list[str]) -> list[dict[str, Any]]:
        return build_messages(record, image_paths, prompts=self.prompts)

    def prompt(self, record: Record, image_paths: list[str]) -> dict[str, np.ndarray]:
        """Prompt ids [P] (image pads expanded), pixel_values uint8 [N, D] with pixel_affine [2, D]
        (``common.packing.segment.pixel_floats`` gives the processor's float32 pixel_values back),
        image_grid_thw [I, 3], mm_token_type_ids [P]."""
        from PIL import Image  # deferred with the processor

        text = self.processor.apply_chat_template(
            self.messages(record, image_paths), tokenize=False, add_generation_prompt=True
        )
        images = []
        for p in image_paths:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        out = self.processor(text=[text], images=images or None, return_tensors="np")
        ids = np.asarray(out["input_ids"][0], dtype=np.int64)
        mm = out.get("mm_token_type_ids")
        mm = np.asarray(mm[0], dtype=np.int64) if mm is not None else np.zeros_like(ids)
        pv = out.get("pixel_values")
        grid = out.get("image_grid_thw")
        if pv is not None:
            affine = pixel_affine(self.processor.image_processor, int(pv.shape[1]))
            u8 = to_uint8_pixels(np.asarray(pv, dtype=np.float32), affine, what=f"{self.model_path} {image_paths}")
        else:
            affine, u8 = np.zeros((2, 0), np.float32), np.zeros((0, 0), np.uint8)
        return {
            "input_ids": ids,
            "mm_token_type_ids": mm,
            "pixel_values": u8,
            "pixel_affine": affine,
            "image_grid_thw": np.asarray(grid, dtype=np.int64).reshape(-1, 3) if grid is not None else np.zeros((0, 3), np.int64),
        }

    def prompt_for_rollout(self, record: Record, image_paths: list[str], *, item_id: str | None = None) -> InferItem:
        """The ``/infer`` item for ``record``: the same messages as :meth:`prompt`, images by path, in order
        (``common.evaluation.loop.rollout_item``, which the evaluator sends too)."""
        return rollout_item(record, image_paths, item_id=item_id, prompts=self.prompts)

    def check_server_prompt(self, sample_id: str, server_ids: list[int] | np.ndarray, our_ids: np.ndarray) -> bool:
        """True if the server templated the prompt exactly as we did; a mismatch is counted and logged."""
        self.counters["prompt_checked"] += 1
        same = len(server_ids) == len(our_ids) and bool(np.array_equal(np.asarray(server_ids, np.int64), our_ids))
        if not same:
            self.counters["prompt_mismatch"] += 1
            if self.counters["prompt_mismatch"] > 5 and self.counters["prompt_mismatch"] % 100:
                return False
            first = next((i for i, (a, b) in enumerate(zip(server_ids, our_ids)) if a != b), min(len(server_ids), len(our_ids)))
            image_id = getattr(self.processor, "image_token_id", None)
            theirs = int(np.sum(np.asarray(server_ids, np.int64) == image_id)) if image_id is not None else 0
            ours = int(np.sum(our_ids == image_id)) if image_id is not None else 0
            if theirs != ours:
                pixels = self.image_pixels.as_dict() if self.image_pixels else "the model's own"
                why = (f"the server's prompt carries {theirs} image tokens, the encoder's {ours} (this process resizes "
                       f"with {pixels}): the two sides resize images differently. Fix: give the rollout server the same "
                       "data.min_pixels / data.max_pixels as the actors and the learner (its GET /health "
                       "engine_info.image_pixels says what it uses)")
            else:
                why = "the server and the actor must load the same model.path processor and prompts"
            log.error(
                "sample %s: the server's prompt (%d ids) differs from the encoder's (%d ids) from position %d; %s "
                "(rollout_prefix targets would be wrong; %d mismatches so far, logged 5 then every 100th)",
                sample_id, len(server_ids), len(our_ids), first, why, self.counters["prompt_mismatch"],
            )
        return same

    # -- segments -------------------------------------------------------------------------------

    def encode(
        self,
        record: Record,
        target: TargetSpec,
        *,
        sample_id: str,
        channel: str,
        ver: int,
        meta: dict[str, Any] | None = None,
        image_paths: list[str] | None = None,
        prompt: dict[str, np.ndarray] | None = None,
    ) -> Segment | None:
        """Prompt + ``target`` as one Segment, or None (counted, logged) if longer than ``packing_length``.

        ``prompt`` may be passed when already computed (:meth:`prompt`) to avoid processing images twice.
        """
        if prompt is None:
            prompt = self.prompt(record, image_paths if image_paths is not None else self.image_paths(record))
        p_ids = prompt["input_ids"]
        n_prompt, n_target = int(p_ids.shape[0]), len(target)
        n = n_prompt + n_target
        if n > self.packing_length:
            self.counters["too_long_dropped"] += 1
            dropped = self.counters["too_long_dropped"]
            if dropped <= 10 or dropped % 100 == 0:
                log.warning(
                    "segment %s dropped (%d so far): %d tokens (prompt %d incl. image tokens + assistant %d) > "
                    "packing_length %d; never truncated. Fix: %s",
                    sample_id, dropped, n, n_prompt, n_target, self.packing_length, _TOO_LONG_FIX,
                )
            return None
        input_ids = np.concatenate([p_ids, target.token_ids.astype(np.int64)])
        labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
        weights = np.zeros(n, dtype=np.float32)
        mask = target.labels_mask.astype(bool)
        labels[n_prompt:][mask] = target.token_ids[mask]
        weights[n_prompt:] = np.where(mask, target.ce_weights, 0.0)
        mm = np.concatenate([prompt["mm_token_type_ids"], np.zeros(n_target, dtype=np.int64)])
        segment = Segment(
            sample_id=sample_id,
            channel=channel,
            ver=int(ver),
            input_ids=input_ids,
            labels=labels,
            weights=weights,
            position_ids=self.position_ids(input_ids, mm, prompt["image_grid_thw"]),
            coord_pos=target.coord_positions.astype(np.int64) + n_prompt,
            coord_bins=target.coord_bins.astype(np.int64),
            pixel_values=prompt["pixel_values"],
            image_grid_thw=prompt["image_grid_thw"],
            pixel_affine=prompt["pixel_affine"],
            meta={**(meta or {}), "prompt_len": n_prompt, "target_len": n_target},
        )
        segment.validate()
        self.counters["encoded"] += 1
        return segment

    def position_ids(self, input_ids: np.ndarray, mm_token_type_ids: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
        """The model's own position ids for one segment alone: [3, L] (mRoPE) or [1, L]."""
        n = int(input_ids.shape[0])
        if self._rope_model is None:
            return np.arange(n, dtype=np.int64)[None, :]
        import torch

        kwargs: dict[str, Any] = {
            "input_ids": torch.from_numpy(input_ids)[None],
            "mm_token_type_ids": torch.from_numpy(mm_token_type_ids)[None].int(),
            "image_grid_thw": torch.from_numpy(image_grid_thw) if image_grid_thw.size else None,
            "attention_mask": torch.ones(1, n, dtype=torch.long),
        }
        accepted = inspect.signature(self._rope_model.get_rope_index).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        with torch.no_grad():
            pos, _ = self._rope_model.get_rope_index(**kwargs)
        return np.ascontiguousarray(pos[:, 0, :].numpy().astype(np.int64))


#: How far (in 0..255 levels) a processor float may sit from an integer level and still be called exact:
#: float32 arithmetic puts the Qwen-VL processors' values within ~1e-5 of one; a float resize would be up to 0.5 off.
UINT8_TOLERANCE = 1e-3


def pixel_affine(image_processor: Any, width: int) -> np.ndarray:
    """``[2, width]`` float32: per ``pixel_values`` column, the scale and offset that map a 0..255 value to the
    processor's float, ``(u8 · rescale_factor − mean[c]) / std[c]`` (without rescale or normalisation when the
    processor skips them). Column d of a patch row belongs to channel ``c = d // (width / channels)``: the
    Qwen-VL processors flatten a patch as (channel, temporal, row, column); :func:`to_uint8_pixels` proves it
    on every image."""
    ip = image_processor
    rescale = float(ip.rescale_factor) if getattr(ip, "do_rescale", True) else 1.0
    normalise = getattr(ip, "do_normalize", True)
    mean = np.atleast_1d(np.asarray(ip.image_mean if normalise else 0.0, np.float64))
    std = np.atleast_1d(np.asarray(ip.image_std if normalise else 1.0, np.float64))
    channels = max(len(mean), len(std))  # 1: one mean and std for every channel
    mean, std = np.broadcast_to(mean, (channels,)), np.broadcast_to(std, (channels,))
    if width % channels:
        raise ValueError(f"pixel_values rows of width {width} do not split into {channels} channels: not a "
                         "Qwen-VL patch layout (channel, temporal, row, column)")
    c = np.arange(width) // (width // channels)
    return np.stack([rescale / std[c], -mean[c] / std[c]]).astype(np.float32)


def to_uint8_pixels(pixel_values: np.ndarray, affine: np.ndarray, *, what: str = "pixel_values") -> np.ndarray:
    """The processor's float ``pixel_values [N, D]`` as the uint8 levels they were computed from (``affine``:
    :func:`pixel_affine`). Raises ValueError naming the deviation when they are not such levels (a processor that
    resizes in float, or a layout other than the Qwen-VL one): sending them as uint8 would change the model's input."""
    # float32 in place: a 1024-px image is 6.4 M values, and float32's error here (~4e-5 levels) is far inside
    # the tolerance
    levels = np.subtract(pixel_values, affine[1], dtype=np.float32)
    levels *= (1.0 / affine[0]).astype(np.float32)
    rounded = np.rint(levels)
    off = np.abs(np.subtract(levels, rounded, out=levels), out=levels)
    if off.size and (off.max() > UINT8_TOLERANCE or rounded.min() < 0 or rounded.max() > 255):
        raise ValueError(
            f"{what}: the image processor's pixel_values are not (0..255 · rescale − mean) / std of the resized "
            f"image (levels {rounded.min():.0f}..{rounded.max():.0f}, up to {off.max():.3g} from an integer; tolerance "
            f"{UINT8_TOLERANCE}), so they cannot travel as uint8 without changing the learner's input. The "
            "Qwen2/2.5/3-VL image processors resize uint8 images before normalising; check the processor config of "
            "model.path (preprocessor_config.json: do_rescale, rescale_factor, image_mean, image_std)"
        )
    return rounded.astype(np.uint8)


def _meta_rope_model(config: Any) -> Any | None:
    """The module that owns ``get_rope_index`` for ``config``'s architecture, built on ``meta`` (no weights)."""
    import torch
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    except (ValueError, KeyError) as exc:  # architecture without a base AutoModel mapping
        log.warning("no AutoModel for %s (%s): position ids fall back to arange", type(config).__name__, exc)
        return None
    for module in (model, getattr(model, "model", None)):
        if module is not None and hasattr(module, "get_rope_index"):
            return module
    return None


def encoder_from_config(cfg: Any) -> Encoder:
    """The Encoder the config describes (model.path, packing_length, data.image_root or the JSONL's folder,
    data.min_pixels / data.max_pixels)."""
    root = cfg.data.image_root or str(Path(cfg.data.train_jsonl).resolve().parent)
    return Encoder(cfg.model.path, cfg.training.global_max_length, image_root=root, check_coord_tokens=cfg.model.coord_tokens,
                   prompts=Prompts.of(cfg.data.system_prompt, cfg.data.user_prompt, cfg.data.answer_format),
                   min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
